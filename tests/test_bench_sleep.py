"""``benchmarks/bench_sleep.py`` outside CUDA: its arguments parse (the lead's H200 command line included), and on a
machine without CUDA it refuses with the reason (vLLM's CPU build has no sleep mode) instead of measuring nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_h200_command_line_parses() -> None:
    from bench_sleep import parse

    args = parse(["--shapes", "qwen3-30b-a3b", "--layers", "48", "--rank", "32", "--json", "OUT"])
    assert (args.shapes, args.layers, args.rank, args.json, args.strategies) == (
        "qwen3-30b-a3b",
        48,
        32,
        "OUT",
        "full,adapter",
    )
    with pytest.raises(SystemExit):
        parse(["--strategies", "full,merged"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the CPU path")
def test_refuses_without_cuda(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_sleep.py"), "--layers", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert run.returncode == 2, run.stderr[-2000:]
    assert "no sleep mode" in run.stderr and not out.exists()


def test_kv_cache_and_rollout_budget_arithmetic() -> None:
    """The KV cache is counted once per storage (layers may view one buffer), per token slot of vLLM's blocks, and a
    KV budget becomes tokens and whole sequences, never negative."""
    import types

    from bench_sleep import _kv_cache, _rollout

    shared = torch.zeros(4, 16, dtype=torch.bfloat16)  # 128 bytes, viewed by two layers
    own = torch.zeros(64, dtype=torch.float32)  # 256 bytes
    runner = types.SimpleNamespace(kv_caches=[shared[:2], (shared[2:], own)])
    llm = types.SimpleNamespace(
        llm_engine=types.SimpleNamespace(
            vllm_config=types.SimpleNamespace(cache_config=types.SimpleNamespace(num_gpu_blocks=2, block_size=16))
        )
    )
    assert _kv_cache(llm, runner) == (384, 12.0)
    assert _rollout(1.2e-6, 12.0, 25) == dict(kv_budget_gb=1.2e-6, rollout_tokens=100, rollout_seqs=4)
    assert _rollout(-3.0, 12.0, 25)["rollout_tokens"] == 0


def test_wake_probe_leaves_vllm_as_it_was() -> None:
    """The wake probe wraps vLLM's wake functions only while it is entered, and puts back exactly what was there."""
    pytest.importorskip("vllm")
    from bench_sleep import _wake_probe
    from vllm.device_allocator import cumem
    from vllm.v1.worker.gpu_worker import Worker

    before = (cumem.create_and_map, cumem.CuMemAllocator.wake_up, Worker.wake_up)
    with _wake_probe() as acc:
        assert (cumem.create_and_map, cumem.CuMemAllocator.wake_up, Worker.wake_up) != before
        assert set(acc) >= {"worker_s", "allocator_s", "map_s", "map_n", "copy_s"}
    assert (cumem.create_and_map, cumem.CuMemAllocator.wake_up, Worker.wake_up) == before
