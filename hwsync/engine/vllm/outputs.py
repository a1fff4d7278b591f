"""Reading what a vLLM engine computed: the logprobs of a ``RequestOutput``, aligned with the trainer's."""

from __future__ import annotations

from typing import Any

from hwsync.common.errors import VerifyError

__all__ = ["engine_logprobs"]


def engine_logprobs(output: Any) -> tuple[list[int], list[float]]:
    """Token ids (prompt + first completion) of a vLLM ``RequestOutput`` and the logprob vLLM assigned to each but
    the first, aligned with :func:`token_logprobs`.

    Needs ``SamplingParams(logprobs=0, prompt_logprobs=0)`` (or larger): vLLM then reports each sampled / prompt
    token's own logprob, computed from the raw model output.
    """
    completion = output.outputs[0]
    if output.prompt_logprobs is None or completion.logprobs is None:
        raise VerifyError("the request was sampled without prompt_logprobs/logprobs; set both to >= 0")
    ids = list(output.prompt_token_ids) + list(completion.token_ids)
    values = [pos[tok].logprob for pos, tok in zip(output.prompt_logprobs[1:], output.prompt_token_ids[1:])]
    values += [pos[tok].logprob for pos, tok in zip(completion.logprobs, completion.token_ids)]
    return ids, values
