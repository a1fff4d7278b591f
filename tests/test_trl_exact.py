"""Exact after every sync of a TRL run: the colocated engine serves what vLLM serves when it loads the same weights
itself (:class:`hwsync.testing.EngineReference`: a fresh engine on a checkpoint of the synced weights plus the saved
adapter as a ``LoRARequest``), checked inside TRL's own training loop right after each ``sync_weights``.

On vLLM's CPU build the engine also equals the trainer (hwsync.verify after every sync, in the job); on a GPU this is
the check that holds exactly (max |Δ logprob| <= 1e-6) where no engine computes like transformers.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_trl_grpo import ROOT  # noqa: E402  (skips without TRL 1.16)

sys.path.insert(0, str(ROOT / "examples"))
import trl_grpo_tiny_moe as job  # noqa: E402

pytestmark = [pytest.mark.trl, pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8], [3, 4, 200, 17, 18, 99]]
STEPS = 2


def test_every_sync_equals_vllms_own_loading(tmp_path, monkeypatch):
    import hwsync
    from hwsync.testing import EXACT_ATOL, EngineReference, require_vllm
    from hwsync.trl import GRPOTrainer

    require_vllm()
    if not job.has_gpu():
        for key, value in {**job.CPU_ENV, "CUDA_VISIBLE_DEVICES": ""}.items():
            monkeypatch.setenv(key, os.environ.get(key, value))
    monkeypatch.setenv("HWSYNC_METRICS", str(tmp_path / "m.jsonl"))
    # this test's check (below) is the stronger one: the engine equals vLLM's own loading of the same weights. The
    # job's hwsync.verify compares with the trainer instead, whose logprob gate tripped once in CI on this tiny
    # random MoE (CPU fp32, first sync, mean |Δ| 2.2e-4 against 1e-4; passed when run again): it runs in
    # test_trl_grpo, not here
    monkeypatch.setenv("HWSYNC_VERIFY_EVERY", "0")
    model_dir, data = job.prepare(tmp_path)
    engine = {
        **job.engine_kwargs(),
        "enable_lora": True,
        "max_lora_rank": 8,
        "max_loras": 1,
        "max_model_len": 256,
        "logprobs_mode": "processed_logprobs",
    }
    gaps: list[tuple[int, str, float]] = []

    with EngineReference(tmp_path / "reference", **engine) as reference:

        class CheckedTrainer(GRPOTrainer):
            def hwsync_sync(self) -> None:
                super().hwsync_sync()
                model: Any = self.accelerator.unwrap_model(self.model)
                target = self.vllm_generation.engine
                strategy = hwsync.as_engine(target).state()["strategy"]
                gaps.append((self.state.global_step, strategy, reference.check(target, model, PROMPTS)))

        job.train(model_dir, data, tmp_path / "out", steps=STEPS, trainer_cls=CheckedTrainer)
    assert len(gaps) == STEPS, gaps
    assert all(gap <= EXACT_ATOL for _, _, gap in gaps), gaps
    assert {s for _, s, _ in gaps} <= {"adapter", "hybrid"}, gaps
