"""End to end: TRL's ``GRPOTrainer`` with ``from hwsync.trl import GRPOTrainer``, vLLM colocated (the TRL main job).

A real TRL 1.16 run of ``examples/trl_grpo_tiny_moe.py`` on the tiny Qwen3-MoE, in a process of its own: LoRA on
attention and experts, ``HWSYNC_STRATEGY=auto`` (hybrid on vLLM's CPU build: attention LoRA served by vLLM, experts
merged; adapter where vLLM has MoE-LoRA kernels), hwsync.verify after every sync. Asserts what the job promises:
every check it prints passed, every sync went through hwsync and was verified with every check, the engine followed
the trained policy; GSPO (``importance_sampling_level="sequence"``, two optimizer steps per rollout batch) too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

trl = pytest.importorskip("trl", reason="hwsync.trl needs TRL (HWSYNC_WITH_TRL=1 bash ci/install.sh; ci/run-trl.sh)")
if tuple(int(x) for x in trl.__version__.split(".")[:2]) < (1, 16):
    pytest.skip(
        f"hwsync.trl is made for trl 1.16 (installed: {trl.__version__}); ci/run-trl.sh runs it",
        allow_module_level=True,
    )

from hwsync.testing import require_vllm  # noqa: E402

pytestmark = [pytest.mark.trl, pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
STEPS = 4


def run_job(
    workdir: Path, *flags: str, env: dict[str, str] | None = None, timeout_s: float = 1800
) -> tuple[list[dict], str]:
    """``examples/trl_grpo_tiny_moe.py`` in its own interpreter; returns its hwsync records and its output."""
    require_vllm()
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "trl_grpo_tiny_moe.py"),
        "--steps",
        str(STEPS),
        "--workdir",
        str(workdir),
        *flags,
    ]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout_s, env={**os.environ, "PYTHONPATH": path, **(env or {})}
    )
    out = proc.stdout + proc.stderr
    name = "trl-" + ("gspo" if "--gspo" in flags else "grpo") + ("-server" if "--server" in flags else "")
    metrics = workdir / name / "hwsync_metrics.jsonl"
    if proc.returncode != 0:
        pytest.fail(
            f"the TRL job exited {proc.returncode}; last lines:\n" + "\n".join(out.splitlines()[-60:]), pytrace=False
        )
    return [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()], out


def _moe_lora() -> bool:
    from hwsync.common.capabilities import vllm_capabilities

    return bool(vllm_capabilities()["moe_lora"]["supported"])


def check_job(records: list[dict], out: str, *, mode: str = "colocate", steps_per_generation: int = 1) -> None:
    assert "[FAILED]" not in out and out.count("[ok]") >= 5, out[-3000:]
    syncs = [r for r in records if r["event"] == "sync"]
    steps = [r for r in records if r["event"] == "step"]
    assert len(steps) == STEPS and len(syncs) == -(-STEPS // steps_per_generation), (len(steps), len(syncs))
    assert {s["mode"] for s in syncs} == {mode}, syncs
    # auto -> hybrid on the CPU build (no MoE-LoRA kernels), adapter where vLLM serves expert LoRA; it says why
    if _moe_lora():
        assert {s["strategy"] for s in syncs} == {"adapter"}, syncs
    else:
        assert {s["strategy"] for s in syncs} == {"hybrid"}, syncs
        assert "experts" in syncs[0]["reason"]
    # after the first sync only LoRA (+ merged experts) travel, not the whole model
    assert all(s["bytes"] < syncs[0]["bytes"] for s in syncs[1:])
    # every check of hwsync.verify passed after every sync, the exact content checks too (server mode: read back
    # over the control channel); the engine sampled every rollout batch from the policy the trainer scores
    assert all(s["verify_ok"] is True and not s["verify_failed"] and not s["verify_skipped"] for s in syncs), syncs
    rollouts = [s["rollout_max_abs_dlogp"] for s in steps if s["rollout_max_abs_dlogp"] is not None]
    assert len(rollouts) == len(syncs), steps
    if not _gpu():  # vLLM's CPU build in fp32 computes like the trainer
        assert all(s["verify_max_abs_dlogp"] <= 1e-4 for s in syncs) and all(r <= 1e-4 for r in rollouts)
    # ... while the policy moved far more than that: the engine served the changed policy
    assert max(s["policy_shift"] for s in syncs[1:]) > 1e-2, syncs


def _gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def test_grpo_colocate(tmp_path):
    check_job(*run_job(tmp_path))


def test_gspo_colocate(tmp_path):
    check_job(*run_job(tmp_path, "--gspo"), steps_per_generation=2)


def test_grpo_colocate_through_vllms_weight_transfer_api(tmp_path):
    """The TRL job with one more engine argument, ``engine_kwargs={"weight_transfer_config": {"backend": "hwsync"}}``
    (``--vllm-weight-transfer``): TRL's colocated engine selects hwsync as vLLM's weight-transfer backend and every
    sync of ``hwsync.trl.GRPOTrainer`` goes through vLLM's own protocol, with everything the job promises."""
    pytest.importorskip("vllm.distributed.weight_transfer")
    records, out = run_job(tmp_path, "--vllm-weight-transfer")
    check_job(records, out)
    syncs = [r for r in records if r["event"] == "sync"]
    assert {s["path"] for s in syncs} == {"vLLM weight-transfer API (backend hwsync)"}, syncs
