"""hwsync.integrations.trainer_sync without an engine: the rollout check every trainer integration (ms-swift, TRL) runs
on the tokens vLLM sampled, the step records, and the check prompts."""

from __future__ import annotations

import json

import pytest
import torch

from hwsync.common.errors import VerifyError
from hwsync.integrations.options import SyncOptions
from hwsync.integrations.trainer_sync import TrainerSync, first_prompts
from hwsync.trainer.verify import GATES


def _logps(gap: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    trainer = torch.linspace(-3.0, -0.1, 12).reshape(2, 6)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False  # padding: a gap there must not count
    engine = trainer + gap
    engine[1, 4:] += 100.0
    return trainer, engine, mask


def test_rollout_check_passes_within_the_gate_and_stops_beyond_it(tmp_path):
    sync = TrainerSync(SyncOptions(), metrics_path=str(tmp_path / "m.jsonl"))
    sync.gate = GATES[("cpu", "float32")]
    assert sync.rollout_check(*_logps(1e-6), step=1, exact_sampling=True) == pytest.approx(
        1e-6, rel=0.05
    )  # fp32 rounding
    with pytest.raises(VerifyError, match="step 2: the engine sampled .*mean \\|Δ\\| 0.5"):
        sync.rollout_check(*_logps(0.5), step=2, exact_sampling=True)
    records = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert records[-1]["event"] == "error" and records[-1]["step"] == 2


def test_rollout_check_only_measures_when_sampling_renormalizes_or_checks_are_off():
    """top-k / top-p / penalties renormalize vLLM's logprobs (a gap is expected there); HWSYNC_VERIFY_EVERY=0 turns
    the checks off. Both still measure."""
    sync = TrainerSync(SyncOptions())
    sync.gate = GATES[("cpu", "float32")]
    assert sync.rollout_check(*_logps(0.5), step=1, exact_sampling=False) == pytest.approx(0.5)
    off = TrainerSync(SyncOptions(verify_every=0))
    off.gate = sync.gate
    assert off.rollout_check(*_logps(0.5), step=1, exact_sampling=True) == pytest.approx(0.5)


def test_strict_atol_applies_to_the_largest_gap():
    sync = TrainerSync(SyncOptions(verify_atol=1e-4))
    trainer, engine, mask = _logps(0.0)
    engine[0, 0] += 1e-3  # one token off: the mean passes a gate, max |Δ| does not pass the atol
    with pytest.raises(VerifyError, match="max \\|Δ\\| 0.001 > HWSYNC_VERIFY_ATOL=0.0001"):
        sync.rollout_check(trainer, engine, mask, step=3, exact_sampling=True)


def test_step_records_carry_the_steps_worst_rollout_gap(tmp_path):
    sync = TrainerSync(SyncOptions(), metrics_path=str(tmp_path / "m.jsonl"))
    sync.gate = GATES[("cpu", "bfloat16")]
    sync.rollout_check(*_logps(0.01), step=1, exact_sampling=True)
    sync.rollout_check(*_logps(0.02), step=1, exact_sampling=True)
    assert sync.rollout_max_abs_dlogp == pytest.approx(0.02)
    sync.step_done(1, reward=0.5, loss=0.1)
    assert sync.rollout_max_abs_dlogp is None
    sync.step_done(2, reward=None, loss=0.2)  # a step without a rollout (steps_per_generation > 1)
    steps = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert steps[0]["rollout_max_abs_dlogp"] == pytest.approx(0.02) and steps[0]["rollout_tokens"] == 20
    assert steps[1]["rollout_max_abs_dlogp"] is None and steps[1]["rollout_tokens"] == 0
    assert "step" in sync.summary()


def test_check_prompts_are_the_first_distinct_ones():
    assert first_prompts([[1], [2, 3], [2, 3], [4, 5, 6], [7, 8]], 2) == [[2, 3], [4, 5, 6]]
