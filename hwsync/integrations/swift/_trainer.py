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
from typing import Any

import torch
from swift.rlhf_trainers.grpo_trainer import GRPOTrainer
from swift.rlhf_trainers.utils import VLLM_LORA_INT_ID as SWIFT_LORA_INT_ID
from swift.rlhf_trainers.utils import VLLM_LORA_NAME as SWIFT_LORA_NAME
from swift.rlhf_trainers.utils import profiling_context
from swift.utils import get_logger

from hwsync.common.errors import OptionError, UnsupportedSetupError
from hwsync.common.version import __version__
from hwsync.integrations.options import ENV
from hwsync.integrations.swift._options import SWIFT_SERVER, SwiftOptions
from hwsync.integrations.trainer_sync import TrainerSync, first_prompts

__all__ = ["HwsyncGRPOTrainer"]

logger = get_logger()


class HwsyncGRPOTrainer(GRPOTrainer):
    """``swift rlhf --rlhf_type grpo`` (GRPO, GSPO, ...) whose vLLM weight sync goes through hwsync."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.hwsync_options = SwiftOptions.from_env()
        super().__init__(*args, **kwargs)
        self._hwsync_target: Any = None
        path = None
        if self.args.use_vllm:
            self._hwsync_check_setup()
            if self.accelerator.is_main_process:
                path = self.hwsync_options.metrics_path or os.path.join(self.args.output_dir, "hwsync_metrics.jsonl")
            # ms-swift only compares its rollout logprobs with the trainer's when asked; hwsync always wants to know
            self.log_rollout_offpolicy_metrics = True
        # the sync, the checks after it and the records: hwsync.integrations.trainer_sync, shared with the TRL
        # integration
        self._hwsync = TrainerSync(
            self.hwsync_options,
            metrics_path=path,
            lora_name=SWIFT_LORA_NAME,
            lora_int_id=SWIFT_LORA_INT_ID,
            log=logger.info,
        )
        if self.args.use_vllm:
            logger.info(
                f"hwsync: weight sync by hwsync {__version__} ({self.hwsync_options}); metrics -> {path or '(rank 0)'}"
            )

    # ------------------------------------------------------------------------------------------------ setup
    def _hwsync_check_setup(self) -> None:
        """Refuse, before the first rollout, the setups whose weights hwsync would read or write wrongly."""
        if self.is_fsdp_enabled and not self._is_fsdp2:
            raise UnsupportedSetupError(
                "FSDP1 (flat parameters) is not read by hwsync: use FSDP2 (fsdp_version 2: hwsync gathers its "
                "DTensor parameters bucket by bucket), DeepSpeed ZeRO-3, or DDP / ZeRO-1/2"
            )
        if self.hwsync_options.strategy in ("adapter", "hybrid") and not self.rollout_enable_lora:
            raise OptionError(
                f"{ENV['strategy']}={self.hwsync_options.strategy} needs an engine that serves LoRA: add "
                "--vllm_enable_lora true (and --tuner_type lora), or use HWSYNC_STRATEGY=auto/full"
            )
        if self.vllm_mode == "server":
            self.hwsync_options.server_credentials(*SWIFT_SERVER)  # HWSYNC_SERVER and HWSYNC_TOKEN, or a clear error

    def _hwsync_engine(self) -> Any:
        """The sync target: ms-swift's in-process vLLM engine (colocate) or hwsync's server in ``swift rollout``."""
        if self._hwsync_target is None and self.vllm_mode == "server":
            from hwsync.integrations.swift._server import connect_to_rollout_engine

            self._hwsync_target = connect_to_rollout_engine(self.hwsync_options)
        elif self._hwsync_target is None:
            from hwsync.integrations.swift._engine_view import LLMEngineView
            from hwsync.trainer.api import as_engine

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
        model = self.accelerator.unwrap_model(self.model)
        # None: a rank of a sharded trainer in server mode without the engine (rank 0 holds it)
        target = self._hwsync_engine() if self.vllm_mode == "colocate" or self.accelerator.is_main_process else None
        _, numbers = self._hwsync.sync(target, model, self.state.global_step)
        for name, value in numbers.items():
            self._metrics["train"][name].append(value)

    # ------------------------------------------------------------------------------------------------ observe
    def _fast_infer(self, samples: list[Any]) -> list[Any]:
        if self._hwsync.probe is None:
            self._hwsync.probe = self._same_on_every_rank(self._hwsync_prompt_ids(samples))
        return super()._fast_infer(samples)

    def _same_on_every_rank(self, probe: list[list[int]]) -> list[list[int]]:
        """Rank 0's check prompts on every rank (every rank calls this at its first rollout). The ranks of one
        tensor-parallel engine must generate the same prompts, and a sharded trainer's forward (FSDP2 / ZeRO-3)
        runs on every rank at once, also in server mode, so each rank's check must score the same prompts."""
        from hwsync.common.gather import rank0_value

        return list(rank0_value(probe)) if self.vllm_mode == "colocate" or _sharded(self) else probe

    def _hwsync_prompt_ids(self, samples: list[Any]) -> list[list[int]]:
        """Token ids of the first distinct prompts, as the chat template renders them for generation."""
        tokenizer = self.template.tokenizer
        rendered: list[list[int]] = []
        for sample in samples:
            messages = [m for m in getattr(sample, "messages", []) if m.get("role") != "assistant"]
            if not messages:
                continue
            try:
                text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception:  # noqa: BLE001 - a tokenizer without a chat template: score the raw text
                text = "\n".join(str(m.get("content", "")) for m in messages)
            rendered.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
        return first_prompts(rendered, self.hwsync_options.verify_prompts)

    def _compute_rollout_offpolicy_metrics(
        self, old_per_token_logps: torch.Tensor, rollout_per_token_logps: torch.Tensor, completion_mask: torch.Tensor
    ) -> dict[str, Any]:
        """Also: the engine's sampled logprobs against the trainer's, checked (:meth:`TrainerSync.rollout_check`)."""
        self._hwsync.rollout_check(
            old_per_token_logps,
            rollout_per_token_logps,
            completion_mask,
            step=self.state.global_step + 1,
            exact_sampling=self._hwsync_sampling_is_exact(),
        )
        return super()._compute_rollout_offpolicy_metrics(old_per_token_logps, rollout_per_token_logps, completion_mask)

    def _hwsync_sampling_is_exact(self) -> bool:
        """Whether vLLM's sampled-token logprobs are the plain (temperature-scaled) distribution the trainer
        computes; top-k / top-p / min-p / repetition penalties renormalize them, so a gap there is expected."""
        args = self.args
        return (
            args.top_k in (None, -1, 0)
            and args.top_p in (None, 1.0)
            and not args.min_p
            and args.repetition_penalty in (None, 1.0)
        )

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._hwsync.rollout_max_abs_dlogp is not None:
            self._metrics["train"]["hwsync/rollout_max_abs_dlogp"].append(self._hwsync.rollout_max_abs_dlogp)
        super().log(logs, start_time)
        if "loss" not in logs:  # not a training-step log (evaluation, the end-of-training summary)
            return
        # reward is logged on steps that generated (with --steps_per_generation N, every N-th step)
        self._hwsync.step_done(
            self.state.global_step, reward=logs.get("reward"), reward_std=logs.get("reward_std"), loss=logs.get("loss")
        )

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:
            text = self._hwsync.summary()
            if text:
                logger.info("hwsync summary\n" + text)


def _sharded(trainer: Any) -> bool:
    """FSDP2 or DeepSpeed ZeRO-3: every rank takes part in each sync's gathers (:mod:`hwsync.common.gather`)."""
    return bool(trainer._is_fsdp2 or (trainer.is_deepspeed_enabled and _zero3()))


def _zero3() -> bool:
    try:
        from transformers.integrations import is_deepspeed_zero3_enabled
    except ImportError:  # pragma: no cover - transformers without DeepSpeed integration
        return False
    return bool(is_deepspeed_zero3_enabled())
