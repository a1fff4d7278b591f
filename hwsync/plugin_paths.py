"""``hwsync plugin-path``: where the ms-swift plugin file is, without importing it.

Importing :mod:`hwsync.swift` installs the plugin and imports ms-swift (seconds), so the path is found through the
import system's spec only. Usage: ``swift rlhf ... --external_plugins "$(hwsync plugin-path)"``.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from hwsync.cli import command

__all__ = ["swift_plugin_file"]


def swift_plugin_file() -> Path:
    """The file ms-swift's ``--external_plugins`` should import to route GRPO weight sync through hwsync."""
    spec = importlib.util.find_spec("hwsync.integrations.swift")
    if spec is None or not spec.submodule_search_locations:  # pragma: no cover - broken install
        raise FileNotFoundError("hwsync.swift is not installed with this hwsync; reinstall: pip install -e '.[swift]'")
    return Path(next(iter(spec.submodule_search_locations))) / "plugin.py"


@command(
    "plugin-path", help='print the ms-swift plugin file: swift rlhf ... --external_plugins "$(hwsync plugin-path)"'
)
def plugin_path(args: argparse.Namespace) -> int:
    print(swift_plugin_file())
    return 0
