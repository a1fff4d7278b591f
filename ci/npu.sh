#!/usr/bin/env bash
# The Ascend NPU CI job (.github/workflows/ci.yml, job `npu`), runnable by hand on any Ascend host with CANN:
#   bash ci/npu.sh            # installs into ./.venv-npu, then doctor, the test suite and the GRPO main job
# Pins follow vllm-ascend 0.23.0.post1's installation guide: CANN 9.1.0, torch 2.10.0 + torch-npu 2.10.0.post4,
# vLLM 0.23.0, vllm-ascend 0.23.0.post1 (its wheels come from the Ascend index its guide names: ASCEND_PIP_INDEX).
# NOT run by hwsync's maintainers so far: no Ascend hardware was available (see docs/ascend.md).
#
# Environment: CANN_SET_ENV (default /usr/local/Ascend/ascend-toolkit/set_env.sh), ATB_SET_ENV (optional NNAL),
# HWSYNC_NPU_VENV (default ./.venv-npu), HWSYNC_PYTHON (default python3), OUT (doctor.json goes there; default .)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO="$PWD"

TORCH_PIN="torch==2.10.0"
TORCH_NPU_PIN="torch-npu==2.10.0.post4"
VLLM_PIN="vllm==0.23.0"
VLLM_ASCEND_PIN="vllm-ascend==0.23.0.post1"
ASCEND_PIP_INDEX="${ASCEND_PIP_INDEX:-https://mirrors.huaweicloud.com/ascend/repos/pypi}"
CANN_SET_ENV="${CANN_SET_ENV:-/usr/local/Ascend/ascend-toolkit/set_env.sh}"
ATB_SET_ENV="${ATB_SET_ENV:-/usr/local/Ascend/nnal/atb/set_env.sh}"
VENV="${HWSYNC_NPU_VENV:-$REPO/.venv-npu}"
OUT="${OUT:-$REPO}"

start=$SECONDS
step() { printf '[npu %4ss] %s\n' "$((SECONDS - start))" "$*"; }

[[ -f "$CANN_SET_ENV" ]] || { echo "CANN not found at $CANN_SET_ENV (set CANN_SET_ENV)" >&2; exit 1; }
set +u  # CANN's scripts read unset variables
# shellcheck source=/dev/null
source "$CANN_SET_ENV"
# shellcheck source=/dev/null
[[ -f "$ATB_SET_ENV" ]] && source "$ATB_SET_ENV"
set -u
command -v npu-smi >/dev/null && npu-smi info

if [[ ! -x "$VENV/bin/python" ]]; then
    step "creating $VENV"
    "${HWSYNC_PYTHON:-python3}" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --progress-bar off)
# shellcheck source=ci/pins.sh
source "$REPO/ci/pins.sh"  # satisfied()

if satisfied "$TORCH_PIN" "$TORCH_NPU_PIN"; then step "$TORCH_PIN $TORCH_NPU_PIN: already installed"; else
    step "installing $TORCH_PIN $TORCH_NPU_PIN"; "${PIP[@]}" "$TORCH_PIN" "$TORCH_NPU_PIN"; fi
if satisfied "$VLLM_PIN" "$VLLM_ASCEND_PIN"; then step "$VLLM_PIN $VLLM_ASCEND_PIN: already installed"; else
    step "installing $VLLM_PIN, then $VLLM_ASCEND_PIN"
    "${PIP[@]}" "$VLLM_PIN" "$TORCH_PIN"
    "${PIP[@]}" --extra-index-url "$ASCEND_PIP_INDEX" "$VLLM_ASCEND_PIN" "$TORCH_PIN" "$TORCH_NPU_PIN"
fi
step "installing hwsync -e '.[test,swift]'"
"${PIP[@]}" -e ".[test,swift]" "$TORCH_PIN" "$TORCH_NPU_PIN"
satisfied "$TORCH_PIN" "$TORCH_NPU_PIN" "$VLLM_ASCEND_PIN" \
    || { echo "a dependency moved torch / torch-npu / vllm-ascend off its pin; see pip output above" >&2; exit 1; }

export CI=true HWSYNC_BACKEND=npu
export VLLM_ASCEND_ENABLE_NZ=0  # RL with sleep mode: vllm-ascend refuses wake_up otherwise; hwsync refuses NZ writes

step "hwsync doctor --json -> $OUT/doctor.json"
mkdir -p "$OUT"
"$VENV/bin/hwsync" doctor --json > "$OUT/doctor.json"
"$PY" - "$OUT/doctor.json" "$TORCH_NPU_PIN" "$VLLM_ASCEND_PIN" <<'PYEOF'
import json, sys
report = json.load(open(sys.argv[1]))
ascend, want_npu, want_va = report["ascend"], sys.argv[2].split("==")[1], sys.argv[3].split("==")[1]
print(json.dumps({"backend": report["backend"], "ascend": ascend}, indent=2))
problems = []
if report["backend"].get("name") != "npu":
    problems.append(f"backend is {report['backend']}, not npu")
if not ascend["cann"]["version"]:
    problems.append(f"CANN version unknown: {ascend['cann']}")
if (ascend["torch_npu"] or "").split("+")[0] != want_npu or ascend["vllm_ascend"] != want_va:
    problems.append(f"torch-npu {ascend['torch_npu']} / vllm-ascend {ascend['vllm_ascend']} are not the pins")
if ascend["nz_mode"]["value"] != 0:
    problems.append(f"NZ mode {ascend['nz_mode']} is not 0")
sys.exit("; ".join(problems) or None)
PYEOF

step "test suite (HWSYNC_BACKEND=npu)"
"$PY" ci/run_tests.py
step "main job: GRPO on a tiny MoE"
"$PY" examples/grpo_tiny_moe.py
step "done"
