"""``worker_extension_cls="hwsync.vllm.HwsyncWorkerExtension"``: hwsync's worker functions, callable by name.

vLLM mixes this class into every worker it starts; ``collective_rpc("hwsync_<name>", args=...)`` then reaches the
functions of :mod:`hwsync.vllm.worker` from any process that drives the engine (vLLM's own RPC). In-process engines
do not need it: :func:`hwsync.sync` calls those functions directly.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import Tensor

from hwsync.vllm import worker as _w
from hwsync.wire import Manifest

__all__ = ["HwsyncWorkerExtension"]


class HwsyncWorkerExtension:
    """Methods mixed into vLLM workers; each delegates to the function of the same name in :mod:`hwsync.vllm.worker`."""

    def hwsync_describe(self, lora_paths: Sequence[str] = (), base: Mapping[str, Sequence[int]] | None = None
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

    def hwsync_receive_remote(self, manifest: Manifest | str, spec: Mapping[str, Any], first_rank: int,
                              secret: bytes, abort_key: str) -> dict[str, Any]:
        return _w.receive_remote(self, manifest, spec, first_rank, secret, abort_key)
