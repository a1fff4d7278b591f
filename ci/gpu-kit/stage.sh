#!/usr/bin/env bash
# Put kit part N (0-based) alone into .gpukit/send/, the one folder each device call carries. From the repo root.
#   bash ci/gpu-kit/stage.sh N                        # the default kit (.gpukit/part.NN)
#   VLLM_VERSION=0.33.0 bash ci/gpu-kit/stage.sh N    # a variant built with that VLLM_VERSION (.gpukit/vllm-0.33.0/)
set -euo pipefail
n=$(printf '%02d' "$1")
dir=.gpukit
[ -n "${VLLM_VERSION:-}" ] && [ -d ".gpukit/vllm-$VLLM_VERSION" ] && dir=".gpukit/vllm-$VLLM_VERSION"
[ -f "$dir/part.$n" ] || { echo "no $dir/part.$n (build the kit first: ${VLLM_VERSION:+VLLM_VERSION=$VLLM_VERSION }bash ci/gpu-kit/build.sh)"; exit 1; }
rm -rf .gpukit/send && mkdir -p .gpukit/send && cp "$dir/part.$n" .gpukit/send/
last=$(ls "$dir"/part.* | tail -1)
[ "$dir/part.$n" = "$last" ] && echo "$dir/part.$n staged (the last one)" || echo "$dir/part.$n staged"
