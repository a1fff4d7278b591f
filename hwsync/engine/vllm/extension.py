"""``worker_extension_cls="hwsync.vllm.HwsyncWorkerExtension"``: hwsync's worker functions, callable by name.

vLLM mixes this class into every worker it starts; ``collective_rpc("hwsync_<name>", args=...)`` then reaches the
functions of :mod:`hwsync.engine.vllm.worker` from any process that drives the engine (vLLM's own RPC). In-process
engines do not need it: :func:`hwsync.sync` calls those functions directly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import Tensor

from hwsync.common.wire import Manifest
from hwsync.engine.vllm import worker as _w

__all__ = ["HwsyncWorkerExtension"]


class HwsyncWorkerExtension:
    """Methods mixed into vLLM workers; each delegates to the function of the same name in
    :mod:`hwsync.engine.vllm.worker`."""

    def hwsync_describe(
        self, lora_paths: Sequence[str] = (), base: Mapping[str, Sequence[int]] | None = None
    ) -> dict[str, Any]:
        return _w.describe(self, lora_paths, base)

    def hwsync_state(self) -> dict[str, Any]:
        return _w.state(self)

    def hwsync_check_servable(self) -> None:
        _w.check_servable(self)

    def hwsync_prepare(self, manifest: Manifest | str) -> dict[str, Any]:
        return _w.prepare(self, manifest)

    def hwsync_receive(self, manifest: Manifest | str, buckets: Iterable[Sequence[Tensor]]) -> dict[str, Any]:
        return _w.receive(self, manifest, buckets)

    def hwsync_receive_remote(
        self, manifest: Manifest | str, spec: Mapping[str, Any], first_rank: int, secret: bytes, abort_key: str
    ) -> dict[str, Any]:
        return _w.receive_remote(self, manifest, spec, first_rank, secret, abort_key)

    def hwsync_call(self, name: str, *args: Any) -> tuple[str, Any]:
        """``(status, value)`` of the worker function ``name`` (:data:`CALLS`): every worker answers, and errors
        travel as data that keeps their hwsync type (:func:`hwsync.engine.vllm.worker.answered`). What a driver in
        another process uses (:class:`hwsync.engine.served.ServedEngine`: vLLM's API server, through its engine
        client)."""
        fn = _calls().get(name)
        if fn is None:
            return "error", {"type": "SyncError", "message": f"unknown hwsync worker call {str(name)[:40]!r}"}
        return _w.answered(self, False, fn, *args)


def _calls() -> dict[str, Any]:
    """The worker functions :meth:`HwsyncWorkerExtension.hwsync_call` reaches by name."""
    from hwsync.engine.vllm.fingerprint import fingerprints

    return {
        "describe": _w.describe,
        "state": _w.state,
        "prepare": _w.prepare,
        "receive_remote": _w.receive_remote,
        "fingerprints": fingerprints,
    }
