"""vllm_cpu_moe_lora: attention LoRA on a MoE model on vLLM's CPU build, experts from base weights.

Without the patch an ``enable_lora`` engine on the tiny Qwen3-MoE dies at its first forward (Triton experts on
CPU); with it, an attention-only adapter gives HF+PEFT's logprobs, and an adapter with expert LoRA is refused
instead of being served with its expert deltas silently dropped.
"""

from __future__ import annotations

import gc

import pytest

import hwsync.patches as patches
from hwsync.common.errors import AdapterFormatError
from hwsync.testing import make_llm, require_vllm, vllm_missing_reason
from hwsync.trainer.verify import engine_logprobs, token_logprobs

PATCH = patches.get("vllm_cpu_moe_lora")
PROMPT = [5, 17, 42, 99, 7, 3, 64, 12, 150, 33]
TOL = 1e-4


def test_probe_matches_the_installed_stack():
    result = PATCH.probe()
    if vllm_missing_reason() is not None:
        assert result.state == patches.TARGET_MISSING and "vllm" in result.reason
        assert "vllm_cpu_moe_lora" not in patches.apply(["vllm_cpu_moe_lora"])
        return
    from vllm.platforms import current_platform

    expected = patches.APPLIES if current_platform.is_cpu() else patches.NOT_NEEDED
    assert result.state == expected, result.reason


@pytest.fixture(scope="module")
def tiny(tiny_qwen3_moe_dir):
    require_vllm()
    return tiny_qwen3_moe_dir


def _adapter(model_dir, out_dir, targets, seed):
    """A PEFT LoRA adapter with random non-zero weights on ``targets``; returns (dir, HF+PEFT model)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    model.save_pretrained(out_dir)
    return out_dir, model.eval()


def _sampling():
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, logprobs=0, prompt_logprobs=0, detokenize=False)


@pytest.mark.vllm
def test_without_patch_moe_lora_fails_at_first_forward(tiny):
    if PATCH.probe().state != patches.APPLIES:
        pytest.skip(f"not affected here: {PATCH.probe().reason}")
    assert not PATCH.active
    # lora_target_modules=None: vLLM's own default (every LoRA-capable layer), not engine_args' CPU restriction
    llm = make_llm(tiny, enable_lora=True, max_lora_rank=8, skip_tokenizer_init=True, lora_target_modules=None)
    try:
        with pytest.raises(Exception, match="triton|Triton"):
            llm.generate([{"prompt_token_ids": PROMPT}], _sampling())
    finally:
        del llm
        gc.collect()


@pytest.fixture(scope="module")
def patched_llm(tiny):
    if PATCH.probe().state != patches.APPLIES:
        pytest.skip(f"not affected here: {PATCH.probe().reason}")
    with PATCH:
        llm = make_llm(tiny, enable_lora=True, max_lora_rank=16, skip_tokenizer_init=True, lora_target_modules=None)
        yield llm
        del llm
        gc.collect()


@pytest.mark.vllm
def test_with_patch_attention_lora_matches_hf_peft(patched_llm, tiny, tmp_path):
    from vllm.lora.request import LoRARequest

    path, peft_model = _adapter(tiny, tmp_path / "attn", ["q_proj", "k_proj", "v_proj", "o_proj"], seed=1)
    out = patched_llm.generate(
        [{"prompt_token_ids": PROMPT}], _sampling(), lora_request=LoRARequest("attn", 1, str(path))
    )
    ids, got = engine_logprobs(out[0])
    want = token_logprobs(peft_model, ids)
    diff = max(abs(a - b) for a, b in zip(got, want.tolist()))
    assert diff <= TOL, f"attention-LoRA logprobs differ from HF+PEFT by {diff:.2e}"

    with peft_model.disable_adapter():
        plain = token_logprobs(peft_model, ids)
    assert max(abs(a - b) for a, b in zip(got, plain.tolist())) > 100 * TOL, "the adapter had no effect"


@pytest.mark.vllm
def test_with_patch_base_requests_match_hf(patched_llm, tiny):
    import torch
    from transformers import AutoModelForCausalLM

    out = patched_llm.generate([{"prompt_token_ids": PROMPT}], _sampling())
    ids, got = engine_logprobs(out[0])
    want = token_logprobs(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32), ids)
    assert max(abs(a - b) for a, b in zip(got, want.tolist())) <= TOL


@pytest.mark.vllm
def test_with_patch_experts_are_unwrapped_and_expert_adapters_refused(patched_llm, tiny, tmp_path):
    from vllm.lora.request import LoRARequest

    from hwsync.patches.vllm_cpu_moe_lora import unwrapped_moe_modules

    model = patched_llm.apply_model(lambda m: m)[0]
    assert unwrapped_moe_modules(model.lora_manager) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]

    path, _ = _adapter(tiny, tmp_path / "moe", ["q_proj", "gate_proj", "up_proj", "down_proj"], seed=2)
    with pytest.raises(AdapterFormatError, match="hybrid"):
        patched_llm.generate([{"prompt_token_ids": PROMPT}], _sampling(), lora_request=LoRARequest("moe", 2, str(path)))
