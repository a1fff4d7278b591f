#!/usr/bin/env bash
# device call W2 (warm, 0.32): the two-GPU parts side by side, the 4-layer server-mode bench beside them
REAL=$OUT; export OUT=/tmp/res/W2; mkdir -p $OUT
T0=$SECONDS
. /tmp/gk/env.sh
bash /tmp/gk/kit/device-install.sh --project > /dev/null 2>&1
export PYTHONUNBUFFERED=1
( timeout 520 bash ci/gpu.sh -j server multigpu-server swift-b > $OUT/twogpu.log 2>&1; echo "2-GPU parts rc=$? at $((SECONDS-T0)) s" ) &
( sleep 50; timeout 300 python benchmarks/bench_sync.py --shapes qwen3-30b-a3b --layers 4 --rank 32 --server \
    --json $OUT/bench4_server.json > $OUT/bench4_server.log 2>&1; echo "bench4 server rc=$? at $((SECONDS-T0)) s" ) &
wait
grep -h -E "^\| |EXACTNESS|exactness:" $OUT/bench4_server.log | tail -14
tail -30 $OUT/twogpu.log
tar czf $REAL/W2.tgz -C /tmp/res W2
