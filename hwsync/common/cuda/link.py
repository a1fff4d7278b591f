"""The CUDA data plane: a standalone NCCL process group (server mode between GPUs, NVLink / IB / PCIe).

The group is formed through the engine's control store under a prefix derived from the token, so nobody who merely
reaches the store can guess where to join. Collectives run on NCCL's own stream after the caller's current stream
(so a bucket packed just before is complete), which lets the sender pack bucket b+1 while bucket b is on the wire.
The NCCL watchdog is told not to tear the process down or dump state when a transfer times out, and its timeout is
set well past the link's own (a trainer that dies mid-sync must not take the rollout engine with it); instead each
wait polls against the link's deadline and aborts the communicator past it (:class:`_Pending`), so the receiver
reports the timeout, marks the engine stale and forms a fresh group next.
Ranks that share one GPU (a server-mode engine beside its trainer on a single-GPU machine) cannot form an NCCL group;
:func:`open_cuda_link` sees that from the ranks' GPU UUIDs and forms a gloo group through host memory instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from hwsync.common.transport.base import LinkSpec

__all__ = ["NcclLink", "peer_devices", "open_cuda_link"]

_QUIET_WATCHDOG = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
"""NCCL watchdog settings of the data-plane group: on a timeout it neither tears the process down nor stops to dump
debug state (on two H200s, 2026-11-28, a killed trainer's stuck broadcast made the watchdog fire at the same moment
as the link's own abort, and the engine stopped answering until it was shut down)."""


def watchdog_timeout_s(link_timeout_s: float) -> float:
    """The group's own collective timeout: well past the link's deadline, so the link's poll-and-abort
    (:class:`_Pending`) always acts first and the watchdog never races it."""
    return 2 * link_timeout_s + 60


logger = logging.getLogger("hwsync.transport")


def peer_devices(store: Any, spec: LinkSpec, rank: int, ident: str) -> list[str]:
    """Every rank's device identity (``ident`` of this one), exchanged through the group's store prefix."""
    ps = dist.PrefixStore(spec.prefix + "devices/", store)
    ps.set(str(rank), ident)
    keys = [str(r) for r in range(spec.world_size)]
    ps.wait(keys, datetime.timedelta(seconds=spec.timeout_s))
    return [ps.get(k).decode() for k in keys]


def open_cuda_link(store: Any, spec: LinkSpec, rank: int, device: torch.device) -> Any:
    """An NCCL link, unless two ranks of the group run on the same GPU (a trainer and a server-mode engine sharing
    one device): NCCL refuses that ("invalid usage"), so every rank then agrees on a gloo link through host
    memory instead -- correct, not fast; give the engine its own GPU for NCCL."""
    from hwsync.common.cpu.link import GlooLink

    ident = str(torch.cuda.get_device_properties(torch.device(device)).uuid)
    devices = peer_devices(store, spec, rank, ident)
    if len(set(devices)) < len(devices):
        if rank == 0:
            logger.warning(
                "hwsync: the trainer and an engine worker share one GPU; NCCL cannot connect two "
                "processes on one device, so the data plane goes through host memory (gloo). Put the "
                "engine on its own GPU for NCCL speed."
            )
        return GlooLink(store, dataclasses.replace(spec, prefix=spec.prefix + "gloo/"), rank)
    return NcclLink(store, spec, rank, device)


class _Pending:
    """An NCCL collective in flight. :meth:`wait` orders the current stream after it, but first polls it from the host
    against the link's deadline: a peer that died mid-sync leaves the collective spinning on the GPU forever (the
    stream, and every host read of a received buffer, would hang with it), and NCCL's own timeout only logs with the
    watchdog's teardown turned off. Past the deadline the communicator is aborted (which frees the GPU) and the wait
    raises, so the receiver reports the timeout, turns stale and keeps serving its other requests."""

    def __init__(self, work: Any, link: NcclLink) -> None:
        self.work = work
        self.link = link

    def wait(self) -> None:
        deadline = time.monotonic() + self.link.timeout_s
        pause = 0.0
        while not self.work.is_completed():
            if time.monotonic() > deadline:
                self.link.close()
                raise TimeoutError(
                    f"NCCL transfer not completed after {self.link.timeout_s:g} s (the peer is gone "
                    "or stalled); the data-plane group was aborted"
                )
            time.sleep(pause)
            pause = min(0.001, pause + 0.00005)  # spin first: a bucket usually lands within microseconds
        self.work.wait()


class NcclLink:
    """Rank ``rank`` of an NCCL group over ``spec`` on ``device``."""

    persistent = True  # kept between syncs (communicator setup is costly); not flood-tested: GPU only

    def __init__(self, store: Any, spec: LinkSpec, rank: int, device: torch.device) -> None:
        self.rank = rank
        self.world_size = spec.world_size
        self.device = torch.device(device)
        self.timeout_s = float(spec.timeout_s)
        self.pg: Any = None  # torch's stubs declare no broadcast on the process group classes
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=watchdog_timeout_s(self.timeout_s))
        saved = {k: os.environ.get(k) for k in _QUIET_WATCHDOG}
        os.environ.update(_QUIET_WATCHDOG)  # read when the group is built
        try:
            with torch.cuda.device(self.device):
                self.pg = dist.ProcessGroupNCCL(dist.PrefixStore(spec.prefix, store), rank, spec.world_size, opts)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> _Pending:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        with torch.cuda.device(self.device):
            return _Pending(self.pg.broadcast([tensor], opts), self)

    def close(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None:
            with contextlib.suppress(Exception):  # closing a broken group must not mask the error that broke it
                pg.abort()
