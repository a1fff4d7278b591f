#!/usr/bin/env bash
# X1: install 0.32 kit + TRL; GPU0: 48-layer adapter r32 then r8; GPU1: TRL's own sync vs hwsync at 48 layers
REAL=$OUT; export OUT=/tmp/res/X1; mkdir -p $OUT
T0=$SECONDS
(cd /tmp/gk && cat part.* | tar x) || { md5sum /tmp/gk/part.*; exit 1; }
bash /tmp/gk/kit/device-install.sh > $OUT/install.log 2>&1 || { tail -40 $OUT/install.log; exit 1; }
python3 -m pip install -q --no-deps --no-index --target /tmp/site-trl /tmp/gk/trl-1.16.0-py3-none-any.whl > $OUT/trl-install.log 2>&1; echo "trl install rc=$?"
echo "installed at $((SECONDS-T0)) s"
. /tmp/gk/env.sh
export PYTHONUNBUFFERED=1
( export CUDA_VISIBLE_DEVICES=0 BENCH_KV_BYTES=2147483648 BENCH_GPU_BLOCKS=1300 BENCH_GPU_MEM=0.5
  timeout 250 python benchmarks/bench_sync.py --shapes qwen3-30b-a3b --layers 48 --rank 32 --strategies adapter \
    --json $OUT/bench48_r32.json > $OUT/bench48_r32.log 2>&1; echo "bench48 r32 rc=$? at $((SECONDS-T0)) s"
  left=$(( 560 - (SECONDS-T0) ))
  timeout $left python benchmarks/bench_sync.py --shapes qwen3-30b-a3b --layers 48 --rank 8 --strategies adapter \
    --json $OUT/bench48_r8.json > $OUT/bench48_r8.log 2>&1; echo "bench48 r8 rc=$? at $((SECONDS-T0)) s" ) &
( export CUDA_VISIBLE_DEVICES=1 PYTHONPATH=/tmp/site-trl:$PYTHONPATH BENCH_KV_BYTES=2147483648 BENCH_GPU_MEM=0.5
  left=$(( 560 - (SECONDS-T0) ))
  timeout $left python benchmarks/bench_trl_sync.py --shapes qwen3-30b-a3b --layers 48 --rank 16 --warmup 1 --syncs 3 \
    --out $OUT/trl48.json > $OUT/trl48.log 2>&1; echo "trl48 rc=$? at $((SECONDS-T0)) s" ) &
wait
grep -h -E "first sync|steady|^\| 48|EXACT|exactness|Error|error" $OUT/bench48_*.log | cut -c1-600 | tail -24
grep -v Warning $OUT/trl48.log | grep -E "^\||Error|error|rc=" | tail -12
tar czf $REAL/X1.tgz -C /tmp/res X1
