"""One home for hwsync's environment variables (:mod:`hwsync.common.config`): every ``HWSYNC_*`` name the package
spells is registered there with its default and meaning, the integrations' options are among them, the page
docs/configuration.md lists each, and a bad value fails naming the variable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hwsync.common import config
from hwsync.common.errors import OptionError
from hwsync.integrations.options import ENV

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"\bHWSYNC_[A-Z0-9_]*[A-Z0-9]\b")
PREFIXES = {"HWSYNC_VERIFY"}
"""Spelled in prose as a family ("``HWSYNC_VERIFY_*``"), not a variable."""


def _spelled() -> dict[str, str]:
    """Where each ``HWSYNC_*`` name is first spelled in the package (outside the registry itself)."""
    found: dict[str, str] = {}
    for f in sorted((ROOT / "hwsync").rglob("*.py")):
        if f.name == "config.py" and f.parent.name == "common":
            continue
        if "testing" in f.relative_to(ROOT / "hwsync").parts:  # the test harness's own switches (HWSYNC_FAMILIES ..)
            continue
        for n, line in enumerate(f.read_text().splitlines(), 1):
            for name in NAME.findall(line):
                if name not in PREFIXES:
                    found.setdefault(name, f"{f.relative_to(ROOT)}:{n}")
    return found


def test_every_variable_the_package_names_is_registered() -> None:
    spelled = _spelled()
    assert len(spelled) >= 10  # the scan reads the package
    missing = {n: where for n, where in spelled.items() if n not in config.VARIABLES}
    assert not missing, f"HWSYNC_* variables without a home in hwsync.common.config: {missing}"
    unread = set(config.VARIABLES) - set(spelled)
    assert not unread, f"registered but named nowhere else in the package: {sorted(unread)}"


def test_the_integrations_options_are_registered_and_documented() -> None:
    assert set(ENV.values()) <= set(config.VARIABLES)
    page = (ROOT / "docs" / "configuration.md").read_text()
    undocumented = [n for n in config.VARIABLES if f"`{n}`" not in page]
    assert not undocumented, f"not in docs/configuration.md: {undocumented}"


def test_read_and_raw(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HWSYNC_GRAPHS", raising=False)
    assert config.read("HWSYNC_GRAPHS") is True and config.raw("HWSYNC_GRAPHS") == "1"
    monkeypatch.setenv("HWSYNC_GRAPHS", "0")
    assert config.read("HWSYNC_GRAPHS") is False
    monkeypatch.setenv("HWSYNC_DISABLE_PATCHES", " a, b ,,")
    assert config.read("HWSYNC_DISABLE_PATCHES") == {"a", "b"}
    monkeypatch.setenv("HWSYNC_TIMEOUT_S", "soon")
    with pytest.raises(OptionError, match="HWSYNC_TIMEOUT_S='soon'"):
        config.read("HWSYNC_TIMEOUT_S")
    with pytest.raises(KeyError, match="not registered"):
        config.raw("HWSYNC_NOT_A_VARIABLE")
