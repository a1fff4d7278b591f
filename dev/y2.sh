#!/usr/bin/env bash
# Y2 (warm): ms-swift's learning run with its own sync and with hwsync, side by side on the GPU (same seed)
REAL=$OUT; export OUT=/tmp/res/Y2; mkdir -p $OUT
T0=$SECONDS
. /tmp/gk/env.sh
bash /tmp/gk/kit/device-install.sh --project > /dev/null 2>&1
export PYTHONUNBUFFERED=1 HWSYNC_EXAMPLE_GPU_UTIL=0.3
for s in swift hwsync; do
  ( timeout 560 python benchmarks/swift_learning.py --steps 40 --sides $s --json $OUT/swift-$s.json \
      --png $OUT/swift-$s.png > $OUT/learn-$s.log 2>&1; echo "learn $s rc=$? at $((SECONDS-T0)) s" ) &
  sleep 5
done
wait
tail -6 $OUT/learn-*.log
tar czf $REAL/Y2.tgz -C /tmp/res Y2
