"""gloo groups for the data plane where a library group is wanted: the CUDA backend's fallback when a trainer and an
engine share one GPU (the CPU backend uses :mod:`hwsync.common.cpu.framed`)."""

from __future__ import annotations

import datetime
import socket
from typing import Any

import torch
import torch.distributed as dist

from hwsync.common.transport.base import LinkSpec

__all__ = ["GlooLink"]


def local_address(host: str, port: int) -> str:
    """The local interface address that reaches ``host`` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port))
            return str(s.getsockname()[0])
        except OSError:
            return host


class _Done:
    def __init__(self, work: Any) -> None:
        self.work = work

    def wait(self) -> None:
        self.work.wait()


class GlooLink:
    """Rank ``rank`` of a gloo group formed through ``store`` under ``spec.prefix`` (independent of any default
    group the trainer or vLLM initialised).

    Not :attr:`~hwsync.common.transport.base.Link.persistent`: gloo's TCP listener accepts any connection while its
    group lives and leaks a descriptor for each one that closes before gloo's own handshake; at the descriptor limit it
    aborts the process (``gloo::EnforceNotMet ... accept: Too many open files``). The group therefore exists only
    while a sync forms it and moves bytes, and :meth:`close` releases its listener."""

    persistent = False

    def __init__(self, store: Any, spec: LinkSpec, rank: int) -> None:
        self.rank = rank
        self.world_size = spec.world_size
        self.device = torch.device("cpu")
        opts: Any = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private in torch's stubs
        # gloo listens for its peers on the interface this process reaches the rendezvous on (loopback for a
        # loopback group), never on whatever the machine's hostname resolves to
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address(spec.host, spec.port))]
        opts._timeout = datetime.timedelta(seconds=spec.timeout_s)
        self.pg: Any = dist.ProcessGroupGloo(dist.PrefixStore(spec.prefix, store), rank, spec.world_size, opts)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> _Done:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        return _Done(self.pg.broadcast([tensor], opts))

    def close(self) -> None:
        self.pg = None  # gloo has no abort; dropping the group closes its sockets and its listener
