"""Server mode: the engine in other processes (or hosts); :func:`serve` on its side, :func:`connect` in the trainer.

* :mod:`hwsync.server.protocol` -- the authenticated control channel (threat model in its docstring)
* :mod:`hwsync.server.server`   -- :class:`SyncServer` / :func:`serve` (engine side)
* :mod:`hwsync.server.client`   -- :class:`RemoteEngine` / :func:`connect` (trainer side)

Tensors travel over the data plane of :mod:`hwsync.transport`.
"""
from __future__ import annotations

from hwsync.server.client import RemoteEngine, connect
from hwsync.server.server import SyncServer, serve

__all__ = ["RemoteEngine", "SyncServer", "connect", "serve"]
