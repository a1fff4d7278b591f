#!/usr/bin/env bash
# device call W1 (session driver, untracked): install the 0.32 kit (+ 0.33 beside it, + TRL 1.16 apart);
# GPU0: 48-layer adapter rows r32, r8, then the 48-layer full sync in server mode (engine on GPU1);
# GPU1: the seal bench, the TRL parts (main job, bench, trl-b modules), lora-configs 1/2
REAL=$OUT; export OUT=/tmp/res/W1; mkdir -p $OUT
T0=$SECONDS
(cd /tmp/gk && cat part.* | tar x) || { md5sum /tmp/gk/part.*; exit 1; }
bash /tmp/gk/kit/device-install.sh > $OUT/install.log 2>&1 || { tail -40 $OUT/install.log; exit 1; }
( (cd /tmp/gk-0.33.0 && cat part.* | tar x) && bash /tmp/gk-0.33.0/kit/device-install.sh > $OUT/install33.log 2>&1
  echo "install33 rc=$?" ) &
python3 -m pip install -q --no-deps --no-index --target /tmp/site-trl /tmp/gk/trl-1.16.0-py3-none-any.whl > $OUT/trl-install.log 2>&1; echo "trl install rc=$?"
echo "installed at $((SECONDS-T0)) s"
. /tmp/gk/env.sh
export PYTHONUNBUFFERED=1
( export CUDA_VISIBLE_DEVICES=0 BENCH_KV_BYTES=2147483648 BENCH_GPU_BLOCKS=1300 BENCH_GPU_MEM=0.5
  timeout 230 python benchmarks/bench_sync.py --shapes qwen3-30b-a3b --layers 48 --rank 32 --strategies adapter \
    --json $OUT/bench48_r32.json > $OUT/bench48_r32.log 2>&1; echo "bench48 r32 rc=$? at $((SECONDS-T0)) s"
  timeout 200 python benchmarks/bench_sync.py --shapes qwen3-30b-a3b --layers 48 --rank 8 --strategies adapter \
    --json $OUT/bench48_r8.json > $OUT/bench48_r8.log 2>&1; echo "bench48 r8 rc=$? at $((SECONDS-T0)) s"
  left=$(( 520 - (SECONDS-T0) )); [ $left -gt 60 ] && { CUDA_VISIBLE_DEVICES=0,1 timeout $left python benchmarks/bench_sync.py \
    --shapes qwen3-30b-a3b --layers 48 --strategies full --server --json $OUT/bench48_server.json > $OUT/bench48_server.log 2>&1
    echo "bench48 server full rc=$? at $((SECONDS-T0)) s"; } ) &
( export CUDA_VISIBLE_DEVICES=1
  python benchmarks/bench_seal.py --mb 617 --repeat 5 > $OUT/seal.log 2>&1; echo "seal rc=$?"
  ( export PYTHONPATH=/tmp/site-trl:$PYTHONPATH
    timeout 300 bash ci/gpu.sh trl > $OUT/trl.log 2>&1; echo "trl rc=$? at $((SECONDS-T0)) s"
    left=$(( 520 - (SECONDS-T0) )); timeout $left bash ci/gpu.sh trl-b > $OUT/trlb.log 2>&1; echo "trl-b rc=$? at $((SECONDS-T0)) s" ) &
  ( sleep 20; left=$(( 520 - (SECONDS-T0) )); HWSYNC_LORA_PART=1/2 timeout $left bash ci/gpu.sh lora-configs > $OUT/lora1.log 2>&1
    echo "lora-configs 1/2 rc=$? at $((SECONDS-T0)) s" ) &
  wait ) &
wait
grep -h -E "^\| 48|first sync|steady|EXACTNESS|exactness:|Traceback|Error" $OUT/bench48_*.log | cut -c1-300 | tail -30
cat $OUT/seal.log | tail -8
grep -h -E "=== ci/gpu.sh|^(ok  |FAIL)|passed|failed" $OUT/trl.log $OUT/trlb.log $OUT/lora1.log | tail -30
tail -5 $OUT/install33.log
cp /tmp/gk/env.sh $OUT/ 2>/dev/null
tar czf $REAL/W1.tgz -C /tmp/res W1
