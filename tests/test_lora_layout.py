"""The engine's LoRA layout is one value: it travels in the engine's description, and the converter takes all of it
(expert stacking, per-expert names, row orders, what it cannot hold)."""

from __future__ import annotations

import types

import pytest
import torch

from hwsync.common.errors import AdapterFormatError
from hwsync.common.lora_formats import LoraAdapter, LoraKind, LoraModule, to_vllm_lora
from hwsync.common.lora_layout import PER_EXPERT, STACKED, LoraLayout
from hwsync.common.wire import EngineInfo

E, R, H, INTER = 4, 2, 8, 6


def _adapter(interleaved: bool = False) -> LoraAdapter:
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    mods = {
        "model.layers.0.self_attn.q_proj.weight": LoraModule(
            "model.layers.0.self_attn.q_proj.weight", LoraKind.LINEAR, rnd(R, H), rnd(H, R), float(R), 1.0
        ),
        "model.layers.0.mlp.experts.gate_up_proj": LoraModule(
            "model.layers.0.mlp.experts.gate_up_proj",
            LoraKind.EXPERTS_GATE_UP,
            rnd(E, R, H),
            rnd(E, 2 * INTER, R),
            float(R),
            1.0,
            interleaved=interleaved,
        ),
    }
    return LoraAdapter(mods, R, float(R))


def test_the_description_carries_the_layout_and_keeps_row_orders_engine_side() -> None:
    layout = LoraLayout("3d", ("w1", "w3", "w2")).with_row_orders({"m": torch.tensor([1, 0])})
    info = EngineInfo(engine="vllm", dtype="bfloat16", lora_layout=layout)
    wire = info.to_dict()
    assert wire["lora_layout"] == {"experts": "3d", "expert_names": ["w1", "w3", "w2"]}
    back = EngineInfo.from_dict(wire)
    assert back.lora_layout == layout and back.lora_layout.row_orders == {}
    assert EngineInfo(engine="vllm", dtype="bfloat16").lora_layout is PER_EXPERT
    assert EngineInfo(engine="vllm", dtype="bfloat16", lora_layout="3d").lora_layout == STACKED
    # the one read of vLLM's flag (vLLM's LoRA model manager sets it where it built the experts for PEFT's format)
    assert LoraLayout.of_vllm(types.SimpleNamespace(_is_3d_moe_model=True)) is STACKED
    assert LoraLayout.of_vllm(types.SimpleNamespace()) is PER_EXPERT


def test_the_converter_takes_every_part_of_the_layout() -> None:
    adapter = _adapter()
    per_expert, _ = to_vllm_lora(adapter, layout=LoraLayout("2d", ("w1", "w3", "w2")))
    assert "base_model.model.model.layers.0.mlp.experts.3.w3.lora_B.weight" in per_expert
    stacked, config = to_vllm_lora(adapter, layout=STACKED)
    assert "base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight" in stacked
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj"]
    order = torch.arange(H).flip(0)
    plain, _ = to_vllm_lora(adapter)
    reordered, _ = to_vllm_lora(adapter, layout=PER_EXPERT.with_row_orders({"model.layers.0.self_attn.q_proj": order}))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    assert torch.equal(reordered[key], plain[key][order])
    assert not torch.equal(reordered[key], plain[key])
    other = "base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_B.weight"
    assert torch.equal(reordered[other], plain[other])


def test_interleaved_gate_up_is_held_only_stacked() -> None:
    with pytest.raises(AdapterFormatError, match="interleaved gate/up"):
        to_vllm_lora(_adapter(interleaved=True), layout=PER_EXPERT)
    to_vllm_lora(_adapter(interleaved=True), layout=STACKED)


@pytest.mark.parametrize("bad", ["4d", {"experts": "2d", "expert_names": ["a", "b"]}, 3])
def test_a_bad_layout_is_one_clear_error(bad: object) -> None:
    with pytest.raises(AdapterFormatError, match="expert LoRA layout"):
        LoraLayout.of(bad)  # type: ignore[arg-type]
