"""The CPU data plane: a standalone gloo process group (server mode on machines without accelerators)."""
from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from hwsync.transport.base import LinkSpec

__all__ = ["GlooLink"]


class _Done:
    def __init__(self, work: Any) -> None:
        self.work = work

    def wait(self) -> None:
        self.work.wait()


class GlooLink:
    """Rank ``rank`` of a gloo group formed through ``store`` under ``spec.prefix`` (independent of any default
    group the trainer or vLLM initialised)."""

    def __init__(self, store: Any, spec: LinkSpec, rank: int) -> None:
        self.rank = rank
        self.world_size = spec.world_size
        self.device = torch.device("cpu")
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(spec.prefix, store), rank, spec.world_size,
                                        datetime.timedelta(seconds=spec.timeout_s))

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> _Done:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        return _Done(self.pg.broadcast([tensor], opts))

    def close(self) -> None:
        self.pg = None  # gloo has no abort; dropping the group closes its sockets
