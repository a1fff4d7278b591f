"""peft_moe_regex on a real tiny Qwen3-MoE with real PEFT.

transformers >= 5 (fused experts): without the patch PEFT widens / drops / rejects regex targets; with it the
regex stays as written, the expert LoRA lands on the fused parameters with rank 2r / alpha 2α (scale α/r), and
the doubling is recorded. transformers 4.x (ci/run-old-transformers.sh): the converter does not exist and a
per-expert regex works natively -- the probe says "target missing" and nothing is patched.
"""

from __future__ import annotations

import copy
import importlib.util
import warnings

import pytest
import torch
from packaging.version import Version

import hwsync.patches as patches
from hwsync.common.errors import AdapterFormatError
from hwsync.testing import tiny_moe_config

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

from hwsync.patches.peft_moe_regex import fused_moe_targets  # noqa: E402

PATCH = patches.get("peft_moe_regex")
V5 = Version(transformers.__version__) >= Version("5")
# PEFT's transformers-5 config converter (peft >= 0.19); older PEFT leaves fused experts alone: target missing
CONVERTER = importlib.util.find_spec("peft.utils.transformers_weight_conversion") is not None
EXPERTS = r".*\.experts\.\d+\.(gate_proj|up_proj|down_proj)"
LAYER0_ATTN = r"model\.layers\.0\.self_attn\.(q_proj|v_proj)"
MIXED = r".*\.(q_proj|experts\.\d+\.(gate_proj|up_proj|down_proj))"
R, ALPHA = 4, 8


@pytest.fixture(scope="module")
def base():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_moe_config("qwen3_moe"), dtype=torch.float32).eval()


def _peft(base, target_modules, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "target_modules ... no module was matched" (experts-only)
        return get_peft_model(
            copy.deepcopy(base),
            LoraConfig(r=R, lora_alpha=ALPHA, target_modules=target_modules, lora_dropout=0.0, **kw),
        )


def _lora_modules(model) -> dict[str, torch.nn.Module]:
    return {
        name.removeprefix("base_model.model."): module
        for name, module in model.named_modules()
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {})
    }


def test_probe_matches_the_installed_version():
    result = PATCH.probe()
    if not V5 or not CONVERTER:
        assert result.state == patches.TARGET_MISSING, result
        assert patches.apply(["peft_moe_regex"]) == [] and not PATCH.active
    else:
        assert result.state == patches.APPLIES, result  # PEFT 0.20 + transformers 5.x
        assert "widens" in result.reason and "drops" in result.reason


@pytest.mark.skipif(V5, reason="transformers >= 5 fuses experts; covered by the tests below")
def test_v4_per_expert_regex_works_natively_and_nothing_is_patched(base):
    assert patches.apply(["peft_moe_regex"]) == []
    model = _peft(base, MIXED)
    names = _lora_modules(model)
    assert "model.layers.0.mlp.experts.3.gate_proj" in names and "model.layers.1.self_attn.q_proj" in names
    assert not PATCH.active


v5_only = pytest.mark.skipif(
    not (V5 and CONVERTER),
    reason=(
        f"transformers {transformers.__version__} has per-expert modules"
        if not V5
        else f"peft {peft.__version__} has no transformers-5 config converter (probe: target missing)"
    ),
)


@v5_only
def test_without_patch_regex_targets_are_widened_dropped_or_rejected(base):
    assert not PATCH.active
    with pytest.raises(ValueError, match="not found"):
        _peft(base, EXPERTS)
    widened = _lora_modules(_peft(base, LAYER0_ATTN))
    assert "model.layers.1.self_attn.q_proj" in widened  # the regex named layer 0 only
    mixed = _peft(base, MIXED)
    assert not any("experts" in n for n in _lora_modules(mixed))  # expert LoRA silently dropped
    assert not fused_moe_targets(mixed.peft_config["default"])


@v5_only
def test_with_patch_expert_lora_lands_with_rank_and_alpha(base):
    with PATCH:
        model = _peft(base, MIXED)
    assert not PATCH.active
    config = model.peft_config["default"]
    assert config.target_modules == MIXED  # the regex is kept as written
    assert set(config.target_parameters) == {"gate_up_proj", "down_proj"}
    mods = _lora_modules(model)
    num_experts, hidden = base.config.num_experts, base.config.hidden_size
    inter = base.config.moe_intermediate_size
    for layer in range(base.config.num_hidden_layers):
        gate_up = mods[f"model.layers.{layer}.mlp.experts.base_layer"]  # inner ParamWrapper = gate_up_proj
        down = mods[f"model.layers.{layer}.mlp.experts"]
        assert gate_up.parameter_name == "gate_up_proj" and down.parameter_name == "down_proj"
        assert gate_up.r["default"] == 2 * R and gate_up.lora_alpha["default"] == 2 * ALPHA
        assert down.r["default"] == R and down.lora_alpha["default"] == ALPHA
        assert gate_up.scaling["default"] == down.scaling["default"] == ALPHA / R  # per-branch scale kept
        assert gate_up.lora_A["default"].weight.shape == (2 * R * num_experts, hidden)
        assert gate_up.lora_B["default"].weight.shape == (2 * inter, 2 * R * num_experts)
        assert f"model.layers.{layer}.self_attn.q_proj" in mods
    recorded = {t.parameter: t for t in fused_moe_targets(config)}
    assert recorded["gate_up_proj"].fused_from == ("gate_proj", "up_proj")
    assert (recorded["gate_up_proj"].rank, recorded["gate_up_proj"].alpha) == (2 * R, 2 * ALPHA)
    assert (recorded["down_proj"].rank, recorded["down_proj"].factor) == (R, 1)
    assert config.rank_pattern[recorded["gate_up_proj"].pattern] == 2 * R


@v5_only
def test_with_patch_expert_lora_is_live_and_survives_save_load(base, tmp_path):
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    with PATCH:
        model = _peft(base, EXPERTS)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "experts" in name and "lora_B" in name:
                    p.normal_(0, 0.05)
            with model.disable_adapter():
                plain = model(ids).logits
            tuned = model(ids).logits
        assert (tuned - plain).abs().max() > 1e-3, "the expert LoRA does not reach the forward"
        model.save_pretrained(tmp_path)
        reloaded = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path)
        with torch.no_grad():
            assert torch.allclose(reloaded(ids).logits, tuned, atol=1e-6)


@v5_only
def test_with_patch_layer_scoped_regex_stays_scoped(base):
    with PATCH:
        names = set(_lora_modules(_peft(base, LAYER0_ATTN)))
        scoped_experts = _peft(base, r"model\.layers\.1\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)")
    assert names == {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"}
    config = scoped_experts.peft_config["default"]
    assert set(config.target_parameters) == {
        "model.layers.1.mlp.experts.gate_up_proj",
        "model.layers.1.mlp.experts.down_proj",
    }
    assert set(_lora_modules(scoped_experts)) == {"model.layers.1.mlp.experts", "model.layers.1.mlp.experts.base_layer"}
    assert _lora_modules(scoped_experts)["model.layers.1.mlp.experts.base_layer"].r["default"] == 2 * R


@v5_only
def test_with_patch_refusals_and_fallbacks(base):
    with PATCH:
        with pytest.raises(AdapterFormatError, match="only some of"):
            _peft(base, r".*\.experts\.[01]\.(gate_proj|up_proj|down_proj)")
        with pytest.raises(AdapterFormatError, match="gate_proj and up_proj"):
            _peft(base, r".*\.experts\.\d+\.gate_proj")
        with pytest.raises(AdapterFormatError, match="different ranks"):
            _peft(base, EXPERTS, rank_pattern={r"layers\.0\.mlp\.experts\.3\.up_proj": 16})
        # lists and all-linear go to PEFT's own converter; the doubling it applies is recorded
        listed = _peft(base, ["q_proj", "gate_proj", "up_proj", "down_proj"]).peft_config["default"]
        every = _peft(base, "all-linear").peft_config["default"]
    for config in (listed, every):
        recorded = {t.parameter: t for t in fused_moe_targets(config)}
        assert recorded["gate_up_proj"].rank == 2 * R and recorded["gate_up_proj"].alpha == 2 * ALPHA
    unpatched = _peft(base, ["q_proj", "gate_proj", "up_proj", "down_proj"]).peft_config["default"]
    assert unpatched.rank_pattern == listed.rank_pattern and set(unpatched.target_parameters) == set(
        listed.target_parameters
    )


@v5_only
def test_with_patch_a_named_router_becomes_a_parameter_target(base):
    with PATCH:
        model = _peft(base, r".*\.(mlp\.gate|q_proj)")
    config = model.peft_config["default"]
    routers = [f"model.layers.{i}.mlp.gate" for i in range(base.config.num_hidden_layers)]
    assert set(config.target_parameters) == {"gate.weight"} and set(config.exclude_modules) == set(routers)
    mods = _lora_modules(model)
    assert all(mods[r].parameter_name == "weight" and mods[r].r["default"] == R for r in routers)
    assert {t.parameter: t.fused_from for t in fused_moe_targets(config)} == {"gate.weight": ("gate",)}


@pytest.fixture(scope="module")
def base35():
    from transformers import AutoModelForCausalLM

    from hwsync.testing.tiny_moe import FixtureConfigError

    try:
        config = tiny_moe_config("qwen3_5_moe")
    except FixtureConfigError as e:
        pytest.skip(str(e))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@v5_only
def test_qwen3_5_moe_experts_are_dropped_without_and_fused_with_the_patch(base35):
    """PEFT 0.20 has no conversion table for qwen3_5_moe_text: even a plain list silently skips the experts."""
    targets = ["gate_proj", "up_proj", "down_proj"]
    plain = set(_lora_modules(_peft(base35, targets)))
    assert plain and all("shared_expert." in n for n in plain)  # only the shared expert got LoRA
    with PATCH:
        listed = _peft(base35, targets)
        regexed = _peft(base35, r".*\.experts\.\d+\.(gate_proj|up_proj|down_proj)")
    for model in (listed, regexed):
        config = model.peft_config["default"]
        assert set(config.target_parameters) == {"gate_up_proj", "down_proj"}
        mods = _lora_modules(model)
        for layer in range(base35.config.num_hidden_layers):
            assert mods[f"model.layers.{layer}.mlp.experts.base_layer"].r["default"] == 2 * R
            assert mods[f"model.layers.{layer}.mlp.experts"].r["default"] == R
        assert {t.parameter: t.rank for t in fused_moe_targets(config)} == {"gate_up_proj": 2 * R, "down_proj": R}
    assert plain <= set(_lora_modules(listed))  # the shared expert keeps its LoRA
