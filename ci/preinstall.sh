#!/usr/bin/env bash
# Starts, in the background, the installs of the venvs CI's later parts need -- ci/run-vllm-matrix.sh's releases
# (.venv-trl, .venv-030), then ci/run-old-transformers.sh's (.venv-old) -- one after the other at the lowest CPU
# priority, and returns at once. .ci/run calls it after ./.venv's install, so those installs run beside the suite
# instead of before the legs that use them (measured: ~153 s wall for the 0.31 venv's install at 60 % of one core,
# i.e. mostly downloads and unpacking). Each install holds <venv>.install.lock and writes <venv>.install.log; the
# leg that uses the venv waits for that lock, prints the log and runs its own install again (every satisfied pin
# skipped, seconds; a failed early install is simply redone there, where its failure fails the leg as before).
# Same environment as the legs: HWSYNC_MATRIX_VENVS, HWSYNC_OLD_VENV / HWSYNC_OLD_TRANSFORMERS.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

old_venv="${HWSYNC_OLD_VENV:-$PWD/.venv-old}"  # as ci/run-old-transformers.sh picks it
if [[ -z "${HWSYNC_OLD_VENV:-}" && -n "${HWSYNC_OLD_TRANSFORMERS:-}" ]]; then
    old_venv="$PWD/.venv-tf$HWSYNC_OLD_TRANSFORMERS"
fi
(
    HWSYNC_MATRIX_INSTALL_ONLY=1 nice -n 19 bash ci/run-vllm-matrix.sh >/dev/null 2>&1
    (
        exec 9>"$old_venv.install.lock"
        flock 9
        HWSYNC_OLD_VENV="$old_venv" nice -n 19 bash ci/install-old-transformers.sh >"$old_venv.install.log" 2>&1 9>&-
    )
) </dev/null >/dev/null 2>&1 &
echo "ci/preinstall.sh: the vLLM matrix's and the old-transformers venvs install in the background (pid $!)"
