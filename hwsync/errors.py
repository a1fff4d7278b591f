"""One exception family, so callers can catch everything hwsync refuses with a single ``except``.

Every error says what is wrong *and* how to fix it; nothing is half-applied when one is raised.
"""
from __future__ import annotations

__all__ = [
    "HwsyncError",
    "BackendUnavailableError",
    "BroadcastError",
    "LayoutError",
    "ResolutionError",
    "AdapterFormatError",
    "SyncError",
    "StaleEngineError",
    "VersionError",
    "VerifyError",
    "PatchError",
]


class HwsyncError(RuntimeError):
    """Base class of every error hwsync raises on purpose."""


class BackendUnavailableError(HwsyncError):
    """A requested device backend is unknown or its runtime is missing."""


class BroadcastError(HwsyncError):
    """A broadcast was called with arguments that cannot work (device mismatch, bad src, ...)."""


class LayoutError(HwsyncError):
    """Expert tensors do not fit the declared layout / sharding."""


class ResolutionError(HwsyncError):
    """Trainer names could not be mapped onto the receiver's live parameters."""


class AdapterFormatError(HwsyncError):
    """An adapter cannot be converted (not LoRA, unsupported options, bad rank...)."""


class SyncError(HwsyncError):
    """A sync could not be completed; the receiver keeps its previous consistent state or is marked stale."""


class StaleEngineError(SyncError):
    """The engine holds a partially applied weight set and must not serve until a full sync lands."""


class VersionError(SyncError):
    """A receiver was offered a weight version older than (or equal to) the one it already serves."""


class VerifyError(HwsyncError):
    """Engine and trainer disagree on logprobs by more than the tolerance."""


class PatchError(HwsyncError):
    """A patch could not be applied or removed cleanly."""
