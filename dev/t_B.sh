#!/usr/bin/env bash
# device call B: the 48-layer GRPO step bench, adapter r8 then r32 (expandable segments), 20 steps each
REAL=$OUT; export OUT=/tmp/res/B; mkdir -p $OUT
bash /tmp/gk/kit/device-install.sh --project > $OUT/install.log 2>&1 || { tail -20 $OUT/install.log; exit 1; }
. /tmp/gk/env.sh
export PYTHONUNBUFFERED=1 BENCH_KV_BYTES=2147483648 BENCH_GPU_MEM=0.5
timeout 270 python benchmarks/bench_step.py --shapes qwen3-30b-a3b --layers 48 --runs adapter:8 --steps 20 \
  --json $OUT/step48r8.json > $OUT/step48r8.log 2>&1; echo "step48 r8 rc=$?"
grep -E "^\||ALARM|Traceback|Error" $OUT/step48r8.log | cut -c1-400 | tail -8
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 300 python benchmarks/bench_step.py --shapes qwen3-30b-a3b --layers 48 --runs adapter:32 --steps 20 \
  --json $OUT/step48r32.json > $OUT/step48r32.log 2>&1; echo "step48 r32 rc=$?"
grep -E "^\||ALARM|Traceback|Error|step [0-9]+:" $OUT/step48r32.log | cut -c1-400 | tail -12
tar czf $REAL/B.tgz -C /tmp/res B
