"""Docs as reference (issue 41): README <= 8 KB, docs/performance.md <= 15 KB, no line over 200 characters in the
README, docs/*.md and hwsync/patches/README.md (a failure names file:line)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINE = 200
# Files whose wide table rows are not cut yet (none left: a table's long cells go to notes under it). An entry must
# still have a long line: fix a file, then drop it from here.
PENDING: set[str] = set()
WHOLE_FILE: set[str] = set()  # files skipped whole (none)


def _docs() -> list[Path]:
    return [ROOT / "README.md", ROOT / "hwsync" / "patches" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _long(path: Path, tables: bool) -> list[str]:
    """Lines over the limit; with ``tables`` False, table rows and generated blocks (between ``<!-- ...:begin`` and
    ``...:end -->`` markers) are left to PENDING."""
    out, generated = [], False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("<!--") and ":begin" in line:
            generated = True
        elif line.startswith("<!--") and ":end" in line:
            generated = False
        pending = generated or line.lstrip().startswith("|") or str(path.relative_to(ROOT)) in WHOLE_FILE
        if len(line) > MAX_LINE and (tables or not pending):
            out.append(f"{path.relative_to(ROOT)}:{n}: {len(line)} characters")
    return out


def test_no_line_over_200_characters() -> None:
    bad = [hit for p in _docs() for hit in _long(p, tables=str(p.relative_to(ROOT)) not in PENDING)]
    assert not bad, (
        "lines over 200 characters (rewrap prose; shorten table cells, detail under the table):\n" + "\n".join(bad)
    )


def test_pending_list_only_names_files_still_pending() -> None:
    done = [f for f in sorted(PENDING) if not _long(ROOT / f, tables=True)]
    assert not done, f"no long line left in {done}: remove them from PENDING"


def test_readme_and_performance_sizes() -> None:
    readme = (ROOT / "README.md").stat().st_size
    perf = (ROOT / "docs" / "performance.md").stat().st_size
    assert readme <= 8 * 1000, f"README.md is {readme} bytes (<= 8 KB: a product page; detail in docs/)"
    assert perf <= 15 * 1000, (
        f"docs/performance.md is {perf} bytes (<= 15 KB: latest numbers by topic; history in runs.md)"
    )
