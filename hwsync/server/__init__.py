"""Public face of server mode: :func:`serve` on the engine's side, :func:`connect` in the trainer.

The code lives in :mod:`hwsync.engine.server` (:class:`SyncServer`, :func:`serve`), :mod:`hwsync.trainer.client`
(:class:`RemoteEngine`, :func:`connect`) and :mod:`hwsync.common.protocol` (the control channel).
"""

from hwsync.engine.server import SyncServer, serve
from hwsync.trainer.client import RemoteEngine, connect

__all__ = ["RemoteEngine", "SyncServer", "connect", "serve"]
