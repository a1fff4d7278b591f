"""vllm_transformers_backend: an engine on vLLM's Transformers backend leaves transformers' decoder class unchanged.

Without the patch, vLLM 0.32 decorates transformers' own decoder class in place (``support_torch_compile``), so
once an engine has loaded a FlexOlmo model, ``AutoModelForCausalLM.from_pretrained`` of the same model in the same
process (hwsync's colocated trainer) fails with ``AssertionError: Current vLLM config is not set``. One engine per
module (tiny FlexOlmo, LoRA as the family matrix builds it), built under the engine patches (what
``VLLM_PLUGINS=hwsync`` installs); with ``HWSYNC_DISABLE_PATCHES=vllm_transformers_backend`` the engine tests fail with
that error.
"""

from __future__ import annotations

import pytest
import torch

import hwsync.patches as patches
from hwsync.testing import on_cpu, vllm_missing_reason

PATCH = patches.get("vllm_transformers_backend")
FAMILY = "flex_olmo"


def test_probe_matches_the_installed_stack() -> None:
    result = PATCH.probe()
    if vllm_missing_reason() is not None:
        assert result.state == patches.TARGET_MISSING, result
        return
    assert result.state == patches.APPLIES, result  # vLLM 0.32 (the supported version) has the bug


def test_decoration_goes_to_a_subclass_and_only_while_an_engine_builds() -> None:
    """Engine-free: the wrapped decorator leaves the class alone; _from_config redirects only under a vLLM config."""
    if vllm_missing_reason() is not None:
        pytest.skip(vllm_missing_reason())
    from transformers import LlamaConfig, LlamaModel, PreTrainedModel
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.models.transformers.base import Base

    from hwsync.patches.vllm_transformers_backend import ENGINE_SUBCLASS_OF

    init, bases = LlamaModel.__init__, LlamaModel.__bases__
    originals = (Base.__dict__["_decorate_cls_for_torch_compile"], PreTrainedModel.__dict__["_from_config"])
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    with PATCH:
        assert PATCH.active
        Base._decorate_cls_for_torch_compile(
            object(),
            cls=LlamaModel,
            dynamic_arg_dims={"input_ids": 1},
            enable_if=lambda _config: False,
            is_encoder=False,
        )
        assert LlamaModel.__init__ is init and LlamaModel.__bases__ == bases
        plain = LlamaModel._from_config(config)  # no vLLM config is current: not redirected (records dropped)
        assert type(plain) is LlamaModel
        Base._decorate_cls_for_torch_compile(
            object(),
            cls=LlamaModel,
            dynamic_arg_dims={"input_ids": 1},
            enable_if=lambda _config: False,
            is_encoder=False,
        )
        with set_current_vllm_config(VllmConfig()):
            model = LlamaModel._from_config(config)
        sub = type(model)
        assert sub is not LlamaModel and issubclass(sub, LlamaModel) and sub.__dict__[ENGINE_SUBCLASS_OF] is LlamaModel
        assert isinstance(model, TorchCompileWithNoGuardsWrapper) and model.do_not_compile
        assert sub.__name__ == LlamaModel.__name__ and sub.__qualname__ == LlamaModel.__qualname__
        assert type(LlamaModel._from_config(config)) is LlamaModel  # one construction per decoration
    assert not PATCH.active
    assert (Base.__dict__["_decorate_cls_for_torch_compile"], PreTrainedModel.__dict__["_from_config"]) == originals
    assert LlamaModel.__init__ is init and LlamaModel.__bases__ == bases
    assert type(LlamaModel(config)) is LlamaModel


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    from hwsync.testing import patched_llm, require_vllm
    from hwsync.testing.families import make_family_checkpoint

    require_vllm()
    if PATCH.probe().state != patches.APPLIES:
        pytest.skip(f"not affected here: {PATCH.probe().reason}")
    import transformers.models.flex_olmo.modeling_flex_olmo as modeling

    path = make_family_checkpoint(tmp_path_factory.mktemp("tb") / FAMILY, FAMILY)
    before = (modeling.FlexOlmoModel.__init__, modeling.FlexOlmoModel.__bases__, dict(modeling.FlexOlmoModel.__dict__))
    with patched_llm(path, max_model_len=256, enable_lora=True, max_lora_rank=8, max_loras=1) as llm:
        yield llm, path, modeling.FlexOlmoModel, before


@pytest.mark.vllm
def test_engine_serves_through_a_decorated_subclass(engine) -> None:
    llm, _, cls, _ = engine
    from vllm import SamplingParams
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper

    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    decoder = model.model
    assert type(decoder) is not cls and isinstance(decoder, cls)
    assert isinstance(decoder, TorchCompileWithNoGuardsWrapper)  # vLLM's decoration is in place, on the subclass
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.vllm
def test_transformers_model_builds_after_the_engine(engine) -> None:
    llm, path, cls, (init, bases, namespace) = engine
    from transformers import AutoModelForCausalLM

    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # raised before the patch
    assert cls.__init__ is init and cls.__bases__ == bases and dict(cls.__dict__) == namespace
    assert type(trainer.model) is cls
    from hwsync.testing.families import PROMPTS
    from hwsync.trainer.verify import agreement

    # the engine's forward is the model's: exactly comparable on vLLM's CPU build (fp32); a GPU engine computes in
    # TF32 / bf16 (0.075 on an H100), where the point of this test -- the model builds, its class untouched -- stands
    assert agreement(llm, trainer, PROMPTS).max_abs_diff < (1e-4 if on_cpu() else 0.5)
