"""Merged view: equals PEFT's merge_and_unload of a deep copy, never writes the trainer's weights."""

from __future__ import annotations

import copy

import pytest
import torch

from hwsync.common.errors import AdapterFormatError
from hwsync.common.trainer_names import strip_peft_name
from hwsync.testing import tiny_moe_config
from hwsync.trainer.merged import delta_weight, merged_named_weights

peft = pytest.importorskip("peft")
from peft import IA3Config, LoraConfig, get_peft_model  # noqa: E402

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def tiny_model(dtype: torch.dtype = torch.float32):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(tiny_moe_config("qwen3_moe", num_experts=4, moe_intermediate_size=32)).to(dtype)


def lora(**kw) -> LoraConfig:
    return LoraConfig(lora_dropout=0.0, init_lora_weights=False, **kw)


BOTH = dict(
    r=4,
    lora_alpha=8,
    target_modules=["q_proj", "v_proj", "o_proj"],
    target_parameters=EXPERTS,
    rank_pattern={"down_proj": 2},
    alpha_pattern={"gate_up_proj": 3},
)


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def reference(pm) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in copy.deepcopy(pm).merge_and_unload().named_parameters()}


@pytest.mark.parametrize(
    "cfg",
    [
        dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
        dict(r=4, lora_alpha=8, target_modules=[], target_parameters=EXPERTS),
        BOTH,
        dict(BOTH, use_rslora=True),
    ],
    ids=["attention", "experts", "both", "rslora"],
)
def test_equals_merge_and_unload_and_leaves_model_untouched(cfg) -> None:
    pm = get_peft_model(tiny_model(), lora(**cfg))
    before = snapshot(pm)
    ptrs = {n: p.data_ptr() for n, p in pm.named_parameters()}
    merged = dict(merged_named_weights(pm))
    want = reference(pm)
    assert merged.keys() == want.keys()
    for n in want:  # fp32: the same additions PEFT does, so bit-identical
        assert torch.equal(merged[n], want[n]), n
    after = snapshot(pm)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert ptrs == {n: p.data_ptr() for n, p in pm.named_parameters()}
    # LoRA-adapted weights are new buffers; everything else is the trainer's own storage (no copy)
    params = {strip_peft_name(n): p for n, p in pm.named_parameters() if "lora_" not in n}
    adapted = {n for n in merged if not torch.equal(merged[n], params[n])}
    assert adapted  # random LoRA B: every adapted weight changed
    for n, t in merged.items():
        assert (t.data_ptr() == params[n].data_ptr()) == (n not in adapted), n


def test_bf16_base_fp32_lora_single_rounding() -> None:
    """PEFT keeps LoRA in fp32 on a bf16 base (autocast_adapter_dtype): merge in fp32, round once."""
    pm = get_peft_model(tiny_model(torch.bfloat16), lora(**BOTH))
    layer = pm.base_model.model.model.layers[0].mlp.experts  # outer ParamWrapper = down_proj
    assert layer.lora_A["default"].weight.dtype == torch.float32
    before = snapshot(pm)
    merged = dict(merged_named_weights(pm))
    base = pm.base_model.model.model.layers[0].mlp.experts.base_layer.base_layer.down_proj
    exact = (base.detach().float() + delta_weight(layer, "default")).to(torch.bfloat16)
    assert torch.equal(merged["model.layers.0.mlp.experts.down_proj"], exact)
    want = reference(pm)  # PEFT rounds ΔW to bf16 first, then adds in bf16: within 1 ulp of ours
    for n in want:
        assert merged[n].dtype == torch.bfloat16
        torch.testing.assert_close(merged[n].float(), want[n].float(), rtol=1.6e-2, atol=1e-2)
    assert all(torch.equal(before[n], p) for n, p in snapshot(pm).items())
    f32 = dict(merged_named_weights(pm, dtype=torch.float32, include=lambda n: "experts" in n))
    assert f32 and all(t.dtype == torch.float32 for t in f32.values()) and all("experts" in n for n in f32)


def test_experts_chunked_merge(monkeypatch) -> None:
    import hwsync.trainer.merged as merged_mod

    pm = get_peft_model(tiny_model(), lora(**BOTH))
    want = reference(pm)
    monkeypatch.setattr(merged_mod, "_CHUNK_BYTES", 1)  # one expert per chunk
    got = dict(merged_named_weights(pm, include=lambda n: "experts" in n))
    assert got and all(torch.equal(got[n], want[n]) for n in got)


def test_adapter_states_follow_peft_forward() -> None:
    pm = get_peft_model(tiny_model(), lora(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=EXPERTS))
    pm.add_adapter("second", lora(r=2, lora_alpha=2, target_modules=["q_proj"], target_parameters=EXPERTS))
    base = {strip_peft_name(n): p.detach().clone() for n, p in pm.named_parameters() if "lora_" not in n}
    q = "model.layers.0.self_attn.q_proj.weight"
    gu = "model.layers.1.mlp.experts.gate_up_proj"

    pm.base_model.set_adapter(["default", "second"])
    both = dict(merged_named_weights(pm))
    want = reference(pm)
    for n in (q, gu):
        torch.testing.assert_close(both[n], want[n], rtol=1e-6, atol=1e-6)

    with pm.disable_adapter():
        off = dict(merged_named_weights(pm))
    assert all(torch.equal(off[n], base[n]) for n in base)

    pm.base_model.set_adapter("default")
    default_only = {n: t.clone() for n, t in merged_named_weights(pm) if n in (q, gu)}
    pm.merge_adapter()  # stored weight now holds W0 + ΔW: must not be added twice
    merged_in_place = {n: t.clone() for n, t in merged_named_weights(pm) if n in (q, gu)}
    for n in (q, gu):
        torch.testing.assert_close(merged_in_place[n], default_only[n], rtol=1e-5, atol=1e-6)
    pm.unmerge_adapter()
    again = dict(merged_named_weights(pm))
    for n in (q, gu):
        torch.testing.assert_close(again[n], default_only[n], rtol=1e-5, atol=1e-6)


def test_modules_to_save_copy_replaces_original() -> None:
    pm = get_peft_model(tiny_model(), lora(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    wrapper = pm.base_model.model.lm_head
    with torch.no_grad():
        wrapper.modules_to_save["default"].weight.add_(1.0)
    merged = dict(merged_named_weights(pm))
    assert "lm_head.weight" in merged and not any("original_module" in n or "modules_to_save" in n for n in merged)
    assert merged["lm_head.weight"].data_ptr() == wrapper.modules_to_save["default"].weight.data_ptr()
    want = reference(pm)
    assert merged.keys() == want.keys() and torch.equal(merged["lm_head.weight"], want["lm_head.weight"])


def test_dora_uses_peft_merge_safe_without_touching_model() -> None:
    pm = get_peft_model(tiny_model(), lora(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True))
    before = snapshot(pm)
    caches = {n: dict(getattr(m, "_caches", {})) for n, m in pm.named_modules() if hasattr(m, "_caches")}
    merged = dict(merged_named_weights(pm))
    want = reference(pm)
    for n in want:
        torch.testing.assert_close(merged[n], want[n], rtol=1e-6, atol=1e-6)
    assert all(torch.equal(before[n], p) for n, p in snapshot(pm).items())
    assert caches == {n: dict(getattr(m, "_caches", {})) for n, m in pm.named_modules() if hasattr(m, "_caches")}
    with pytest.raises(AdapterFormatError, match="no additive"):
        delta_weight(pm.base_model.model.model.layers[0].self_attn.q_proj, "default")


def test_non_lora_adapters_are_refused() -> None:
    ia3 = get_peft_model(tiny_model(), IA3Config(target_modules=["q_proj", "o_proj"], feedforward_modules=["o_proj"]))
    with pytest.raises(AdapterFormatError, match="IA3"):
        next(iter(merged_named_weights(ia3)))


def test_strip_peft_name() -> None:
    cases = {
        "base_model.model.model.layers.0.mlp.experts.base_layer.base_layer.gate_up_proj": (
            "model.layers.0.mlp.experts.gate_up_proj"
        ),
        "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight": "model.layers.0.self_attn.q_proj.weight",
        "base_model.model.lm_head.modules_to_save.default.weight": "lm_head.weight",
        "base_model.model.lm_head.original_module.weight": "lm_head.weight",
        "model._fsdp_wrapped_module.layers.0._checkpoint_wrapped_module.mlp.gate.weight": (
            "model.layers.0.mlp.gate.weight"
        ),
        "_orig_mod.model.norm.weight": "model.norm.weight",
        "model.layers.0.self_attn.q_proj.base_layer": "model.layers.0.self_attn.q_proj",
        "model.my_base_layer_x.weight": "model.my_base_layer_x.weight",
    }
    assert {k: strip_peft_name(k) for k in cases} == cases


def test_suspended_generator_leaves_autograd_enabled() -> None:
    """A consumer that stops mid-way (bucketing, an exception) must not leave the trainer under no_grad."""
    pm = get_peft_model(tiny_model(), lora(target_modules=["q_proj", "v_proj"]))
    it = merged_named_weights(pm)
    for _ in range(3):
        next(it)
        assert torch.is_grad_enabled()
    del it
    assert torch.is_grad_enabled()
