"""hwsync: correct, fast trainer -> vLLM weight sync for GRPO/GSPO + LoRA on MoE models.

The top-level names are imported lazily so that ``import hwsync`` stays cheap (no vLLM, no transformers)
and so that plugins loaded inside vLLM or ms-swift processes do not drag in what they do not use.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hwsync.errors import (
    AdapterFormatError,
    EngineBusyError,
    OptionError,
    PlanChangedError,
    UnsupportedSetupError,
    BackendUnavailableError,
    BroadcastError,
    HwsyncError,
    LayoutError,
    PatchError,
    ResolutionError,
    StaleEngineError,
    EngineAsleepError,
    SyncError,
    VerifyError,
    VersionError,
)

from hwsync.version import __version__


def _map_source_checkout_patches() -> None:
    """Make ``hwsync.patches`` importable from a source checkout (``PYTHONPATH=.``, ``python -m pytest``).

    The wheel installs ``patches/`` as ``hwsync.patches``; in a checkout that folder sits beside ``hwsync/``. When
    this package was imported from a checkout, ``hwsync.patches`` must come from the *same* checkout (not from
    another tree an editable install points at), so its folder is added to this package's search path under its
    own name only: nothing else beside ``hwsync/`` becomes importable.
    """
    import importlib.abc
    import importlib.machinery
    import importlib.util
    import sys
    from collections.abc import Sequence
    from pathlib import Path
    from types import ModuleType

    here = Path(__file__).resolve().parent
    source = here.parent / "patches"
    if (here / "patches").is_dir() or not (source / "_base.py").is_file():
        return

    class _SourcePatches(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                      target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
            if fullname != "hwsync.patches":
                return None
            return importlib.util.spec_from_file_location(fullname, source / "__init__.py",
                                                          submodule_search_locations=[str(source)])

    sys.meta_path.insert(0, _SourcePatches())


_map_source_checkout_patches()

_LAZY: dict[str, str] = {
    "Backend": "hwsync.backend",
    "get_backend": "hwsync.backend",
    "register_backend": "hwsync.backend",
    "available_backends": "hwsync.backend",
    "known_backends": "hwsync.backend",
    "backend_for_device": "hwsync.backend",
    "broadcast": "hwsync.comm",
    "broadcast_coalesced": "hwsync.comm",
    "sync": "hwsync.api",
    "generate": "hwsync.api",
    "verify": "hwsync.verify",
    "agreement": "hwsync.verify",
    "SyncReport": "hwsync.report",
    "Strategy": "hwsync.wire",
    "as_engine": "hwsync.api",
    "TransferBackendEngine": "hwsync.transfer_backend",
    "connect": "hwsync.server",
    "serve": "hwsync.server",
    "new_token": "hwsync.tokens",
    "ExpertLayout": "hwsync.layouts",
    "ExpertSharding": "hwsync.layouts",
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
    # `hwsync.verify` is the module itself, callable as the function (`hwsync.verify(...)`, `hwsync.verify.check`):
    # importing the submodule rebinds the package attribute anyway, so both spellings must mean one object
    value = mod if name == module.rsplit(".", 1)[-1] and callable(mod) else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:  # pragma: no cover - for type checkers only ("X as X": re-exported, the lazy names above)
    from hwsync.api import as_engine as as_engine
    from hwsync.api import generate as generate
    from hwsync.api import sync as sync
    from hwsync.transfer_backend import TransferBackendEngine as TransferBackendEngine
    from hwsync.backend import Backend as Backend
    from hwsync.backend import available_backends as available_backends
    from hwsync.backend import backend_for_device as backend_for_device
    from hwsync.backend import get_backend as get_backend
    from hwsync.backend import known_backends as known_backends
    from hwsync.backend import register_backend as register_backend
    from hwsync.comm import broadcast as broadcast
    from hwsync.comm import broadcast_coalesced as broadcast_coalesced
    from hwsync.layouts import ExpertLayout as ExpertLayout
    from hwsync.layouts import ExpertSharding as ExpertSharding
    from hwsync.report import SyncReport as SyncReport
    from hwsync.server import connect as connect
    from hwsync.server import serve as serve
    from hwsync.verify import agreement as agreement
    from hwsync.verify import verify as verify
    from hwsync.wire import Strategy as Strategy
