#!/usr/bin/env bash
# Z1: install 0.32 kit; GPU: 48-layer adapter r32 (first sync's allocations recorded) and r8 after the plan's
# adapter copy was dropped and the walk after an engine-side registration; then ms-swift learning, three sides
REAL=$OUT; export OUT=/tmp/res/Z1; mkdir -p $OUT
T0=$SECONDS
(cd /tmp/gk && cat part.* | tar x) || { md5sum /tmp/gk/part.*; exit 1; }
bash /tmp/gk/kit/device-install.sh > $OUT/install.log 2>&1 || { tail -40 $OUT/install.log; exit 1; }
echo "installed at $((SECONDS-T0)) s"
. /tmp/gk/env.sh
export PYTHONUNBUFFERED=1
( export BENCH_KV_BYTES=2147483648 BENCH_GPU_BLOCKS=1300 BENCH_GPU_MEM=0.5
  timeout 190 python benchmarks/bench_sync.py --shapes qwen3-30b-a3b --layers 48 --rank 32 --strategies adapter \
    --memory-history $OUT/mem48_r32 --json $OUT/bench48_r32.json > $OUT/bench48_r32.log 2>&1; echo "bench48 r32 rc=$? at $((SECONDS-T0)) s"
  timeout 150 python benchmarks/bench_sync.py --shapes qwen3-30b-a3b --layers 48 --rank 8 --strategies adapter \
    --json $OUT/bench48_r8.json > $OUT/bench48_r8.log 2>&1; echo "bench48 r8 rc=$? at $((SECONDS-T0)) s" )
export HWSYNC_EXAMPLE_GPU_UTIL=0.25
for s in swift swift-merged hwsync; do
  left=$(( 575 - (SECONDS-T0) ))
  ( timeout $left python benchmarks/swift_learning.py --steps 40 --sides $s --json $OUT/swift-$s.json \
      --png $OUT/swift-$s.png > $OUT/learn-$s.log 2>&1; echo "learn $s rc=$? at $((SECONDS-T0)) s" ) &
  sleep 3
done
wait
grep -h -E "first sync|steady|^\| 48|EXACT|exactness|Error|error" $OUT/bench48_*.log | cut -c1-500 | tail -30
for s in swift swift-merged hwsync; do tail -n 4 $OUT/learn-$s.log; done
tar czf $REAL/Z1.tgz -C /tmp/res Z1
