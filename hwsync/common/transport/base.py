"""The :class:`Link` interface every data plane implements (see :mod:`hwsync.common.transport`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Transfer(Protocol):
    """A broadcast in flight (``torch.distributed.Work``-like)."""

    def wait(self) -> None:
        """Order the caller's current stream after the transfer (accelerators: the host does not block;
        gloo: the host blocks until the bytes are there)."""


@dataclass(frozen=True)
class LinkSpec:
    """Where and how to form one data-plane group (plain data: it crosses processes as JSON)."""

    host: str
    """Rendezvous store host (the engine's control store)."""
    port: int
    prefix: str
    """Store key prefix of this group; derived from the shared token so that no store reader can guess it."""
    world_size: int
    """1 (trainer) + number of engine workers."""
    timeout_s: float


@runtime_checkable
class Link(Protocol):
    """One data-plane group: rank 0 is the trainer, ranks 1.. are engine workers.

    ``broadcast`` is stream-ordered on accelerators: it starts after the work already queued on the caller's
    current stream (so a buffer packed just before is complete) and runs on the link's own stream, overlapping
    whatever the caller queues next; ``Transfer.wait()`` orders the current stream after it.
    """

    device: torch.device
    """Device every buffer passed to :meth:`broadcast` must live on."""
    rank: int
    world_size: int
    persistent: bool
    """Whether the group may stay open between syncs (reused by the next one). ``False`` closes it after every sync:
    gloo's, whose listener would accept anyone's connections meanwhile until the process runs out of file
    descriptors (and gloo then aborts it)."""

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Transfer:
        """Send ``tensor`` (contiguous, on :attr:`device`) from ``src`` into the same-shaped tensor of every
        other rank."""

    def close(self) -> None:
        """Release the group (idempotent); a later sync opens a new one."""
