#!/usr/bin/env bash
# device call 5: install the 0.32 kit, then the 48-layer GRPO step bench (adapter r8, r32) on one H200
REAL=$OUT; export OUT=/tmp/res/r1; mkdir -p $OUT
cp .gpukit/send/* /tmp/gk/ && (cd /tmp/gk && cat part.* | tar x) || { md5sum /tmp/gk/part.*; exit 1; }
bash /tmp/gk/kit/device-install.sh > $OUT/install.log 2>&1 || { tail -40 $OUT/install.log; exit 1; }
. /tmp/gk/env.sh
export PYTHONUNBUFFERED=1 BENCH_KV_BYTES=2147483648 BENCH_GPU_MEM=0.5
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
timeout 90 python benchmarks/bench_step.py --shapes qwen3-30b-a3b --layers 4 --runs adapter:8,full --steps 3 \
  --json $OUT/step4.json > $OUT/step4.log 2>&1; echo "step4 rc=$?"
grep -E "^\||ALARM|Error|error" $OUT/step4.log | tail -12
timeout 420 python benchmarks/bench_step.py --shapes qwen3-30b-a3b --layers 48 --runs adapter:8,adapter:32 --steps 20 \
  --json $OUT/step48a.json > $OUT/step48a.log 2>&1; echo "step48 adapter rc=$?"
grep -E "^\||ALARM|Traceback|Error" $OUT/step48a.log | tail -20
tar czf $REAL/r1.tgz -C /tmp/res r1
