"""hwsync: correct, fast trainer -> vLLM weight sync for GRPO/GSPO + LoRA on MoE models.

The top-level names are imported lazily so that ``import hwsync`` stays cheap (no vLLM, no transformers)
and so that plugins loaded inside vLLM or ms-swift processes do not drag in what they do not use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hwsync.common.errors import (
    AdapterFormatError,
    BackendUnavailableError,
    BroadcastError,
    EngineAsleepError,
    EngineBusyError,
    HwsyncError,
    LayoutError,
    OptionError,
    PatchError,
    PlanChangedError,
    ResolutionError,
    StaleEngineError,
    SyncError,
    UnsupportedSetupError,
    VerifyError,
    VersionError,
)
from hwsync.common.version import __version__

_LAZY: dict[str, str] = {
    "Backend": "hwsync.common.backend",
    "get_backend": "hwsync.common.backend",
    "register_backend": "hwsync.common.backend",
    "available_backends": "hwsync.common.backend",
    "known_backends": "hwsync.common.backend",
    "backend_for_device": "hwsync.common.backend",
    "broadcast": "hwsync.common.comm",
    "broadcast_coalesced": "hwsync.common.comm",
    "sync": "hwsync.trainer.api",
    "generate": "hwsync.trainer.api",
    "verify": "hwsync.trainer.verify",
    "agreement": "hwsync.trainer.verify",
    "SyncReport": "hwsync.trainer.report",
    "Strategy": "hwsync.common.wire",
    "as_engine": "hwsync.trainer.api",
    "TransferBackendEngine": "hwsync.trainer.transfer_backend",
    "connect": "hwsync.trainer.client",
    "serve": "hwsync.engine.server",
    "new_token": "hwsync.common.tokens",
    "ExpertLayout": "hwsync.common.layouts",
    "ExpertSharding": "hwsync.common.layouts",
}

__all__ = [
    "__version__",
    *sorted(_LAZY),
    "AdapterFormatError",
    "EngineBusyError",
    "OptionError",
    "PlanChangedError",
    "UnsupportedSetupError",
    "BackendUnavailableError",
    "BroadcastError",
    "HwsyncError",
    "LayoutError",
    "PatchError",
    "ResolutionError",
    "StaleEngineError",
    "EngineAsleepError",
    "SyncError",
    "VerifyError",
    "VersionError",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hwsync' has no attribute {name!r}")
    mod = importlib.import_module(module)
    # `hwsync.verify` is the module hwsync.trainer.verify itself, callable as the function (`hwsync.verify(...)`,
    # `hwsync.verify.check`): both spellings mean one object
    value = mod if name == module.rsplit(".", 1)[-1] and callable(mod) else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:  # pragma: no cover - for type checkers only ("X as X": re-exported, the lazy names above)
    from hwsync.common.backend import Backend as Backend
    from hwsync.common.backend import available_backends as available_backends
    from hwsync.common.backend import backend_for_device as backend_for_device
    from hwsync.common.backend import get_backend as get_backend
    from hwsync.common.backend import known_backends as known_backends
    from hwsync.common.backend import register_backend as register_backend
    from hwsync.common.comm import broadcast as broadcast
    from hwsync.common.comm import broadcast_coalesced as broadcast_coalesced
    from hwsync.common.layouts import ExpertLayout as ExpertLayout
    from hwsync.common.layouts import ExpertSharding as ExpertSharding
    from hwsync.common.wire import Strategy as Strategy
    from hwsync.engine.server import serve as serve
    from hwsync.trainer.api import as_engine as as_engine
    from hwsync.trainer.api import generate as generate
    from hwsync.trainer.api import sync as sync
    from hwsync.trainer.client import connect as connect
    from hwsync.trainer.report import SyncReport as SyncReport
    from hwsync.trainer.transfer_backend import TransferBackendEngine as TransferBackendEngine
    from hwsync.trainer.verify import agreement as agreement
    from hwsync.trainer.verify import verify as verify
