"""ms-swift's ``GRPOTrainer`` with the trainer -> vLLM weight sync done by :func:`hwsync.sync`.

ms-swift picks its trainer class from ``TrainerFactory.TRAINER_MAPPING`` (see :mod:`hwsync.swift`), so hwsync
plugs in as an ordinary subclass: one method of ms-swift's rollout mixin is overridden
(``_move_model_to_vllm``, the single entry point of its full / adapter sync paths) and two are extended to
observe the run (``_fast_infer`` to pick the verification prompts, ``_compute_rollout_offpolicy_metrics`` to
measure the engine against the trainer on the tokens it really sampled). Everything else — rollouts, rewards,
the GRPO/GSPO loss, sleep/wake, async generation — is ms-swift's own code.
"""
from __future__ import annotations

import os
import time
from typing import Any

import torch

from swift.rlhf_trainers.grpo_trainer import GRPOTrainer
from swift.rlhf_trainers.utils import VLLM_LORA_INT_ID as SWIFT_LORA_INT_ID
from swift.rlhf_trainers.utils import VLLM_LORA_NAME as SWIFT_LORA_NAME
from swift.rlhf_trainers.utils import profiling_context
from swift.utils import get_logger

import hwsync
from hwsync.api import sync as hwsync_sync
from hwsync.verify import check as verify_check
from hwsync.verify import gate_for, token_logprobs
from hwsync.errors import VerifyError
from hwsync.errors import OptionError, UnsupportedSetupError
from hwsync.swift._metrics import MetricsLog, format_summary, read_metrics
from hwsync.swift._options import ENV, SwiftOptions

__all__ = ["HwsyncGRPOTrainer"]

logger = get_logger()


class HwsyncGRPOTrainer(GRPOTrainer):
    """``swift rlhf --rlhf_type grpo`` (GRPO, GSPO, ...) whose vLLM weight sync goes through hwsync."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.hwsync_options = SwiftOptions.from_env()
        super().__init__(*args, **kwargs)
        self._hwsync_target: Any = None
        self._hwsync_syncs = 0
        self._hwsync_probe: list[list[int]] | None = None
        self._hwsync_probe_ref: list[torch.Tensor] | None = None
        self._hwsync_rollout: tuple[float, int] | None = None
        self._hwsync_gate: Any = None  # the logprob gate of the engine's device/dtype, known after the first sync
        self._hwsync_log: MetricsLog | None = None
        if self.args.use_vllm:
            self._hwsync_check_setup()
            if self.accelerator.is_main_process:
                path = self.hwsync_options.metrics_path or os.path.join(self.args.output_dir, "hwsync_metrics.jsonl")
                self._hwsync_log = MetricsLog(path)
            # ms-swift only compares its rollout logprobs with the trainer's when asked; hwsync always wants to know
            self.log_rollout_offpolicy_metrics = True
            logger.info(f"hwsync: weight sync by hwsync {hwsync.__version__} ({self.hwsync_options}); "
                        f"metrics -> {self._hwsync_log.path if self._hwsync_log else '(rank 0)'}")

    # ------------------------------------------------------------------------------------------------ setup
    def _hwsync_check_setup(self) -> None:
        """Refuse, before the first rollout, the setups whose weights hwsync would read or write wrongly."""
        args = self.args
        if self.is_fsdp_enabled and not self._is_fsdp2:
            raise UnsupportedSetupError(
                "FSDP1 (flat parameters) is not read by hwsync: use FSDP2 (fsdp_version 2: hwsync gathers its "
                "DTensor parameters bucket by bucket), DeepSpeed ZeRO-3, or DDP / ZeRO-1/2")
        if args.sleep_level == 2:
            raise UnsupportedSetupError(
                "--sleep_level 2 makes vLLM discard its weights behind hwsync's back (hwsync sends base weights once "
                "and then only what changes): use --sleep_level 1 or 0")
        if self.hwsync_options.strategy in ("adapter", "hybrid") and not self.rollout_enable_lora:
            raise OptionError(
                f"{ENV['strategy']}={self.hwsync_options.strategy} needs an engine that serves LoRA: add "
                "--vllm_enable_lora true (and --tuner_type lora), or use HWSYNC_STRATEGY=auto/full")
        if self.vllm_mode == "server":
            self.hwsync_options.server_credentials()  # both HWSYNC_SERVER and HWSYNC_TOKEN, or a clear error

    def _hwsync_engine(self) -> Any:
        """The sync target: ms-swift's in-process vLLM engine (colocate) or hwsync's server in ``swift rollout``."""
        if self._hwsync_target is None and self.vllm_mode == "server":
            from hwsync.swift._server import connect_to_rollout_engine

            self._hwsync_target = connect_to_rollout_engine(self.hwsync_options)
        elif self._hwsync_target is None:
            from hwsync.api import as_engine
            from hwsync.swift._engine_view import LLMEngineView

            self._hwsync_target = as_engine(LLMEngineView.of(self.engine.engine))
        return self._hwsync_target

    # ------------------------------------------------------------------------------------------------ sync
    def _move_model_to_vllm(self, skip_async_check: bool = False) -> None:
        """Make the rollout engine serve the current policy (replaces ms-swift's full/adapter sync paths)."""
        if self.args.async_generate and not skip_async_check:
            self._wait_queue()
        # server mode: the engine(s) fed by rank 0 (DDP ranks hold the same weights); the other ranks wait for it in
        # ms-swift's rollout gather -- or, with a sharded trainer (FSDP2 / ZeRO-3), take part in its gathers and in
        # the check after it (rank 0 alone queries the engine). Colocate: every rank feeds its own engine (or its
        # own worker of a tensor-parallel engine).
        if self.vllm_mode == "colocate" or self.accelerator.is_main_process or _sharded(self):
            with profiling_context(self, "hwsync_sync"):
                self._hwsync_sync()
        self._reset_vllm_cache()

    def _hwsync_sync(self) -> None:
        opts = self.hwsync_options
        model = self.accelerator.unwrap_model(self.model)
        # None: a rank of a sharded trainer in server mode without the engine (rank 0 holds it)
        target = self._hwsync_engine() if self.vllm_mode == "colocate" or self.accelerator.is_main_process else None
        grad_mode = torch.is_grad_enabled()
        try:
            report = hwsync_sync(target, model, strategy=opts.strategy, bucket_mb=opts.bucket_mb,
                                 lora_name=SWIFT_LORA_NAME, lora_int_id=SWIFT_LORA_INT_ID)
        finally:
            torch.set_grad_enabled(grad_mode)  # the next backward needs autograd exactly as the trainer left it
        self._hwsync_syncs += 1
        if self._hwsync_gate is None and target is not None:
            info = target.describe()
            self._hwsync_gate = opts.verify_gate or gate_for(info.device_type, info.dtype)
        delta = shift = verdict = None
        tokens, mismatches = 0, []
        if opts.verify_every and self._hwsync_syncs % opts.verify_every == 0 and self._hwsync_probe:
            t0 = time.perf_counter()
            # hwsync.verify: exact content fingerprints + this platform's logprob gate (+ the strict max |Δ| check
            # when HWSYNC_VERIFY_ATOL is set); one prompt per engine call (vLLM 0.32's LoRA prompt logprobs)
            # (ranks without the engine: the same check, rank 0's answers -- and without a gate of their own the
            # platform's, from the engine rank 0 describes: the same gate)
            verdict = verify_check(target, model, self._hwsync_probe, gate=self._hwsync_gate or opts.verify_gate,
                                   atol=opts.verify_atol, batch=False)
            a = verdict.agreement
            delta, tokens, mismatches = a.max_abs_diff, a.tokens, list(a.greedy_mismatches)
            shift = self._hwsync_policy_shift(model)
            logger.info(f"hwsync: verify after sync v{report.version if report else '?'}: "
                        f"{'passed' if verdict.ok else 'FAILED'} "
                        f"({'; '.join(f'{c.name} ok' if c.ok else f'{c.name} FAILED' for c in verdict.checks)}); "
                        f"mean |Δ logprob| {a.mean_abs_diff:.2e}, max {delta:.2e} over {tokens} tokens "
                        f"({time.perf_counter() - t0:.2f}s)")
        if report is None:  # a rank without the engine: rank 0 records and reports; the same verdict stops it too
            if verdict is not None and not verdict.ok:
                raise VerifyError(f"after the sync (step {self.state.global_step}; checked by rank 0's engine): "
                                  f"{verdict.message()}")
            return
        record = dict(step=self.state.global_step, strategy=report.strategy, reason=report.reason, mode=report.mode,
                      version=report.version, tensors=report.tensors, base_tensors=report.base_tensors,
                      lora_tensors=report.lora_tensors, bytes=report.bytes, mb=report.bytes / 1e6,
                      seconds=report.seconds, buckets=report.buckets, verify_max_abs_dlogp=delta,
                      verify_mean_abs_dlogp=verdict.agreement.mean_abs_diff if verdict else None,
                      verify_ok=verdict.ok if verdict else None,
                      verify_failed=[c.name for c in verdict.failed] if verdict else None,
                      verify_skipped=list(verdict.skipped) if verdict else None,
                      verify_tokens=tokens, greedy_mismatches=len(mismatches), policy_shift=shift)
        if self._hwsync_log is not None:
            self._hwsync_log.write("sync", **record)
        logger.info(report.line())
        metrics = self._metrics["train"]
        metrics["hwsync/sync_mb"].append(record["mb"])
        metrics["hwsync/sync_ms"].append(1000 * report.seconds)
        if verdict is not None:
            metrics["hwsync/verify_max_abs_dlogp"].append(delta)
            metrics["hwsync/verify_mean_abs_dlogp"].append(verdict.agreement.mean_abs_diff)
            if not verdict.ok:
                where = f"after sync v{report.version} (step {self.state.global_step}, strategy {report.strategy})"
                raise VerifyError(f"{where}: rollouts would not come from the policy being trained. "
                                  f"{verdict.message()}\nAlso: `hwsync doctor` (patches, capabilities); "
                                  "HWSYNC_STRATEGY=full does not depend on adapter routing")

    def _hwsync_policy_shift(self, model: torch.nn.Module) -> float:
        """Max |Δ logprob| of the trainer on the check prompts since the first sync (how far the policy moved)."""
        now = [token_logprobs(model, ids) for ids in self._hwsync_probe or []]
        if self._hwsync_probe_ref is None:
            self._hwsync_probe_ref = now
        return max((float((a - b).abs().max()) for a, b in zip(now, self._hwsync_probe_ref) if a.numel()),
                   default=0.0)

    # ------------------------------------------------------------------------------------------------ observe
    def _fast_infer(self, samples: list[Any]) -> list[Any]:
        if self._hwsync_probe is None:
            self._hwsync_probe = self._same_on_every_rank(self._hwsync_prompt_ids(samples))
        return super()._fast_infer(samples)

    def _same_on_every_rank(self, probe: list[list[int]]) -> list[list[int]]:
        """Rank 0's check prompts on every rank (every rank calls this at its first rollout). The ranks of one
        tensor-parallel engine must generate the same prompts, and a sharded trainer's forward (FSDP2 / ZeRO-3)
        runs on every rank at once, also in server mode, so each rank's check must score the same prompts."""
        from hwsync.gather import rank0_value

        return list(rank0_value(probe)) if self.vllm_mode == "colocate" or _sharded(self) else probe

    def _hwsync_prompt_ids(self, samples: list[Any]) -> list[list[int]]:
        """Token ids of the first distinct prompts, as the chat template renders them for generation."""
        tokenizer = self.template.tokenizer
        probe: list[list[int]] = []
        for sample in samples:
            messages = [m for m in getattr(sample, "messages", []) if m.get("role") != "assistant"]
            if not messages:
                continue
            try:
                text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception:  # noqa: BLE001 - a tokenizer without a chat template: score the raw text
                text = "\n".join(str(m.get("content", "")) for m in messages)
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            if len(ids) > 1 and ids not in probe:
                probe.append(ids)
            if len(probe) >= self.hwsync_options.verify_prompts:
                break
        return probe

    def _compute_rollout_offpolicy_metrics(self, old_per_token_logps: torch.Tensor,
                                           rollout_per_token_logps: torch.Tensor,
                                           completion_mask: torch.Tensor) -> dict[str, Any]:
        """Also: the largest |Δ logprob| between what the engine sampled with and what the trainer computes."""
        mask = completion_mask.bool()
        if mask.any():
            diff = float((old_per_token_logps.detach() - rollout_per_token_logps).abs()[mask].max())
            worst, count = self._hwsync_rollout or (0.0, 0)
            self._hwsync_rollout = (max(worst, diff), count + int(mask.sum()))
            opts = self.hwsync_options
            gap = self._hwsync_rollout_gap(old_per_token_logps.detach(), rollout_per_token_logps, mask, diff)
            if opts.verify_every and gap and self._hwsync_sampling_is_exact():
                message = (
                    f"step {self.state.global_step + 1}: the engine sampled this step's rollouts with logprobs "
                    f"away from the trainer's ({gap}) although hwsync.verify passed after the sync: ms-swift did "
                    "not generate with the weights/adapter hwsync delivered. Run `hwsync doctor`; "
                    "HWSYNC_STRATEGY=full does not depend on adapter routing")
                if self._hwsync_log is not None:
                    self._hwsync_log.write("error", step=self.state.global_step + 1, message=message)
                raise VerifyError(message)
        return super()._compute_rollout_offpolicy_metrics(old_per_token_logps, rollout_per_token_logps,
                                                          completion_mask)

    def _hwsync_rollout_gap(self, old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, worst: float) -> str:
        """Why the sampled tokens' logprobs are too far from the trainer's ("" when they are not): max |Δ| above
        HWSYNC_VERIFY_ATOL when set, else the mean / 90th percentile of |Δ| above the platform's gate."""
        opts = self.hwsync_options
        if opts.verify_atol is not None:
            atol = opts.verify_atol
            return "" if worst <= atol else f"max |Δ| {worst:.3g} > {ENV['verify_atol']}={atol:g}"
        gate = self._hwsync_gate
        if gate is None:
            return ""
        d = (old - rollout).abs()[mask].double()
        mean, p90 = float(d.mean()), float(torch.quantile(d, 0.9)) if d.numel() > 1 else float(d.max())
        if not (mean <= gate.mean_abs and p90 <= gate.p90_abs):  # NaN included
            return f"mean |Δ| {mean:.3g} (gate {gate.mean_abs:g}), p90 {p90:.3g} (gate {gate.p90_abs:g})"
        return ""

    def _hwsync_sampling_is_exact(self) -> bool:
        """Whether vLLM's sampled-token logprobs are the plain (temperature-scaled) distribution the trainer
        computes; top-k / top-p / min-p / repetition penalties renormalize them, so a gap there is expected."""
        args = self.args
        return (args.top_k in (None, -1, 0) and args.top_p in (None, 1.0) and not args.min_p
                and args.repetition_penalty in (None, 1.0))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._hwsync_rollout is not None:
            self._metrics["train"]["hwsync/rollout_max_abs_dlogp"].append(self._hwsync_rollout[0])
        super().log(logs, start_time)
        if "loss" not in logs:  # not a training-step log (evaluation, the end-of-training summary)
            return
        if self._hwsync_log is not None:
            worst, count = self._hwsync_rollout or (None, 0)
            # reward is logged on steps that generated (with --steps_per_generation N, every N-th step)
            self._hwsync_log.write("step", step=self.state.global_step, reward=logs.get("reward"),
                                   reward_std=logs.get("reward_std"), loss=logs.get("loss"),
                                   rollout_max_abs_dlogp=worst, rollout_tokens=count)
        self._hwsync_rollout = None

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:
            if self._hwsync_log is not None and self._hwsync_log.path.exists():
                text = format_summary(read_metrics(self._hwsync_log.path))
                self._hwsync_log.write("summary", text=text)
                logger.info("hwsync summary\n" + text)


def _sharded(trainer: Any) -> bool:
    """FSDP2 or DeepSpeed ZeRO-3: every rank takes part in each sync's gathers (:mod:`hwsync.gather`)."""
    return bool(trainer._is_fsdp2 or (trainer.is_deepspeed_enabled and _zero3()))


def _zero3() -> bool:
    try:
        from transformers.integrations import is_deepspeed_zero3_enabled
    except ImportError:  # pragma: no cover - transformers without DeepSpeed integration
        return False
    return bool(is_deepspeed_zero3_enabled())
