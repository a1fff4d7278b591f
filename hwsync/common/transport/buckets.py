"""Buckets over a :class:`~hwsync.common.transport.Link`: a symmetric sender / receiver pair.

Each bucket travels as one flat buffer: the manifest's tensors at their offsets, then a trailer (status, bucket
index, sync version, and a keyed tag over the payload, :mod:`hwsync.common.transport.seal`). The receiver knows the
bucket plan from the manifest, so no per-bucket header round trip is needed; it checks the trailer before a bucket's
views reach any loader. An aborting sender sends one last trailer with status ``ABORT`` and stops; both sides then stop.

Pipelining (accelerators): the sender packs bucket b+1 while bucket b is on the wire, the receiver posts bucket b+1
before it hands bucket b to the engine, each side alternating between buffers that nothing else references (a
buffer is reused only when no view of it is left: vLLM's layer-wise reload may hold a layer's tensors across
buckets; LoRA tensors wait for the last bucket).
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from hwsync.common.errors import SyncError
from hwsync.common.transport.base import Link, Transfer
from hwsync.common.transport.pack import pack, views
from hwsync.common.transport.seal import Sealer
from hwsync.common.wire import Manifest

__all__ = ["BucketLists", "bucket_lists", "send_buckets", "receive_buckets", "TRAILER_BYTES"]

ProgressFn = Callable[[int, int], None]

_OK, _ABORT = 0x4F4B, 0x4142  # "OK", "AB"
_HEAD = struct.Struct("<qqq")  # status, bucket index, version
TRAILER_BYTES = 64
"""Status, index, version (24 bytes) and a 32-byte tag, padded to 64."""


def bucket_lists(
    manifest: Manifest, produce: Callable[[], Iterator[Tensor]], progress: ProgressFn | None
) -> Iterator[list[Tensor]]:
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
            # the manifest carries the engine's dtype (an fp32 trainer feeding a bf16 engine): cast here, once, on
            # the trainer's device, so every receiver path (in place, vLLM's loaders, the data plane) sees it
            pending[nxt] = t if t.dtype == spec.dtype else t.to(spec.dtype)
            nxt += 1
        tensors = [pending.pop(i) for i in bucket.entries]
        if progress is not None:
            progress(bucket.index, n)
        yield tensors


BucketLists = Iterator[list[Tensor]]


def _use_count(buf: Tensor) -> int | None:
    count = getattr(torch._C, "_storage_Use_Count", None)  # no public API says "is anyone else holding a view?"
    return None if count is None else int(count(buf.untyped_storage()._cdata))


class _Pool:
    """Flat buffers, reused only while nothing else references their memory (see the module docstring). The first
    free buffer in creation order is taken, so every sync of one plan meets the same addresses bucket by bucket (a
    graph of the per-sync copies that read them replays: :mod:`hwsync.common.replay`)."""

    def __init__(self, device: torch.device, size: int = 3) -> None:
        self.device = device
        self.size = size
        self.bufs: list[tuple[Tensor, int | None]] = []

    def take(self, nbytes: int, busy: Sequence[Tensor] = ()) -> Tensor:
        for buf, baseline in self.bufs:
            if (
                baseline is not None
                and buf.numel() >= nbytes
                and _use_count(buf) == baseline
                and not any(b is buf for b in busy)
            ):
                return buf
        buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        self.bufs.append((buf, _use_count(buf)))
        del self.bufs[: -self.size]  # forget the oldest; whoever still holds views keeps that memory alive
        return buf


def pool_of(owner: dict[str, Any], device: torch.device) -> _Pool:
    """The owner's buffer pool for ``device``, kept across syncs (``owner``: the dict an end of the data plane keeps,
    :mod:`hwsync.common.transport.plane`)."""
    pools: dict[str, _Pool] = owner.setdefault("pools", {})
    key = str(device)
    if key not in pools:
        pools[key] = _Pool(device)
    return pools[key]


def _trailer(buf: Tensor, size: int) -> Tensor:
    return buf[size : size + TRAILER_BYTES]


def _write_trailer(buf: Tensor, size: int, status: int, index: int, version: int, tag: bytes) -> None:
    head = _HEAD.pack(status, index, version) + tag
    data = torch.frombuffer(bytearray(head.ljust(TRAILER_BYTES, b"\0")), dtype=torch.uint8)
    _trailer(buf, size).copy_(data, non_blocking=False)


def send_buckets(
    manifest: Manifest,
    lists: BucketLists,
    link: Link,
    pool: _Pool,
    sealer: Sealer,
    on_abort: Callable[[BaseException], None] | None = None,
) -> None:
    """Sender side: pack and broadcast every bucket (rank 0 of ``link``); on a failure, send ``ABORT`` and raise.
    ``on_abort(error)`` runs before the ``ABORT`` goes out (e.g. to publish the reason the receivers then read)."""
    size = max((b.nbytes for b in manifest.buckets), default=0)
    inflight: list[tuple[Tensor, Transfer]] = []
    for bucket in manifest.buckets:
        busy = [b for b, _ in inflight]
        buf = pool.take(size + TRAILER_BYTES, busy)
        try:
            tensors = next(lists)
            specs = [manifest.specs[i] for i in bucket.entries]
            pack(buf, bucket.offsets, tensors, [s.dtype for s in specs])
            tag = sealer.seal(buf[: bucket.nbytes], bucket.index, manifest.version)
            _write_trailer(buf, size, _OK, bucket.index, manifest.version, tag)
        except BaseException as e:
            if on_abort is not None:
                with contextlib.suppress(Exception):  # the reason is a courtesy; the abort itself must go out
                    on_abort(e)
            _write_trailer(
                buf,
                size,
                _ABORT,
                bucket.index,
                manifest.version,
                sealer.seal(buf[:0], -1 - bucket.index, manifest.version),
            )  # an abort is sealed too
            link.broadcast(buf[: size + TRAILER_BYTES], 0).wait()
            raise
        inflight.append((buf, link.broadcast(buf[: size + TRAILER_BYTES], 0)))
        if len(inflight) > 1:
            inflight.pop(0)[1].wait()
    for _, transfer in inflight:
        transfer.wait()


def receive_buckets(
    manifest: Manifest, link: Link, pool: _Pool, sealer: Sealer, abort_reason: Callable[[], str] | None = None
) -> BucketLists:
    """Receiver side: one list of views per bucket, each checked (status, index, version, tag) before it is
    yielded; the next bucket is already on the wire while the engine consumes this one."""
    size = max((b.nbytes for b in manifest.buckets), default=0)
    buckets = manifest.buckets
    posted: list[tuple[Tensor, Transfer]] = []

    def post() -> None:
        buf = pool.take(size + TRAILER_BYTES, [b for b, _ in posted])
        posted.append((buf, link.broadcast(buf[: size + TRAILER_BYTES], 0)))

    if buckets:
        post()
    for k, bucket in enumerate(buckets):
        buf, transfer = posted[0]
        transfer.wait()
        status, index, version = _HEAD.unpack(bytes(_trailer(buf, size)[: _HEAD.size].cpu().tolist()))
        if status == _ABORT:
            posted.clear()
            tag = bytes(_trailer(buf, size)[_HEAD.size : _HEAD.size + sealer.tag_bytes].cpu().tolist())
            sealer.check(buf[:0], -1 - bucket.index, manifest.version, tag)  # only the trainer may abort
            why = abort_reason() if abort_reason else ""
            raise SyncError(f"sender aborted before bucket {bucket.index}" + (f": {why}" if why else ""))
        if status != _OK or index != bucket.index or version != manifest.version:
            raise SyncError(
                f"bucket {bucket.index} of sync v{manifest.version} arrived as bucket {index} of "
                f"v{version} (status {status:#x}): the data plane is out of step; the next sync "
                "re-forms it"
            )
        posted.pop(0)
        if k + 1 < len(buckets):
            # the sender follows an OK bucket with the next one (or its abort): on the wire while this one is
            # checked and consumed (checked after it, the check would hold the wire idle: ~3 ms per bucket on GPUs)
            post()
        tag = bytes(_trailer(buf, size)[_HEAD.size : _HEAD.size + sealer.tag_bytes].cpu().tolist())
        try:
            sealer.check(buf[: bucket.nbytes], bucket.index, manifest.version, tag)
        except SyncError:
            for _, pending in posted:  # let the posted receive land (or time out) before its buffer can be reused
                with contextlib.suppress(Exception):  # the failed check is the error to report
                    pending.wait()
            raise
        specs = [manifest.specs[i] for i in bucket.entries]
        out = views(buf, bucket.offsets, [s.shape for s in specs], [s.dtype for s in specs])
        del buf
        yield out
        del out
