#!/usr/bin/env bash
# Z2: install 0.32 kit; 48-layer adapter rows r32 and r8 after the steady plan is validated when made
REAL=$OUT; export OUT=/tmp/res/Z2; mkdir -p $OUT
T0=$SECONDS
(cd /tmp/gk && cat part.* | tar x) || { md5sum /tmp/gk/part.*; exit 1; }
bash /tmp/gk/kit/device-install.sh > $OUT/install.log 2>&1 || { tail -40 $OUT/install.log; exit 1; }
echo "installed at $((SECONDS-T0)) s"
. /tmp/gk/env.sh
export PYTHONUNBUFFERED=1 BENCH_KV_BYTES=2147483648 BENCH_GPU_BLOCKS=1300 BENCH_GPU_MEM=0.5
timeout 170 python benchmarks/bench_sync.py --shapes qwen3-30b-a3b --layers 48 --rank 32 --strategies adapter --syncs 8 \
  --json $OUT/bench48_r32.json > $OUT/bench48_r32.log 2>&1; echo "bench48 r32 rc=$? at $((SECONDS-T0)) s"
timeout 150 python benchmarks/bench_sync.py --shapes qwen3-30b-a3b --layers 48 --rank 8 --strategies adapter --syncs 8 \
  --json $OUT/bench48_r8.json > $OUT/bench48_r8.log 2>&1; echo "bench48 r8 rc=$? at $((SECONDS-T0)) s"
grep -h -E "first sync|steady|^\| 48|exactness|Error|error" $OUT/bench48_*.log | cut -c1-500 | tail -16
tar czf $REAL/Z2.tgz -C /tmp/res Z2
