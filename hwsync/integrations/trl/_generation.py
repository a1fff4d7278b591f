"""TRL's vLLM backend (``GRPOTrainer.vllm_generation``) with hwsync's weight sync and the synced adapter.

TRL calls two things of its backend on the training path: ``sync_weights()`` before generating whenever the
optimizer step changed, and ``generate(...)``. :class:`HwsyncGeneration` wraps TRL's own
``VLLMGeneration`` (everything else -- sampling parameters, prompt gathering across ranks, tensor-parallel slices,
logprob extraction -- stays TRL's code) and changes exactly those two:

* ``sync_weights`` is :meth:`hwsync.trl.GRPOTrainer.hwsync_sync` (:func:`hwsync.sync`, then the checks), after
  waking the weights where TRL runs vLLM in sleep mode (``vllm_enable_sleep_mode=True``: level 2);
* generation uses the adapter hwsync installed: colocate, TRL's ``llm`` is seen through :class:`ServedLLM`
  (``LLM.generate`` through :func:`hwsync.generate`: the synced ``LoRARequest``, waits for a sync in progress,
  refuses on a stale engine); server mode, TRL's client asks vLLM's server for the adapter by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["HwsyncGeneration", "ServedLLM"]


class ServedLLM:
    """A colocated ``vllm.LLM`` whose ``generate`` goes through :func:`hwsync.generate`; all else is the LLM's, but
    TRL's ``collective_rpc("reload_weights")`` after a wake (its sleep-mode workaround for vllm#29341, which would
    reload the checkpoint from disk over the trainer's weights and drop the adapter) is hwsync's refill instead:
    ``refill()`` where vLLM discarded the weights since the last sync, nothing otherwise."""

    def __init__(self, llm: Any, refill: Callable[[], Any] | None = None) -> None:
        self.llm = llm
        self.refill = refill

    def generate(self, prompts: Any, sampling_params: Any = None, **kwargs: Any) -> Any:
        from hwsync.trainer.api import generate

        return generate(self.llm, prompts, sampling_params, **kwargs)

    def collective_rpc(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        if method != "reload_weights" or args or kwargs:
            return self.llm.collective_rpc(method, *args, **kwargs)
        from hwsync.trainer.api import as_engine

        state = as_engine(self.llm).state()
        if state.get("refill") and self.refill is not None:
            self.refill()
        return [None]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.llm, name)


class HwsyncGeneration:
    """TRL's ``VLLMGeneration`` with ``sync_weights`` replaced by ``sync`` (an object TRL accepts in its place)."""

    def __init__(self, trl_generation: Any, sync: Callable[[], Any]) -> None:
        self.__dict__["inner"] = trl_generation
        self.__dict__["_sync"] = sync
        llm = getattr(trl_generation, "llm", None)
        if llm is not None and not isinstance(llm, ServedLLM):
            trl_generation.llm = ServedLLM(llm, sync)
        # TRL 1.16's generate() re-pushes the weights itself after a level-2 sleep (``self.sync_weights()`` when
        # ``_llm_weights_sleeping``): that call is hwsync's sync too, never TRL's merge-and-load_weights
        trl_generation.__dict__["sync_weights"] = self.sync_weights

    @property
    def engine(self) -> Any:
        """The colocated ``vllm.LLM`` (``None`` in server mode)."""
        llm = getattr(self.inner, "llm", None)
        return llm.llm if isinstance(llm, ServedLLM) else llm

    def sync_weights(self) -> None:
        """Make the rollout engine serve the trainer's current policy (hwsync; TRL calls this before generating).
        With sleep mode the weights are woken first, as TRL's own ``sync_weights`` does (after a level-2 sleep the
        sync refills them)."""
        inner = self.inner
        if getattr(inner, "mode", None) == "colocate" and getattr(inner, "enable_sleep_mode", False):
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self.engine.wake_up(tags=["weights"])
        self._sync()
        if "_llm_weights_sleeping" in vars(inner):  # TRL's own record that the weights need pushing: they are pushed
            inner._llm_weights_sleeping = False

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
