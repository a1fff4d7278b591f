"""hwsync's release number, in a module of its own: code inside the package reads it without importing the package's
lazy facade (``hwsync/__init__.py`` names every public module, so importing it from within would close a cycle)."""

from __future__ import annotations

__version__ = "0.1.0"
