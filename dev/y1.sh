#!/usr/bin/env bash
# Y1: install 0.32 kit + TRL; GPU0: 48-layer adapter r32 (first sync's allocations recorded), then r8; then the
# all-linear LoRA cell and the router tests
REAL=$OUT; export OUT=/tmp/res/Y1; mkdir -p $OUT
T0=$SECONDS
(cd /tmp/gk && cat part.* | tar x) || { md5sum /tmp/gk/part.*; exit 1; }
bash /tmp/gk/kit/device-install.sh > $OUT/install.log 2>&1 || { tail -40 $OUT/install.log; exit 1; }
python3 -m pip install -q --no-deps --no-index --target /tmp/site-trl /tmp/gk/trl-1.16.0-py3-none-any.whl > $OUT/trl-install.log 2>&1; echo "trl install rc=$?"
echo "installed at $((SECONDS-T0)) s"
. /tmp/gk/env.sh
export PYTHONUNBUFFERED=1
( export BENCH_KV_BYTES=2147483648 BENCH_GPU_BLOCKS=1300 BENCH_GPU_MEM=0.5
  timeout 200 python benchmarks/bench_sync.py --shapes qwen3-30b-a3b --layers 48 --rank 32 --strategies adapter \
    --memory-history $OUT/mem48_r32 --json $OUT/bench48_r32.json > $OUT/bench48_r32.log 2>&1; echo "bench48 r32 rc=$? at $((SECONDS-T0)) s"
  timeout 170 python benchmarks/bench_sync.py --shapes qwen3-30b-a3b --layers 48 --rank 8 --strategies adapter \
    --json $OUT/bench48_r8.json > $OUT/bench48_r8.log 2>&1; echo "bench48 r8 rc=$? at $((SECONDS-T0)) s" )
left=$(( 570 - (SECONDS-T0) ))
( timeout $left pytest -q -s tests/test_router_lora.py > $OUT/router.log 2>&1; echo "router rc=$? at $((SECONDS-T0)) s" ) &
( sleep 10; left=$(( 570 - (SECONDS-T0) ))
  HWSYNC_LORA_CELLS="all-linear" HWSYNC_LORA_RESULTS=$OUT/lora-cells.json \
    timeout $left pytest -q tests/test_lora_configs.py -k test_cell > $OUT/lora-cells.log 2>&1; echo "lora cells rc=$? at $((SECONDS-T0)) s" ) &
wait
grep -h -E "first sync|steady|second|^\| 48|EXACT|exactness|Error|error" $OUT/bench48_*.log | cut -c1-500 | tail -30
tail -3 $OUT/router.log; grep -E "passed|failed|FAILED" $OUT/lora-cells.log | tail -4
ls -la $OUT
tar czf $REAL/Y1.tgz -C /tmp/res Y1
