"""The GRPO step bench and the depth study run, on the platform's engine, and say what they measured.

``benchmarks/bench_step.py`` (tiny MoE on CPU): a few GRPO-shaped steps per run with hwsync's guard inside, no false
alarm, every phase timed. ``benchmarks/verify_depth.py`` (CPU fp32, where vLLM computes like transformers): the
engine's residual stream equals the trainer's layer by layer to fp32 rounding and every token is routed to the same
experts -- no semantic difference between vLLM's and transformers' Qwen3-MoE for the check to mistake for numerics.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hwsync.testing import on_cpu

pytestmark = pytest.mark.vllm


def test_bench_step_runs_the_guard_without_false_alarms(tmp_path: Path, run_script: Any) -> None:
    out = tmp_path / "step.json"
    run_script("benchmarks/bench_step.py", "--runs", "adapter:8,full", "--steps", "3", "--strict", "--json", str(out))
    rows = json.loads(out.read_text())
    assert [r["run"] for r in rows] == ["adapter r8", "full"]
    for r in rows:
        assert r["false_alarms"] == 0, r["alarms"]
        assert r["steps"] == 3
        assert r["guard_s"] > 0 and r["sync_s"] > 0 and r["generate_s"] > 0 and r["train_s"] > 0, r
        assert 0 < r["guard_share"] < 1, r
        assert r["spread_mean"] is not None and r["spread_mean"] > 0, r  # the first check measured the spread
        assert any("verify after" in line for line in r["log"]), r["log"]


@pytest.mark.skipif(not on_cpu(), reason="CPU fp32: vLLM's CPU build computes like transformers")
def test_engine_and_trainer_compute_the_same_model_layer_by_layer(tmp_path: Path, run_script: Any) -> None:
    out = tmp_path / "depth.json"
    run_script("benchmarks/verify_depth.py", "--layers", "2,4", "--dtypes", "float32", "--json", str(out))
    rows = json.loads(out.read_text())
    assert [r["depth"] for r in rows] == [2, 4]
    for r in rows:
        assert r["layer0_rel"] < 1e-5, r  # fp32 rounding, not O(1): no semantic difference in the first layer
        assert r["mean_abs"] < 1e-4, r
        for layer in r["layers"]:
            assert layer.get("route_differ", 0) == 0, layer  # the same experts for every token in every layer
            assert layer["rel_median"] < 1e-4, layer
