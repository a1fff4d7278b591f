"""Public face: ``from hwsync.trl import GRPOTrainer`` (and :func:`serve_args`, :class:`SyncOptions`).

The code lives in :mod:`hwsync.integrations.trl`.
"""

from hwsync.integrations.trl import ENV, GRPOTrainer, OptionError, SyncOptions, UnsupportedSetupError, serve_args

__all__ = ["ENV", "GRPOTrainer", "OptionError", "SyncOptions", "UnsupportedSetupError", "serve_args"]
