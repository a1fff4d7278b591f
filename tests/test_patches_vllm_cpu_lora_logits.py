"""``vllm_cpu_lora_logits``: prompt logprobs on a LoRA engine of vLLM's CPU build with default LoRA targets.

One real engine with ``enable_lora=True`` and vLLM's own default ``lora_target_modules`` (which wraps ``lm_head``):
with the patch an adapter synced by hwsync serves prompt logprobs equal to the trainer's; without it the same
request crashes in ``punica_cpu.add_lora_logits`` (the probe's reason to apply).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hwsync
from hwsync.testing import assert_serves, close_llm, make_llm, on_cpu, require_vllm

pytestmark = pytest.mark.vllm

PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8], [3, 4, 200, 17, 18, 99]]


@pytest.fixture(scope="module")
def patch() -> Any:
    require_vllm()
    if not on_cpu():
        pytest.skip("the patch targets vLLM's CPU build")
    import hwsync.patches as patches

    return patches.get("vllm_cpu_lora_logits")


def test_probe_reproduces_the_crash_and_the_fix_computes_the_lora_delta(patch: Any) -> None:
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    import hwsync.patches.vllm_cpu_lora_logits as module
    from hwsync.patches import APPLIES

    assert patch.probe(refresh=True).state == APPLIES, patch.probe().reason
    with pytest.raises(RuntimeError, match="einsum"):
        module.reproduce(patch.original())
    fixed = patch.replacement(patch.original(), module._TARGET)
    got, want = module.reproduce(fixed)
    assert torch.allclose(got, want, atol=1e-4)
    # rows of one request, but the batch's requests on different adapters: refused with the cause named
    wrapper = module._wrapper(3)
    wrapper._sampler_indices[:2] = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="different adapters"):
        fixed(wrapper, torch.zeros(3, 64), torch.zeros(3, 32), torch.zeros(2, 1, 8, 32), torch.zeros(2, 1, 64, 8), 1.0)
    assert not patch.installed or PunicaWrapperCPU.add_lora_logits is not patch.original()


@pytest.fixture(scope="module")
def llm(patch: Any, tiny_qwen3_moe_dir: Path) -> Iterator[Any]:
    import hwsync.patches as patches
    from hwsync.engine import vllm_plugin

    before = {n for n in patches.names() if patches.get(n).installed}
    active = set(vllm_plugin.register()) - before
    assert patch.installed  # the vLLM plugin installs it in engine processes
    engine = make_llm(tiny_qwen3_moe_dir, enable_lora=True, max_lora_rank=8, max_loras=1, lora_target_modules=None)
    yield engine
    close_llm(engine)
    for name in active:
        patches.get(name).uninstall()


def test_default_lora_engine_serves_prompt_logprobs(patch: Any, llm: Any, tiny_qwen3_moe_dir: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe_dir, dtype=torch.float32).eval()
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"]))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    r = hwsync.sync(llm, model, strategy="adapter")
    assert r.lora_request is not None
    worker = llm.llm_engine.model_executor.driver_worker.worker
    layers = {type(m).__name__ for m in worker.model_runner.model.modules()}
    assert "LogitsProcessorWithLoRA" in layers, "vLLM's default LoRA targets no longer wrap lm_head"
    assert assert_serves(llm, model, PROMPTS, atol=1e-4) <= 1e-4  # prompt logprobs of a 2-request batch
    # the crash the patch prevents, on the same engine (last: a failed forward may leave the engine unusable)
    patch.uninstall()
    try:
        with pytest.raises(Exception, match="einsum"):
            hwsync.as_engine(llm).logprobs(PROMPTS, 1)
    finally:
        patch.install()
