"""What the ms-swift plugin refuses, each an :class:`~hwsync.errors.HwsyncError` whose message names the fix."""
from __future__ import annotations

from hwsync.errors import HwsyncError

__all__ = ["OptionError", "PluginError", "UnsupportedSetupError"]


class PluginError(HwsyncError):
    """hwsync cannot be installed into this ms-swift (missing, or a version without the hooks it uses)."""


class OptionError(HwsyncError, ValueError):
    """An ``HWSYNC_*`` environment variable holds a value hwsync cannot use, or one it needs is missing."""


class UnsupportedSetupError(HwsyncError):
    """The ms-swift run is configured in a way the hwsync plugin cannot sync correctly."""
