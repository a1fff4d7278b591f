#!/usr/bin/env bash
# device call B (warm): the 48-layer step bench with full, then the depth study (bf16 4/24/48, fp32 4/24) and isfinite
REAL=$OUT; export OUT=/tmp/res/B; mkdir -p $OUT
. /tmp/gk/env.sh
bash /tmp/gk/kit/device-install.sh --project > /dev/null 2>&1
export PYTHONUNBUFFERED=1 BENCH_KV_BYTES=2147483648 BENCH_GPU_MEM=0.5
timeout 260 python benchmarks/bench_step.py --shapes qwen3-30b-a3b --layers 48 --runs full --steps 20 \
  --json $OUT/step48f.json > $OUT/step48f.log 2>&1; echo "step48 full rc=$?"
grep -E "^\||ALARM|Traceback|Error|hwsync: verify after" $OUT/step48f.log | cut -c1-700 | tail -12
timeout 40 python benchmarks/bench_isfinite.py --gb 60 --device cuda > $OUT/isfinite.log 2>&1; echo "isfinite rc=$?"; tail -12 $OUT/isfinite.log
BENCH_GPU_MEM=0.45 timeout 250 python benchmarks/verify_depth.py --shapes qwen3-30b-a3b --layers 4,24,48 --dtypes bfloat16 \
  --json $OUT/depth_bf16.json > $OUT/depth_bf16.log 2>&1; echo "depth bf16 rc=$?"
tail -8 $OUT/depth_bf16.log
tar czf $REAL/B.tgz -C /tmp/res B
