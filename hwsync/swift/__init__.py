"""Public face: ``import hwsync.swift`` installs hwsync into ms-swift (``hwsync plugin-path`` for the CLI).

The code lives in :mod:`hwsync.integrations.swift` (importing it installs the plugin).
"""

from hwsync.integrations.swift import (
    ENV,
    OptionError,
    PluginError,
    SwiftOptions,
    UnsupportedSetupError,
    format_summary,
    install,
    installed,
    read_metrics,
    uninstall,
)

__all__ = [
    "ENV",
    "OptionError",
    "PluginError",
    "SwiftOptions",
    "UnsupportedSetupError",
    "format_summary",
    "install",
    "installed",
    "read_metrics",
    "uninstall",
]
