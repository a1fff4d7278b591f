#!/usr/bin/env bash
# device call A: install; the checking copy's GPU tests, its cost on 60 GB, and the 48-layer full sync with/without it
REAL=$OUT; export OUT=/tmp/res/A; mkdir -p $OUT
cp .gpukit/send/* /tmp/gk/ && (cd /tmp/gk && cat part.* | tar x) || { md5sum /tmp/gk/part.*; exit 1; }
bash /tmp/gk/kit/device-install.sh > $OUT/install.log 2>&1 || { tail -40 $OUT/install.log; exit 1; }
. /tmp/gk/env.sh
export PYTHONUNBUFFERED=1 BENCH_KV_BYTES=2147483648 BENCH_GPU_MEM=0.5
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
timeout 120 python -m pytest -q -p no:cacheprovider tests/test_checked_copy.py > $OUT/checked_copy.log 2>&1; echo "checked_copy rc=$?"; tail -3 $OUT/checked_copy.log
timeout 120 python benchmarks/bench_isfinite.py --gb 60 --device cuda > $OUT/isfinite.log 2>&1; echo "isfinite rc=$?"; cat $OUT/isfinite.log | tail -12
timeout 300 python benchmarks/bench_sync.py --shapes qwen3-30b-a3b --layers 48 --strategies full --syncs 7 \
  --json $OUT/sync48full.json > $OUT/sync48full.log 2>&1; echo "sync48 full rc=$?"
grep -E "^\||steady|first sync|Error|Traceback" $OUT/sync48full.log | cut -c1-600 | tail -20
tar czf $REAL/A.tgz -C /tmp/res A
