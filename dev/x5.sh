#!/usr/bin/env bash
# X5: install; the 4-layer bench with server mode (2 GPUs), then the 48-layer r32 adapter row on GPU0
REAL=$OUT; export OUT=/tmp/res/X5; mkdir -p $OUT
T0=$SECONDS
(cd /tmp/gk && cat part.* | tar x) || exit 1
bash /tmp/gk/kit/device-install.sh > $OUT/install.log 2>&1 || { tail -40 $OUT/install.log; exit 1; }
echo "installed at $((SECONDS-T0)) s"
. /tmp/gk/env.sh
export PYTHONUNBUFFERED=1
timeout 140 python benchmarks/bench_sync.py --shapes qwen3-30b-a3b --layers 4 --rank 32 --server \
    --json $OUT/bench4_server.json > $OUT/bench4_server.log 2>&1; echo "bench4 server rc=$? at $((SECONDS-T0)) s"
grep -h -E "^\| 4|^\| (full|adapter|hybrid)|phases \(ms\)|second sync" $OUT/bench4_server.log | cut -c1-330
tar czf $REAL/X5.tgz -C /tmp/res X5
CUDA_VISIBLE_DEVICES=0 BENCH_KV_BYTES=2147483648 BENCH_GPU_BLOCKS=1300 BENCH_GPU_MEM=0.5 timeout 200 \
  python benchmarks/bench_sync.py --shapes qwen3-30b-a3b --layers 48 --rank 32 --strategies adapter --syncs 5 \
    --json $OUT/bench48_r32.json > $OUT/bench48_r32.log 2>&1; echo "bench48 r32 rc=$? at $((SECONDS-T0)) s"
grep -h -E "first sync|steady|^\| 48|exactness" $OUT/bench48_r32.log | cut -c1-400
tar czf $REAL/X5.tgz -C /tmp/res X5
