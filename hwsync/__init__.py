"""hwsync: correct, fast trainer -> vLLM weight sync for GRPO/GSPO + LoRA on MoE models.

The top-level names are imported lazily so that ``import hwsync`` stays cheap (no vLLM, no transformers)
and so that plugins loaded inside vLLM or ms-swift processes do not drag in what they do not use.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hwsync.errors import (
    AdapterFormatError,
    BackendUnavailableError,
    BroadcastError,
    HwsyncError,
    LayoutError,
    PatchError,
    ResolutionError,
    StaleEngineError,
    SyncError,
    VerifyError,
    VersionError,
)

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    "Backend": "hwsync.backend",
    "get_backend": "hwsync.backend",
    "register_backend": "hwsync.backend",
    "available_backends": "hwsync.backend",
    "known_backends": "hwsync.backend",
    "backend_for_device": "hwsync.backend",
    "broadcast": "hwsync.comm",
    "broadcast_coalesced": "hwsync.comm",
    "sync": "hwsync.sync",
    "verify": "hwsync.sync",
    "SyncReport": "hwsync.sync",
    "connect": "hwsync.sync",
    "ExpertLayout": "hwsync.layouts",
    "ExpertSharding": "hwsync.layouts",
}

__all__ = [
    "__version__",
    *sorted(_LAZY),
    "AdapterFormatError",
    "BackendUnavailableError",
    "BroadcastError",
    "HwsyncError",
    "LayoutError",
    "PatchError",
    "ResolutionError",
    "StaleEngineError",
    "SyncError",
    "VerifyError",
    "VersionError",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hwsync' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:  # pragma: no cover - for type checkers only
    from hwsync.backend import (
        Backend,
        available_backends,
        backend_for_device,
        get_backend,
        known_backends,
        register_backend,
    )
    from hwsync.comm import broadcast, broadcast_coalesced
    from hwsync.layouts import ExpertLayout, ExpertSharding
    from hwsync.sync import SyncReport, connect, sync, verify
