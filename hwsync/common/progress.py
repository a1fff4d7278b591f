"""Progress of long sync phases: a phase that runs past a couple of seconds says so in the log, instead of going
silent (a first adapter install, a re-plan, 60 GB of base weights through vLLM's reload)."""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from torch import Tensor

__all__ = ["phase", "counted", "SLOW_S", "recent"]

logger = logging.getLogger("hwsync")

SLOW_S = 2.0
"""A phase that takes longer than this is logged (and a counted stream logs its progress this often)."""


recent: collections.deque[tuple[str, float]] = collections.deque(maxlen=64)
"""The last phases of this process, ``(what, seconds)``, slow or not (a benchmark prints where a first sync went)."""


@contextlib.contextmanager
def phase(what: str) -> Iterator[None]:
    """Log ``what`` with its duration when it took over :data:`SLOW_S`."""
    t0 = time.perf_counter()
    yield
    seconds = time.perf_counter() - t0
    recent.append((what, seconds))
    if seconds > SLOW_S:
        logger.info("hwsync: %s in %.1f s", what, seconds)


def counted(what: str, items: Iterator[tuple[str, Tensor]], total: int | None = None) -> Iterator[tuple[str, Any]]:
    """``items`` passed through; every :data:`SLOW_S` seconds the tensors and bytes done so far are logged."""
    t0 = last = time.perf_counter()
    n = nbytes = 0
    for name, t in items:
        yield name, t
        n += 1
        nbytes += t.numel() * t.element_size()
        now = time.perf_counter()
        if now - last > SLOW_S:
            last = now
            of = f" of {total}" if total is not None else ""
            logger.info("hwsync: %s: %d%s tensors, %.2f GB, %.1f s", what, n, of, nbytes / 1e9, now - t0)
    if time.perf_counter() - t0 > SLOW_S:
        logger.info("hwsync: %s: done, %d tensors, %.2f GB in %.1f s", what, n, nbytes / 1e9, time.perf_counter() - t0)
