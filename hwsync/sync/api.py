"""``hwsync.sync`` and ``hwsync.verify``: the two calls a trainer makes after each optimizer step."""
from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hwsync.errors import SyncError, VerifyError
from hwsync.sync.engine import ProgressFn, as_engine
from hwsync.sync.manifest import Manifest, plan_buckets
from hwsync.sync.payload import build_payload, choose, lora_paths, read_lora
from hwsync.sync.report import SyncReport

__all__ = ["sync", "verify", "agreement", "Agreement", "default_bucket_mb", "BUCKET_ENV"]

BUCKET_ENV = "HWSYNC_BUCKET_MB"
# Measured with benchmarks/bench_sync.py (vLLM CPU build, 105 MB fp32 MoE, server mode over gloo/loopback, 2 shared
# cores, two runs): a full sync takes 0.40-0.52 s for any bucket size from 1 to 256 MB -- flat within noise, because
# vLLM's reload, not the transfer, dominates on CPU. 64 MB keeps per-bucket overhead negligible with two receive
# buffers in flight. On GPUs (NCCL) buckets of 512 MB-1 GB reach link speed (verl: 2048 MB, ms-swift: 512 MB, vLLM's
# native transfer: 1 GB x 2): 512 MB, to be re-measured with bench_sync.py on the target cluster.
_DEFAULT_MB = {"cpu": 64, "cuda": 512, "npu": 512}


def default_bucket_mb(device_type: str = "cpu") -> float:
    """Bucket size used when ``bucket_mb`` is not given: ``$HWSYNC_BUCKET_MB`` or the measured per-device default."""
    env = os.environ.get(BUCKET_ENV)
    if env:
        try:
            return float(env)
        except ValueError:
            raise SyncError(f"{BUCKET_ENV}={env!r} is not a number of megabytes") from None
    return float(_DEFAULT_MB.get(device_type, 512))


def sync(
    target: Any,
    model: nn.Module,
    *,
    strategy: str = "auto",
    bucket_mb: float | None = None,
    version: int | None = None,
    progress: ProgressFn | None = None,
    lora_name: str | None = None,
    lora_int_id: int | None = None,
) -> SyncReport:
    """Make ``target`` serve ``model``'s current weights; return what was sent.

    ``target`` is an in-process ``vllm.LLM`` (colocate) or a handle from :func:`hwsync.connect` (server mode).
    ``model`` is a transformers model, PEFT-wrapped or not. ``strategy`` is ``"auto"``, ``"full"``, ``"adapter"``
    or ``"hybrid"`` (see :mod:`hwsync.sync.payload`); auto asks the engine what it can serve and the report says
    why. ``version`` must increase strictly (default: the engine's version + 1). The engine validates the whole
    manifest before writing anything; see :mod:`hwsync.sync.receiver` for what an interrupted sync leaves behind.
    ``progress(bucket, num_buckets)`` is called before each bucket is handed over (raising aborts the sync).
    ``lora_name``/``lora_int_id`` install the adapter under a framework's own identity (ms-swift: ``swift_lora``/111)
    instead of hwsync's default; the report's ``lora_request`` carries it.
    """
    engine = as_engine(target)
    t0 = time.perf_counter()
    info = engine.describe()
    lora = read_lora(model, info)
    if lora is not None and not isinstance(lora, Exception) and info.lora_enabled:
        info = engine.describe(lora_paths(lora.tensors))
    chosen, reason, unservable = choose(strategy, lora, info)
    payload = build_payload(model, chosen, reason, lora if chosen != "full" else None, unservable, info)  # type: ignore[arg-type]
    mb = default_bucket_mb(info.device_type) if bucket_mb is None else bucket_mb
    if mb <= 0:
        raise SyncError(f"bucket_mb must be positive, got {mb}")
    buckets = plan_buckets(payload.specs, max(1, int(mb * (1 << 20))))
    manifest = Manifest(
        version=info.version + 1 if version is None else int(version),
        strategy=chosen,
        specs=tuple(payload.specs),
        buckets=buckets,
        lora_config=payload.lora_config,
        lora_base_names=dict(payload.lora_base_names),
        base_key=payload.base_key,
        lora_name=lora_name,
        lora_int_id=lora_int_id,
    )
    engine.apply(manifest, payload.produce, progress)
    report = SyncReport(
        strategy=chosen,
        tensors=len(manifest.specs),
        bytes=manifest.nbytes,
        seconds=time.perf_counter() - t0,
        buckets=len(buckets),
        version=manifest.version,
        reason=payload.reason,
        mode=engine.mode,
        base_tensors=len(manifest.base_specs),
        lora_tensors=len(manifest.lora_specs),
        lora_request=engine.lora_request if manifest.lora_specs or chosen != "full" else None,
    )
    report.log()
    return report


def trainer_logprobs(model: nn.Module, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Under ``model`` (eval, no grad, fp32 softmax): for t >= 1 the logprob of ``ids[t]`` given ``ids[:t]``, the
    argmax token there, and its logprob."""
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
        ref, arg, best = trainer_logprobs(model, ids)
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
