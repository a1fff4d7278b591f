"""Server mode end to end: ``swift rollout`` (vLLM) and ``swift rlhf --vllm_mode server`` (trainer) as two processes.

Both load the hwsync plugin; hwsync's sync server runs inside ``swift rollout``'s engine process
(``HWSYNC_SERVER`` / ``HWSYNC_TOKEN``), the trainer syncs into it over gloo, and generation still goes through
ms-swift's HTTP routes. Same guarantees as colocate: every sync verified, rollouts from the trained policy. With
``--vllm_data_parallel_size 2``: two engines (one per swift worker process), ``HWSYNC_SERVER`` lists one address
each, the trainer feeds both with one broadcast and checks both; swift splits each rollout batch over them.
"""

from __future__ import annotations

import pytest
from test_swift_grpo import check_main_job, job, run_main_job

pytestmark = [pytest.mark.swift, pytest.mark.vllm, pytest.mark.slow]


def test_grpo_server_mode_two_processes(tmp_path, tiny_qwen3_moe_dir):
    result = run_main_job(tmp_path, tiny_qwen3_moe_dir, server=True)
    check_main_job(result, mode="server")
    assert "hwsync: serving weight syncs into swift rollout's engine" in (result.output_dir / "rollout.log").read_text()


def test_grpo_server_mode_two_rollout_engines(tmp_path, tiny_qwen3_moe_dir):
    import torch

    from hwsync.testing import on_cpu

    if not on_cpu() and torch.cuda.device_count() < 2:  # not a failure: the GPU job runs on one GPU too
        pytest.skip(
            "swift rollout --vllm_data_parallel_size 2 needs 2 GPUs (ms-swift checks local_device_count); "
            "on vLLM's CPU build both engines share the CPU"
        )
    result = run_main_job(tmp_path, tiny_qwen3_moe_dir, server=True, engines=2)
    check_main_job(result, mode="server")  # rollouts of both engines sampled from the trained policy
    log = result.output_dir / "rollout.log"
    for k in range(2):
        assert f"(data-parallel engine {k} of 2)" in log.read_text(), job.file_tail(log, 30)
