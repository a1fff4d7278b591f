"""The :class:`~hwsync.common.target.Engine` handle on a ``vllm.LLM`` whose driver runs in this process.

Colocate: the engine's worker runs in this process too (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, or ms-swift's
external-launcher engines: one worker per trainer rank), so buckets are Python lists of the trainer's own tensors
handed over by reference: no serialization and no copy beyond the one into the engine's storage.

Server mode (:mod:`hwsync.server`): the same handle drives every worker of the engine, in-process or not (tensor
parallel), through ``collective_rpc``; their buckets arrive over the data plane.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from torch import Tensor

from hwsync.common import foreign
from hwsync.common.capabilities import check_vllm_supported
from hwsync.common.errors import SyncError, decode_error
from hwsync.common.target import Engine, Generating, ProgressFn
from hwsync.common.transport.base import LinkSpec
from hwsync.common.transport.buckets import bucket_lists
from hwsync.common.wire import EngineInfo, Manifest
from hwsync.engine.vllm import worker

__all__ = ["LocalEngine", "local_engine"]


def _shapes(base: Mapping[str, Sequence[int]] | None) -> dict[str, list[int]] | None:
    return None if base is None else {str(n): [int(d) for d in s] for n, s in base.items()}


class LocalEngine(Engine, Generating):
    """A ``vllm.LLM`` (or anything with its ``llm_engine`` / ``collective_rpc`` surface) driven from here."""

    mode = "colocate"

    def __init__(self, llm: Any) -> None:
        super().__init__()
        self.llm = llm
        if getattr(llm, "llm_engine", None) is None:
            raise SyncError(f"{type(llm).__name__} is not an in-process vLLM engine (no llm_engine)")
        check_vllm_supported()  # one clear error before anything touches vLLM internals

    @property
    def in_process(self) -> bool:
        """Whether this process holds the (single) worker, so buckets can be handed over by reference."""
        executor = getattr(self.llm.llm_engine, "model_executor", None)
        return executor is not None and hasattr(executor, "driver_worker")

    def rpc_all(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(worker, *args)`` on every worker (functions of :mod:`hwsync.engine.vllm.worker`), results in rank order.
        Every worker answers before anything is raised (:func:`hwsync.engine.vllm.worker.answered`); then the first
        failure in rank order is raised, with its hwsync error type."""
        replies = list(self.llm.collective_rpc(worker.answered, args=(self.in_process, fn, *args)))
        for status, value in replies:
            if status != "ok":
                raise value if isinstance(value, BaseException) else decode_error(value)
        return [value for _, value in replies]

    def rpc(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.rpc_all(fn, *args)[0]

    def describe(self, lora_paths: Sequence[str] = (), base: Mapping[str, Sequence[int]] | None = None) -> EngineInfo:
        return EngineInfo.from_dict(self.rpc(worker.describe, list(lora_paths), _shapes(base)))

    def state(self) -> dict[str, Any]:
        """The receiver's state, and what of the engine sleeps (``asleep``: vLLM's sleep tags; while any is left its
        scheduler is paused and nothing generates)."""
        from hwsync.engine.vllm.sleep import engine_asleep

        return {**self.rpc(worker.state), "asleep": list(engine_asleep(self.llm))}

    def prepare(self, manifest: Manifest) -> None:
        """Validate ``manifest`` on every worker (nothing is written)."""
        self.rpc_all(worker.prepare, manifest.to_json())

    def warm(self, manifest: Manifest) -> None:
        self.prepare(manifest)

    def receive_remote(
        self, manifest: Manifest, spec: LinkSpec, first_rank: int, secret: bytes, abort_key: str
    ) -> dict[str, Any]:
        """Every worker joins the data plane ``spec`` and receives the buckets the trainer broadcasts; then vLLM's
        prefix cache is reset (:meth:`committed`)."""
        return self.committed(
            manifest,
            lambda: self.rpc_all(
                worker.receive_remote, manifest.to_json(), spec.__dict__, first_rank, secret, abort_key
            )[0],
        )

    def fingerprints(self, request: dict[str, Any]) -> dict[str, Any] | None:
        """Content fingerprints of what the worker's kernels read (:mod:`hwsync.engine.vllm.fingerprint`); ``None`` with
        several workers (each holds a shard: not compared with the trainer's whole tensors yet)."""
        from hwsync.engine.vllm.fingerprint import fingerprints

        with self.lock:
            results = self.rpc_all(fingerprints, request)
        return results[0] if len(results) == 1 else None

    def compare(self, request: dict[str, Any]) -> dict[str, Any] | None:
        """The colocated content check (:func:`hwsync.engine.vllm.fingerprint.compare`): the trainer's own tensors
        against what the worker's kernels read, element by element; ``None`` where the worker is not in this process or
        the engine runs several (fingerprints serve there)."""
        from hwsync.engine.vllm.fingerprint import compare

        if not self.in_process:
            return None
        with self.lock:
            results = self.rpc_all(compare, request)
        return results[0] if len(results) == 1 else None

    def reset_cache(self) -> None:
        """KV computed with old weights (or an adapter id whose weights changed) must not be reused.

        vLLM declines the reset while a request holds KV blocks (returns ``False``: an in-process request left
        unfinished, e.g. by a generate that raised), and its cached blocks would then keep serving the old weights'
        KV. Such requests are preempted (their KV is recomputed under the new weights) and the reset repeated; a
        reset that still fails is a :class:`~hwsync.common.errors.SyncError`."""
        if self.llm.reset_prefix_cache():
            return
        if not self.llm.reset_prefix_cache(reset_running_requests=True):
            raise SyncError("vLLM could not reset its prefix cache even after preempting its running requests")

    def committed(self, manifest: Manifest, receive: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``receive()``, then the prefix-cache reset (:meth:`reset_cache`), before the sync counts as done.

        A receive that raises keeps its own error and needs no reset: the receiver left the engine as it was (the old
        weights' KV still matches them) or stale (it refuses to generate). A reset that does not happen after the
        weights were written -- vLLM declines it, or it raises anything (vLLM's ``RuntimeError``, a Ctrl-C landing
        there) -- marks the engine stale, so no output mixes the new weights with cached KV of the old ones; a
        declined reset is a :class:`~hwsync.common.errors.SyncError`, anything else is raised as it was. The next
        complete sync clears it."""
        result = receive()
        t0 = time.perf_counter()
        try:
            self.reset_cache()
        except BaseException as e:
            why = str(e) if isinstance(e, SyncError) else f"its prefix-cache reset raised {type(e).__name__}: {e}"
            reason = (
                f"sync v{manifest.version} wrote the weights but {why}, so cached KV of the old weights could mix in"
            )
            self.rpc_all(worker.mark_stale, reason)
            if not isinstance(e, SyncError):
                raise  # the original error (an interrupt stays an interrupt); the engine is stale
            raise SyncError(
                f"{reason}: the engine is marked stale and refuses to generate through hwsync until a "
                "sync completes with the reset"
            ) from e
        if isinstance(result, dict):
            result["reset_ms"] = (time.perf_counter() - t0) * 1e3
        return result

    def send(
        self, manifest: Manifest, produce: Callable[[], Iterator[Tensor]], progress: ProgressFn | None
    ) -> dict[str, Any]:
        if not self.in_process:
            raise SyncError(
                "colocated sync needs the engine's worker in this process: create the LLM with "
                "VLLM_ENABLE_V1_MULTIPROCESSING=0 (one worker per process; ms-swift's colocate TP engines qualify), "
                "or serve the engine (hwsync.serve on its side, hwsync.connect(address, token) in the trainer)"
            )
        with self.lock:
            return self.committed(
                manifest, lambda: self.rpc(worker.receive, manifest, bucket_lists(manifest, produce, progress))
            )

    def generate(self, prompts: Any, sampling_params: Any = None, **kwargs: Any) -> Any:
        from hwsync.engine.vllm.sleep import check_engine_awake

        with self.lock:
            self.check_servable()
            check_engine_awake(self.llm, "generating")
            kwargs.setdefault("lora_request", self.lora_request)
            kwargs.setdefault("use_tqdm", False)
            return self.llm.generate(prompts, sampling_params, **kwargs)

    def logprobs(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
        from vllm import SamplingParams

        from hwsync.engine.vllm.outputs import engine_logprobs

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, prompt_logprobs=0, detokenize=False)
        outs = self.generate([{"prompt_token_ids": list(p)} for p in prompts], params)
        return [engine_logprobs(out) for out in outs]


def local_engine(llm: Any) -> LocalEngine:
    """The one handle on an in-process ``vllm.LLM``, made at the first call and kept on it: ``hwsync.sync``,
    ``hwsync.generate`` and ``hwsync.serve`` of one engine share its lock."""
    handle: LocalEngine | None = foreign.held(llm, "engine")
    if handle is None:
        handle = LocalEngine(llm)  # refuses what is not an in-process engine
        with contextlib.suppress(TypeError):  # an object without a __dict__ keeps no handle
            foreign.state_of(llm)["engine"] = handle
    return handle
