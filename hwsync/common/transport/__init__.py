"""Data plane: how a sync's bytes travel from the trainer to the engine workers in another process.

A :class:`Link` is one group of processes (the trainer at rank 0, every engine worker after it) that moves
flat byte buffers by broadcast. Each backend owns the link for its device (``Backend.open_link``):

| backend | link | module |
| --- | --- | --- |
| cpu  | length-checked TCP frames, authenticated rendezvous | ``hwsync.common.cpu.framed`` |
| cuda | NCCL process group          | ``hwsync.common.cuda.link`` |
| npu  | HCCL process group          | ``hwsync.common.npu.link`` |

Everything above the link is shared and lives in this package: both ends of a sync's group
(:mod:`~hwsync.common.transport.plane`: rendezvous, link lifetime, abort), buckets, packing and seals.
"""

from __future__ import annotations

from hwsync.common.transport.base import Link, LinkSpec, Transfer

__all__ = ["Link", "LinkSpec", "Transfer"]
