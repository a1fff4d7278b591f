"""Server mode end to end: ``swift rollout`` (vLLM) and ``swift rlhf --vllm_mode server`` (trainer) as two processes.

Both load the hwsync plugin; hwsync's sync server runs inside ``swift rollout``'s engine process
(``HWSYNC_SERVER`` / ``HWSYNC_TOKEN``), the trainer syncs into it over gloo, and generation still goes through
ms-swift's HTTP routes. Same guarantees as colocate: every sync verified, rollouts from the trained policy.
"""
from __future__ import annotations

import pytest
from test_swift_grpo import check_main_job, run_main_job

pytestmark = [pytest.mark.swift, pytest.mark.vllm, pytest.mark.slow]


def test_grpo_server_mode_two_processes(tmp_path, tiny_qwen3_moe_dir):
    result = run_main_job(tmp_path, tiny_qwen3_moe_dir, server=True)
    check_main_job(result, mode="server")
    assert "hwsync: serving weight syncs into swift rollout's engine" in (result.output_dir / "rollout.log").read_text()
