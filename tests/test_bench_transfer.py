"""The weight-transfer side-by-side benchmark as CI runs it: ``benchmarks/bench_transfer.py`` at tiny shapes on vLLM's
CPU build -- hwsync through vLLM's weight-transfer verbs and hwsync's own path into the same engine, full and
adapter, must leave the engine in the same state (base and LoRA slot checksums, logprobs) and the script says so in
its exit status. vLLM's ipc backend needs CUDA (the GPU job runs it); timings are printed, never asserted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hwsync.testing import on_cpu, require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_bench_transfer_backend_and_direct_leave_the_same_engine(tmp_path: Path, run_script: Any) -> None:
    require_vllm()
    if not on_cpu():
        pytest.skip("the GPU job runs the benchmark at the real size (ci/gpu.sh transfer48)")
    out = tmp_path / "transfer.json"
    proc = run_script(
        "benchmarks/bench_transfer.py", "--layers", "2", "--syncs", "2", "--warmup", "1", "--json", str(out)
    )
    rows = json.loads(out.read_text())
    assert [(r["path"], r["strategy"]) for r in rows] == [
        ("backend", "full"),
        ("direct", "full"),
        ("backend", "adapter"),
        ("direct", "adapter"),
    ]
    for r in rows:
        assert r["equal_to_direct"] is True and r["Δ_vs_direct"] == 0.0, r
        assert r["seconds"] > 0 and r["MB"] > 0, r
    assert "vLLM ipc: not run (CUDA IPC needs a GPU)" in proc.stdout
