#!/usr/bin/env bash
# Z3: install; 48-layer adapter r32 (memory: vLLM's adapter as views of the fold buffers); then the adapter exact cells
REAL=$OUT; export OUT=/tmp/res/Z3; mkdir -p $OUT
T0=$SECONDS
(cd /tmp/gk && cat part.* | tar x) || { md5sum /tmp/gk/part.*; exit 1; }
bash /tmp/gk/kit/device-install.sh > $OUT/install.log 2>&1 || { tail -40 $OUT/install.log; exit 1; }
echo "installed at $((SECONDS-T0)) s"
. /tmp/gk/env.sh
export PYTHONUNBUFFERED=1
( export BENCH_KV_BYTES=2147483648 BENCH_GPU_BLOCKS=1300 BENCH_GPU_MEM=0.5
  timeout 150 python benchmarks/bench_sync.py --shapes qwen3-30b-a3b --layers 48 --rank 32 --strategies adapter --syncs 3 \
  --json $OUT/bench48_r32.json > $OUT/bench48_r32.log 2>&1; echo "bench48 r32 rc=$? at $((SECONDS-T0)) s" )
grep -h -E "first sync|steady|^\| 48|exactness|Error|error" $OUT/bench48_*.log | cut -c1-500 | tail -10
left=$(( 315 - (SECONDS-T0) ))
timeout $left pytest -q -x tests/test_sync_exact.py -k "test_adapter and qwen3_moe and (2d or 3d)" > $OUT/exact.log 2>&1; echo "exact rc=$? at $((SECONDS-T0)) s"
tail -3 $OUT/exact.log
tar czf $REAL/Z3.tgz -C /tmp/res Z3
