"""TRL's vLLM backend (``GRPOTrainer.vllm_generation``) with hwsync's weight sync and the synced adapter.

TRL calls two things of its backend on the training path: ``sync_weights()`` before generating whenever the
optimizer step changed, and ``generate(...)``. :class:`HwsyncGeneration` wraps TRL's own
``VLLMGeneration`` (everything else -- sampling parameters, prompt gathering across ranks, tensor-parallel slices,
logprob extraction -- stays TRL's code) and changes exactly those two:

* ``sync_weights`` is :meth:`hwsync.trl.GRPOTrainer.hwsync_sync` (:func:`hwsync.sync`, then the checks);
* generation uses the adapter hwsync installed: colocate, TRL's ``llm`` is seen through :class:`ServedLLM`
  (``LLM.generate`` through :func:`hwsync.generate`: the synced ``LoRARequest``, waits for a sync in progress,
  refuses on a stale engine); server mode, TRL's client asks vLLM's server for the adapter by name.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["HwsyncGeneration", "ServedLLM"]


class ServedLLM:
    """A colocated ``vllm.LLM`` whose ``generate`` goes through :func:`hwsync.generate`; all else is the LLM's."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def generate(self, prompts: Any, sampling_params: Any = None, **kwargs: Any) -> Any:
        from hwsync.api import generate

        return generate(self.llm, prompts, sampling_params, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.llm, name)


class HwsyncGeneration:
    """TRL's ``VLLMGeneration`` with ``sync_weights`` replaced by ``sync`` (an object TRL accepts in its place)."""

    def __init__(self, trl_generation: Any, sync: Callable[[], Any]) -> None:
        self.__dict__["inner"] = trl_generation
        self.__dict__["_sync"] = sync
        llm = getattr(trl_generation, "llm", None)
        if llm is not None and not isinstance(llm, ServedLLM):
            trl_generation.llm = ServedLLM(llm)

    @property
    def engine(self) -> Any:
        """The colocated ``vllm.LLM`` (``None`` in server mode)."""
        llm = getattr(self.inner, "llm", None)
        return llm.llm if isinstance(llm, ServedLLM) else llm

    def sync_weights(self) -> None:
        """Make the rollout engine serve the trainer's current policy (hwsync; TRL calls this before generating)."""
        self._sync()

    def serve_adapter(self, name: str | None) -> None:
        """Server mode: generate with the adapter vLLM's server serves under ``name`` (``None``: the base model)."""
        client = getattr(self.inner, "vllm_client", None)
        if client is None:
            return
        base = self.__dict__.setdefault("_base_model_name", client.model)
        client.model = name or base

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.inner, name, value)


def prompt_ids_of(args: Sequence[Any], kwargs: dict[str, Any]) -> list[list[int]]:
    """The prompt token ids of a ``GRPOTrainer._generate_single_turn(prompt_ids, ...)`` call."""
    ids = kwargs.get("prompt_ids", args[0] if args else None)
    return [list(p) for p in ids or []]
