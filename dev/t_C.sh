#!/usr/bin/env bash
# device call C: Qwen3.5-MoE shapes at 24 layers, GRPO step bench: adapter r8, r32, full, 20 steps each
REAL=$OUT; export OUT=/tmp/res/C; mkdir -p $OUT
bash /tmp/gk/kit/device-install.sh --project > $OUT/install.log 2>&1 || { tail -20 $OUT/install.log; exit 1; }
. /tmp/gk/env.sh
export PYTHONUNBUFFERED=1 BENCH_KV_BYTES=2147483648 BENCH_GPU_MEM=0.5
timeout 540 python benchmarks/bench_step.py --shapes qwen3.5-moe --layers 24 --runs ${RUNS:-adapter:32,adapter:8,full} --steps 20 \
  --json $OUT/step35.json > $OUT/step35.log 2>&1; echo "step35 rc=$?"
grep -E "^\||ALARM|Traceback|Error|\] step [0-9]+:" $OUT/step35.log | cut -c1-300 | tail -16
tar czf $REAL/C.tgz -C /tmp/res C
