#!/usr/bin/env bash
# device call A: install the 0.32 kit; the 48-layer GRPO step bench, adapter r8 and r32, 20 steps each
REAL=$OUT; export OUT=/tmp/res/A; mkdir -p $OUT
cp .gpukit/send/* /tmp/gk/ && (cd /tmp/gk && cat part.* | tar x) || { md5sum /tmp/gk/part.*; exit 1; }
bash /tmp/gk/kit/device-install.sh > $OUT/install.log 2>&1 || { tail -40 $OUT/install.log; exit 1; }
. /tmp/gk/env.sh
export PYTHONUNBUFFERED=1 BENCH_KV_BYTES=2147483648 BENCH_GPU_MEM=0.5
timeout 470 python benchmarks/bench_step.py --shapes qwen3-30b-a3b --layers 48 --runs adapter:8,adapter:32 --steps 20 \
  --json $OUT/step48a.json > $OUT/step48a.log 2>&1; echo "step48 adapter rc=$?"
grep -E "^\||ALARM|Traceback|Error|hwsync: verify after" $OUT/step48a.log | cut -c1-700 | tail -24
tar czf $REAL/A.tgz -C /tmp/res A
