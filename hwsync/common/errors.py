"""One exception family, so callers can catch everything hwsync refuses with a single ``except``.

Every error says what is wrong *and* how to fix it; nothing is half-applied when one is raised. This module is the
one registry of hwsync's errors: an error raised in the engine process reaches the trainer as the same class
(:func:`encode_error` / :func:`decode_error`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "encode_error",
    "decode_error",
    "HwsyncError",
    "BackendUnavailableError",
    "BroadcastError",
    "LayoutError",
    "ResolutionError",
    "AdapterFormatError",
    "SyncError",
    "StaleEngineError",
    "EngineAsleepError",
    "EngineBusyError",
    "VersionError",
    "VerifyError",
    "PatchError",
    "PlanChangedError",
    "OptionError",
    "PluginError",
    "UnsupportedSetupError",
    "FixtureConfigError",
    "UnsupportedVersionError",
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


class EngineAsleepError(SyncError):
    """The engine's weights are not in device memory (vLLM sleep mode): wake it, then sync; nothing was written."""


class EngineBusyError(SyncError):
    """A served engine turned a connection away because all its slots are held (try again later); the token was not
    refused."""


class VersionError(SyncError):
    """A receiver was offered a weight version older than (or equal to) the one it already serves."""


class VerifyError(HwsyncError):
    """Engine and trainer disagree on logprobs by more than the tolerance."""


class PatchError(HwsyncError):
    """A patch could not be applied or removed cleanly."""


class PlanChangedError(SyncError):
    """The engine no longer matches the sync plan the trainer cached (another sync, a restart, a failure):
    :func:`hwsync.sync` re-plans once and retries; nothing was written."""


class OptionError(HwsyncError, ValueError):
    """An option -- an argument of hwsync's API (``strategy=``, ``bucket_mb=``, ...) or an ``HWSYNC_*`` environment
    variable -- holds a value hwsync cannot use, or one it needs is missing; the message names the accepted values."""


class PluginError(HwsyncError):
    """hwsync cannot be installed into this ms-swift (missing, or a version without the hooks it uses)."""


class UnsupportedSetupError(HwsyncError):
    """A training setup hwsync cannot sync correctly (the message names what is missing)."""


class FixtureConfigError(HwsyncError, ValueError):
    """A tiny-model request that vLLM's CPU build or transformers cannot serve; nothing was written."""


def encode_error(error: BaseException) -> dict[str, str]:
    """An error as plain data for the other process (class name + message)."""
    return {"type": type(error).__name__, "message": str(error)}


def decode_error(data: Mapping[str, Any]) -> HwsyncError:
    """The hwsync error :func:`encode_error` described; anything not one of ours becomes a :class:`SyncError`."""
    cls = globals().get(str(data.get("type", "")))
    message = str(data.get("message", "remote error"))
    if isinstance(cls, type) and issubclass(cls, HwsyncError):
        return cls(message)
    return SyncError(f"{data.get('type', 'Error')}: {message}")


class UnsupportedVersionError(HwsyncError):
    """An installed library (vLLM) is outside the version range hwsync supports."""
