"""vLLM's CPU build: an FSDP2 trainer on 2 gloo ranks syncs into a TP=2 engine, exactly.

The scenario of ``tests/test_multigpu_fsdp_tp.py`` (:mod:`hwsync.testing.tp`) on CPU: a TP=2 ``external_launcher``
engine whose two workers are the two trainer processes (fp32; attention LoRA only: the CPU build serves no expert
LoRA), 5 syncs (``tp.CPU_STRATEGIES``: full, adapter, adapter, full, adapter -- every transition of the GPU test's 6;
its last sync repeats the fourth's path and would cost one more fresh TP=2 engine), each compared with a fresh TP=2
engine (``mp`` executor) loading the same weights itself, within ``EXACT_ATOL``. The fresh engines start after the
synced one is gone (one engine at a time).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_fsdp2_trainer_into_cpu_tp2_engine_is_exact(tmp_path: Path) -> None:
    from hwsync.testing import make_tiny_moe, on_cpu, tp

    if not on_cpu():
        pytest.skip("the CPU variant; tests/test_multigpu_fsdp_tp.py runs this on GPUs")
    tp.run_and_check(tmp_path, make_tiny_moe(tmp_path / "model"), cuda=False, strategies=tp.CPU_STRATEGIES)
