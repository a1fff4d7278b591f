"""Receiver handles: what :func:`hwsync.sync` talks to.

* :class:`LocalEngine` wraps an in-process ``vllm.LLM`` (colocate). Buckets are Python lists of the trainer's own
  tensors handed to the worker by reference (``collective_rpc`` in-process): no serialization, no extra copy; the
  engine's weight loaders do the single copy (and dtype cast) into its storage.
* :class:`hwsync.sync.remote.RemoteEngine` (from :func:`hwsync.connect`) talks to an engine in another process.

Both expose the same small surface (:class:`Engine`), so ``sync``/``verify`` do not care where the engine lives.
"""
from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch import Tensor

from hwsync.errors import StaleEngineError, SyncError
from hwsync.sync.manifest import Manifest
from hwsync.sync.payload import EngineInfo

__all__ = ["Engine", "LocalEngine", "as_engine", "ProgressFn"]

ProgressFn = Callable[[int, int], None]
"""``progress(bucket_index, num_buckets)``, called after a bucket is ready and before it is handed over; raising
aborts the sync (the engine keeps its previous adapter, or turns stale if base weights were being written)."""


class Engine(abc.ABC):
    """A sync target."""

    mode: str = "colocate"

    def __init__(self) -> None:
        self._static: dict[str, Any] | None = None

    @abc.abstractmethod
    def _describe(self, lora_paths: Sequence[str]) -> dict[str, Any]: ...

    @abc.abstractmethod
    def apply(self, manifest: Manifest, produce: Callable[[], Iterator[Tensor]],
              progress: ProgressFn | None) -> dict[str, Any]:
        """Send ``manifest``, have it validated, then stream the tensors; returns the receiver's summary."""

    @abc.abstractmethod
    def logprobs(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
        """Greedy-generate ``max_tokens`` per prompt; return (prompt+completion ids, logprob of each id after the
        first) as the engine computed them. Refuses on a stale engine."""

    @abc.abstractmethod
    def state(self) -> dict[str, Any]: ...

    def describe(self, lora_paths: Sequence[str] = ()) -> EngineInfo:
        return EngineInfo.from_dict(self._describe(list(lora_paths)))

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

        return LoRARequest(st["lora_name"], st["lora_int_id"], f"hwsync-in-memory://{st['lora_name']}")


def bucket_lists(manifest: Manifest, produce: Callable[[], Iterator[Tensor]],
                 progress: ProgressFn | None) -> Iterator[list[Tensor]]:
    """Group the producer's tensors (spec order) into the manifest's buckets (entry order), lazily."""
    it = produce()
    pending: dict[int, Tensor] = {}
    nxt = 0
    n = len(manifest.buckets)
    for bucket in manifest.buckets:
        hi = max(bucket.entries) if bucket.entries else nxt - 1
        while nxt <= hi:
            t = next(it)
            spec = manifest.specs[nxt]
            if tuple(t.shape) != spec.shape:
                raise SyncError(f"{spec.name}: produced shape {tuple(t.shape)} differs from the manifest {spec.shape}")
            pending[nxt] = t
            nxt += 1
        tensors = [pending.pop(i) for i in bucket.entries]
        if progress is not None:
            progress(bucket.index, n)
        yield tensors


class _RpcCall:
    """Calls a :class:`~hwsync.vllm_ext.HwsyncWorkerExtension` method on a worker that may not have it mixed in."""

    def __init__(self, method: str) -> None:
        self.method = method

    def __call__(self, worker: Any, *args: Any) -> Any:
        from hwsync.vllm_ext import HwsyncWorkerExtension

        return getattr(HwsyncWorkerExtension, self.method)(worker, *args)


class LocalEngine(Engine):
    """An in-process ``vllm.LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one worker)."""

    mode = "colocate"

    def __init__(self, llm: Any) -> None:
        super().__init__()
        self.llm = llm
        executor = getattr(getattr(llm, "llm_engine", None), "model_executor", None)
        if executor is None or not hasattr(executor, "driver_worker"):
            raise SyncError(
                "colocated sync needs the engine in this process: create the LLM with "
                "VLLM_ENABLE_V1_MULTIPROCESSING=0 and one worker, or run the engine as a server "
                "(hwsync.sync.serve on its side, hwsync.connect(address, token) here)"
            )
        self.lock = threading.RLock()

    def rpc(self, method: str, *args: Any) -> Any:
        extension = getattr(self.llm.llm_engine.vllm_config.parallel_config, "worker_extension_cls", "") or ""
        target: Any = method if extension.endswith("HwsyncWorkerExtension") else _RpcCall(method)
        return self.llm.collective_rpc(target, args=args)[0]

    def _describe(self, lora_paths: Sequence[str]) -> dict[str, Any]:
        return self.rpc("hwsync_describe", list(lora_paths))

    def state(self) -> dict[str, Any]:
        return self.rpc("hwsync_state")

    def apply(self, manifest: Manifest, produce: Callable[[], Iterator[Tensor]],
              progress: ProgressFn | None) -> dict[str, Any]:
        with self.lock:
            self.rpc("hwsync_prepare", manifest)
            try:
                return self.rpc("hwsync_receive", manifest, bucket_lists(manifest, produce, progress))
            finally:
                # KV computed with old weights (or an adapter id whose weights changed) must not be reused
                self.llm.reset_prefix_cache()

    def check_servable(self) -> None:
        st = self.state()
        if st.get("stale"):
            raise StaleEngineError(
                f"engine is stale: {st.get('last_error') or 'an interrupted sync'} left part of the weights written. "
                "Run a complete hwsync.sync(...) before generating"
            )

    def generate(self, prompts: Any, sampling_params: Any = None, **kwargs: Any) -> Any:
        """``LLM.generate`` that refuses on a stale engine and uses the synced adapter when one is served."""
        with self.lock:
            self.check_servable()
            kwargs.setdefault("lora_request", self.lora_request)
            kwargs.setdefault("use_tqdm", False)
            return self.llm.generate(prompts, sampling_params, **kwargs)

    def logprobs(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, prompt_logprobs=0,
                                detokenize=False)
        outs = self.generate([{"prompt_token_ids": list(p)} for p in prompts], params)
        result = []
        for out in outs:
            comp = out.outputs[0]
            ids = list(out.prompt_token_ids) + list(comp.token_ids)
            vals = [pos[tok].logprob for pos, tok in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
            vals += [pos[tok].logprob for pos, tok in zip(comp.logprobs, comp.token_ids)]
            result.append((ids, vals))
        return result


def as_engine(target: Any) -> Engine:
    """The handle for ``target``: an :class:`Engine` as is, an in-process ``vllm.LLM`` wrapped once (cached)."""
    if isinstance(target, Engine):
        return target
    if hasattr(target, "llm_engine") and hasattr(target, "collective_rpc"):
        handle = target.__dict__.get("_hwsync_engine")
        if handle is None:
            handle = LocalEngine(target)
            target.__dict__["_hwsync_engine"] = handle
        return handle
    raise SyncError(
        f"cannot sync into a {type(target).__name__}: pass an in-process vllm.LLM (colocate) or the handle "
        "returned by hwsync.connect(address, token) (server mode)"
    )
