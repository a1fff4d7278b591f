#!/usr/bin/env bash
# The GPU job: hwsync's whole test suite on a CUDA machine with vLLM (and ms-swift, bitsandbytes) installed --
# every vLLM-marked module on CUDA (engine settings from hwsync.testing.engine_args: bf16 with LoRA, fp32 without),
# the cuda/multigpu tests, the README's ms-swift GRPO job, the QLoRA tests and the sync benchmark.
#
#   bash ci/gpu.sh              # every part, in order (~45-60 min on one H100, from the parts' times in ci/gpu-kit/README.md)
#   bash ci/gpu.sh suite-a      # one part; each meant to fit one 10-minute device call (measured on an H100 so far: exact, bench, qlora; see ci/gpu-kit/README.md)
#   bash ci/gpu.sh --list       # the parts and what they run
#   bash ci/gpu.sh -j verify exact swift   # those parts at the same time on one GPU (each logs to gpu-<part>.log;
#                                          # engines take gpu_memory_utilization 0.15, the main job 0.5): a device
#                                          # call's 10 minutes then cover several parts
#   HWSYNC_TEST_JOBS=4 bash ci/gpu.sh --modules tests/a.py,tests/b.py   # just those modules, 4 side by side
#                                          # (test engines keep a fixed KV budget, so neighbours do not disturb them)
#
# Tests run one module per interpreter (ci/run_tests.py) with `pytest` (not `python -m pytest`: that puts the source
# tree first on sys.path, ahead of the installed package), CI=true (a vLLM test that cannot run fails instead of
# skipping) and HWSYNC_BACKEND=cuda. With $OUT set, the output is also written to $OUT/gpu-<part>.log.
# On the lent GPU machines (no vLLM, no network) install the kit first: ci/gpu-kit/README.md.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export CI=true HWSYNC_BACKEND=cuda
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # no NVLink multicast
export HWSYNC_PYTEST="${HWSYNC_PYTEST:-pytest}" HWSYNC_TEST_JOBS="${HWSYNC_TEST_JOBS:-1}"  # parts share GPUs already (-j)
# a module that hangs is killed (with its engines) before the device call ends, and shows which tests finished
export HWSYNC_MODULE_TIMEOUT="${HWSYNC_MODULE_TIMEOUT:-500}"
# the whole output of every failed module, brought back with $OUT (the console keeps only each one's tail)
[ -n "${OUT:-}" ] && export HWSYNC_TEST_LOG="${HWSYNC_TEST_LOG:-$OUT/failed-modules.log}"
PY="${PYTHON:-python3}"
# HWSYNC_STACKS_EVERY=N: every Python process of the part dumps its threads' stacks every N s (what a hang waits on)
if [ -n "${HWSYNC_STACKS_EVERY:-}" ]; then
    stacks="$(cd "$(dirname "$0")" && pwd)/stacks"
    export PYTHONPATH="$stacks${PYTHONPATH:+:$PYTHONPATH}"
fi

PARTS=(unit-a unit-b suite-a suite-b exact lora-configs server swift swift-b qlora families multigpu multigpu-z3 multigpu-server bench verify qwen35 trl trl-b depth campaign48 sleep sleep-bench sleep-bench35 sleep-e2e trained-depth transfer48)
declare -A MODULES=(
    [suite-a]="tests/test_fixtures.py tests/test_names_vllm.py tests/test_patches_vllm_ascend.py tests/test_vllm_version.py"
    [suite-b]="tests/test_sync_strategies.py tests/test_sync_faults.py"
    [exact]="tests/test_sync_exact.py"
    [lora-configs]="tests/test_lora_configs.py"
    [server]="tests/test_sync_server.py"
    [swift]="tests/test_swift_grpo.py"
    [swift-b]="tests/test_swift_gspo.py tests/test_swift_server.py"
    [qlora]="tests/test_qlora.py"
    [families]="tests/test_families.py"
    [verify]="tests/test_verify_faults.py tests/test_verify_faults_bf16.py"
    [multigpu]="tests/test_multigpu_fsdp_tp.py"
    [multigpu-z3]="tests/test_multigpu_fsdp_tp.py"
    [multigpu-server]="tests/test_server_tp.py tests/test_server_dp.py"
    [qwen35]="tests/test_sync_exact.py tests/test_verify_faults_qwen3_5.py"
    [trl-b]="tests/test_trl_plugin.py tests/test_trl_grpo.py tests/test_trl_exact.py tests/test_trl_qlora.py tests/test_trl_server.py tests/test_trl_zero3.py"
)
declare -A ABOUT=(
    [unit-a]="the first half (by name) of every module no other part names: backend, broadcast (cuda/multigpu), doctor, layouts, LoRA formats, merged view, names, ..."
    [unit-b]="the second half of those: patches, sync units and in-place writers, swift plugin, vLLM versions, ..."
    [suite-a]="${MODULES[suite-a]}"
    [suite-b]="${MODULES[suite-b]} (20 syncs per strategy, faults, versions)"
    [exact]="${MODULES[exact]} -k 'not qwen3_5' (tiny Qwen3-MoE: every strategy x MoE-LoRA format, 10 syncs each, == vLLM's own loading; the 3-D format in a second process beside the others: one process took > 265 s for 5 of 13 on an H100; Qwen3.5: part qwen35)"
    [lora-configs]="${MODULES[lora-configs]}: the LoRA configuration matrix (rsLoRA, rank/alpha patterns, all-linear, expert LoRA of another rank, bias, modules_to_save, bf16 adapters, two adapters, PiSSA/OLoRA, DoRA, IA3, prompt tuning) x full/adapter/hybrid, 10 syncs each == vLLM's own loading or refused before any write; HWSYNC_LORA_PROCS (3) processes side by side, shard s writes \$OUT/lora-configs-gpu-s.json (docs: python -m hwsync.testing.lora_configs --from docs/lora-configs.json --gpu lora-configs-gpu-*.json --save-gpu docs/lora-configs-gpu.json --write-docs); then benchmarks/lora_fold_order.py (issue 29: vLLM's fold order vs fp32-once, against vLLM's own loading and the fp32 trainer). 160 checked full syncs start 160 reference engines: ~2 device calls, HWSYNC_LORA_PART=1/2 then 2/2 (or HWSYNC_LORA_FULL_SYNCS=3 for one)"
    [server]="${MODULES[server]} (engine in another process; on GPU 1 when there are 2: NCCL data plane)"
    [swift]="examples/grpo_tiny_moe.py --steps 4 (the README's main job on one GPU), ${MODULES[swift]}"
    [swift-b]="${MODULES[swift-b]} (sees every GPU: the data-parallel swift rollout takes two)"
    [qlora]="${MODULES[qlora]} (bitsandbytes 4-bit base + LoRA: full and adapter vs vLLM's own loading)"
    [families]="${MODULES[families]} for every family (HWSYNC_FAMILIES=all: vLLM's CPU build serves no expert LoRA, so only a GPU runs the LoRA paths of the families it serves; cpu-unserved, names, or <spec>@k/n narrow it), 3 syncs per strategy, every sync vs vLLM's own loading of the same weights; HWSYNC_FAMILY_PROCS (4) processes side by side, shard p writes \$OUT/families-gpu-p.json. All 42 take ~2 device calls: HWSYNC_FAMILIES=all@1/2, then all@2/2"
    [multigpu]="${MODULES[multigpu]} -k 'not zero3' (2 GPUs: an FSDP2 trainer on 2 ranks -> TP=2 engine, 6 syncs == fresh TP=2 engines; skipped on fewer GPUs; ~4 min on two H200s)"
    [multigpu-server]="${MODULES[multigpu-server]} (2 GPUs: server mode into a TP=2 engine; data-parallel engines, one per GPU, one hwsync.connect([a, b]); skipped on fewer GPUs)"
    [multigpu-z3]="${MODULES[multigpu-z3]} -k zero3 (2 GPUs: the same with a DeepSpeed ZeRO-3 trainer; skipped on fewer GPUs)"
    [bench]="benchmarks/bench_sync.py --shapes qwen3-30b-a3b --layers 4 --rank 32 --profile [--server with 2 GPUs] (every strategy, exactness vs vLLM own loading; server mode vs the colocated engine)"
    [verify]="${MODULES[verify]} (no false alarm over 20 syncs per strategy, every injected fault caught), benchmarks/verify_table.py (healthy max vs faulty min per check, bf16 + fp32)"
    [qwen35]="Qwen3.5-MoE on the GPU, side by side: tests/test_sync_exact.py -k qwen3_5 (every strategy x MoE-LoRA format, 10 syncs each == vLLM's own loading, A_log kept fp32; two processes), tests/test_verify_faults_qwen3_5.py (no false alarm, every fault caught) + tests/test_fixtures.py -k 'qwen3_5 or gated_deltanet' (vLLM serves the fixture), examples/grpo_tiny_moe.py --family qwen3_5_moe GRPO then --gspo (4 steps each); then alone: benchmarks/bench_sync.py --shapes qwen3.5-moe --layers 4 --rank 32 --strategies full,adapter (\$OUT/bench_qwen35.json)"
    [trl]="examples/trl_grpo_tiny_moe.py (the TRL main job, GRPO and GSPO, colocated on one GPU) and benchmarks/bench_trl_sync.py --shapes qwen3-30b-a3b --layers 4 (TRL's own sync vs hwsync's); needs trl 1.16 beside vLLM (pip install --no-deps trl==1.16.0)"
    [trl-b]="${MODULES[trl-b]} (TRL 1.16: main job colocated and in server mode, == vLLM's own loading after every sync, QLoRA, ZeRO-3)"
    [depth]="the guard at 4 and 12 layers (issue 38, one H200): benchmarks/bench_step.py --shapes qwen3-30b-a3b, adapter r8, r32 and full, 20 steps each (\$OUT/step-depth-*.json)"
    [campaign48]="the fault campaign at 48 layers for full and hybrid (issue 38, one H200): benchmarks/verify_table.py --shapes qwen3-30b-a3b --layers 48 (\$OUT/verify48.json)"
    [sleep]="sleep mode at 48 layers (issue 40, one H200, ~10 min): benchmarks/bench_step.py --sleep 2,1,0 (adapter r8, 6 steps a level, every refill's report), then adapter r32 with --sleep 1, bf16 LoRA and SGD (20 steps: what fits one H200, L14) (\$OUT/sleep-*.json)"
    [sleep-e2e]="the main jobs with vLLM sleep level 2 (issue 40): examples/grpo_tiny_moe.py --sleep-level 2 (ms-swift --sleep_level 2), then examples/trl_grpo_tiny_moe.py --sleep-mode (TRL vllm_enable_sleep_mode=True; needs trl 1.16 on PYTHONPATH, HWSYNC_TRL_PATH)"
    [trained-depth]="benchmarks/verify_depth.py at 12 and 24 layers of Qwen3-30B-A3B shapes, bf16, a checkpoint trained 200 steps (issue 38: verify's verdict on a trained model at depth, and on an engine left on the untrained policy) (\$OUT/depth-trained.json)"
    [transfer48]="benchmarks/bench_transfer.py at 48 layers, rank 32 (issue 42): hwsync through vLLM's weight-transfer verbs vs hwsync direct vs vLLM's ipc backend, full and adapter (\$OUT/transfer48.json)"
    [sleep-bench]="benchmarks/bench_sleep.py at 48 layers, rank 8 (issue 40): level-2 wake + refill vs vLLM's level-1 wake and reload, per strategy, exactness checksums (\$OUT/sleep-bench.json)"
    [sleep-bench35]="benchmarks/bench_sleep.py at Qwen3.5-MoE shapes, 24 layers, rank 8 (issue 40): the refill's exactness after a level-2 wake with Gated-DeltaNet state, full / adapter / hybrid (\$OUT/sleep-bench35.json)"
)

unit_modules() {  # $1 = a|b: that half (by name) of the test modules no other part names, space-separated
    local m named=" ${MODULES[*]} " out=() half
    for m in tests/test_*.py; do
        [[ "$named" == *" $m "* ]] || out+=("$m")
    done
    half=$(( (${#out[@]} + 1) / 2 ))
    if [ "$1" = a ]; then echo "${out[*]:0:$half}"; else echo "${out[*]:$half}"; fi
}

run_modules() {  # $1: space-separated module paths; the rest: pytest arguments
    local mods
    read -r -a mods <<<"$1"
    shift
    "$PY" ci/run_tests.py --modules="$(IFS=,; echo "${mods[*]}")" "$@"
}

qwen35_job() {  # $1: a tag for each output line; the rest: the command (its status is returned, not sed's)
    local tag=$1
    shift
    "$@" 2>&1 | sed "s/^/[qwen35 $tag] /"
    return "${PIPESTATUS[0]}"
}

run_part() {
    local part=$1 rc=0
    echo "=== ci/gpu.sh $part: ${ABOUT[$part]}"
    case "$part" in
        unit-a) run_modules "$(unit_modules a)" || rc=$? ;;
        unit-b) run_modules "$(unit_modules b)" || rc=$? ;;
        swift)
            "$PY" examples/grpo_tiny_moe.py --steps 4 --workdir "${TMPDIR:-/tmp}/hwsync-grpo-gpu" || rc=$?
            run_modules "${MODULES[swift]}" || rc=$? ;;
        trl)
            "$PY" examples/trl_grpo_tiny_moe.py --workdir "${TMPDIR:-/tmp}/hwsync-trl-gpu" || rc=$?
            "$PY" examples/trl_grpo_tiny_moe.py --gspo --workdir "${TMPDIR:-/tmp}/hwsync-trl-gpu" || rc=$?
            "$PY" benchmarks/bench_trl_sync.py --shapes qwen3-30b-a3b --layers 4 ${OUT:+--out "$OUT/bench_trl_sync.json"} || rc=$? ;;
        multigpu|multigpu-z3|multigpu-server)
            local gpus
            gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
            if [ "${gpus:-0}" -lt 2 ]; then
                # skipped, not failed: `bash ci/gpu.sh` (every part) runs on one GPU too; the module itself fails on
                # a machine that has the GPUs
                echo "ci/gpu.sh $part: SKIPPED: needs 2 GPUs, this machine has ${gpus:-0} (run it on nvidia-h200-x2)"
            elif [ "$part" = multigpu ]; then
                run_modules "${MODULES[multigpu]}" -k "not zero3" || rc=$?
            elif [ "$part" = multigpu-server ]; then
                run_modules "${MODULES[multigpu-server]}" || rc=$?
            else
                run_modules "${MODULES[multigpu-z3]}" -k zero3 || rc=$?
            fi ;;
        sleep-e2e)
            "$PY" examples/grpo_tiny_moe.py --steps 4 --sleep-level 2 --workdir "${TMPDIR:-/tmp}/hwsync-sleep-swift" || rc=$?
            PYTHONPATH="${HWSYNC_TRL_PATH:+$HWSYNC_TRL_PATH:}${PYTHONPATH:-}" "$PY" examples/trl_grpo_tiny_moe.py --sleep-mode \
                --workdir "${TMPDIR:-/tmp}/hwsync-sleep-trl" || rc=$? ;;
        depth|campaign48|sleep|sleep-bench|sleep-bench35|trained-depth|transfer48)  # real-size shapes: a fixed KV budget, half the GPU for the engine
            # 2 GiB of KV: 1,300 blocks at Qwen3-30B-A3B shapes (vLLM's block override wins over BENCH_KV_BYTES; the
            # sync bench's default, 10,000 blocks, is ~15 GB at 48 layers)
            export BENCH_KV_BYTES=${BENCH_KV_BYTES:-2147483648} BENCH_GPU_MEM=${BENCH_GPU_MEM:-0.5} \
                BENCH_GPU_BLOCKS=${BENCH_GPU_BLOCKS:-1300}
            local layers
            case "$part" in
                depth) for layers in 4 12; do
                    "$PY" benchmarks/bench_step.py --shapes qwen3-30b-a3b --layers "$layers" \
                        --runs adapter:8,adapter:32,full --steps 20 ${OUT:+--json "$OUT/step-depth-$layers.json"} || rc=$?
                done ;;
                campaign48) "$PY" benchmarks/verify_table.py --shapes qwen3-30b-a3b --layers 48 --strategies full,hybrid \
                    --steps 20 ${OUT:+--json "$OUT/verify48.json"} || rc=$? ;;
                sleep)
                    "$PY" benchmarks/bench_step.py --shapes qwen3-30b-a3b --layers 48 --runs adapter:8 --steps 6 \
                        --sleep 2,1,0 ${OUT:+--json "$OUT/sleep-levels.json"} || rc=$?
                    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "$PY" benchmarks/bench_step.py --shapes qwen3-30b-a3b \
                        --layers 48 --runs adapter:32 --steps 20 --sleep 1 --lora-dtype bfloat16 --optimizer sgd \
                        ${OUT:+--json "$OUT/sleep-r32.json"} || rc=$? ;;
                trained-depth) "$PY" benchmarks/verify_depth.py --shapes qwen3-30b-a3b --layers 12,24 --dtypes bfloat16 \
                    --train-steps 200 ${OUT:+--json "$OUT/depth-trained.json"} || rc=$? ;;
                transfer48) "$PY" benchmarks/bench_transfer.py --shapes qwen3-30b-a3b --layers 48 --rank 32 \
                    ${OUT:+--json "$OUT/transfer48.json"} || rc=$? ;;
                sleep-bench) "$PY" benchmarks/bench_sleep.py --shapes qwen3-30b-a3b --layers 48 --rank 8 --repeats 2 \
                    --strategies full,adapter --profile-refill ${OUT:+--json "$OUT/sleep-bench.json"} || rc=$? ;;
                sleep-bench35) "$PY" benchmarks/bench_sleep.py --shapes qwen3.5-moe --layers 24 --rank 8 --repeats 1 \
                    --strategies full,adapter,hybrid ${OUT:+--json "$OUT/sleep-bench35.json"} || rc=$? ;;
            esac ;;
        bench)
            local server=()
            # server mode (engine on GPU 1, trainer on GPU 0, NCCL data plane) where a second GPU exists
            [ "$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)" -ge 2 ] && server=(--server)
            "$PY" benchmarks/bench_sync.py --shapes qwen3-30b-a3b --layers 4 --rank 32 --profile "${server[@]}" ${OUT:+--json "$OUT/bench_sync.json"} || rc=$? ;;
        verify)
            run_modules "${MODULES[verify]}" || rc=$?
            "$PY" benchmarks/verify_table.py ${OUT:+--json "$OUT/verify_table.json"} || rc=$? ;;
        families)  # HWSYNC_FAMILY_PROCS processes, shard p of the selection each (its own results file)
            local procs=${HWSYNC_FAMILY_PROCS:-4} p pids=()
            for ((p = 1; p <= procs; p++)); do
                local select=(-k test_family)  # the module's other tests: once, in the first process
                [ "$p" = 1 ] && select=()
                (HWSYNC_FAMILIES="${HWSYNC_FAMILIES:-all}@$p/$procs" HWSYNC_FAMILY_SYNCS="${HWSYNC_FAMILY_SYNCS:-3}" \
                    HWSYNC_FAMILY_RESULTS="${OUT:-${TMPDIR:-/tmp}}/families-gpu-$p.json" \
                    run_modules "${MODULES[families]}" "${select[@]}" 2>&1 | sed "s/^/[families $p\/$procs] /") &
                pids+=($!)  # a subshell: with pipefail its status is the tests', not sed's
            done
            for p in "${pids[@]}"; do wait "$p" || rc=$?; done ;;
        lora-configs)  # HWSYNC_LORA_PROCS processes, one shard of the cells each (its own results file);
            # HWSYNC_LORA_PART=i/m runs the i-th of m device calls' worth (shards (i-1)*procs+p of m*procs)
            local procs=${HWSYNC_LORA_PROCS:-3} calls=${HWSYNC_LORA_PART:-1/1} p pids=()
            local i=${calls%/*} m=${calls#*/}
            for ((p = 1; p <= procs; p++)); do
                local shard=$(( (i - 1) * procs + p )) select=(-k test_cell)  # the other tests: once, in shard 1
                [ "$shard" = 1 ] && select=()
                (HWSYNC_LORA_CELLS="$shard/$(( m * procs ))" \
                    HWSYNC_LORA_RESULTS="${OUT:-${TMPDIR:-/tmp}}/lora-configs-gpu-$shard.json" \
                    run_modules "${MODULES[lora-configs]}" "${select[@]}" 2>&1 | sed "s/^/[lora-configs $shard\/$(( m * procs ))] /") &
                pids+=($!)
            done
            for p in "${pids[@]}"; do wait "$p" || rc=$?; done
            if [ "$i" = "$m" ]; then
                "$PY" benchmarks/lora_fold_order.py --syncs "${HWSYNC_LORA_FOLD_SYNCS:-5}" \
                    ${OUT:+--json "$OUT/lora_fold_order.json"} || rc=$?
            fi ;;
        exact)  # two processes side by side (the module's engines are per format); Qwen3.5: part qwen35
            run_modules "${MODULES[exact]}" -k "not 3d and not qwen3_5" & local other=$!
            run_modules "${MODULES[exact]}" -k "3d and not qwen3_5" || rc=$?
            wait "$other" || rc=$? ;;
        qwen35)  # four jobs side by side (engines of 0.15 of the GPU each, started 20 s apart), then the bench alone
            local pids=() pid work="${TMPDIR:-/tmp}/hwsync-qwen35"
            qwen35_job "exact" run_modules tests/test_sync_exact.py -k "qwen3_5 and not 3d" & pids+=($!); sleep 20
            qwen35_job "exact-3d" run_modules tests/test_sync_exact.py -k "qwen3_5 and 3d" & pids+=($!); sleep 20
            qwen35_job "verify" run_modules "tests/test_verify_faults_qwen3_5.py tests/test_fixtures.py" \
                -k "qwen3_5 or gated_deltanet" & pids+=($!); sleep 20
            (  # the main job: GRPO, then GSPO (each engine 0.15 of the GPU); both run, either failing fails the part
                export HWSYNC_EXAMPLE_GPU_UTIL=0.15
                qwen35_job "grpo" "$PY" examples/grpo_tiny_moe.py --family qwen3_5_moe --steps 4 --workdir "$work"
                r=$?
                qwen35_job "gspo" "$PY" examples/grpo_tiny_moe.py --family qwen3_5_moe --gspo --steps 4 \
                    --workdir "$work" || r=$?
                exit $r
            ) & pids+=($!)
            for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
            qwen35_job "bench" "$PY" benchmarks/bench_sync.py --shapes qwen3.5-moe --layers 4 --rank 32 \
                --strategies full,adapter ${OUT:+--json "$OUT/bench_qwen35.json"} || rc=$? ;;
        *) run_modules "${MODULES[$part]}" || rc=$? ;;
    esac
    echo "=== ci/gpu.sh $part: $([ $rc -eq 0 ] && echo passed || echo "FAILED (exit $rc)")"
    return $rc
}

if [ "${1:-}" = "--modules" ]; then  # a re-run of chosen modules with the GPU job's settings
    [ -n "${2:-}" ] || { echo "usage: bash ci/gpu.sh --modules tests/a.py,tests/b.py [pytest args]"; exit 2; }
    only=$2; shift 2
    if [ -n "${OUT:-}" ]; then mkdir -p "$OUT"; exec > >(tee -a "$OUT/gpu-modules.log") 2>&1; fi
    "$PY" ci/run_tests.py --modules="$only" "$@"
    exit
fi
jobs=0
if [ "${1:-}" = "-j" ]; then jobs=1; shift; fi
if [ "${1:-}" = "--list" ]; then
    for p in "${PARTS[@]}"; do printf '%-8s %s\n' "$p" "${ABOUT[$p]}"; done
    exit 0
fi
selected=("${@:-${PARTS[@]}}")
for p in "${selected[@]}"; do
    [ -n "${ABOUT[$p]:-}" ] || { echo "unknown part '$p'; parts: ${PARTS[*]}"; exit 2; }
done
if [ "$jobs" = 1 ]; then  # each part in its own process and log; this process prints their verdicts
    logs="${OUT:-${TMPDIR:-/tmp}/hwsync-gpu-logs}"
    mkdir -p "$logs"
    pids=()
    ngpu=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
    spread=0
    for p in "${selected[@]}"; do
        # the main job's engine takes 0.15 of the GPU instead of 0.5, as the tests' engines do. With several GPUs,
        # parts that use one GPU go round-robin over them (multigpu*, server and bench use two and see every GPU)
        gpu_env=()
        if [ "${ngpu:-0}" -ge 2 ] && [[ " multigpu multigpu-z3 multigpu-server server swift-b bench " != *" $p "* ]]; then
            gpu_env=(CUDA_VISIBLE_DEVICES=$((spread % ngpu))); spread=$((spread + 1))
        fi
        env "${gpu_env[@]}" HWSYNC_GPU_LOG=0 HWSYNC_EXAMPLE_GPU_UTIL=0.15 bash "${BASH_SOURCE[0]}" "$p" >"$logs/gpu-$p.log" 2>&1 &
        pids+=($!)
        sleep 20  # engines start one after another: each start checks the GPU's free memory
    done
    failed=()
    for i in "${!selected[@]}"; do
        wait "${pids[$i]}" || failed+=("${selected[$i]}")
        grep -E '^(ok  |FAIL|=== ci/gpu.sh|[0-9]+ passed)' "$logs/gpu-${selected[$i]}.log"
    done
    echo "ci/gpu.sh -j: ${#selected[@]} part(s), failed: ${failed[*]:-none}"
    [ ${#failed[@]} -eq 0 ]
    exit
fi
if [ -n "${OUT:-}" ] && [ "${HWSYNC_GPU_LOG:-1}" = 1 ]; then
    mkdir -p "$OUT"
    exec > >(tee -a "$OUT/gpu-$(IFS=+; echo "${selected[*]}").log") 2>&1
fi
nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not available"
"$PY" -m hwsync doctor --no-vllm 2>/dev/null | sed -n '/^Backend/,/^$/p;/^Versions/,/^$/p'
failed=()
for p in "${selected[@]}"; do
    run_part "$p" || failed+=("$p")
done
echo "ci/gpu.sh: ${#selected[@]} part(s), failed: ${failed[*]:-none}"
[ ${#failed[@]} -eq 0 ]
