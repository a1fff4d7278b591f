#!/usr/bin/env bash
# The patches' tests on an older transformers without vLLM (see install-old-transformers.sh): here the probes
# must say "target missing" / "not needed" and nothing may be patched. Tests marked `vllm` / `swift` are
# deselected (this venv has neither on purpose, and CI=true would turn their skips into failures);
# HWSYNC_NO_VLLM_EXPECTED=1 additionally tells hwsync.testing.require_vllm that vLLM is absent on purpose.
# Extra arguments go to pytest. `HWSYNC_OLD_TRANSFORMERS=5.0.0 HWSYNC_OLD_PEFT=0.18.1` runs the same tests on
# transformers 5.0.0 (in .venv-tf5.0.0 unless HWSYNC_OLD_VENV says otherwise), where the RoPE-list bug is live.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -z "${HWSYNC_OLD_VENV:-}" && -n "${HWSYNC_OLD_TRANSFORMERS:-}" ]]; then
    export HWSYNC_OLD_VENV="$PWD/.venv-tf$HWSYNC_OLD_TRANSFORMERS"
fi
VENV="${HWSYNC_OLD_VENV:-$PWD/.venv-old}"
# one install of the venv at a time (ci/preinstall.sh may have one under way): wait for it and print its log; the
# install below then finds every pin satisfied
exec 9>"$VENV.install.lock"
flock 9
if [[ -f "$VENV.install.log" ]]; then
    echo "--- the early install (ci/preinstall.sh, beside the suite):"
    cat "$VENV.install.log"
    rm -f "$VENV.install.log"
fi
HWSYNC_OLD_VENV="$VENV" bash ci/install-old-transformers.sh 9>&-
exec 9>&-
export HWSYNC_NO_VLLM_EXPECTED=1
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "not vllm and not swift" tests/test_patches*.py "$@"
