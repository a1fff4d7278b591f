#!/usr/bin/env bash
# X2 (warm): GPU0: router LoRA tests, the two re-run LoRA cells, TRL server test; GPU1: TRL learning runs side by side
REAL=$OUT; export OUT=/tmp/res/X2; mkdir -p $OUT
T0=$SECONDS
. /tmp/gk/env.sh
export PYTHONUNBUFFERED=1
( export CUDA_VISIBLE_DEVICES=0
  timeout 200 pytest -q -s tests/test_router_lora.py > $OUT/router.log 2>&1; echo "router rc=$? at $((SECONDS-T0)) s"
  HWSYNC_LORA_CELLS="all-linear;experts, rank ≠ attention" HWSYNC_LORA_RESULTS=$OUT/lora-cells.json \
    timeout 330 pytest -q tests/test_lora_configs.py -k test_cell > $OUT/lora-cells.log 2>&1; echo "lora cells rc=$? at $((SECONDS-T0)) s" ) &
( export CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/site-trl:$PYTHONPATH; sleep 15
  timeout 300 pytest -q tests/test_trl_server.py > $OUT/trl_server.log 2>&1; echo "trl_server rc=$? at $((SECONDS-T0)) s" ) &
( export CUDA_VISIBLE_DEVICES=1 PYTHONPATH=/tmp/site-trl:$PYTHONPATH HWSYNC_EXAMPLE_GPU_UTIL=0.2
  for s in trl hwsync hwsync-noverify; do
    mkdir -p /tmp/tl-$s
    ( timeout 520 python benchmarks/trl_learning.py --sync $s --steps 40 --seed 42 --workdir /tmp/tl-$s \
        > $OUT/learn-$s.log 2>&1; echo "learn $s rc=$? at $((SECONDS-T0)) s" ) &
    sleep 20
  done; wait ) &
wait
tail -5 $OUT/router.log; grep -E "passed|failed|FAILED" $OUT/lora-cells.log $OUT/trl_server.log | tail -6
for s in trl hwsync hwsync-noverify; do grep -c "^RESULT" $OUT/learn-$s.log; done
tar czf $REAL/X2.tgz -C /tmp/res X2
