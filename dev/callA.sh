#!/usr/bin/env bash
# device call A (session driver, untracked): install the 0.32 kit, then GPU0 the 48-layer adapter scaling rows, GPU1
# Qwen3.5 (part qwen35) + the new replay path's GPU tests + the Qwen3.5 family rows
REAL=$OUT; export OUT=/tmp/res/A; mkdir -p $OUT
cp .gpukit/send/* /tmp/gk/ && (cd /tmp/gk && cat part.* | tar x) || { md5sum /tmp/gk/part.*; exit 1; }
bash /tmp/gk/kit/device-install.sh > $OUT/install.log 2>&1 || { tail -40 $OUT/install.log; exit 1; }
grep -E "vllm ops|torch|vllm " $OUT/install.log | head -8
. /tmp/gk/env.sh
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
( CUDA_VISIBLE_DEVICES=0 BENCH_KV_BYTES=2147483648 BENCH_GPU_BLOCKS=1300 BENCH_GPU_MEM=0.5 timeout 470 \
  python benchmarks/bench_sync.py --shapes qwen3-30b-a3b --layers 48,24,12 --rank 32 --strategies adapter \
  --json $OUT/bench_adapter_scaling.json > $OUT/bench48.log 2>&1; echo "bench48 rc=$?" ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 470 bash ci/gpu.sh qwen35 > $OUT/qwen35.log 2>&1; echo "qwen35 rc=$?" ) &
( export CUDA_VISIBLE_DEVICES=1; sleep 30
  HWSYNC_TEST_JOBS=3 timeout 440 bash ci/gpu.sh --modules tests/test_lora_template.py,tests/test_sync_inplace.py,tests/test_replay.py,tests/test_lora_formats.py > $OUT/replay-tests.log 2>&1; echo "replay-tests rc=$?"
  HWSYNC_FAMILIES=qwen3_5_moe_text,qwen3_next HWSYNC_FAMILY_PROCS=2 timeout 300 bash ci/gpu.sh families > $OUT/families35.log 2>&1; echo "families35 rc=$?" ) &
wait
grep -h -E "^\| |passed|failed|FAILED|EXACTNESS|exactness|rc=" $OUT/bench48.log | tail -40
grep -h -E "=== ci/gpu.sh|passed|failed" $OUT/qwen35.log $OUT/replay-tests.log $OUT/families35.log | tail -40
tar czf $REAL/A.tgz -C /tmp/res A
