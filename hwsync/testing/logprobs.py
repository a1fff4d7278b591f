"""Reference logprobs: what the trainer's model says about a token sequence, and what vLLM said about it.

Comparing the two on the same token ids is the end-to-end check that an engine serves the trainer's weights
(parameter equality is not evidence: vLLM repacks weights after loading).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["hf_logprobs", "vllm_logprobs"]


def hf_logprobs(model: Any, token_ids: Sequence[int]) -> Any:
    """Float32 logprob of ``token_ids[t]`` given ``token_ids[:t]`` for t = 1..T-1 (one forward pass).

    ``model`` is any transformers causal LM (PEFT-wrapped too); it is run in eval mode without grad.
    """
    import torch

    ids = torch.as_tensor(list(token_ids), dtype=torch.long).unsqueeze(0)
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=ids.to(device), use_cache=False).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None].to(device))[:, 0].cpu()


def vllm_logprobs(output: Any) -> tuple[list[int], list[float]]:
    """Token ids (prompt + first completion) of a vLLM ``RequestOutput`` and the logprob vLLM assigned to
    each but the first, aligned with :func:`hf_logprobs`.

    Needs ``SamplingParams(logprobs=0, prompt_logprobs=0)`` (or larger): vLLM then reports each sampled /
    prompt token's own logprob, computed from the raw model output (``logprobs_mode="raw_logprobs"``).
    """
    completion = output.outputs[0]
    if output.prompt_logprobs is None or completion.logprobs is None:
        raise ValueError("the request was sampled without prompt_logprobs/logprobs; set both to >= 0")
    ids = list(output.prompt_token_ids) + list(completion.token_ids)
    values = [pos[tok].logprob for pos, tok in zip(output.prompt_logprobs[1:], output.prompt_token_ids[1:])]
    values += [pos[tok].logprob for pos, tok in zip(completion.logprobs, completion.token_ids)]
    return ids, values
