#!/usr/bin/env bash
# device call D: sleep mode at 48 layers, LoRA r8: level-2 wake + refill against level 1 and vLLM's reload
REAL=$OUT; export OUT=/tmp/res/D; mkdir -p $OUT
bash /tmp/gk/kit/device-install.sh --project > $OUT/install.log 2>&1 || { tail -20 $OUT/install.log; exit 1; }
. /tmp/gk/env.sh
export PYTHONUNBUFFERED=1 BENCH_KV_BYTES=2147483648 BENCH_GPU_MEM=0.5
timeout 150 python benchmarks/bench_sync.py --shapes qwen3-30b-a3b --layers 48 --strategies full --syncs 5 \
  --json $OUT/sync48full.json > $OUT/sync48full.log 2>&1; echo "sync48 full rc=$?"
grep -E "steady|first sync" $OUT/sync48full.log | cut -c1-300 | tail -4
timeout 400 python benchmarks/bench_sleep.py --shapes qwen3-30b-a3b --layers ${LAYERS:-48} --rank 8 --repeats 2 --json $OUT/sleep.json > $OUT/sleep.log 2>&1; echo "sleep rc=$?"
grep -E "^\||Error|Traceback|failed" $OUT/sleep.log | cut -c1-400 | tail -24
tar czf $REAL/D.tgz -C /tmp/res D
