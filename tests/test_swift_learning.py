"""benchmarks/swift_learning.py: the parts that read ms-swift's logs (its ``format_time`` and ``logging.jsonl``), and
the table for a side whose run failed (ms-swift's own sync on vLLM's CPU build). The runs themselves are a
benchmark: ``python benchmarks/swift_learning.py`` (a GPU runs both sides)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import swift_learning as sl  # noqa: E402


def test_ms_swift_times_read_back() -> None:
    pytest.importorskip("swift")
    from swift.utils import format_time

    for s in (0, 7, 59.6, 61, 3599, 3600, 90061):
        assert sl.seconds(format_time(s)) == round(s)
    with pytest.raises(ValueError, match="not an ms-swift elapsed time"):
        sl.seconds("soon")


def test_steps_and_table_from_a_logging_jsonl(tmp_path: Path) -> None:
    log = tmp_path / "v0-20261128" / "logging.jsonl"
    log.parent.mkdir()
    lines = [
        {"loss": 0.1, "reward": 0.25, "global_step/max_steps": "1/3", "elapsed_time": "2s"},
        {"train_runtime": 9.0},  # the closing record: no reward
        {"reward": 0.5, "global_step/max_steps": "2/3", "elapsed_time": "4s"},
        {"reward": 0.75, "global_step/max_steps": "3/3", "elapsed_time": "1m 6s"},
    ]
    log.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    steps = sl.steps_of(tmp_path)
    assert [s["step"] for s in steps] == [1, 2, 3] and [s["elapsed_s"] for s in steps] == [2.0, 4.0, 66.0]
    runs = [
        {"side": sl.SIDES["swift"], "returncode": 1, "wall_s": 3.0, "steps": [], "error": "AttributeError: x"},
        {"side": sl.SIDES["hwsync"], "returncode": 0, "wall_s": 70.0, "steps": steps, "sync_s": 0.01, "verify_s": 0.5},
    ]
    text = sl.table(runs)
    assert "fails: AttributeError: x" in text
    assert "| hwsync (verify every sync) | 3 | 0.250 | 0.750 | 32.00 | 0.010 | 0.50 |" in text
