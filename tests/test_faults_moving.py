"""What a fault campaign's "optimizer step" moves (:func:`hwsync.testing.faults.moving`): every weight where copies of
them fit, only the last decoder layer's (the one the injector corrupts) where they do not -- the campaign keeps up to
three copies of what moves, and a 48-layer model's base is 60 GB."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from hwsync.testing.faults import moving


def _model() -> torch.nn.Module:
    cfg = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
    )
    return get_peft_model(Qwen3MoeForCausalLM(cfg), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))


def test_without_the_base_only_the_adapter_moves() -> None:
    model = _model()
    lora = {n for n, _ in model.named_parameters() if "lora_" in n}
    assert lora and moving(model, base=False) == lora


def test_the_whole_base_moves_where_its_copies_fit() -> None:
    model = _model()
    floating = {n for n, p in model.named_parameters() if p.is_floating_point()}
    assert moving(model, base=True, budget=float("inf")) == floating


def test_only_the_last_layer_moves_where_the_base_does_not_fit() -> None:
    model = _model()
    moved = moving(model, base=True, budget=1)
    base = {n for n in moved if "lora_" not in n}
    assert base and all(".layers.2." in n for n in base)
    assert any(n.endswith("experts.gate_up_proj") for n in base)
    assert {n for n, _ in model.named_parameters() if "lora_" in n} <= moved
