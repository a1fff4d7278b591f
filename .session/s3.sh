#!/usr/bin/env bash
# last call (one H200): the adapter/hybrid exact tests of both families (the new adapter path), the Qwen3.5 main job (GRPO), the Qwen3.5 bench row
. /tmp/gk/env.sh
( timeout 470 bash ci/gpu.sh --modules tests/test_sync_exact.py -k "(adapter or hybrid) and not 3d" > $OUT/exact2d.log 2>&1; echo "exact-2d rc=$?" ) &
sleep 15
( timeout 455 bash ci/gpu.sh --modules tests/test_sync_exact.py -k "(adapter or hybrid) and 3d" > $OUT/exact3d.log 2>&1; echo "exact-3d rc=$?" ) &
sleep 15
( HWSYNC_EXAMPLE_GPU_UTIL=0.15 timeout 440 python3 examples/grpo_tiny_moe.py --family qwen3_5_moe --steps 4 --workdir /tmp/q35 > $OUT/grpo35.log 2>&1; echo "grpo35 rc=$?" ) &
sleep 15
( BENCH_GPU_MEM=0.3 timeout 420 python3 benchmarks/bench_sync.py --shapes qwen3.5-moe --layers 4 --rank 32 --strategies full,adapter --syncs 5 --warmup 2 --json $OUT/bench35.json > $OUT/bench35.log 2>&1; echo "bench35 rc=$?" ) &
wait
for f in exact2d exact3d; do grep -E "^ok |^FAIL|^FAILED|passed|failed" $OUT/$f.log | cut -c1-400 | tail -8; done
grep -E "check|PASS|FAIL|step|Error" $OUT/grpo35.log | tail -15 | cut -c1-300
grep -E "first sync|^\| [0-9]|EXACT|exactness|Error" $OUT/bench35.log | cut -c1-500 | tail -6
