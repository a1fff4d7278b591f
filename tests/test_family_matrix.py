"""The family table (docs/families.md) is generated: the CPU results plus, for the families the CPU build does not
serve, the GPU job's results (several files from parallel GPU processes merge; later ones win)."""

from __future__ import annotations

import json
from pathlib import Path

from hwsync.testing.family_matrix import main


def _entry(status: str, detail: str = "", **kw: object) -> dict:
    return {"status": status, "detail": detail, "max_diff": None, **kw}


def _results(platform: str, rows: list[tuple[str, str]]) -> dict:
    return {
        "versions": {"vllm": "0.32.0"},
        "platform": platform,
        "syncs": 3,
        "results": [
            {
                "family": f,
                "arch": f.title(),
                "note": "",
                "seconds": 1.0,
                "strategies": {
                    s: (_entry("pass", "3 syncs", max_diff=1e-6) if st == "pass" else _entry(st, f"{st} reason"))
                    for s in ("full", "adapter", "hybrid")
                },
            }
            for f, st in rows
        ],
    }


def test_gpu_rows_replace_only_families_the_cpu_build_does_not_serve(tmp_path: Path) -> None:
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps(_results("cpu", [("mixtral", "pass"), ("jamba", "not_served"), ("dbrx", "not_served")])))
    g1, g2 = tmp_path / "g1.json", tmp_path / "g2.json"
    g1.write_text(json.dumps(_results("H100", [("jamba", "fail"), ("mixtral", "fail")])))
    g2.write_text(json.dumps(_results("H100", [("jamba", "pass")])))  # a later re-run wins
    readme, fam = tmp_path / "README.md", tmp_path / "docs" / "families.md"
    fam.parent.mkdir()
    from hwsync.testing.family_matrix import BEGIN, END

    for f in (readme, fam):
        f.write_text(f"x\n{BEGIN}\n{END}\ny\n")
    merged = tmp_path / "gpu.json"
    assert (
        main(
            [
                "--from",
                str(cpu),
                "--gpu",
                str(g1),
                str(g2),
                "--save-gpu",
                str(merged),
                "--write-readme",
                "--root",
                str(tmp_path),
            ]
        )
        == 0
    )
    table = readme.read_text()
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines() if line.startswith("| ")}
    assert "(GPU)" in rows["jamba **(GPU)**"] and "✅" in rows["jamba **(GPU)**"]
    assert "❌" not in rows["mixtral"]  # served on CPU: its CPU row stays
    assert "dbrx" in rows and "(GPU)" not in rows["dbrx"]  # not run on a GPU: the CPU reason stays
    assert "CPU build: not_served 1, pass 1; GPU: pass 1" in table
    assert {r["family"] for r in json.loads(merged.read_text())["results"]} == {"jamba", "mixtral"}
    assert fam.read_text() == readme.read_text()
