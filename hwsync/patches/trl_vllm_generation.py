"""TRL 1.16: let hwsync's GRPO trainer choose how TRL builds its vLLM backend (LoRA serving, no NCCL group).

``GRPOTrainer.__init__`` builds ``trl.generation.vllm_generation.VLLMGeneration``, whose ``_init_vllm`` creates the
rollout backend with no way to pass engine arguments:

* colocate: ``LLM(model=..., ...)`` without ``enable_lora``, so the engine cannot serve the trainer's adapter and
  every weight sync has to merge it into full weights (TRL's own ``sync_weights`` merges, pushes every parameter,
  unmerges); a 4-bit (QLoRA) trainer gets a bitsandbytes engine that in-memory weights cannot be written into;
* server: ``VLLMClient.init_communicator`` joins vLLM's NCCL weight-transfer group at once (on a machine without
  CUDA it raises ``NotImplementedError``), though hwsync moves the weights over its own link.

While :class:`hwsync.trl.GRPOTrainer` builds its parent (``with engine_settings(...)``, this patch scoped around
it), ``LLM`` receives hwsync's engine settings on top of TRL's arguments (``enable_lora``, ``max_lora_rank``,
``quantization=None`` for a 4-bit trainer, the user's ``engine_kwargs``), and ``init_communicator`` does nothing.
Outside that block both behave exactly as TRL's own, and the patch is removed again when the block ends.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

from ._base import APPLIES, NOT_NEEDED, Patch, ProbeResult, register

__all__ = ["TrlVllmGenerationPatch", "engine_settings"]

_LLM = "trl.generation.vllm_generation:LLM"
_COMMUNICATOR = "trl.generation.vllm_client:VLLMClient.init_communicator"

_SETTINGS: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar("hwsync_trl_engine", default=None)


@contextlib.contextmanager
def engine_settings(settings: Mapping[str, Any]) -> Iterator[None]:
    """For the block: TRL's colocated ``LLM(...)`` gets ``settings`` on top of its own arguments, and its server
    client joins no weight-transfer group (with the patch installed: ``with patches.get("trl_vllm_generation")``)."""
    token = _SETTINGS.set(dict(settings))
    try:
        yield
    finally:
        _SETTINGS.reset(token)


class TrlVllmGenerationPatch(Patch):
    name = "trl_vllm_generation"
    targets = (_LLM, _COMMUNICATOR)
    upstream = "https://github.com/huggingface/trl/blob/v1.16.0/trl/generation/vllm_generation.py"
    seen_in = ("trl 1.16.0",)
    remove_when = (
        "TRL lets a trainer pass vLLM engine arguments (enable_lora, max_lora_rank, ...) to "
        "VLLMGeneration and skip its weight-transfer group, e.g. with adapter sync (trl#5188)"
    )
    opt_in = True  # held by hwsync.trl.GRPOTrainer around its construction only

    def check(self) -> ProbeResult:
        from trl.generation.vllm_generation import VLLMGeneration

        try:
            source = inspect.getsource(VLLMGeneration._init_vllm)
        except (OSError, TypeError):
            source = ""
        if "LLM(" not in source:
            return ProbeResult(
                NOT_NEEDED,
                "VLLMGeneration._init_vllm no longer builds vllm.LLM itself: check how "
                "TRL builds its engine now and retire this patch",
            )
        if "enable_lora" in source:
            return ProbeResult(
                NOT_NEEDED,
                "TRL builds its colocated engine with enable_lora: pass hwsync's settings "
                "through TRL and retire this patch",
            )
        return ProbeResult(
            APPLIES,
            "TRL builds its colocated vLLM engine without LoRA serving (its sync merges the "
            "adapter into every weight) and its server client joins vLLM's NCCL "
            "weight-transfer group (CUDA only)",
        )

    def replacement(self, original: Any, target: str) -> Any:
        if target == _LLM:
            return self._llm(original)
        return self._communicator(original)

    @staticmethod
    def _llm(original: Any) -> Any:
        @functools.wraps(original, updated=())
        def LLM(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 - stands in for the class TRL calls
            settings = _SETTINGS.get()
            return original(*args, **{**kwargs, **settings}) if settings is not None else original(*args, **kwargs)

        return LLM

    @staticmethod
    def _communicator(original: Any) -> Any:
        @functools.wraps(original)
        def init_communicator(client: Any, *args: Any, **kwargs: Any) -> None:
            if _SETTINGS.get() is None:
                return original(client, *args, **kwargs)
            return None  # hwsync syncs over its own link (hwsync.connect): no vLLM weight-transfer group

        return init_communicator


register(TrlVllmGenerationPatch())
