#!/usr/bin/env bash
# device call W3 (warm): vLLM 0.33 -- exact, verify, swift, bench -- and, beside it on 0.32, lora-configs 2/2
REAL=$OUT; export OUT=/tmp/res/W3; mkdir -p $OUT
T0=$SECONDS
export PYTHONUNBUFFERED=1
( . /tmp/gk-0.33.0/env.sh; bash /tmp/gk-0.33.0/kit/device-install.sh --project > /dev/null 2>&1
  python -m hwsync doctor 2>&1 | head -30 > $OUT/doctor33.log
  export OUT=$OUT/v33; mkdir -p $OUT
  timeout 520 bash ci/gpu.sh -j exact verify swift bench > $OUT/parts33.log 2>&1; echo "0.33 parts rc=$? at $((SECONDS-T0)) s" ) &
( . /tmp/gk/env.sh; bash /tmp/gk/kit/device-install.sh --project > /dev/null 2>&1; sleep 60
  export OUT=$OUT/lora2; mkdir -p $OUT; export CUDA_VISIBLE_DEVICES=1
  HWSYNC_LORA_PART=2/2 timeout 450 bash ci/gpu.sh lora-configs > $OUT/lora2.log 2>&1; echo "lora-configs 2/2 rc=$? at $((SECONDS-T0)) s" ) &
wait
cat $OUT/doctor33.log | head -12
tail -30 $OUT/v33/parts33.log
grep -h -E "^\| |EXACTNESS|exactness:" $OUT/v33/gpu-bench.log | tail -10
grep -h -E "=== ci/gpu.sh|^(ok  |FAIL)" $OUT/lora2/lora2.log | tail -10
tar czf $REAL/W3.tgz -C /tmp/res W3
