"""Shared test setup: tiny offline checkpoints, hardware markers, thread count.

Markers (declared in pyproject.toml) decide what a test needs; a missing piece skips the test with a reason
naming it. On the CPU CI job (``CI=true``) a missing vLLM or ms-swift *fails* instead: that job exists to run
those tests for real.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from hwsync.testing import make_tiny_moe, require_vllm


def _configure_threads() -> None:
    """Two cores are shared by the test runner, vLLM's in-process engine and sometimes gloo peers:
    oversubscribing them makes everything slower. OMP_NUM_THREADS, when set, wins."""
    import torch

    wanted = int(os.environ.get("OMP_NUM_THREADS") or min(4, os.cpu_count() or 1))
    torch.set_num_threads(max(1, wanted))


_configure_threads()


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen3-MoE checkpoint (fp32, seed 0); read-only for tests: copy it before writing."""
    return make_tiny_moe(tmp_path_factory.mktemp("tiny_qwen3_moe"), "qwen3_moe")


@pytest.fixture(scope="session")
def tiny_qwen3_5_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen3.5-MoE text checkpoint (GDN + attention layers, MTP weights; fp32, seed 0)."""
    return make_tiny_moe(tmp_path_factory.mktemp("tiny_qwen3_5_moe"), "qwen3_5_moe")


ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def run_script() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run a repository script (``benchmarks/...``) in a fresh interpreter from the repository root; the test fails
    with the output's tail unless it exits 0. Returns the finished process (its stdout for further checks)."""

    def run(
        script: str, *args: str, env: dict[str, str] | None = None, timeout: float = 900
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [sys.executable, str(ROOT / script), *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        return proc

    return run


def _on_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _npu_count() -> int:
    if importlib.util.find_spec("torch_npu") is None:
        return 0
    try:
        import torch
        import torch_npu  # noqa: F401

        return torch.npu.device_count() if torch.npu.is_available() else 0
    except Exception:  # noqa: BLE001  (torch_npu imports but CANN / the driver is missing)
        return 0


def pytest_runtest_setup(item: pytest.Item) -> None:
    markers = {m.name for m in item.iter_markers()}
    if "vllm" in markers:
        require_vllm()
    if "swift" in markers and importlib.util.find_spec("swift") is None:
        reason = "ms-swift is not installed (pip install 'ms-swift==4.6.0' msgspec)"
        if _on_ci():
            pytest.fail(f"CI=true but {reason}", pytrace=False)
        pytest.skip(reason)
    if "cuda" in markers and _cuda_count() == 0:
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    if "npu" in markers and _npu_count() == 0:
        pytest.skip("needs an Ascend NPU (torch_npu with a visible device)")
    if "multigpu" in markers and max(_cuda_count(), _npu_count()) < 2:
        pytest.skip("needs >= 2 GPUs/NPUs on one host")
