#!/usr/bin/env bash
# Builds the "old transformers" venv: the stack a user has before transformers 5, without vLLM, so the
# patches' "target missing" / "not needed" paths run for real (tests/test_patches*.py).
#   1. torch==2.13.0 first (the local CPU wheel; otherwise a resolver may fetch a CUDA build);
#   2. transformers at an older release (default 4.57.6, the last 4.x: per-expert MoE modules, no
#      PretrainedConfig.convert_rope_params_to_dict) and the PEFT release of the main venv (0.20.0), so only
#      transformers differs between the two jobs;
#   3. pytest; NO vLLM, NO ms-swift;
#   4. hwsync itself, editable, --no-deps (its runtime deps are the ones above).
# Idempotent: satisfied pins are skipped.
#
# Environment:
#   HWSYNC_OLD_VENV          venv directory (default: ./.venv-old)
#   HWSYNC_OLD_TRANSFORMERS  transformers version (default: 4.57.6; 5.0.0 exercises the RoPE-list bug)
#   HWSYNC_OLD_PEFT          peft version (default: 0.20.0; with transformers 5.0.0 use the PEFT of its time,
#                            0.18.1: PEFT 0.20's adapter loading calls a transformers API 5.0.0 lacks)
#   HWSYNC_PYTHON            interpreter used to create the venv (default: python3; >= 3.10)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO="$PWD"
VENV="${HWSYNC_OLD_VENV:-$REPO/.venv-old}"
PYTHON="${HWSYNC_PYTHON:-python3}"
TORCH_PIN="torch==2.13.0"
TF_PIN="transformers==${HWSYNC_OLD_TRANSFORMERS:-4.57.6}"
PEFT_PIN="peft==${HWSYNC_OLD_PEFT:-0.20.0}"

start=$SECONDS
step() { printf '[install-old %4ss] %s\n' "$((SECONDS - start))" "$*"; }

if [[ ! -x "$VENV/bin/python" ]]; then
    step "creating venv $VENV with $PYTHON"
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
        || { echo "hwsync needs Python >= 3.10; set HWSYNC_PYTHON" >&2; exit 1; }
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --progress-bar off)
no_vllm() {
    if "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("vllm") is None)'; then
        echo "vLLM is installed in $VENV; this venv must not have it (it tests the vLLM-less paths): pick another" \
             "HWSYNC_OLD_VENV" >&2
        exit 1
    fi
}
no_vllm  # before touching anything: never downgrade transformers under an existing vLLM venv

# shellcheck source=ci/pins.sh
source "$REPO/ci/pins.sh"  # satisfied()

if satisfied "$TORCH_PIN"; then step "$TORCH_PIN: already installed"; else
    step "installing $TORCH_PIN"; "${PIP[@]}" "$TORCH_PIN"; fi

if satisfied "$TF_PIN" "$PEFT_PIN" pytest pytest-timeout; then step "$TF_PIN $PEFT_PIN pytest: already installed"; else
    step "installing $TF_PIN $PEFT_PIN pytest"
    "${PIP[@]}" "$TF_PIN" "$PEFT_PIN" "pytest>=8" pytest-timeout "$TORCH_PIN"
fi

no_vllm

if satisfied hwsync && "$PY" -c 'import hwsync.patches' 2>/dev/null; then step "hwsync (editable): already installed"; else
    step "installing hwsync -e . --no-deps"; "${PIP[@]}" --no-deps -e .
fi

satisfied "$TORCH_PIN" || { echo "torch is no longer at $TORCH_PIN after install; see pip output above" >&2; exit 1; }
step "done ($("$PY" -c 'import torch, transformers, peft; print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__)'))"
