"""vLLM's CPU build: an FSDP2 trainer on 2 gloo ranks syncs into a TP=2 engine, exactly.

The scenario of ``tests/test_multigpu_fsdp_tp.py`` (:mod:`hwsync.testing.tp`) on CPU: a TP=2 ``external_launcher``
engine whose two workers are the two trainer processes (fp32; attention LoRA only: the CPU build serves no expert
LoRA), 6 syncs (3 full, 3 adapter), each compared with a fresh TP=2 engine (``mp`` executor) loading the same
weights itself, within ``EXACT_ATOL``. The fresh engines start after the synced one is gone (one engine at a time).
"""
from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_fsdp2_trainer_into_cpu_tp2_engine_is_exact(tmp_path: Path) -> None:
    from hwsync.testing import EXACT_ATOL, make_tiny_moe, on_cpu
    from hwsync.testing import tp

    if not on_cpu():
        pytest.skip("the CPU variant; tests/test_multigpu_fsdp_tp.py runs this on GPUs")
    model_dir = make_tiny_moe(tmp_path / "model")
    results = tp.run(tmp_path, model_dir, cuda=False)
    for r, res in enumerate(results):
        for entry in res.get("syncs", []):
            print(f"rank {r}: " + ", ".join(f"{k}={v}" for k, v in entry.items() if k not in ("got",)))
        assert res.get("ok"), f"rank {r}:\n{res.get('error')}"
    syncs = results[0]["syncs"]
    assert [s["strategy"] for s in syncs] == tp.STRATEGIES
    assert [s["got"] for s in syncs] == [s["got"] for s in results[1]["syncs"]]  # one engine, same answers
    for res in results:  # gathered bytes alive at once: <= 2 buckets (a bucket is at least the largest tensor)
        assert all(s["peak_gathered_mb"] <= s["bound_mb"] for s in res["syncs"]), res["syncs"]
    assert syncs[1]["base_tensors"] > 0 and syncs[2]["base_tensors"] == 0 and syncs[2]["lora_tensors"] > 0
    diffs = tp.check(tmp_path, syncs, cuda=False)
    print(f"max |Δ logprob| per sync vs a fresh TP=2 engine: {diffs}")
    assert all(d <= EXACT_ATOL for d in diffs), diffs
