"""LoRA on the MoE router (``mlp.gate``, which ``target_modules="all-linear"`` adapts) into a real engine.

vLLM wraps the router for LoRA where its targets include it; its MoE runner holds the router too (``FusedMoE(gate=
...)`` computes the router logits) and gets the same wrapper (read on vLLM 0.32's CPU build: both paths lead to one
``ReplicatedLinearWithLoRA``). The GPU LoRA-configuration matrix saw ``all-linear``'s adapter sync equal vLLM's own
loading but not the trainer (2026-11-28): the router is one suspect. Whatever the engine does with a router LoRA, what
it serves after a sync must be the trainer's policy: ``adapter`` serves it exactly, or refuses before anything is
written, naming ``hybrid``, which merges the router into its base weight.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm]

PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8], [3, 4, 200, 17, 18, 99]]


def test_router_lora_is_served_as_trained_or_refused_and_merged(tiny_qwen3_moe_dir: Path) -> None:
    from hwsync.testing import on_cpu, patched_llm, require_vllm
    from hwsync.testing.trainer import lora_trainer

    require_vllm()
    with patched_llm(tiny_qwen3_moe_dir, enable_lora=True, max_lora_rank=8,
                     lora_target_modules=["qkv_proj", "o_proj", "gate"]) as llm:
        _check(llm, lora_trainer(tiny_qwen3_moe_dir, ["q_proj", "v_proj", "gate"]), 1e-4 if on_cpu() else None)


def _check(llm: Any, model: Any, atol: float | None) -> None:
    import torch

    import hwsync
    from hwsync.testing.trainer import perturb

    assert any(".mlp.gate.lora_A" in n for n, _ in model.named_parameters())  # PEFT adapted the router
    perturb(model, 1)  # B != 0: the router's LoRA changes the routing
    engine = hwsync.as_engine(llm)
    before = engine.state()
    try:
        report = hwsync.sync(llm, model, strategy="adapter")
        print("adapter served the router's LoRA:", report.line())
    except hwsync.HwsyncError as e:
        print("adapter refused:", e)
        assert "mlp.gate" in str(e) and 'strategy="hybrid"' in str(e), e
        assert engine.state() == before  # refused before anything was written
        report = hwsync.sync(llm, model)  # auto: hybrid, the router merged
        assert report.strategy == "hybrid", report.line()
    hwsync.verify(llm, model, PROMPTS, atol=atol)  # raises unless the engine serves the trainer's policy
    if atol is None:  # a bf16 engine: verify's gate cannot tell a small router change from bf16 noise
        return
    # and the router's LoRA is part of that policy: the trainer without it (not synced) is told apart
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp.gate.lora_B" in name:
                p.zero_()
    with pytest.raises(hwsync.HwsyncError):
        hwsync.verify(llm, model, PROMPTS, atol=atol)
