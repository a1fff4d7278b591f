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
    with patched_llm(
        tiny_qwen3_moe_dir, enable_lora=True, max_lora_rank=8, lora_target_modules=["qkv_proj", "o_proj", "gate"]
    ) as llm:
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


def test_the_router_wrapper_computes_base_plus_its_slots(tiny_qwen3_moe_dir: Path) -> None:
    """What the engine's router computes under a synced LoRA, taken apart: the wrapper's output on the tokens it saw
    equals its base layer's output plus x·Aᵀ·Bᵀ of its own slot (fp32), and the MoE runner computes the logits through
    that wrapper. On a GPU this is where a router LoRA that vLLM builds correctly but applies wrongly shows (the GPU
    matrix's all-linear gap); whichever part differs is named with the dtypes involved."""
    import torch

    import hwsync
    from hwsync.testing import patched_llm, require_vllm
    from hwsync.testing.trainer import lora_trainer, perturb

    require_vllm()
    model = lora_trainer(tiny_qwen3_moe_dir, ["q_proj", "v_proj", "gate"])
    perturb(model, 1)
    with patched_llm(
        tiny_qwen3_moe_dir, enable_lora=True, max_lora_rank=8, lora_target_modules=["qkv_proj", "o_proj", "gate"]
    ) as llm:
        try:
            hwsync.sync(llm, model, strategy="adapter")
        except hwsync.HwsyncError as e:  # refused: the router travels merged (the test above checks that)
            pytest.skip(f"adapter refused the router's LoRA here: {e}")
        seen: list[tuple[Any, Any]] = []

        def hook(_m: Any, inp: Any, out: Any) -> None:
            seen.append((inp[0].detach().clone(), (out[0] if isinstance(out, tuple) else out).detach().clone()))

        def attach(m: Any) -> Any:
            mlp = m.model.layers[0].mlp
            # the MoE runner holds the router too (FusedMoE(gate=...)), inside the experts' LoRA wrapper where the
            # engine wraps the experts
            aliases = [sub._modules["gate"] for sub in mlp.modules() if sub is not mlp and "gate" in sub._modules]
            return mlp.gate, aliases, mlp.gate.register_forward_hook(hook)

        gate, aliases, handle = llm.apply_model(attach)[0]
        try:
            hwsync.generate(llm, [{"prompt_token_ids": PROMPTS[0]}])
        finally:
            handle.remove()
        assert seen, "the router's LoRA wrapper never ran: the engine computes the router logits elsewhere"
        assert aliases and all(a is gate for a in aliases), (
            f"the MoE runner holds {[type(a).__name__ for a in aliases]}, not the router's LoRA wrapper "
            f"{type(gate).__name__} (patch vllm_moe_router_lora_alias)"
        )
        x, out = seen[0]
        with torch.no_grad():
            base = gate.base_layer(x)
            base = base[0] if isinstance(base, tuple) else base
            slots = [i for i in range(gate.lora_b_stacked[0].shape[0]) if gate.lora_b_stacked[0][i].any()]
            assert len(slots) == 1, f"one adapter is installed, but slots {slots} hold a router LoRA"
            slot = slots[0]
            a = gate.lora_a_stacked[0][slot, 0].float()
            b = gate.lora_b_stacked[0][slot, 0].float()
            want = base.float() + (x.float() @ a.T) @ b.T
        facts = (
            f"x {x.dtype}, base out {base.dtype}, wrapper out {out.dtype}, slots {gate.lora_a_stacked[0].dtype}"
            f", base out_dtype {getattr(gate.base_layer, 'out_dtype', None)}"
        )
        lora_part = (want - base.float()).abs().max().item()
        assert lora_part > 0, "the slot holds no LoRA: nothing to tell apart"
        err = (out.float() - want).abs().max().item()
        # bf16 engines: the LoRA term rounds in bf16 (one ulp of the logits), fp32 ones are exact to fp32 rounding
        bound = 1e-4 if out.dtype == torch.float32 and x.dtype == torch.float32 else 0.05 * max(1.0, lora_part)
        assert err <= bound, (
            f"router wrapper: max |out - (base + xAᵀBᵀ)| {err:.3g} (LoRA part {lora_part:.3g}); {facts}"
        )
