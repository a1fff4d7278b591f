"""Per-sync device work recorded once and replayed: thousands of small copies become one launch.

A steady adapter sync of Qwen3-30B-A3B's 48 layers is ~2,000 small copies and folds whose tensors stay where they
are from one sync to the next (the trainer's LoRA parameters, the reader's fold buffers, the engine's slot blocks).
Launched one by one, the host spends more time issuing them than the GPU spends running them. :class:`Replay`
records them once as a graph (where the backend records graphs: :meth:`hwsync.backend.Backend.capture`) and then
launches that graph, for as long as every tensor it reads or writes is still at the same address (the caller's
``key``). Anywhere else (CPU, a backend without graphs, ``HWSYNC_GRAPHS=0``, tensors that moved) the work runs as it
is, so the values are the same either way: a graph replays the recorded kernels on the current addresses.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

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
    """Runs ``work`` eagerly the first time a ``key`` is seen and records it right after, so the next run with that
    key is one launch (the second sync as fast as the third); replays the recording while the key holds. A caller
    whose keys move from run to run would pay a recording per run: once a recording goes unused, a key is recorded
    only the second time in a row (and launched at once). ``key`` must name every address ``work`` touches
    (:func:`addresses`)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._key: Hashable = None
        self._seen: Hashable = None
        self._launch: Callable[[], None] | None = None
        self._used = False
        self._at_first_sight = True
        self._failed = False
        self.replays = 0
        """Runs that were one graph launch (the tests read it)."""
        self.recorded = 0
        """Recordings made (the tests read it)."""

    def run(self, key: Hashable, device: torch.device, work: Callable[[], None]) -> None:
        if self._launch is not None and key == self._key:
            self._launch_recorded()
            return
        if self._launch is not None and not self._used:
            self._at_first_sight = False  # this caller's keys move: a recording per run would be wasted
        self._launch = None
        if key == self._seen and self._records(device) and self._keep(key, device, work):
            self._launch_recorded()
            return
        work()
        if key != self._seen and self._at_first_sight and self._records(device):
            self._keep(key, device, work)  # nothing runs while recording: the next run with this key launches it
        self._seen = key

    def _launch_recorded(self) -> None:
        assert self._launch is not None
        self._launch()
        self._used = True
        self.replays += 1

    def _keep(self, key: Hashable, device: torch.device, work: Callable[[], None]) -> bool:
        launch = self._record(device, work)
        if launch is None:
            return False
        self._launch, self._key, self._used = launch, key, False
        self.recorded += 1
        return True

    def _records(self, device: torch.device) -> bool:
        return not self._failed and device.type != "cpu" and os.environ.get(GRAPHS_ENV, "1") != "0"

    def _record(self, device: torch.device, work: Callable[[], None]) -> Callable[[], None] | None:
        from hwsync.backend import backend_for_device

        try:
            return backend_for_device(device).capture(work, device)
        except Exception as e:  # noqa: BLE001 - a graph is an optimisation: the eager path is always right
            logger.warning("hwsync: %s could not be recorded as one graph on %s (%s: %s); launching it op by op",
                           self.what, device, type(e).__name__, e)
            self._failed = True
            return None
