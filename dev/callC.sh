#!/usr/bin/env bash
# device call C (warm, 0.32 kit installed): the 2-GPU parts side by side, and the 4-layer server-mode bench beside them
REAL=$OUT; export OUT=/tmp/res/C; mkdir -p $OUT
. /tmp/gk/env.sh
bash /tmp/gk/kit/device-install.sh --project > /dev/null 2>&1
export PYTHONUNBUFFERED=1
( timeout 500 bash ci/gpu.sh -j multigpu multigpu-z3 server swift-b > $OUT/twogpu.log 2>&1; echo "2-GPU parts rc=$?" ) &
( sleep 60; timeout 400 python benchmarks/bench_sync.py --shapes qwen3-30b-a3b --layers 4 --rank 32 --server \
    --json $OUT/bench4_server.json > $OUT/bench4_server.log 2>&1; echo "bench4 server rc=$?" ) &
wait
grep -h -E "^\| |EXACTNESS|exactness:" $OUT/bench4_server.log | tail -12
cat $OUT/twogpu.log | tail -30
tar czf $REAL/C.tgz -C /tmp/res C
