#!/usr/bin/env bash
# device session call: GPU0 the 48-layer bench (issue 24), GPU1 exact + qwen35 (regression of the new adapter path, issue 25)
. /tmp/gk/env.sh
export BENCH_KV_BYTES=2147483648 BENCH_GPU_BLOCKS=1300 BENCH_GPU_MEM=0.5
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 300 python3 benchmarks/bench_sync.py --shapes qwen3-30b-a3b --layers 48 --rank 32 --strategies adapter,full --syncs 5 --warmup 2 --json $OUT/b48_r32.json > $OUT/b48_r32.log 2>&1; echo "b48 r32 rc=$?"
  timeout 230 python3 benchmarks/bench_sync.py --shapes qwen3-30b-a3b --layers 48 --rank 8 --strategies adapter --syncs 5 --warmup 2 --json $OUT/b48_r8.json > $OUT/b48_r8.log 2>&1; echo "b48 r8 rc=$?"
) > $OUT/gpu0.txt 2>&1 &
g0=$!
( export CUDA_VISIBLE_DEVICES=${GPU1:-1}; unset BENCH_KV_BYTES BENCH_GPU_BLOCKS BENCH_GPU_MEM; timeout 530 bash ci/gpu.sh -j exact qwen35 > $OUT/gpu1.log 2>&1; echo "gpu1 rc=$?" ) &
g1=$!
wait $g0; cat $OUT/gpu0.txt
for f in $OUT/b48_r32.log $OUT/b48_r8.log; do grep -E "first sync|^\| [0-9]|EXACT|exactness|Error" $f | cut -c1-600 | tail -8; done
wait $g1
grep -E "^=== |passed|failed|FAILED|^ok |^FAIL" $OUT/gpu1.log | tail -40
