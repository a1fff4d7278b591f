#!/usr/bin/env bash
# device call E: last part + install; checking-copy tests; 48-layer full sync checked vs not; the guard's profile (48L r8)
REAL=$OUT; export OUT=/tmp/res/E; mkdir -p $OUT
cp .gpukit/s4/* /tmp/gk/ && (cd /tmp/gk && cat part.* | tar x) || { md5sum /tmp/gk/part.*; exit 1; }
bash /tmp/gk/kit/device-install.sh > $OUT/install.log 2>&1 || { tail -40 $OUT/install.log; exit 1; }
. /tmp/gk/env.sh
export PYTHONUNBUFFERED=1 BENCH_KV_BYTES=2147483648 BENCH_GPU_MEM=0.5
timeout 60 python -m pytest -q -p no:cacheprovider tests/test_checked_copy.py > $OUT/checked_copy.log 2>&1; echo "checked_copy rc=$?"; tail -2 $OUT/checked_copy.log
for i in 1 2; do
timeout 130 python benchmarks/bench_sync.py --shapes qwen3-30b-a3b --layers 48 --strategies full --syncs 5 \
  --json $OUT/sync48full$i.json > $OUT/sync48full$i.log 2>&1; echo "sync48 full rc=$?"
grep -E "steady|first sync " $OUT/sync48full$i.log | cut -c1-300 | tail -3
done
timeout 240 python dev/prof_guard.py --shapes qwen3-30b-a3b --layers 48 --runs adapter:8 --steps 5 > $OUT/prof.log 2>&1; echo "prof rc=$?"
grep -v "^INFO\|^DEBUG\|^(EngineCore\|it/s\|^\[rank" $OUT/prof.log | grep -A45 "Ordered by: cumulative" | cut -c1-220 | head -50
tar czf $REAL/E.tgz -C /tmp/res E
