"""The sync benchmark's exactness checks, as CI runs them: ``benchmarks/bench_sync.py`` at tiny shapes on vLLM's CPU
build, colocated and in server mode (a second engine process), every strategy. The script exits non-zero when a
synced engine differs from vLLM's own loading of the same weights (or a served engine from the colocated one); its
timings are printed, never asserted (docs/performance.md has the GPU tables). In the GPU job it runs beside other
modules: a fixed KV budget (no start-up profiling), server mode only with a second GPU, bf16 (no transformers gate)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from hwsync.testing import require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_bench_sync_is_exact_colocated_and_served(tmp_path: Path, run_script: Any) -> None:
    require_vllm()
    from hwsync.testing import on_cpu

    out = tmp_path / "bench.json"
    server = on_cpu() or torch.cuda.device_count() >= 2  # one GPU: the served engine would share the trainer's GPU
    env = dict(os.environ) if on_cpu() else {**os.environ, "BENCH_KV_BYTES": str(256 << 20), "BENCH_GPU_BLOCKS": "64"}
    run_script(
        "benchmarks/bench_sync.py",
        *("--layers", "2", "--syncs", "2", "--warmup", "1", *(["--server"] if server else []), "--json", str(out)),
        env=env,
    )
    tables = json.loads(out.read_text())
    assert [r["strategy"] for r in tables["colocate"]] == ["full", "adapter", "hybrid"]
    assert [r["strategy"] for r in tables.get("server", [])] == (["full", "adapter", "hybrid"] if server else [])
    for row in tables["colocate"]:  # the script's own gate, restated on what it measured
        assert row["Δ_vs_vllm_path"] <= 1e-5 + row["Δ_repeat"], row
        assert row["base_equal"] is True, row  # the engine's weights equal vLLM's own path's, tensor for tensor
        assert row["slots_equal"] is (None if row["strategy"] == "full" else True), row
        assert row["first_s"] > 0 and row["seconds"] > 0, row
        if on_cpu():  # CPU fp32: the engine computes like transformers (a bf16 GPU engine does not)
            assert row["Δ_vs_trainer"] <= 1e-4, row
    for row in tables.get("server", []):
        assert row["Δ_vs_colocated"] <= 1e-6, row
        assert row["buckets"] >= 1 and row["MB"] > 0, row
