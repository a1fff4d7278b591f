"""Non-finite weights (NaN, +-Inf) never serve: checked inside the copy that writes them where the device can, one
device reduction per bucket otherwise, one host read per sync.

Why: a diverged step's NaN outlived the next complete sync. A forward with NaN weights writes NaN into the KV blocks
it uses; the prefix-cache reset frees those blocks without clearing them, and attention reads the unused slots of a
reused block (masked, but ``NaN * 0`` is NaN), so later requests came out NaN or wrong for a few calls
(``tests/test_attacks_reliability.py::test_nan_weights_poison_reused_kv_blocks`` shows it). Refusing to *serve*
non-finite weights keeps every cache clean: no forward ever runs on them.

How: the receiver opens each bucket (:meth:`FiniteFlags.open`) with its floating-point tensors, writes under
:meth:`FiniteFlags.writing` and closes the bucket (:meth:`FiniteFlags.close`) before it receives the next. A write of
a whole bucket tensor goes through :func:`copy_` / :func:`copy_all`. hwsync's own in-place writer runs them inside
:func:`deferred`: the copies are queued and launched together when the bucket closes, as one copy that checks as it
copies per device and dtype (:meth:`hwsync.common.backend.Backend.checked_copy_all`: a Triton kernel on CUDA), so every
tensor is read once, as the write reads it anyway, for one launch per bucket. Outside :func:`deferred` (vLLM's loaders
calling hwsync's layout writers, whose post-load steps may read what was just written) a large tensor is checked in a
copy of its own at once. Whatever is not checked that way when the bucket closes (vLLM's loaders, the adapter, sharded
pieces, devices without such a copy) gets ``torch._foreach_norm(ord=inf)`` per (device, dtype): one multi-tensor
kernel, NaN propagating, no host synchronization (also where a checking copy fails to run: logged once, then that
device kind is checked this way). The receiver reads all flags once, after the last bucket and before
the adapter is installed or the sync counts as complete; a non-finite sync leaves the engine stale (it refuses to
generate) and names the first offending tensors. An adapter-only sync is thereby refused before anything is written.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

__all__ = ["FiniteFlags", "copy_", "copy_all", "deferred"]

_CHECKED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""Dtypes checked (8-bit floats have no foreach norm; they are not checked)."""

_WRITING: contextvars.ContextVar[FiniteFlags | None] = contextvars.ContextVar("hwsync_finite_writing", default=None)
_DEFERRING: contextvars.ContextVar[bool] = contextvars.ContextVar("hwsync_finite_deferring", default=False)
_SLOTS = 256
"""Checking-copy flags per device buffer (a 48-layer sync in 512 MiB buckets uses ~100)."""
_UNUSABLE: set[str] = set()
"""Device kinds whose checking copy failed to run in this process (a kernel that does not build or launch there):
their copies are plain and their sources reduced from then on, so syncs go on, checked the slower way."""
logger = logging.getLogger("hwsync")


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Inside a receive, the whole-bucket-tensor copies made here are queued and launched together when the bucket
    closes (nothing may read their destinations before that: hwsync's own in-place writer, not vLLM's loaders)."""
    token = _DEFERRING.set(True)
    try:
        yield
    finally:
        _DEFERRING.reset(token)


def _span(t: Tensor) -> tuple[torch.device, int, int]:
    return t.device, t.data_ptr(), t.numel() * t.element_size()


class FiniteFlags:
    """Per-bucket "all finite" flags on the tensors' devices, read back once (:meth:`non_finite`)."""

    def __init__(self) -> None:
        self._flags: list[tuple[int, Tensor]] = []
        self._names: dict[int, list[str]] = {}
        self._index = -1
        self._pending: dict[tuple[torch.device, int, int], Tensor] = {}
        self._queue: list[tuple[Tensor, Tensor]] = []
        self._queued: set[tuple[torch.device, int]] = set()
        self._copy_flags: dict[torch.device, Tensor] = {}  # the open bucket's flag per device: a slot of a buffer
        self._buffers: dict[torch.device, list[Tensor]] = {}  # zeroed int32 chunks, a slot per bucket and device
        self._slots: list[tuple[int, torch.device, int]] = []  # (bucket, device, slot) of every checking copy's flag
        self._used: dict[torch.device, int] = {}
        self.checked_in_copy = 0
        """Tensors checked by the copy that wrote them (the benchmarks and tests read it)."""

    def open(self, index: int, tensors: Sequence[Tensor], names: Sequence[str]) -> None:
        """Start bucket ``index`` (closing the one before): its tensors are checked by the copy that writes them
        whole, or when the bucket closes. No host synchronization."""
        self.close()
        self._index = index
        self._names[index] = list(names)
        for t in tensors:
            if t.dtype in _CHECKED and t.numel():
                self._pending[_span(t)] = t.detach()

    def close(self) -> None:
        """Launch the bucket's queued copies (one checking copy per device and dtype), then reduce what no checking
        copy read (one multi-tensor kernel per device and dtype). Call before the transport may reuse the bucket's
        memory."""
        self._flush()
        groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for t in self._pending.values():
            groups.setdefault((t.device, t.dtype), []).append(t)
        self._pending.clear()
        for group in groups.values():
            peaks = torch._foreach_norm(group, float("inf"))
            self._flags.append((self._index, torch.stack(peaks).isfinite().all()))
        self._copy_flags.clear()

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """While inside, :func:`copy_` / :func:`copy_all` check the open bucket's tensors as they copy them. Queued
        copies are launched on leaving; after an error they are dropped (the sync has failed: nothing counts)."""
        token = _WRITING.set(self)
        try:
            yield
        except BaseException:
            self._queue.clear()
            self._queued.clear()
            raise
        else:
            self._flush()
        finally:
            _WRITING.reset(token)

    def _flag(self, device: torch.device) -> Tensor:
        """The open bucket's checking-copy flag on ``device``: the next slot of a zeroed buffer (one allocation per
        ``_SLOTS`` buckets, read back with the rest: no launch of its own per bucket)."""
        flag = self._copy_flags.get(device)
        if flag is None:
            chunks = self._buffers.setdefault(device, [])
            slot = self._used.get(device, 0)
            self._used[device] = slot + 1
            if slot == len(chunks) * _SLOTS:
                chunks.append(torch.zeros(_SLOTS, dtype=torch.int32, device=device))
            flag = self._copy_flags[device] = chunks[slot // _SLOTS][slot % _SLOTS]
            self._slots.append((self._index, device, slot))
        return flag

    def _flush(self) -> None:
        """The queued copies, one checking copy per device (and dtype); pairs the device cannot check as it copies
        are copied plainly and their sources reduced when the bucket closes."""
        if not self._queue:
            return
        queue, self._queue = self._queue, []
        self._queued.clear()
        by_device: dict[torch.device, list[tuple[Tensor, Tensor]]] = {}
        for d, s in queue:
            by_device.setdefault(s.device, []).append((d, s))
        for device, pairs in by_device.items():
            dsts, srcs = [d for d, _ in pairs], [s for _, s in pairs]
            left = _checked_copy_all(device, dsts, srcs, self._flag)
            self.checked_in_copy += len(pairs) - len(left)
            if left:
                _plain_copy_all([dsts[i] for i in left], [srcs[i] for i in left])
                for i in left:
                    self._pending[_span(srcs[i])] = srcs[i]

    def _copy(self, dst: Tensor, src: Tensor) -> bool:
        key = _span(src)
        if key not in self._pending or dst.shape != src.shape or dst.dtype != src.dtype or dst.device != src.device:
            return False
        if _DEFERRING.get():
            target = (dst.device, dst.data_ptr())
            if target in self._queued:  # written twice in one bucket: the first write lands first
                self._flush()
            del self._pending[key]
            self._queue.append((dst, src))
            self._queued.add(target)
            return True
        if _checked_copy_all(src.device, [dst], [src], self._flag, alone=True):
            return False
        del self._pending[key]
        self.checked_in_copy += 1
        return True

    def non_finite(self) -> list[int]:
        """Indices of the buckets that carried a NaN or an infinity (one host read per device)."""
        self.close()
        reduced: dict[torch.device, list[tuple[int, Tensor]]] = {}
        for index, ok in self._flags:
            reduced.setdefault(ok.device, []).append((index, ok))
        bad: set[int] = set()
        for device in {*reduced, *self._buffers}:
            chunks = self._buffers.get(device, [])
            flags = reduced.get(device, [])
            parts = [*chunks] + ([torch.stack([ok for _, ok in flags]).logical_not().to(torch.int32)] if flags else [])
            seen = (torch.cat(parts) if len(parts) > 1 else parts[0]).cpu().tolist()  # one read per device
            copied = len(chunks) * _SLOTS
            bad.update(index for index, d, slot in self._slots if d == device and seen[slot])
            bad.update(index for k, (index, _) in enumerate(flags) if seen[copied + k])
        return sorted(bad)

    def describe(self, bad: Sequence[int]) -> str:
        """A short list of the tensors in the first offending bucket(s)."""
        names = [n for i in bad[:2] for n in self._names.get(i, [])]
        more = f" (+{len(names) - 4} more)" if len(names) > 4 else ""
        return f"bucket(s) {list(bad[:8])}: {', '.join(names[:4])}{more}"


def _checked_copy_all(
    device: torch.device,
    dsts: Sequence[Tensor],
    srcs: Sequence[Tensor],
    flag: Callable[[torch.device], Tensor],
    *,
    alone: bool = False,
) -> list[int]:
    """The device's checking copy of these pairs; the indices it left (all of them where it has none, or where it
    failed: then logged once, and not tried again on that kind of device in this process)."""
    from hwsync.common.backend import backend_for_device

    backend = backend_for_device(device)
    if not backend.checks_in_copy or device.type in _UNUSABLE:
        return list(range(len(srcs)))
    try:
        return backend.checked_copy_all(dsts, srcs, flag(device), alone=alone)
    except Exception as e:  # noqa: BLE001 - an optimisation that cannot run here must not stop syncs
        _UNUSABLE.add(device.type)
        logger.warning(
            "hwsync: the %s checking copy failed (%s: %s); copies there are plain and checked by a separate "
            "reduction from now on",
            device.type,
            type(e).__name__,
            e,
        )
        return list(range(len(srcs)))


def copy_(dst: Tensor, src: Tensor) -> None:
    """``dst.copy_(src)``; inside :meth:`FiniteFlags.writing`, a whole bucket tensor is checked in the same pass."""
    flags = _WRITING.get()
    if flags is None or not flags._copy(dst, src):
        dst.copy_(src)


def copy_all(dsts: Sequence[Tensor], srcs: Sequence[Tensor]) -> None:
    """:func:`copy_` for every pair: the pairs checked in their copy (or queued for it), the rest one
    ``torch._foreach_copy_``."""
    flags = _WRITING.get()
    rest = [(d, s) for d, s in zip(dsts, srcs) if flags is None or not flags._copy(d, s)]
    if rest:
        _plain_copy_all([d for d, _ in rest], [s for _, s in rest])


def _plain_copy_all(dsts: Sequence[Tensor], srcs: Sequence[Tensor]) -> None:
    torch._foreach_copy_(list(dsts), list(srcs))
