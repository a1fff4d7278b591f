"""2 GPUs: an FSDP2 trainer on 2 ranks syncs into a tensor-parallel (TP=2) vLLM engine, exactly.

The scenario is :mod:`hwsync.testing.tp` (NCCL, bf16 engine with 2-D MoE LoRA): every rank is a trainer rank
(``fully_shard``) and one worker of one TP=2 ``external_launcher`` engine; 6 syncs (full, adapter, adapter, full,
adapter, full: 3 of each, the third one LoRA-only), and after each the engine's greedy tokens and logprobs must equal
those of a fresh TP=2 engine (``mp`` executor, same arguments) that vLLM loads from the same weights itself, within
``EXACT_ATOL``. Skips without 2 CUDA GPUs (conftest: ``multigpu``); with them, a failure fails, CI or not.
"""
from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.multigpu, pytest.mark.cuda, pytest.mark.vllm, pytest.mark.slow]


def test_fsdp2_trainer_into_tp2_engine_is_exact(tmp_path: Path) -> None:
    import torch

    from hwsync.testing import EXACT_ATOL, make_tiny_moe
    from hwsync.testing import tp

    if torch.cuda.device_count() < 2:  # conftest skips first; kept for a direct run
        pytest.skip("needs 2 CUDA GPUs")
    model_dir = make_tiny_moe(tmp_path / "model")
    results = tp.run(tmp_path, model_dir, cuda=True)
    for r, res in enumerate(results):
        for entry in res.get("syncs", []):
            print(f"rank {r}: " + ", ".join(f"{k}={v}" for k, v in entry.items() if k not in ("got",)))
        assert res.get("ok"), f"rank {r}:\n{res.get('error')}"
    syncs = results[0]["syncs"]
    assert [s["strategy"] for s in syncs] == tp.STRATEGIES
    assert [s["got"] for s in syncs] == [s["got"] for s in results[1]["syncs"]]  # one engine, same answers
    for res in results:  # gathered bytes alive at once: <= 2 buckets (a bucket is at least the largest tensor)
        assert all(s["peak_gathered_mb"] <= s["bound_mb"] for s in res["syncs"]), res["syncs"]
    assert syncs[1]["base_tensors"] > 0  # after a full sync, the base travels again
    assert syncs[2]["base_tensors"] == 0 and syncs[2]["lora_tensors"] > 0, syncs[2]  # steady: LoRA only
    diffs = tp.check(tmp_path, syncs, cuda=True)
    print(f"max |Δ logprob| per sync vs a fresh TP=2 engine: {diffs}")
    assert all(d <= EXACT_ATOL for d in diffs), diffs
