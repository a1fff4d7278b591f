"""Generated Markdown tables whose rows stay short (docs: no line over 200 characters): prose wrapped, long cell texts
(reasons, refusals, descriptions) numbered once as notes under the table, each identical text one note."""

from __future__ import annotations

import textwrap

__all__ = ["Notes", "wrap"]

WIDTH = 120


def wrap(text: str, indent: str = "") -> str:
    """``text`` as lines of at most :data:`WIDTH` characters (continuation lines indented by ``indent``)."""
    return textwrap.fill(text, width=WIDTH, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


class Notes:
    """Numbered notes for a table's long cells: :meth:`ref` in the cell, :meth:`lines` under the table."""

    def __init__(self) -> None:
        self._numbers: dict[str, int] = {}

    def ref(self, text: str) -> str:
        """The cell's reference to ``text`` ("" for no text): ``note N``, N the same for the same text."""
        if not text:
            return ""
        return f"note {self._numbers.setdefault(text, len(self._numbers) + 1)}"

    def lines(self, title: str = "Notes") -> list[str]:
        """The notes as a numbered list, wrapped; nothing when no cell referred to one."""
        if not self._numbers:
            return []
        items = [wrap(f"{n}. {text}", indent=" " * (len(str(n)) + 2)) for text, n in self._numbers.items()]
        return ["", f"{title}:", "", *items]
