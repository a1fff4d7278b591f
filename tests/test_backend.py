"""Backend registry and the device surface, on whatever hardware this machine has."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import sys
import textwrap
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
import torch

from hwsync.common import backend as backend_mod
from hwsync.common.backend import (
    Backend,
    available_backends,
    backend_for_device,
    get_backend,
    known_backends,
    refresh_backends,
    register_backend,
    unregister_backend,
)
from hwsync.common.cpu import CpuBackend
from hwsync.common.errors import BackendUnavailableError, HwsyncError

HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HWSYNC_BACKEND", raising=False)


def test_builtin_backends_are_known_with_their_dist_backends() -> None:
    known = known_backends()
    assert {n: (b.device_type, b.dist_backend) for n, b in known.items() if n in ("cpu", "cuda", "npu")} == {
        "cpu": ("cpu", "gloo"),
        "cuda": ("cuda", "nccl"),
        "npu": ("npu", "hccl"),
    }
    assert known["npu"].priority > known["cuda"].priority > known["cpu"].priority


def test_auto_detection_picks_the_best_available_backend() -> None:
    chosen = get_backend()
    assert chosen.unavailable_reason() is None
    better = [b.name for b in known_backends().values() if b.priority > chosen.priority and b.is_available()]
    assert better == []
    if not torch.cuda.is_available() and not HAS_TORCH_NPU:
        assert chosen.name == "cpu"
    assert next(iter(available_backends())) == chosen.name


def test_env_override_selects_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HWSYNC_BACKEND", "cpu")
    assert get_backend().name == "cpu"


def test_unknown_backend_name_names_the_known_ones() -> None:
    with pytest.raises(BackendUnavailableError, match=r"unknown hwsync backend 'xpu'; known: .*cpu, cuda, npu"):
        get_backend("xpu")


def test_unknown_backend_from_env_says_where_it_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HWSYNC_BACKEND", "tpu")
    with pytest.raises(BackendUnavailableError, match=r"'tpu' \(from \$HWSYNC_BACKEND\)"):
        get_backend()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_unavailable_says_why() -> None:
    with pytest.raises(BackendUnavailableError, match="'cuda' is unavailable: .*(no CUDA support|no GPU is visible)"):
        get_backend("cuda")


@pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed here")
def test_npu_without_torch_npu_names_the_install_command() -> None:
    with pytest.raises(BackendUnavailableError, match=r"torch_npu is not installed: pip install 'hwsync\[npu\]'"):
        get_backend("npu")
    assert "torch_npu" not in sys.modules  # probing never imports it


def test_selected_backend_device_surface() -> None:
    b = get_backend()
    assert b.device_count() >= 1
    dev = b.device(0) if b.device_type != "cpu" else b.device()
    assert b.owns(dev) and not b.owns("meta")
    with b.device_context(dev):
        assert b.current_device() == dev
        stream = b.current_stream(dev)
        if b.device_type == "cpu":
            assert stream is None
        else:
            assert isinstance(stream, torch.Stream) and stream.device == dev
        x = torch.ones(4, device=dev) * 2
        b.synchronize(dev)
        assert x.sum().item() == 8
    assert backend_for_device(dev) is b


def test_device_context_in_a_thread_pool_worker() -> None:
    """Workers start on device 0; the context must make the requested device (and its stream) current."""
    b = get_backend()
    if b.device_type == "cpu" or b.device_count() < 2:
        pytest.skip(f"needs 2 accelerator devices ({b.name} has {b.device_count()})")
    target = b.device(1)

    def work() -> tuple[torch.device, torch.device, torch.device, bool]:
        before = b.current_device()
        with b.device_context(target):
            stream = b.current_stream(target)
            # vLLM's PyNcclCommunicator reads stream.cuda_stream: the runtime's own class is needed.
            native = hasattr(stream, f"{b.device_type}_stream")
            return before, b.current_device(), stream.device, native

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        before, inside, stream_dev, native = pool.submit(work).result()
    assert before.index == 0 and inside == target and stream_dev == target and native


class LoopbackBackend(CpuBackend):
    """A third-party backend as a plugin would ship it (here: CPU under another name, top priority)."""

    name = "loopback-test"
    priority = 1000


def test_register_backend_in_process() -> None:
    register_backend(LoopbackBackend)
    try:
        assert get_backend().name == "loopback-test"  # highest priority wins auto-detection
        assert isinstance(get_backend("loopback-test"), LoopbackBackend)
        with pytest.raises(BackendUnavailableError, match="already registered"):
            register_backend(type("Other", (LoopbackBackend,), {}))
        register_backend(LoopbackBackend)  # the same class again is a no-op
    finally:
        unregister_backend("loopback-test")
    assert get_backend().name != "loopback-test"


def test_per_device_policy_comes_from_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bucket size and where LoRA layouts are traced are the device's backend's to say: a new backend's device kind is
    not silently treated like the CPU, and a kind no backend drives gets the base class's policy."""
    from hwsync.engine.vllm.lora_slots import trace_device
    from hwsync.trainer.api import default_bucket_mb

    monkeypatch.delenv("HWSYNC_BUCKET_MB", raising=False)

    class WideBackend(CpuBackend):
        name = "wide-test"
        device_type = "meta"
        bucket_mb = 128.0
        traces_in_float64 = True

    assert default_bucket_mb("cpu") == 64 and default_bucket_mb("cuda") == 512 and default_bucket_mb("npu") == 512
    assert default_bucket_mb("xla") == Backend.bucket_mb
    register_backend(WideBackend)
    try:
        assert default_bucket_mb("meta") == 128
        assert trace_device("meta") == torch.device("meta")  # this backend traces on its device
        monkeypatch.setattr(WideBackend, "traces_in_float64", False)
        assert trace_device("meta") == torch.device("cpu")
    finally:
        unregister_backend("wide-test")
    assert trace_device(None) == trace_device("cpu") == torch.device("cpu")
    monkeypatch.setenv("HWSYNC_BUCKET_MB", "32")
    assert default_bucket_mb("cpu") == 32


def test_verify_gates_come_from_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Verify's logprob gate is the device's policy too: a new backend brings its measured gates, a dtype it has
    none for gets the loosest gate, and the built-in devices keep theirs."""
    from hwsync.common.gate import LOOSEST, Gate
    from hwsync.trainer.verify import GATES, gate_for

    monkeypatch.delenv("HWSYNC_VERIFY_GATE", raising=False)
    measured = Gate(mean_abs=0.2, p90_abs=0.6, mean_prob=0.02)

    class GatedBackend(CpuBackend):
        name = "gated-test"
        device_type = "meta"
        verify_gates = {"bfloat16": measured}

    assert gate_for("meta", "bfloat16") == LOOSEST
    register_backend(GatedBackend)
    try:
        assert gate_for("meta", "bfloat16") == GATES[("meta", "bfloat16")] == measured
        assert gate_for("meta", "float32") == LOOSEST
    finally:
        unregister_backend("gated-test")
    assert ("meta", "bfloat16") not in GATES
    assert GATES[("cpu", "float32")].max_abs is not None and ("cuda", "bfloat16") in GATES


def test_register_backend_rejects_non_backends() -> None:
    with pytest.raises(BackendUnavailableError, match="not a hwsync.Backend subclass"):
        register_backend(object)  # type: ignore[arg-type]

    class NoName(Backend):  # abstract bits irrelevant: rejected before instantiation
        device_type = "cpu"
        dist_backend = "gloo"

    with pytest.raises(BackendUnavailableError, match="must set class attribute 'name'"):
        register_backend(NoName)


@pytest.fixture
def plugin_dist(tmp_path: Path) -> Iterator[Path]:
    """A real installed distribution declaring two hwsync.backends entry points (one broken)."""
    (tmp_path / "hwsync_plugin_test.py").write_text(
        textwrap.dedent("""
        from hwsync.common.cpu import CpuBackend

        class PluginBackend(CpuBackend):
            name = "plugin-test"
            priority = -5
    """)
    )
    info = tmp_path / "hwsync_plugin_test-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hwsync-plugin-test\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[hwsync.backends]\nplugin-test = hwsync_plugin_test:PluginBackend\n"
        "broken-test = hwsync_plugin_test:DoesNotExist\n"
    )
    sys.path.insert(0, str(tmp_path))
    refresh_backends()
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("hwsync_plugin_test", None)
        refresh_backends()


def test_entry_point_backends_are_discovered(plugin_dist: Path) -> None:
    assert "plugin-test" in known_backends()
    assert get_backend("plugin-test").name == "plugin-test"
    assert get_backend().name != "plugin-test"  # low priority: does not win auto-detection
    with pytest.raises(BackendUnavailableError, match="broken-test = hwsync_plugin_test:DoesNotExist failed to load"):
        get_backend("broken-test")


def test_installed_package_declares_the_builtin_entry_points() -> None:
    try:
        eps = {ep.name: ep.value for ep in metadata.entry_points(group=backend_mod.ENTRY_POINT_GROUP)}
    except Exception as e:  # pragma: no cover
        pytest.fail(f"entry point metadata unreadable: {e}")
    if not eps:
        pytest.skip("hwsync is not pip-installed here (running from a source tree)")
    assert eps["cpu"] == "hwsync.common.cpu:CpuBackend"
    assert eps["cuda"] == "hwsync.common.cuda:CudaBackend"
    assert eps["npu"] == "hwsync.common.npu:NpuBackend"


def test_backend_for_unknown_device_kind() -> None:
    with pytest.raises(BackendUnavailableError, match="no hwsync backend drives device xpu:0"):
        backend_for_device("xpu:0")


def test_backend_errors_are_hwsync_errors() -> None:
    assert issubclass(BackendUnavailableError, HwsyncError)
