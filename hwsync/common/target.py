"""The sync target, whatever and wherever it is: the :class:`Engine` interface :func:`hwsync.sync` talks to.

* :class:`hwsync.engine.vllm.local.LocalEngine` wraps an in-process ``vllm.LLM`` (colocate): buckets are Python lists of
  the trainer's own tensors handed to the worker by reference (no serialization, no extra copy).
* :class:`hwsync.trainer.client.RemoteEngine` (from :func:`hwsync.connect`) talks to an engine in other processes.

Both expose the same small surface, so ``sync`` / ``verify`` do not care where the engine lives. One handle exists
per engine (:func:`hwsync.trainer.api.as_engine` caches it on the ``LLM``), and its lock serializes syncs with
generation.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from torch import Tensor

from hwsync.common.errors import StaleEngineError
from hwsync.common.wire import EngineInfo, Manifest

__all__ = ["Engine", "EngineQueries", "Generating", "IN_MEMORY_LORA", "ProgressFn"]

IN_MEMORY_LORA = "hwsync-in-memory://"
"""Path prefix of the ``LoRARequest`` hwsync reports: the adapter lives in the engine's memory only, so vLLM cannot load
it again once evicted (:func:`hwsync.engine.vllm.worker.receiver_of` makes that one clear error)."""

ProgressFn = Callable[[int, int], None]
"""``progress(bucket_index, num_buckets)``, called after a bucket is ready and before it is handed over; raising
aborts the sync (the engine keeps its previous adapter, or turns stale if base weights were being written)."""


class EngineQueries(abc.ABC):
    """What every handle on an engine answers: its description, its sync state and greedy logprobs -- all
    :func:`hwsync.verify` asks. Views that only check an engine (one engine of several, rank 0's engine as a sharded
    trainer's other ranks see it, the engine process's own surface) are this and no more."""

    mode: str = "colocate"

    def __init__(self) -> None:
        self.lock = threading.RLock()
        """Held by every sync and every generation through this handle: one at a time per engine."""
        self.plans: dict[str, Any] = {}
        """Trainer-side sync plans per model (:mod:`hwsync.trainer.api`): a steady-state sync skips planning, and
        :func:`hwsync.verify` reads what was last synced."""
        self.checks: dict[str, Any] = {}
        """What :func:`hwsync.verify` keeps between checks of this handle (its reference payload, the base it read)."""

    @abc.abstractmethod
    def describe(self, lora_paths: Sequence[str] = (), base: Mapping[str, Sequence[int]] | None = None) -> EngineInfo:
        """What the engine serves, whether it can serve LoRA on ``lora_paths``, and which of the trainer's ``base``
        tensors (name -> shape) it keeps in a wider dtype than its model dtype (:attr:`EngineInfo.kept_dtypes`)."""

    @abc.abstractmethod
    def state(self) -> dict[str, Any]:
        """The receiver's state (:class:`hwsync.common.wire.ReceiverState` as a dict)."""

    @abc.abstractmethod
    def logprobs(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
        """Greedy-generate ``max_tokens`` per prompt; return (prompt+completion ids, logprob of each id after the
        first) as the engine computed them. Refuses on a stale engine."""

    def check_servable(self) -> None:
        """Raise :class:`~hwsync.common.errors.StaleEngineError` while the engine holds a partially applied sync."""
        st = self.state()
        if st.get("stale"):
            raise StaleEngineError(
                f"engine is stale: {st.get('last_error') or 'an interrupted sync left part of the weights written'}. "
                "Run a complete hwsync.sync(...) before generating"
            )

    @property
    def lora_request(self) -> Any:
        """``LoRARequest`` for the adapter the engine currently serves (``None`` when it serves merged weights)."""
        st = self.state()
        if st.get("lora_int_id") is None:
            return None
        try:
            from vllm.lora.request import LoRARequest
        except ImportError:  # a trainer process without vLLM (server mode): nothing to generate with here
            return None

        return LoRARequest(st["lora_name"], st["lora_int_id"], f"{IN_MEMORY_LORA}{st['lora_name']}")


class Engine(EngineQueries):
    """A sync target: a handle :func:`hwsync.sync` sends through (:func:`hwsync.trainer.api.as_engine`)."""

    @abc.abstractmethod
    def send(
        self, manifest: Manifest, produce: Callable[[], Iterator[Tensor]], progress: ProgressFn | None
    ) -> dict[str, Any]:
        """Send ``manifest``, have it validated, then stream the tensors; returns the receiver's summary."""

    def warm(self, manifest: Manifest) -> None:
        """Have ``manifest`` (a next sync's) validated now where that costs no round trip of its own (colocated):
        after a first sync that carried the base, the steady plan's validation is then not paid by the second sync.
        Default: nothing (the sync validates it)."""
        return None


class Generating(abc.ABC):
    """A handle that generates in this process (an in-process ``vllm.LLM``): :func:`hwsync.generate` through it waits
    for a sync in progress and refuses on a stale engine. A handle on an engine in another process does not."""

    @abc.abstractmethod
    def generate(self, prompts: Any, sampling_params: Any = None, **kwargs: Any) -> Any:
        """``LLM.generate`` with the synced adapter; refuses on a stale engine, waits for a sync in progress."""
