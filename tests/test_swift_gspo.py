"""The main job as GSPO (``--importance_sampling_level sequence``, two optimizer steps per rollout batch, so the
second step is off-policy): same sync guarantees as GRPO; the rollout check compares the engine with the policy that
generated (ms-swift's old logprobs), not with the one already updated."""

from __future__ import annotations

import pytest
from test_swift_grpo import check_main_job, job, run_main_job

pytestmark = [pytest.mark.swift, pytest.mark.vllm, pytest.mark.slow]


def test_gspo_colocate(tmp_path, tiny_qwen3_moe_dir):
    result = run_main_job(tmp_path, tiny_qwen3_moe_dir, gspo=True)
    check_main_job(result, steps_per_generation=job.GSPO_STEPS_PER_GENERATION)
    assert "--importance_sampling_level sequence" in " ".join(result.log.read_text().splitlines()[:3])
