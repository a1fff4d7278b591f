"""Trainer side of hwsync as a vLLM weight-transfer backend: :class:`TransferBackendEngine`.

An engine built with ``LLM(..., weight_transfer_config={"backend": "hwsync"})`` takes weights through vLLM's own
protocol (``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``);
this handle is what ``hwsync.sync`` drives it with, so planning, strategies (full / adapter / hybrid) and reports are
hwsync's own. The config line is all it takes: :func:`hwsync.as_engine` hands out this handle for such an engine
(:func:`transfer_engine`), so ``hwsync.sync(llm, model)``, the ms-swift plugin (``--vllm_engine_kwargs
'{"weight_transfer_config": {"backend": "hwsync"}}'``) and every other caller of ``as_engine`` sync through vLLM's
protocol::

    llm = LLM(model, weight_transfer_config={"backend": "hwsync"}, enable_lora=True)   # in-process worker
    hwsync.sync(llm, model, strategy="hybrid")   # after each optimizer step

The verbs are the ``vllm.LLM`` methods where the engine object has them, else what those methods run
(``llm_engine.collective_rpc(verb)``, ``set_weight_version``): ms-swift's colocated engine is a bare ``LLMEngine``.

One ``update_weights`` carries one whole hwsync sync: its manifest (JSON) and its buckets (this process's tensors,
by reference) in the backend's ``update_info`` (see :mod:`hwsync.engine.vllm.weight_transfer` for what rides where and
why). Engine facts (``strategy="auto"``), the receiver's state, generation and vLLM's prefix-cache reset after a sync go
through the colocated handle (:func:`hwsync.as_engine`), as they do for ``hwsync.sync(llm, ...)``.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from torch import Tensor

from hwsync.common import foreign
from hwsync.common.errors import SyncError, UnsupportedSetupError
from hwsync.common.target import Engine, Generating, ProgressFn
from hwsync.common.transport.buckets import bucket_lists
from hwsync.common.wire import EngineInfo, Manifest

__all__ = ["BACKEND", "TransferBackendEngine", "check_weight_transfer_api", "selects_hwsync", "transfer_engine"]

BACKEND = "hwsync"
PROTOCOL = 1
"""Must equal :data:`hwsync.engine.vllm.weight_transfer.PROTOCOL` (checked by the engine at init)."""


def check_weight_transfer_api() -> None:
    """Raise :class:`UnsupportedSetupError` where the installed vLLM has no weight-transfer API
    (``vllm.distributed.weight_transfer``: vLLM 0.30, 0.31 and 0.32 ship it, the CPU build included)."""
    try:
        found = importlib.util.find_spec("vllm.distributed.weight_transfer") is not None
    except ModuleNotFoundError:  # no vllm, or no vllm.distributed
        found = False
    if not found:
        from hwsync.common.capabilities import vllm_support

        raise UnsupportedSetupError(
            f"vLLM {vllm_support()['version'] or '(not installed)'} has no weight-transfer API "
            "(vllm.distributed.weight_transfer, in vLLM 0.30-0.32), so weight_transfer_config={'backend': 'hwsync'} "
            "cannot work here: install a vLLM that has it, or sync without it (hwsync.sync(llm, model) colocated, "
            "hwsync.serve / hwsync.connect for an engine in another process)"
        )


def _backend_of(llm: Any) -> Any:
    """The weight-transfer backend the in-process engine ``llm`` was built with (``None``: none)."""
    config = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "weight_transfer_config", None)
    return getattr(config, "backend", None)


def selects_hwsync(llm: Any) -> bool:
    """Whether the in-process engine ``llm`` was built with ``weight_transfer_config={"backend": "hwsync"}``."""
    return _backend_of(llm) == BACKEND


def transfer_engine(llm: Any) -> TransferBackendEngine:
    """The one :class:`TransferBackendEngine` of ``llm`` (made at the first call, kept on it): what
    :func:`hwsync.as_engine` hands out for an engine that selected hwsync's backend."""
    handle: TransferBackendEngine | None = foreign.held(llm, "transfer engine")
    return handle if handle is not None else TransferBackendEngine(llm)


class TransferBackendEngine(Engine, Generating):
    """hwsync's :class:`~hwsync.common.target.Engine` over vLLM's weight-transfer protocol, for an in-process
    ``vllm.LLM`` built with ``weight_transfer_config={"backend": "hwsync"}``."""

    mode = "colocate"

    def __init__(self, llm: Any) -> None:
        check_weight_transfer_api()
        super().__init__()
        from hwsync.engine.vllm.local import local_engine

        self.llm = llm
        self.inner = local_engine(llm)
        self.lock = self.inner.lock  # one lock per engine: syncs and generation through either handle serialize
        backend = _backend_of(llm)
        if backend != BACKEND:
            raise UnsupportedSetupError(
                f"this engine's weight transfer backend is {backend!r}, not 'hwsync': build it with "
                "LLM(..., weight_transfer_config={'backend': 'hwsync'}) (the hwsync vLLM plugin registers it), or "
                "sync it with hwsync.sync(llm, model) directly"
            )
        # hwsync's receiver on every worker, registered under the model vLLM handed the backend
        # (hwsync.engine.vllm.worker.worker_of_model): what the backend reaches it by, from init_transfer_engine on
        self.inner.state()
        self._verb("init_weight_transfer_engine", {"init_info": {"protocol": PROTOCOL}})
        with contextlib.suppress(TypeError):  # an object without a __dict__ keeps no handle
            foreign.state_of(llm)["transfer engine"] = self

    def _verb(self, name: str, request: dict[str, Any] | None = None) -> None:
        """vLLM's weight-transfer verb ``name``: the ``vllm.LLM`` method where the engine object has it, else what
        that method runs (vLLM 0.30-0.32 ``LLM``: ``llm_engine.collective_rpc(name)`` with the
        request's one field as keyword)."""
        method = getattr(self.llm, name, None)
        if callable(method):
            method(*(() if request is None else (request,)))
        else:
            self.llm.llm_engine.collective_rpc(name, kwargs=dict(request or {}))

    def _finish(self, version: int) -> None:
        method = getattr(self.llm, "finish_weight_update", None)
        if callable(method):
            method(weight_version=str(version))
            return
        self.llm.llm_engine.collective_rpc("finish_weight_update")
        setter = getattr(self.llm.llm_engine, "set_weight_version", None)
        if callable(setter):
            setter(str(version))

    def describe(self, lora_paths: Sequence[str] = (), base: Mapping[str, Sequence[int]] | None = None) -> EngineInfo:
        return self.inner.describe(lora_paths, base)

    def state(self) -> dict[str, Any]:
        return self.inner.state()

    def warm(self, manifest: Manifest) -> None:
        self.inner.warm(manifest)

    def send(
        self, manifest: Manifest, produce: Callable[[], Iterator[Tensor]], progress: ProgressFn | None
    ) -> dict[str, Any]:
        committed = getattr(self.inner, "committed", None)
        if committed is None or not getattr(self.inner, "in_process", False):
            raise SyncError(
                "hwsync's weight-transfer backend hands tensors over by reference and needs the engine's worker in "
                "this process (VLLM_ENABLE_V1_MULTIPROCESSING=0); for an engine in another process use hwsync.serve "
                "/ hwsync.connect"
            )
        with self.lock:
            result: dict[str, Any] = committed(manifest, lambda: self._through_vllm(manifest, produce, progress))
            return result

    def _through_vllm(
        self, manifest: Manifest, produce: Callable[[], Iterator[Tensor]], progress: ProgressFn | None
    ) -> dict[str, Any]:
        self._verb("start_weight_update")
        self._verb(
            "update_weights",
            {"update_info": {"manifest": manifest.to_json(), "buckets": bucket_lists(manifest, produce, progress)}},
        )
        try:
            self._finish(manifest.version)
        except BaseException as e:
            # the weights are written and the receiver counted the sync, but vLLM's session did not close: the engine
            # must not serve them until a sync completes (no prefix-cache reset follows a raising receive)
            from hwsync.engine.vllm import worker

            reason = (
                f"sync v{manifest.version} wrote the weights but vLLM's finish_weight_update raised "
                f"{type(e).__name__}: {e}"
            )
            self.inner.rpc_all(worker.mark_stale, reason)
            raise
        return {"version": manifest.version, "path": "vLLM weight-transfer API (backend hwsync)"}

    def generate(self, prompts: Any, sampling_params: Any = None, **kwargs: Any) -> Any:
        return self.inner.generate(prompts, sampling_params, **kwargs)

    def logprobs(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
        return self.inner.logprobs(prompts, max_tokens)

    def fingerprints(self, request: dict[str, Any]) -> Any:
        """What :func:`hwsync.verify` reads, from the colocated handle."""
        return self.inner.fingerprints(request)

    def compare(self, request: dict[str, Any]) -> Any:
        return self.inner.compare(request)
