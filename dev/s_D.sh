#!/usr/bin/env bash
# device call D: sleep mode at 48 layers (level 2 wake + refill against level 1 and vLLM's reload)
REAL=$OUT; export OUT=/tmp/res/D; mkdir -p $OUT
bash /tmp/gk/kit/device-install.sh --project > $OUT/install.log 2>&1 || { tail -20 $OUT/install.log; exit 1; }
. /tmp/gk/env.sh
export PYTHONUNBUFFERED=1 BENCH_KV_BYTES=2147483648 BENCH_GPU_MEM=0.5
timeout ${T:-500} python benchmarks/bench_sleep.py --shapes qwen3-30b-a3b --layers ${LAYERS:-48} --rank 32 --json $OUT/sleep.json > $OUT/sleep.log 2>&1; echo "sleep rc=$?"
grep -E "^\||Error|Traceback|refill|wake" $OUT/sleep.log | cut -c1-500 | tail -30
tar czf $REAL/D.tgz -C /tmp/res D
