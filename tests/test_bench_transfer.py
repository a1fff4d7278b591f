"""The weight-transfer side-by-side benchmark as CI runs it: ``benchmarks/bench_transfer.py`` at tiny shapes on vLLM's
CPU build -- hwsync through vLLM's weight-transfer verbs and hwsync's own path into the same engine, full and
adapter, must leave the engine in the same state (base and LoRA slot checksums, logprobs) and the script says so in
its exit status. vLLM's ipc backend needs CUDA (the GPU job runs it); timings are printed, never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hwsync.testing import on_cpu, require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent


def test_bench_transfer_backend_and_direct_leave_the_same_engine(tmp_path: Path) -> None:
    require_vllm()
    if not on_cpu():
        pytest.skip("the GPU job runs the benchmark at the real size (ci/gpu.sh transfer48)")
    out = tmp_path / "transfer.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_transfer.py"),
            "--layers",
            "2",
            "--syncs",
            "2",
            "--warmup",
            "1",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
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
