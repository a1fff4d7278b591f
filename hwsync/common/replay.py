"""Per-sync device work recorded once and replayed: thousands of small copies become one launch.

A steady adapter sync of Qwen3-30B-A3B's 48 layers is ~2,000 small copies and folds whose tensors stay where they
are from one sync to the next (the trainer's LoRA parameters, the reader's fold buffers, the engine's slot blocks).
Launched one by one, the host spends more time issuing them than the GPU spends running them. :class:`Replay`
records them once as a graph (where the backend records graphs: :meth:`hwsync.common.backend.Backend.capture`) and then
launches that graph, for as long as every tensor it reads or writes is still at the same address (the caller's
``key``). Anywhere else (CPU, a backend without graphs, ``HWSYNC_GRAPHS=0``, tensors that moved) the work runs as it
is, so the values are the same either way: a graph replays the recorded kernels on the current addresses.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from hwsync.common.config import read

__all__ = ["Replay", "addresses", "common_device", "copy_all", "GRAPHS_ENV"]

GRAPHS_ENV = "HWSYNC_GRAPHS"
logger = logging.getLogger("hwsync")


def addresses(tensors: Sequence[Tensor]) -> tuple[Hashable, ...]:
    """Where ``tensors`` are and how they are laid out: a recorded graph is valid while this stays the same."""
    return tuple((t.data_ptr(), t.stride(), t.dtype) for t in tensors)


def common_device(tensors: Iterable[Tensor]) -> torch.device:
    """The one device all ``tensors`` are on; ``cpu`` when they span several (such work runs op by op, never as a
    graph)."""
    devices = {t.device for t in tensors}
    return devices.pop() if len(devices) == 1 else torch.device("cpu")


def copy_all(dsts: Sequence[Tensor], srcs: Sequence[Tensor]) -> None:
    """``dst.copy_(src)`` for every pair, batched per (device, dtype) pair: one multi-tensor copy, not thousands of
    Python-level calls (``copy_`` casts, so sources may keep another dtype)."""
    groups: dict[tuple[Any, ...], tuple[list[Tensor], list[Tensor]]] = {}
    for d, s in zip(dsts, srcs):
        if d.device != s.device:  # e.g. a trainer on another device than the engine: one copy each, across devices
            d.copy_(s)
            continue
        pair = groups.setdefault((d.device, d.dtype, s.device, s.dtype), ([], []))
        pair[0].append(d)
        pair[1].append(s)
    for ds, ss in groups.values():
        torch._foreach_copy_(ds, ss)


class Replay:
    """Runs ``work`` eagerly the first time a ``key`` is seen, records it right after and launches the recording once
    (its first launch pays the graph's upload), so the next run with that key is one cheap launch: the second sync as
    fast as the third. The last :attr:`KEEP` recordings are kept, so work whose addresses alternate (double-buffered
    receive buffers) replays too. A caller whose keys move from run to run would pay a recording per run: once a
    recording is dropped unused, a key is recorded only when seen again (and launched at once). ``key`` must name
    every address ``work`` touches (:func:`addresses`); ``work`` must be idempotent (its writes a function of what it
    reads: copies, folds), since a recording is launched once more than the work was asked for."""

    KEEP = 2

    def __init__(self, what: str) -> None:
        self.what = what
        self._kept: OrderedDict[Hashable, Callable[[], None]] = OrderedDict()
        self._used: set[Hashable] = set()
        self._seen: deque[Hashable] = deque(maxlen=4 * self.KEEP)
        self._at_first_sight = True
        self._failed = False
        self.replays = 0
        """Runs that were one graph launch (the tests read it)."""
        self.recorded = 0
        """Recordings made (the tests read it)."""

    def run(self, key: Hashable, device: torch.device, work: Callable[[], None]) -> None:
        launch = self._kept.get(key)
        if launch is not None:
            self._kept.move_to_end(key)
            self._used.add(key)
            launch()
            self.replays += 1
            return
        seen = key in self._seen
        if seen and self._records(device):
            launch = self._keep(key, device, work)
            if launch is not None:
                self._used.add(key)
                launch()
                self.replays += 1
                return
        work()
        if not seen and self._at_first_sight and self._records(device):
            launch = self._keep(key, device, work)
            if launch is not None:
                launch()  # idempotent: the same values again; the graph's first launch is paid here, not next run
        self._seen.append(key)

    def _keep(self, key: Hashable, device: torch.device, work: Callable[[], None]) -> Callable[[], None] | None:
        launch = self._record(device, work)
        if launch is None:
            return None
        self._kept[key] = launch
        self.recorded += 1
        while len(self._kept) > self.KEEP:
            dropped, _ = self._kept.popitem(last=False)
            if dropped not in self._used:
                self._at_first_sight = False  # this caller's keys move: a recording per run would be wasted
            self._used.discard(dropped)
        return launch

    def _records(self, device: torch.device) -> bool:
        return not self._failed and device.type != "cpu" and read(GRAPHS_ENV)

    def _record(self, device: torch.device, work: Callable[[], None]) -> Callable[[], None] | None:
        from hwsync.common.backend import backend_for_device

        try:
            return backend_for_device(device).capture(work, device)
        except Exception as e:  # noqa: BLE001 - a graph is an optimisation: the eager path is always right
            logger.warning(
                "hwsync: %s could not be recorded as one graph on %s (%s: %s); launching it op by op",
                self.what,
                device,
                type(e).__name__,
                e,
            )
            self._failed = True
            return None
