#!/usr/bin/env bash
# device call B: the 48-layer GRPO step bench, adapter r8, r32 and full, 20 steps each
REAL=$OUT; export OUT=/tmp/res/B; mkdir -p $OUT
bash /tmp/gk/kit/device-install.sh --project > $OUT/install.log 2>&1 || { tail -20 $OUT/install.log; exit 1; }
. /tmp/gk/env.sh
export PYTHONUNBUFFERED=1 BENCH_KV_BYTES=2147483648 BENCH_GPU_MEM=0.5
timeout 575 python benchmarks/bench_step.py --shapes qwen3-30b-a3b --layers 48 --runs ${RUNS:-adapter:8,adapter:32,full} --steps 20 \
  --json $OUT/step48.json > $OUT/step48.log 2>&1; echo "step48 rc=$?"
grep -E "^\||ALARM|Traceback|Error|hwsync: verify after|weak" $OUT/step48.log | cut -c1-500 | tail -30
tar czf $REAL/B.tgz -C /tmp/res B
