"""2 GPUs: a sharded trainer (FSDP2, DeepSpeed ZeRO-3) on 2 ranks syncs into a tensor-parallel (TP=2) vLLM engine,
exactly.

The scenario is :mod:`hwsync.testing.tp` (NCCL, bf16 engine with 2-D MoE LoRA): every rank is a trainer rank
(``fully_shard``, or DeepSpeed stage 3 with every parameter partitioned) and one worker of one TP=2
``external_launcher`` engine; 6 syncs (full, adapter, adapter, full, adapter, full: 3 of each, the third one LoRA-only),
and after each the engine's greedy tokens and logprobs must equal those of a fresh TP=2 engine (``mp`` executor, same
arguments) that vLLM loads from the same weights itself, within ``EXACT_ATOL``. Skips without 2 CUDA GPUs (conftest:
``multigpu``); with them, a failure fails, CI or not.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multigpu, pytest.mark.cuda, pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.parametrize("trainer", ["fsdp2", "zero3"])
def test_sharded_trainer_into_tp2_engine_is_exact(tmp_path: Path, trainer: str) -> None:
    import torch

    from hwsync.testing import make_tiny_moe, tp

    if torch.cuda.device_count() < 2:  # conftest skips first; kept for a direct run
        pytest.skip("needs 2 CUDA GPUs")
    if trainer == "zero3" and not os.environ.get("CI"):
        pytest.importorskip("deepspeed")  # the GPU kit carries it: a missing deepspeed fails the GPU job (CI=true)
    tp.run_and_check(tmp_path, make_tiny_moe(tmp_path / "model"), cuda=True, trainer=trainer)
