"""What a trainer integration does at each weight sync, whatever the trainer: one home for ms-swift's and TRL's.

:class:`TrainerSync` holds one training run's side of the contract: :func:`hwsync.sync` (strategy, bucket size and
adapter identity from :class:`~hwsync.integrations.options.SyncOptions`), :func:`hwsync.verify`'s checks every
``verify_every`` syncs on the run's own prompts (the first rollout batch's), the rollout check (the logprobs the
engine sampled with against the trainer's, on the sampled tokens), and the JSONL records of
:mod:`hwsync.integrations.metrics`. A failed check raises :class:`~hwsync.common.errors.VerifyError`: training stops
rather than learn from rollouts of another policy. The trainer integration decides only *when* to call it and where its
numbers go in the trainer's own logs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from hwsync.common.errors import VerifyError
from hwsync.integrations.metrics import MetricsLog, format_summary, read_metrics
from hwsync.integrations.options import ENV, SyncOptions

__all__ = ["TrainerSync", "first_prompts"]

logger = logging.getLogger("hwsync")


class TrainerSync:
    """One run's syncs, checks and records (rank 0 writes the records; every rank syncs and checks)."""

    def __init__(
        self,
        options: SyncOptions,
        *,
        metrics_path: str | None = None,
        lora_name: str | None = None,
        lora_int_id: int | None = None,
        log: Callable[[str], None] = logger.info,
    ) -> None:
        self.options = options
        self.lora_name, self.lora_int_id = lora_name, lora_int_id
        self.log = log
        self.records = MetricsLog(metrics_path) if metrics_path else None
        self.syncs = 0
        self.probe: list[list[int]] | None = None
        """The check prompts (token ids), the same at every sync and on every rank; ``None`` until the first
        rollout supplied them (no check runs before that)."""
        self.gate: Any = None  # the logprob gate of the engine's device/dtype, known after the first sync
        self.spread: Any = None
        """The model's numerics spread (:class:`hwsync.verify.Spread`) from the last logprob check: a rollout gap is
        decisive only beyond it and the gate (``None``: the gate alone)."""
        self.checks = 0
        self.logprobs_owed = False
        """A due logprob check found vLLM's KV cache asleep (sleep mode): the next check runs it."""
        self.weak = 0
        """Checks and rollouts whose logprob gap was beyond the gate but within the model's numerics: logged."""
        self._probe_ref: list[torch.Tensor] | None = None
        self._rollout: tuple[float, int] | None = None  # (max |Δ|, tokens) of the current step's rollouts

    # ---------------------------------------------------------------------------------------------------- sync
    def sync(self, target: Any, model: nn.Module, step: int) -> tuple[Any, dict[str, Any]]:
        """Sync ``model`` into ``target`` (``None``: a rank of a sharded trainer whose rank 0 holds the engine), then
        check it when due. Returns the :class:`~hwsync.trainer.report.SyncReport` (``None`` on such ranks) and the
        numbers for the trainer's logs (``hwsync/sync_ms``, ``hwsync/sync_mb``, ``hwsync/verify_*_abs_dlogp``)."""
        from hwsync.trainer.api import sync as hwsync_sync
        from hwsync.trainer.verify import KV_ASLEEP, check, trainer_gate

        opts = self.options
        grad_mode = torch.is_grad_enabled()
        try:
            report = hwsync_sync(
                target,
                model,
                strategy=opts.strategy,
                bucket_mb=opts.bucket_mb,
                lora_name=self.lora_name,
                lora_int_id=self.lora_int_id,
            )
        finally:
            torch.set_grad_enabled(grad_mode)  # the next backward needs autograd exactly as the trainer left it
        self.syncs += 1
        if self.gate is None and target is not None:
            info = _describe(target)
            self.gate = opts.verify_gate or trainer_gate(info.device_type, info.dtype, model)
        verdict = shift = None
        verify_s = 0.0
        if opts.verify_every and self.syncs % opts.verify_every == 0 and self.probe:
            t0 = time.perf_counter()
            self.checks += 1
            every = opts.verify_logprobs_every
            with_logprobs = self.checks == 1 or self.logprobs_owed or bool(every and (self.checks - 1) % every == 0)
            # exact content checks every time: the adapter whole, the base in turns (BASE_ROUNDS); at the first
            # check and every N-th, the base whole and the check prompts' logprobs (+ the model's numerics spread):
            # the step's rollouts carry the logprob evidence in between. One prompt per engine call (vLLM 0.32's
            # LoRA prompt logprobs). Ranks without the engine run the same check on rank 0's answers.
            verdict = check(
                target,
                model,
                self.probe,
                gate=opts.verify_gate,
                atol=opts.verify_atol,
                batch=False,
                logprobs=with_logprobs,
                whole_base=with_logprobs,
                spread=with_logprobs or None,
            )
            if with_logprobs:
                if KV_ASLEEP in verdict.skipped:  # vLLM's KV cache slept through the sync: the next check tries again
                    self.logprobs_owed = True
                else:
                    self.logprobs_owed, self.spread = False, verdict.spread
                shift = self.policy_shift(model)
            verify_s = time.perf_counter() - t0
            a: Any = verdict.agreement
            for why in verdict.weak:
                self.weak += 1
                self.log(f"hwsync: weak evidence after sync v{report.version if report else '?'}: {why}")
            self.log(
                f"hwsync: verify after sync v{report.version if report else '?'}: "
                f"{'passed' if verdict.ok else 'FAILED'} "
                f"({'; '.join(f'{c.name} ok' if c.ok else f'{c.name} FAILED' for c in verdict.checks)})"
                + "".join(f"; logprobs: {c.detail}" for c in verdict.checks if c.name == "logprobs")
                + f" ({verify_s:.3f}s)"
            )
        if report is None:  # a rank without the engine: rank 0 records; the same verdict stops this rank too
            if verdict is not None and not verdict.ok:
                raise VerifyError(f"after the sync (step {step}; checked by rank 0's engine): {verdict.message()}")
            return None, {}
        a = verdict.agreement if verdict is not None and verdict.agreement.tokens else None
        record = dict(
            step=step,
            strategy=report.strategy,
            reason=report.reason,
            mode=report.mode,
            version=report.version,
            tensors=report.tensors,
            base_tensors=report.base_tensors,
            lora_tensors=report.lora_tensors,
            bytes=report.bytes,
            mb=report.bytes / 1e6,
            seconds=report.seconds,
            buckets=report.buckets,
            path=report.path,
            verify_max_abs_dlogp=a.max_abs_diff if a else None,
            verify_mean_abs_dlogp=a.mean_abs_diff if a else None,
            verify_ok=verdict.ok if verdict else None,
            verify_failed=[c.name for c in verdict.failed] if verdict else None,
            verify_skipped=list(verdict.skipped) if verdict else None,
            verify_tokens=a.tokens if a else 0,
            greedy_mismatches=len(a.greedy_mismatches) if a else 0,
            policy_shift=shift,
            verify_seconds=verify_s if verdict is not None else None,
            verify_weak=list(verdict.weak) if verdict else None,
            numerics_spread=self.spread.mean_abs if self.spread is not None else None,
        )
        if self.records is not None:
            self.records.write("sync", **record)
        self.log(report.line())
        numbers = {"hwsync/sync_mb": record["mb"], "hwsync/sync_ms": 1000 * report.seconds}
        if verdict is not None:
            numbers["hwsync/verify_ms"] = 1000 * verify_s
        if a is not None:
            numbers.update(
                {"hwsync/verify_max_abs_dlogp": a.max_abs_diff, "hwsync/verify_mean_abs_dlogp": a.mean_abs_diff}
            )
        if verdict is not None and not verdict.ok:
            where = f"after sync v{report.version} (step {step}, strategy {report.strategy})"
            raise VerifyError(
                f"{where}: rollouts would not come from the policy being trained. {verdict.message()}"
                f"\nAlso: `hwsync doctor` (patches, capabilities); {ENV['strategy']}=full does not "
                "depend on adapter routing"
            )
        return report, numbers

    def policy_shift(self, model: nn.Module) -> float:
        """Max |Δ logprob| of the trainer on the check prompts since the first sync (how far the policy moved)."""
        from hwsync.trainer.verify import token_logprobs

        now = [token_logprobs(model, ids) for ids in self.probe or []]
        if self._probe_ref is None:
            self._probe_ref = now
        return max((float((a - b).abs().max()) for a, b in zip(now, self._probe_ref) if a.numel()), default=0.0)

    # ---------------------------------------------------------------------------------------------------- rollouts
    def rollout_check(
        self,
        trainer_logps: torch.Tensor,
        engine_logps: torch.Tensor,
        mask: torch.Tensor,
        *,
        step: int,
        exact_sampling: bool,
    ) -> float | None:
        """Compare the logprobs the engine sampled with (``engine_logps``) with the trainer's on the same tokens
        (``mask``: the completion tokens); returns max |Δ| (``None`` without tokens). When the check is on and the
        sampling is the plain distribution (``exact_sampling``: no top-k / top-p / min-p / penalties, which
        renormalize vLLM's logprobs), a gap beyond the gate raises :class:`VerifyError`: the engine generated with
        other weights than the ones hwsync delivered (verify passed after the sync)."""
        mask = mask.bool()
        if not mask.any():
            return None
        d = (trainer_logps.detach().float() - engine_logps.detach().float()).abs()[mask].double()
        worst = float(d.max()) if not d.isnan().any() else float("nan")
        prev, count = self._rollout or (0.0, 0)
        self._rollout = (max(prev, worst) if worst == worst else worst, count + int(mask.sum()))
        gap = self._rollout_gap(d, worst)
        if self.options.verify_every and gap and exact_sampling:
            message = (
                f"step {step}: the engine sampled this step's rollouts with logprobs away from the trainer's "
                f"({gap}) although hwsync.verify passed after the sync: the trainer did not generate with the "
                f"weights/adapter hwsync delivered. Run `hwsync doctor`; {ENV['strategy']}=full does not "
                "depend on adapter routing"
            )
            if self.records is not None:
                self.records.write("error", step=step, message=message)
            raise VerifyError(message)
        return worst

    def _rollout_gap(self, d: torch.Tensor, worst: float) -> str:
        """Why the sampled tokens' logprobs are too far from the trainer's ("" when they are not): max |Δ| above
        HWSYNC_VERIFY_ATOL when set; else the mean / 90th percentile of |Δ| above the platform's gate **and** above
        :data:`hwsync.verify.NUMERICS_FACTOR` times the model's numerics spread (the last logprob check's). Beyond
        the gate alone is weak evidence: logged with its numbers, counted in :attr:`weak`."""
        from hwsync.trainer.verify import NUMERICS_FACTOR, spread_ratio

        atol = self.options.verify_atol
        if atol is not None:
            return "" if worst <= atol else f"max |Δ| {worst:.3g} > {ENV['verify_atol']}={atol:g}"
        if self.gate is None:
            return ""
        mean = float(d.mean())
        p90 = float(torch.quantile(d, 0.9)) if d.numel() > 1 else float(d.max())
        if mean <= self.gate.mean_abs and p90 <= self.gate.p90_abs:
            return ""
        gap = f"mean |Δ| {mean:.3g} (gate {self.gate.mean_abs:g}), p90 {p90:.3g} (gate {self.gate.p90_abs:g})"
        spread = self.spread if self.options.verify_gate is None else None
        if spread is not None:
            k = NUMERICS_FACTOR
            if spread_ratio(mean, p90, spread) <= 1.0:  # NaN: beyond it
                self.weak += 1
                self.log(
                    f"hwsync: weak evidence in this step's rollouts: {gap}, within {k:g}x the model's own "
                    f"numerics spread (mean {spread.mean_abs:.3g}, p90 {spread.p90_abs:.3g}): not evidence of "
                    "another policy at this depth"
                )
                return ""
            gap += f", beyond {k:g}x the model's numerics spread (mean {spread.mean_abs:.3g}, p90 {spread.p90_abs:.3g})"
        return gap

    @property
    def rollout_max_abs_dlogp(self) -> float | None:
        """The largest rollout |Δ| of the current step so far (``None`` before any rollout)."""
        return None if self._rollout is None else self._rollout[0]

    def step_done(self, step: int, **fields: Any) -> None:
        """Record one logged optimizer step (``reward``, ``reward_std``, ``loss``, ...) with its rollout check."""
        if self.records is not None:
            worst, count = self._rollout or (None, 0)
            self.records.write("step", step=step, **fields, rollout_max_abs_dlogp=worst, rollout_tokens=count)
        self._rollout = None

    def summary(self) -> str | None:
        """The per-step table of the run (also recorded as a ``summary`` record); ``None`` without records."""
        if self.records is None or not self.records.path.exists():
            return None
        text = format_summary(read_metrics(self.records.path))
        self.records.write("summary", text=text)
        return text


def _describe(target: Any) -> Any:
    from hwsync.trainer.api import as_engine

    return as_engine(target).describe()


def first_prompts(prompts: Sequence[Sequence[int]], count: int) -> list[list[int]]:
    """The first ``count`` distinct prompts of more than one token (the check prompts of a run)."""
    probe: list[list[int]] = []
    for ids in prompts:
        ids = [int(t) for t in ids]
        if len(ids) > 1 and ids not in probe:
            probe.append(ids)
        if len(probe) >= count:
            break
    return probe
