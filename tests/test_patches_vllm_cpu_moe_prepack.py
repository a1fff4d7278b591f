"""vllm_cpu_moe_prepack: a weight reload on vLLM's CPU build keeps the MoE experts correct.

One engine on the tiny Qwen3-MoE: it serves HF's logprobs; after ``reload_weights`` of the very same checkpoint
without the patch it does not (the CPU prepack was skipped); after a reload under the patch it does again.
"""

from __future__ import annotations

import pytest

import hwsync.patches as patches
from hwsync.testing import make_llm, require_vllm, vllm_missing_reason
from hwsync.trainer.verify import engine_logprobs, token_logprobs

PATCH = patches.get("vllm_cpu_moe_prepack")
PROMPT = [5, 17, 42, 99, 7, 3, 64, 12, 150, 33]
TOL = 1e-4


def test_probe_matches_the_installed_stack():
    result = PATCH.probe()
    if vllm_missing_reason() is not None:
        assert result.state == patches.TARGET_MISSING and "vllm" in result.reason
        return
    from vllm.platforms import current_platform

    assert result.state == (patches.APPLIES if current_platform.is_cpu() else patches.NOT_NEEDED), result


@pytest.mark.vllm
def test_reload_without_and_with_the_patch(tiny_qwen3_moe_dir):
    require_vllm()
    if PATCH.probe().state != patches.APPLIES:
        pytest.skip(f"not affected here: {PATCH.probe().reason}")
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    tiny = tiny_qwen3_moe_dir
    llm = make_llm(tiny, skip_tokenizer_init=True)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    weights = load_file(str(tiny / "model.safetensors"))
    sampling = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0, prompt_logprobs=0, detokenize=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)

    def max_diff() -> float:
        ids, got = engine_logprobs(llm.generate([{"prompt_token_ids": PROMPT}], sampling)[0])
        return max(abs(a - b) for a, b in zip(got, token_logprobs(hf, ids).tolist()))

    def reload() -> None:
        runner.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)

    assert max_diff() <= TOL  # first load: correct
    assert not PATCH.active
    reload()
    broken = max_diff()
    assert broken > 100 * TOL, f"reload without the patch stayed correct ({broken:.2e}): is the probe stale?"
    with PATCH:
        reload()
    assert not PATCH.active
    assert max_diff() <= TOL
