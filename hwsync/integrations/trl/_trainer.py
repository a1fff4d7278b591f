"""TRL's ``GRPOTrainer`` with the trainer -> vLLM weight sync done by :func:`hwsync.sync`.

A subclass, so everything a GRPO/GSPO run does -- rollouts, rewards, the loss, importance sampling, logging -- is
TRL's own code. What changes:

* **construction**: TRL builds its vLLM backend with hwsync's engine settings (colocate: ``enable_lora`` and a
  ``max_lora_rank`` that fits the trainer's adapter, ``quantization=None`` for a 4-bit trainer, ``engine_kwargs``;
  server: no vLLM NCCL weight-transfer group), through the scoped patch ``trl_vllm_generation`` (TRL 1.16 has no
  argument for either); then ``self.vllm_generation`` becomes
  :class:`~hwsync.integrations.trl._generation.HwsyncGeneration`;
* **sync**: ``vllm_generation.sync_weights()`` (TRL calls it before generating when the step changed) is
  :meth:`GRPOTrainer.hwsync_sync`: :class:`hwsync.integrations.trainer_sync.TrainerSync` -- :func:`hwsync.sync`
  (strategy ``auto``: adapter-only where the engine serves LoRA on every adapted module, experts included; ``hybrid``
  where it serves it on some; ``full`` without LoRA) and :func:`hwsync.verify` every ``verify_every`` syncs on the run's
  first prompts, a failed check stopping training;
* **observation**: the first rollout's prompts become the check prompts (``_generate_single_turn``); the logprobs
  vLLM sampled with are checked against the trainer's on the same tokens (``_generate_and_score_completions``,
  from TRL's own importance-sampling inputs); ``hwsync/*`` numbers join TRL's logs; per-sync and per-step records
  go to ``hwsync_metrics.jsonl`` (:mod:`hwsync.integrations.metrics`) and a summary table is logged at the end.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Mapping
from typing import Any

import trl

from hwsync.common.errors import OptionError, UnsupportedSetupError
from hwsync.common.version import __version__
from hwsync.integrations.options import ENV, SyncOptions
from hwsync.integrations.trainer_sync import TrainerSync, first_prompts
from hwsync.integrations.trl._generation import HwsyncGeneration, prompt_ids_of

__all__ = ["GRPOTrainer", "TRL_SERVER", "engine_settings_for", "lora_rank_for_vllm"]

logger = logging.getLogger("hwsync.trl")

TRL_SERVER = ("vllm_mode='server'", "`trl vllm-serve` (or `vllm serve`) and the trainer", "vLLM's --port")
"""How :meth:`SyncOptions.server_credentials` names TRL's server-mode setup in its error."""

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts."""


class GRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` (GRPO, GSPO, ...) whose vLLM weight sync goes through hwsync.

    Takes TRL's arguments, plus ``hwsync_options`` (default: :meth:`SyncOptions.from_env`, the ``HWSYNC_*``
    variables) and ``engine_kwargs``: more ``vllm.LLM`` arguments for the colocated engine (e.g.
    ``enforce_eager=True``); they win over TRL's and hwsync's."""

    def __init__(
        self,
        *args: Any,
        hwsync_options: SyncOptions | None = None,
        engine_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        import hwsync.patches as patches

        self.hwsync_options = hwsync_options if hwsync_options is not None else SyncOptions.from_env()
        bound = inspect.signature(trl.GRPOTrainer.__init__).bind(self, *args, **kwargs).arguments
        config = bound.get("args")
        if config is not None and config.use_vllm:
            _check_config(config, self.hwsync_options)
        settings = engine_settings_for(
            bound.get("model"),
            bound.get("peft_config"),
            bound.get("quantization_config"),
            self.hwsync_options,
            engine_kwargs,
        )
        from hwsync.patches.trl_vllm_generation import engine_settings

        with engine_settings(settings), patches.get("trl_vllm_generation").scoped():
            super().__init__(*args, **kwargs)
        self._hwsync_target: Any = None
        path = None
        if self.use_vllm:
            _check_engine(self, settings)
            self.vllm_generation: Any = HwsyncGeneration(self.vllm_generation, self.hwsync_sync)
            if self.accelerator.is_main_process:
                path = self.hwsync_options.metrics_path or os.path.join(self.args.output_dir, "hwsync_metrics.jsonl")
        self._hwsync = TrainerSync(self.hwsync_options, metrics_path=path, log=logger.info)
        if self.use_vllm:
            logger.info(
                f"hwsync: weight sync by hwsync {__version__} ({self.hwsync_options}); metrics -> {path or '(rank 0)'}"
            )

    # ------------------------------------------------------------------------------------------------ sync
    def hwsync_sync(self) -> None:
        """Make the rollout engine serve the current policy: what ``vllm_generation.sync_weights()`` does now.

        Colocate: every rank feeds its own engine (or its worker of a tensor-parallel engine). Server: rank 0 feeds
        hwsync's sync server in the vLLM server process; with a sharded trainer (FSDP2 / ZeRO-3) every rank takes
        part in the gathers and the check, other ranks have nothing to do (TRL's rollouts come from rank 0)."""
        colocate = self.vllm_mode == "colocate"
        main = self.accelerator.is_main_process
        if not (colocate or main or _sharded(self)):
            return
        model = self.accelerator.unwrap_model(self.model)
        target = self._hwsync_engine() if colocate or main else None
        report, numbers = self._hwsync.sync(target, model, self.state.global_step)
        for name, value in numbers.items():
            self._metrics["train"][name].append(value)
        if not colocate and report is not None:
            self.vllm_generation.serve_adapter(report.lora_request.lora_name if report.lora_request else None)

    def _hwsync_engine(self) -> Any:
        """The sync target: TRL's colocated ``vllm.LLM``, or hwsync's server in the vLLM server process."""
        if self._hwsync_target is None:
            if self.vllm_mode == "server":
                from hwsync.trainer.client import connect

                _, token = self.hwsync_options.server_credentials(*TRL_SERVER)
                self._hwsync_target = connect(self.hwsync_options.servers, token)
            else:
                self._hwsync_target = self.vllm_generation.engine
        return self._hwsync_target

    # ------------------------------------------------------------------------------------------------ observe
    def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
        if self.use_vllm and self._hwsync.probe is None:
            probe = first_prompts(prompt_ids_of(args, kwargs), self.hwsync_options.verify_prompts)
            self._hwsync.probe = self._same_on_every_rank(probe)
        return super()._generate_single_turn(*args, **kwargs)

    def _same_on_every_rank(self, probe: list[list[int]]) -> list[list[int]]:
        """Rank 0's check prompts on every rank: the ranks of one tensor-parallel engine generate the same prompts,
        and a sharded trainer's forward runs on every rank at once (server mode too)."""
        from hwsync.common.gather import rank0_value

        if self.accelerator.num_processes > 1 and (self.vllm_mode == "colocate" or _sharded(self)):
            return list(rank0_value(probe))
        return probe

    def _generate_and_score_completions(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Also: the logprobs vLLM sampled with against the trainer's on the same tokens (TRL computes both for its
        importance-sampling correction), checked by :meth:`TrainerSync.rollout_check`."""
        output = super()._generate_and_score_completions(*args, **kwargs)
        trainer_logps, engine_logps = output.get("old_per_token_logps"), output.get("sampling_per_token_logps")
        if self.use_vllm and self.model.training and trainer_logps is not None and engine_logps is not None:
            mask = output["completion_mask"]
            if output.get("tool_mask") is not None:
                mask = mask * output["tool_mask"]
            self._hwsync.rollout_check(
                trainer_logps,
                engine_logps,
                mask.bool() & ~engine_logps.isnan(),
                step=self.state.global_step + 1,
                exact_sampling=self._exact_sampling(),
            )
        return output

    def _exact_sampling(self) -> bool:
        """Whether vLLM's sampled-token logprobs are the plain (temperature-scaled) distribution the trainer
        computes; top-k / top-p / min-p / penalties renormalize them, so a gap there is expected."""
        extra = self.args.generation_kwargs or {}
        penalties = any(
            extra.get(k) not in (None, 0, 0.0, 1, 1.0)
            for k in ("frequency_penalty", "presence_penalty", "repetition_penalty", "top_k", "top_p", "min_p")
        )
        return (
            self.top_k in (None, -1, 0)
            and self.top_p in (None, 1.0)
            and not self.min_p
            and self.repetition_penalty in (None, 1.0)
            and not penalties
        )

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._hwsync.rollout_max_abs_dlogp is not None:
            self._metrics["train"]["hwsync/rollout_max_abs_dlogp"].append(self._hwsync.rollout_max_abs_dlogp)
        super().log(logs, start_time)
        logged = self.state.log_history[-1] if self.state.log_history else {}
        if "loss" not in logged:  # not a training-step log (evaluation, the end-of-training summary)
            return
        # reward is logged on steps that generated (with steps_per_generation N, every N-th step)
        self._hwsync.step_done(
            self.state.global_step,
            reward=logged.get("reward"),
            reward_std=logged.get("reward_std"),
            loss=logged.get("loss"),
        )

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:
            text = self._hwsync.summary()
            if text:
                logger.info("hwsync summary\n" + text)


# ---------------------------------------------------------------------------------------------------- setup
def _check_config(config: Any, options: SyncOptions) -> None:
    """Refuse, before any engine is built, the setups whose weights hwsync would read or write wrongly."""
    if config.vllm_mode == "server":
        options.server_credentials(*TRL_SERVER)  # HWSYNC_SERVER and HWSYNC_TOKEN, or a clear error
    elif config.vllm_mode != "colocate":
        return  # TRL names the valid modes itself


def _check_engine(trainer: GRPOTrainer, settings: Mapping[str, Any]) -> None:
    """After construction: FSDP1 is refused; a colocated engine that was meant to serve LoRA does (TRL built it
    through the ``trl_vllm_generation`` patch), else one error naming the TRL version."""
    if trainer.is_fsdp_enabled and getattr(trainer._dist, "fsdp_version", None) == 1:
        raise UnsupportedSetupError(
            "FSDP1 (flat parameters) is not read by hwsync: use FSDP2 (fsdp_version: 2; hwsync gathers its DTensor "
            "parameters bucket by bucket), DeepSpeed ZeRO-3, or DDP / ZeRO-1/2"
        )
    if trainer.vllm_mode != "colocate" or not settings.get("enable_lora"):
        return
    llm = trainer.vllm_generation.llm
    if getattr(llm.llm_engine.vllm_config, "lora_config", None) is None:
        raise UnsupportedSetupError(
            f"TRL {trl.__version__} built its colocated vLLM engine without LoRA serving although hwsync asked for it "
            "(patch trl_vllm_generation: see `hwsync doctor`); hwsync.trl is made for trl 1.16. Set "
            f"{ENV['strategy']}=full to sync merged weights into this engine"
        )


def lora_rank_for_vllm(peft_config: Any) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds every rank of ``peft_config`` (``rank_pattern`` too)."""
    ranks = [
        int(getattr(peft_config, "r", 0) or 0),
        *(int(r) for r in (getattr(peft_config, "rank_pattern", None) or {}).values()),
    ]
    need = max(ranks)
    for allowed in VLLM_LORA_RANKS:
        if allowed >= need:
            return allowed
    raise OptionError(f"LoRA rank {need} is above the largest max_lora_rank vLLM serves ({VLLM_LORA_RANKS[-1]})")


def engine_settings_for(
    model: Any,
    peft_config: Any,
    quantization_config: Any,
    options: SyncOptions,
    engine_kwargs: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The arguments hwsync adds to TRL's ``vllm.LLM(...)`` (colocate): LoRA serving sized for the trainer's
    adapter unless the strategy is ``full``; no bitsandbytes engine for a 4-bit trainer (hwsync sends the
    dequantized base once, then the adapter: vLLM takes no in-memory weights into a bitsandbytes engine); then
    ``engine_kwargs``."""
    settings: dict[str, Any] = {}
    config = peft_config
    if config is None and hasattr(model, "peft_config"):  # a PeftModel
        config = next(iter(model.peft_config.values()), None)
    if config is not None and options.strategy != "full":
        settings.update(enable_lora=True, max_lora_rank=lora_rank_for_vllm(config), max_loras=1)
    if _four_bit(model, quantization_config):
        settings["quantization"] = None
    settings.update(engine_kwargs or {})
    return settings


def _four_bit(model: Any, quantization_config: Any) -> bool:
    if quantization_config is not None and getattr(quantization_config, "load_in_4bit", False):
        return True
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if isinstance(config, Mapping):
        return bool(config.get("load_in_4bit"))
    return bool(getattr(config, "load_in_4bit", False))


def _sharded(trainer: Any) -> bool:
    """FSDP2 or DeepSpeed ZeRO-3: every rank takes part in each sync's gathers (:mod:`hwsync.common.gather`)."""
    if trainer.is_fsdp_enabled:
        return getattr(trainer._dist, "fsdp_version", None) == 2
    if not trainer.is_deepspeed_enabled:
        return False
    try:
        from transformers.integrations import is_deepspeed_zero3_enabled
    except ImportError:  # pragma: no cover - transformers without DeepSpeed integration
        return False
    return bool(is_deepspeed_zero3_enabled())
