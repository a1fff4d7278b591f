#!/usr/bin/env bash
# GPU0: the LoRA configuration matrix (issue 29); GPU1: vLLM 0.33 kit install + exact, verify, swift on 0.33 (issue 26)
(
  . /tmp/gk/env.sh; export CUDA_VISIBLE_DEVICES=0 HWSYNC_LORA_FULL_SYNCS=3
  timeout 540 bash ci/gpu.sh lora-configs > $OUT/lora.log 2>&1; echo "lora rc=$?"
) > $OUT/gpu0.txt 2>&1 &
g0=$!
(
  export CUDA_VISIBLE_DEVICES=1
  (cd /tmp/gk-0.33.0 && cat part.* | tar x) && bash /tmp/gk-0.33.0/kit/device-install.sh > $OUT/install033.log 2>&1; echo "install rc=$?"; tail -4 $OUT/install033.log
  . /tmp/gk-0.33.0/env.sh
  python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
  timeout 480 bash ci/gpu.sh -j exact verify swift > $OUT/v033.log 2>&1; echo "v033 rc=$?"
) > $OUT/gpu1.txt 2>&1 &
g1=$!
wait $g0; wait $g1
cat $OUT/gpu0.txt; grep -E "^=== |^ok |^FAIL|FAILED|passed|failed" $OUT/lora.log | tail -25
cat $OUT/gpu1.txt; grep -E "^=== |^ok |^FAIL|FAILED|passed, |failed" $OUT/v033.log | tail -30
