#!/usr/bin/env bash
# X3 (warm): two GPUs: the 4-layer server-mode bench (phases), then the 2-GPU parts
REAL=$OUT; export OUT=/tmp/res/X3; mkdir -p $OUT
T0=$SECONDS
. /tmp/gk/env.sh
export PYTHONUNBUFFERED=1
timeout 200 python benchmarks/bench_sync.py --shapes qwen3-30b-a3b --layers 4 --rank 32 --server \
    --json $OUT/bench4_server.json > $OUT/bench4_server.log 2>&1; echo "bench4 server rc=$? at $((SECONDS-T0)) s"
left=$(( 560 - (SECONDS-T0) ))
timeout $left bash ci/gpu.sh multigpu-server swift-b > $OUT/twogpu.log 2>&1; echo "2-GPU parts rc=$? at $((SECONDS-T0)) s"
grep -h -E "^\| |phases|EXACT|exactness" $OUT/bench4_server.log | cut -c1-400 | tail -24
grep -E "=== |passed|failed|FAILED" $OUT/twogpu.log | tail -20
tar czf $REAL/X3.tgz -C /tmp/res X3
