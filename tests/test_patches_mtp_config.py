"""mtp_config: the pure helpers on real transformers configs, and vLLM's multi-module MTP check.

The vLLM part feeds ``use_multi_module_mtp`` the draft config vLLM itself derives from a Qwen3.5-MoE config
(``SpeculativeConfig.hf_config_override``), without and with the patch.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import hwsync.patches as patches
from hwsync.patches.mtp_config import mtp_disable_overrides, mtp_layers
from hwsync.testing import require_vllm, vllm_missing_reason

transformers = pytest.importorskip("transformers")
PATCH = patches.get("mtp_config")


def _nested(top: dict, text: dict):
    from transformers import PretrainedConfig

    config = PretrainedConfig(**top)
    config.text_config = PretrainedConfig(**text)
    return config


def _qwen3_5_moe(mtp: int):
    """The real Qwen3.5-MoE config class where this transformers has it (MTP depth nested in text_config)."""
    try:
        from transformers import Qwen3_5MoeConfig
    except ImportError:
        return _nested({"model_type": "qwen3_5_moe"}, {"mtp_num_hidden_layers": mtp})
    return Qwen3_5MoeConfig(
        text_config={"mtp_num_hidden_layers": mtp, "num_hidden_layers": 2},
        architectures=["Qwen3_5MoeForConditionalGeneration"],
    )


def test_mtp_layers_reads_every_spelling_and_nesting():
    from transformers import PretrainedConfig

    assert mtp_layers(_qwen3_5_moe(2)) == 2
    assert mtp_layers(_qwen3_5_moe(0)) == 0
    assert mtp_layers(PretrainedConfig(num_nextn_predict_layers=1)) == 1  # DeepSeek-V3 / GLM / Qwen3-Next
    assert mtp_layers(PretrainedConfig(mtp_num_hidden_layers=3)) == 3  # Qwen3.5 text-only checkpoint
    # a default 0 at the top must not hide the nested value
    assert mtp_layers(_nested({"num_nextn_predict_layers": 0}, {"mtp_num_hidden_layers": 1})) == 1
    assert mtp_layers({"text_config": {"mtp_num_hidden_layers": 2}, "num_nextn_predict_layers": 0}) == 2
    assert mtp_layers(SimpleNamespace(hf_config=_qwen3_5_moe(1))) == 1  # a vLLM ModelConfig
    assert mtp_layers(PretrainedConfig()) == 0
    assert mtp_layers({"num_nextn_predict_layers": True}) == 0  # not a layer count


def test_mtp_disable_overrides_zero_each_field_where_it_lives():
    assert mtp_disable_overrides(_qwen3_5_moe(1)) == {"text_config": {"mtp_num_hidden_layers": 0}}
    assert mtp_disable_overrides({"num_nextn_predict_layers": 1}) == {"num_nextn_predict_layers": 0}
    assert mtp_disable_overrides(_nested({"num_nextn_predict_layers": 2}, {"mtp_num_hidden_layers": 1})) == {
        "num_nextn_predict_layers": 0,
        "text_config": {"mtp_num_hidden_layers": 0},
    }
    assert mtp_disable_overrides(_qwen3_5_moe(0)) == {}


def test_probe_matches_the_installed_stack():
    result = PATCH.probe()
    if vllm_missing_reason() is not None:
        assert result.state == patches.TARGET_MISSING
        assert patches.apply(["mtp_config"]) == []
    else:
        assert result.state == patches.APPLIES, result  # vLLM 0.32


def _spec(hf_config, num_speculative_tokens):
    # use_multi_module_mtp reads exactly these three attributes of the SpeculativeConfig
    return SimpleNamespace(
        method="mtp",
        num_speculative_tokens=num_speculative_tokens,
        draft_model_config=SimpleNamespace(hf_config=hf_config),
    )


@pytest.mark.vllm
def test_multi_module_mtp_is_detected_for_qwen3_5_with_the_patch():
    require_vllm()
    from vllm.config.speculative import SpeculativeConfig

    if PATCH.probe().state != patches.APPLIES:
        pytest.skip(PATCH.probe().reason)
    draft = SpeculativeConfig.hf_config_override(_qwen3_5_moe(2))  # what vLLM builds for the MTP drafter
    deepseek_like = SimpleNamespace(num_nextn_predict_layers=2)
    assert SpeculativeConfig.use_multi_module_mtp(_spec(draft, 2)) is False  # the bug
    with PATCH:
        assert SpeculativeConfig.use_multi_module_mtp(_spec(draft, 2)) is True
        assert SpeculativeConfig.use_multi_module_mtp(_spec(draft, 1)) is False  # one token: one module
        assert (
            SpeculativeConfig.use_multi_module_mtp(_spec(SpeculativeConfig.hf_config_override(_qwen3_5_moe(1)), 3))
            is False
        )  # one MTP module
        assert SpeculativeConfig.use_multi_module_mtp(_spec(deepseek_like, 2)) is True  # unchanged
    assert SpeculativeConfig.use_multi_module_mtp(_spec(draft, 2)) is False
