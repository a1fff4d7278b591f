"""Does the engine serve the trainer's policy? Logprobs of the same token ids, engine vs trainer.

Parameter equality is no evidence (engines repack weights after loading); this compares what both compute. One
helper computes the trainer's logprobs (:func:`token_logprobs`) and one reads the engine's (:func:`engine_logprobs`),
for :func:`verify`, the ms-swift plugin and the tests alike.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hwsync.api import as_engine
from hwsync.errors import VerifyError
from hwsync.vllm.outputs import engine_logprobs  # the engine half of the pair, re-exported

__all__ = ["Agreement", "agreement", "engine_logprobs", "token_logprobs", "verify"]


def _scores(model: nn.Module, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Under ``model`` (eval mode, no grad, fp32 log-softmax): for t >= 1 the logprob of ``ids[t]`` given
    ``ids[:t]``, the argmax token there, and its logprob (on the CPU)."""
    device = next(model.parameters()).device
    x = torch.as_tensor(list(ids), dtype=torch.long, device=device).unsqueeze(0)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=x, use_cache=False).logits[0, :-1].float()
    finally:
        model.train(was_training)
    logp = torch.log_softmax(logits, -1)
    best, arg = logp.max(-1)
    return logp.gather(1, x[0, 1:, None])[:, 0].cpu(), arg.cpu(), best.cpu()


def token_logprobs(model: nn.Module, ids: Sequence[int]) -> torch.Tensor:
    """The trainer's fp32 logprob of each ``ids[t]`` (t >= 1) given ``ids[:t]``, aligned with
    :func:`engine_logprobs` (``model``: any transformers causal LM, PEFT-wrapped too; eval mode, no grad)."""
    return _scores(model, ids)[0]


@dataclass(frozen=True)
class Agreement:
    """How closely an engine follows the trainer on some prompts (see :func:`agreement`)."""

    max_abs_diff: float
    """Max |Δ logprob| over every prompt token and greedy-generated token."""
    where: str
    tokens: int
    """Number of logprobs compared."""
    greedy_mismatches: tuple[str, ...]
    """Generated positions where the engine's greedy token is not the trainer's argmax (and not a near-tie)."""


def agreement(target: Any, model: nn.Module, prompt_token_ids: Sequence[Sequence[int]], *, max_tokens: int = 4,
              tie: float = 2e-4) -> Agreement:
    """Run ``prompt_token_ids`` through the engine (greedy, ``max_tokens`` new tokens) and through ``model`` on the
    engine's own ids; compare logprobs everywhere and the greedy choice at each generated position (a trainer
    argmax that beats the engine's token by at most ``tie`` counts as a tie, not a mismatch)."""
    if not prompt_token_ids or any(len(p) < 1 for p in prompt_token_ids):
        raise VerifyError("verify needs at least one non-empty prompt (a list of token-id lists)")
    engine = as_engine(target)
    worst, where, count = 0.0, "", 0
    mismatches: list[str] = []
    for prompt, (ids, values) in zip(prompt_token_ids, engine.logprobs(prompt_token_ids, max_tokens)):
        ref, arg, best = _scores(model, ids)
        got = torch.tensor(values, dtype=torch.float32)
        if got.shape != ref.shape:
            raise VerifyError(f"engine returned {got.numel()} logprobs for {len(ids)} tokens")
        diff = (got - ref).abs()
        count += diff.numel()
        if diff.numel() and (float(diff.max()) > worst or not where or diff.isnan().any()):
            worst = float("nan") if diff.isnan().any() else max(worst, float(diff.max()))
            where = f"prompt of {len(prompt)} tokens, position {int(diff.nan_to_num(float('inf')).argmax()) + 1}"
        for t in range(len(prompt) - 1, len(ids) - 1):
            token = ids[t + 1]
            if int(arg[t]) != token and float(best[t] - ref[t]) > tie:
                mismatches.append(f"after {ids[:t + 1]}: engine chose {token}, trainer {int(arg[t])} "
                                  f"(logprob {float(best[t]):.4f} vs {float(ref[t]):.4f})")
    return Agreement(worst, where, count, tuple(mismatches))


def verify(
    target: Any,
    model: nn.Module,
    prompt_token_ids: Sequence[Sequence[int]],
    *,
    atol: float = 1e-4,
    max_tokens: int = 4,
) -> float:
    """Max |Δ logprob| between ``model`` and the engine over the prompts plus ``max_tokens`` greedy tokens.

    The engine generates greedily (with the synced adapter when it serves one) and reports the logprob of every
    prompt and generated token; the trainer scores the same ids. Raises :class:`~hwsync.errors.VerifyError` above
    ``atol`` or when a greedy token is not the trainer's choice, and :class:`~hwsync.errors.StaleEngineError` on a
    stale engine. Parameter equality is no evidence (engines repack weights); this compares what both compute.
    """
    a = agreement(target, model, prompt_token_ids, max_tokens=max_tokens, tie=2 * atol)
    hint = ("The engine does not serve the trainer's weights: check the sync strategy, the hwsync patches "
            "(`hwsync doctor`) and dtypes")
    if not a.max_abs_diff <= atol:  # also catches NaN
        raise VerifyError(f"engine and trainer disagree: max |Δ logprob| = {a.max_abs_diff:.3g} > atol {atol:g} "
                          f"({a.where}). {hint}")
    if a.greedy_mismatches:
        raise VerifyError(f"greedy tokens differ at {len(a.greedy_mismatches)} position(s), e.g. "
                          f"{a.greedy_mismatches[0]}. {hint}")
    return a.max_abs_diff
