#!/usr/bin/env bash
# device call B: install the 0.32 kit; GPU0 the 48-layer adapter rows (r32 then r8), then the 48-layer full sync in
# server mode (engine on GPU1); GPU1 beside it: exactness of every strategy/format, the verify campaigns, fixtures
REAL=$OUT; export OUT=/tmp/res/B; mkdir -p $OUT
cp .gpukit/send/* /tmp/gk/ && (cd /tmp/gk && cat part.* | tar x) || { md5sum /tmp/gk/part.*; exit 1; }
bash /tmp/gk/kit/device-install.sh > $OUT/install.log 2>&1 || { tail -40 $OUT/install.log; exit 1; }
. /tmp/gk/env.sh
export PYTHONUNBUFFERED=1
export BENCH_KV_BYTES=2147483648 BENCH_GPU_BLOCKS=1300 BENCH_GPU_MEM=0.5
( CUDA_VISIBLE_DEVICES=0 timeout 280 python benchmarks/bench_sync.py --shapes qwen3-30b-a3b --layers 48 --rank 32 \
    --strategies adapter --json $OUT/bench48_r32.json > $OUT/bench48.log 2>&1; echo "bench48 r32 rc=$?"
  timeout 240 python benchmarks/bench_sync.py --shapes qwen3-30b-a3b --layers 48 --strategies full --server \
    --json $OUT/bench48_server_full.json > $OUT/bench48_server.log 2>&1; echo "bench48 server full rc=$?" ) &
( export CUDA_VISIBLE_DEVICES=1 OUT=$OUT/g1; mkdir -p $OUT
  ( HWSYNC_TEST_JOBS=2 timeout 430 bash ci/gpu.sh --modules tests/test_verify_faults_qwen3_5.py,tests/test_verify_faults.py > $OUT/verify.log 2>&1; echo "verify rc=$?" ) &
  ( sleep 15; timeout 300 bash ci/gpu.sh --modules tests/test_fixtures.py -k "qwen3_5 or gated_deltanet" > $OUT/fixtures.log 2>&1; echo "fixtures rc=$?" ) &
  ( sleep 30; timeout 400 bash ci/gpu.sh exact > $OUT/exact.log 2>&1; echo "exact rc=$?" ) &
  wait ) &
wait
grep -h -E "^\| 48|EXACTNESS|exactness:|first sync|Traceback|Error" $OUT/bench48.log $OUT/bench48_server.log | cut -c1-400 | tail -30
grep -h -E "^(ok|FAIL) |modules:|passed|=== ci" $OUT/g1/*.log | tail -30
tar czf $REAL/B.tgz -C /tmp/res B
