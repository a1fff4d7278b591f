#!/usr/bin/env bash
# Put kit part N (0-based) alone into .gpukit/send/, the one folder each device call carries. From the repo root.
set -euo pipefail
n=$(printf '%02d' "$1")
[ -f ".gpukit/part.$n" ] || { echo "no .gpukit/part.$n (build the kit first: bash ci/gpu-kit/build.sh)"; exit 1; }
rm -rf .gpukit/send && mkdir -p .gpukit/send && cp ".gpukit/part.$n" .gpukit/send/
last=$(ls .gpukit/part.* | tail -1)
[ ".gpukit/part.$n" = "$last" ] && echo "part.$n staged (the last one)" || echo "part.$n staged"
