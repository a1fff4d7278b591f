"""Real two-process broadcasts through ``hwsync.common.comm.broadcast``.

The transport follows ``hwsync.common.backend.get_backend()``: gloo on a CPU machine, nccl on a machine with
two or more GPUs — the module runs unchanged on both. Two ranks are spawned once per module; every
case runs on both ranks and reports back, and each case is one pytest test below.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import json
import os
import traceback
import warnings
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hwsync.common.backend import backend_for_device, get_backend
from hwsync.common.comm import broadcast, broadcast_coalesced
from hwsync.common.errors import BroadcastError, HwsyncError

WORLD = 2
SPAWN_TIMEOUT_S = 300


# --------------------------------------------------------------------------------- data helpers


def pattern(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Deterministic data of any dtype (same on every rank for the same seed), made on the CPU."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 4).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=g).to(dtype)


def raw(t: torch.Tensor) -> torch.Tensor:
    """Bytes of ``t`` on the CPU: bitwise comparison for every dtype (NaN, fp8 and bool included)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    assert torch.equal(raw(got), raw(want)), "received data differs from the source's"


def prepare(
    ctx: Any, shape: tuple[int, ...], dtype: torch.dtype, src: int, seed: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tensor to pass, expected result): src holds the data, receivers start from other data."""
    want = pattern(shape, dtype, seed)
    start = want.clone() if ctx.rank == src else pattern(shape, dtype, seed + 1000)
    if ctx.rank != src and want.numel() > 1:
        assert not torch.equal(raw(start), raw(want)), "receiver must start from different data"
    return start.to(device or ctx.device), want


# ------------------------------------------------------------------------ vLLM-like communicator


class GroupCommunicator:
    """Stands in for vLLM's ``PyNcclCommunicator`` / vllm-ascend's ``PyHcclCommunicator``.

    A real broadcast over a ``torch.distributed`` group that asserts what those communicators need:
    the tensor on the communicator's device, and — on accelerators — the stream passed explicitly,
    belonging to that device, with that device current (vllm-ascend's default stream is a
    process-global cached one that is wrong after a device switch).
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.ranks = dist.get_process_group_ranks(group)
        self.world_size = len(self.ranks)
        self.rank = dist.get_rank(group)
        self.calls: list[tuple[torch.dtype, int]] = []

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        assert tensor.device == self.device, f"tensor on {tensor.device}, communicator on {self.device}"
        assert tensor.is_contiguous()
        ctx: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if self.device.type != "cpu":
            backend = backend_for_device(self.device)
            assert stream is not None, "stream must be passed explicitly"
            assert stream.device == self.device, f"stream of {stream.device}, communicator on {self.device}"
            assert backend.current_device() == self.device, "communicator device is not current"
            ctx = torch.get_device_module(self.device.type).stream(stream)
        self.calls.append((tensor.dtype, tensor.numel()))
        with ctx:
            dist.broadcast(tensor, self.ranks[src], group=self.group)


# ---------------------------------------------------------------------------------------- cases

CASES: dict[str, Callable[[Any], str | None]] = {}


def case(name: str) -> Callable[[Callable[[Any], str | None]], Callable[[Any], str | None]]:
    def register(fn: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
        CASES[name] = fn
        return fn

    return register


DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


def _dtype_case(dtype: torch.dtype) -> Callable[[Any], None]:
    def run(ctx: Any) -> None:
        t, want = prepare(ctx, (7, 33), dtype, src=1, seed=11)
        assert broadcast(t, 1, None) is t
        assert_same(t, want)

    return run


for _dt in DTYPES:
    case(f"dtype_{str(_dt).removeprefix('torch.')}")(_dtype_case(_dt))


def _shape_case(shape: tuple[int, ...], dtype: torch.dtype) -> Callable[[Any], None]:
    def run(ctx: Any) -> None:
        t, want = prepare(ctx, shape, dtype, src=0, seed=12)
        broadcast(t, 0, None)
        assert_same(t, want)

    return run


for _name, _shape in {"0d": (), "empty": (0,), "empty_2d": (0, 5), "one": (1,), "4d": (2, 3, 4, 5)}.items():
    case(f"shape_{_name}")(_shape_case(_shape, torch.float32))
case("shape_0d_bf16")(_shape_case((), torch.bfloat16))
case("shape_0d_bool")(_shape_case((), torch.bool))


@case("noncontiguous_transposed")
def _(ctx: Any) -> None:
    base, want = prepare(ctx, (33, 7), torch.bfloat16, src=1, seed=13)
    t = base.t()
    assert not t.is_contiguous()
    broadcast(t, 1, None)
    assert_same(t, want.t())
    assert_same(base, want)  # written through the view into the caller's storage


@case("noncontiguous_strided_slice")
def _(ctx: Any) -> None:
    base, want = prepare(ctx, (8, 30), torch.float32, src=0, seed=14)
    untouched = base[:, 1::3].clone()
    t = base[:, ::3]
    broadcast(t, 0, None)
    assert_same(t, want[:, ::3])
    assert_same(base[:, 1::3], untouched)  # elements outside the view are not written


@case("large")
def _(ctx: Any) -> None:
    numel = (16 << 20) if ctx.device.type == "cpu" else (64 << 20)  # 64 MiB / 256 MiB of fp32
    t, want = prepare(ctx, (numel,), torch.float32, src=1, seed=15)
    broadcast(t, 1, None)
    assert_same(t, want)


@case("explicit_group")
def _(ctx: Any) -> None:
    t, want = prepare(ctx, (5, 5), torch.int32, src=1, seed=16)
    broadcast(t, 1, ctx.group)
    assert_same(t, want)


@case("group_cpu_tensor")
def _(ctx: Any) -> None:
    """A CPU tensor through the device's group: staged on the device (nccl) or in place (gloo)."""
    t, want = prepare(ctx, (3, 9), torch.float16, src=0, seed=17, device=torch.device("cpu"))
    broadcast(t, 0, ctx.group)
    assert t.device.type == "cpu"
    assert_same(t, want)


def _in_worker_thread(ctx: Any, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a fresh thread-pool worker, checking it did not inherit the current device."""

    def body() -> Any:
        if ctx.device.type != "cpu" and ctx.device.index != 0:
            # Precondition that makes the case meaningful: the worker starts on device 0.
            assert ctx.backend.current_device().index == 0, ctx.backend.current_device()
        return fn()

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(body).result(timeout=120)


@case("thread_pool_group")
def _(ctx: Any) -> None:
    t, want = prepare(ctx, (64, 17), torch.bfloat16, src=1, seed=18)
    _in_worker_thread(ctx, lambda: broadcast(t, 1, ctx.group))
    assert_same(t, want)


@case("communicator")
def _(ctx: Any) -> None:
    comm = GroupCommunicator(ctx.group, ctx.device)
    t, want = prepare(ctx, (4, 6), torch.bool, src=1, seed=19)  # bool: absent from PyNccl's dtype table
    broadcast(t, 1, comm)
    assert_same(t, want)
    assert comm.calls == [(torch.uint8, 24)], comm.calls  # sent as raw bytes, once


@case("communicator_thread_pool")
def _(ctx: Any) -> None:
    comm = GroupCommunicator(ctx.group, ctx.device)
    t, want = prepare(ctx, (128, 3), torch.float32, src=0, seed=20)
    _in_worker_thread(ctx, lambda: broadcast(t, 0, comm))
    assert_same(t, want)


@case("communicator_cpu_tensor")
def _(ctx: Any) -> None:
    """Tensor on the CPU, communicator on the rank's device: staged there and copied back."""
    comm = GroupCommunicator(ctx.group, ctx.device)
    t, want = prepare(ctx, (10, 10), torch.bfloat16, src=1, seed=21, device=torch.device("cpu"))
    _in_worker_thread(ctx, lambda: broadcast(t, 1, comm))
    assert t.device.type == "cpu"
    assert_same(t, want)


@case("communicator_other_device_index")
def _(ctx: Any) -> str | None:
    if ctx.device.type == "cpu":
        return "skip: needs two accelerator devices (a CPU has one)"
    comm = GroupCommunicator(ctx.group, ctx.device)
    other = torch.device(ctx.device.type, 1 - ctx.device.index)
    t, want = prepare(ctx, (31,), torch.int64, src=0, seed=22, device=other)
    broadcast(t, 0, comm)
    assert t.device == other
    assert_same(t, want)
    return None


@case("communicator_noncontiguous")
def _(ctx: Any) -> None:
    comm = GroupCommunicator(ctx.group, ctx.device)
    base, want = prepare(ctx, (6, 10), torch.float16, src=1, seed=23)
    broadcast(base[:, 2:7], 1, comm)
    assert_same(base[:, 2:7], want[:, 2:7])


@case("parameter_requires_grad")
def _(ctx: Any) -> None:
    t, want = prepare(ctx, (8, 8), torch.float32, src=0, seed=24)
    p = torch.nn.Parameter(t, requires_grad=True)
    broadcast(p, 0, None)
    assert_same(p.detach(), want)


def _mixed_tensors(ctx: Any, src: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    specs = [
        ((17,), torch.bfloat16),
        ((), torch.float32),
        ((0, 4), torch.float16),
        ((3, 5), torch.bool),
        ((9,), torch.int8),
        ((2, 2, 2), torch.float64),
        ((40, 3), torch.int64),
        ((1,), torch.uint8),
    ]
    got, want = [], []
    for i in range(60):
        shape, dtype = specs[i % len(specs)]
        t, w = prepare(ctx, shape, dtype, src=src, seed=100 + i)
        if i % 7 == 3 and t.dim() == 2 and t.shape[0] > 1:
            t, w = t.t(), w.t()  # some non-contiguous ones
        got.append(t)
        want.append(w)
    big, big_want = prepare(ctx, (3000,), torch.float32, src=src, seed=99)  # > bucket: sent alone
    return [*got, big], [*want, big_want]


@case("coalesced_communicator")
def _(ctx: Any) -> None:
    comm = GroupCommunicator(ctx.group, ctx.device)
    tensors, want = _mixed_tensors(ctx, src=1)
    out = broadcast_coalesced(tensors, 1, comm, bucket_bytes=1024)
    assert all(a is b for a, b in zip(out, tensors))
    for t, w in zip(tensors, want):
        assert_same(t, w)
    # Far fewer collectives than tensors, and more than one bucket, plus the oversized tensor alone.
    assert 2 < len(comm.calls) < len(tensors) // 3, comm.calls
    assert (torch.uint8, 3000 * 4) in comm.calls


@case("coalesced_group_thread_pool")
def _(ctx: Any) -> None:
    tensors, want = _mixed_tensors(ctx, src=0)
    _in_worker_thread(ctx, lambda: broadcast_coalesced(tensors, 0, ctx.group))
    for t, w in zip(tensors, want):
        assert_same(t, w)


@case("bad_src_group_raises_on_all_ranks_without_hanging")
def _(ctx: Any) -> None:
    t, want = prepare(ctx, (4,), torch.float32, src=1, seed=25)
    before = t.clone()
    for bad in (WORLD, -1):
        try:
            broadcast(t, bad, None)
        except BroadcastError as e:
            assert f"src={bad}" in str(e) and "global rank" in str(e), str(e)
        else:
            raise AssertionError(f"src={bad} did not raise")
        assert_same(t, before)
    broadcast(t, 1, None)  # ranks are still in step: the next collective works
    assert_same(t, want)


@case("bad_src_communicator")
def _(ctx: Any) -> None:
    comm = GroupCommunicator(ctx.group, ctx.device)
    t, _ = prepare(ctx, (4,), torch.float32, src=0, seed=26)
    try:
        broadcast(t, 2, comm)
    except BroadcastError as e:
        assert "world_size 2" in str(e), str(e)
    else:
        raise AssertionError("src=2 did not raise")
    assert comm.calls == []


# ---------------------------------------------------------------------------------- the workers


def _worker(rank: int, backend_name: str, init_file: str, out_dir: str) -> None:
    if os.path.isdir("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    backend = get_backend(backend_name)
    device = torch.device("cpu") if backend.device_type == "cpu" else backend.device(rank)
    kwargs: dict[str, Any] = {}
    if device.type != "cpu":
        torch.get_device_module(device.type).set_device(device)
        kwargs["device_id"] = device
    dist.init_process_group(
        backend.dist_backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=120),
        **kwargs,
    )
    group = dist.new_group(list(range(WORLD)), backend=backend.dist_backend)
    ctx = SimpleNamespace(rank=rank, device=device, backend=backend, group=group)
    results: dict[str, str] = {}
    for name, fn in CASES.items():
        try:
            results[name] = fn(ctx) or "ok"
        except Exception:  # noqa: BLE001 - reported to the parent, per case
            results[name] = traceback.format_exc()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    backend = get_backend()
    if backend.device_type != "cpu" and backend.device_count() < WORLD:
        pytest.skip(f"{backend.name}: needs {WORLD} devices for {backend.dist_backend}, found {backend.device_count()}")
    tmp = tmp_path_factory.mktemp("broadcast")
    ctx = mp.start_processes(
        _worker, args=(backend.name, str(tmp / "store"), str(tmp)), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=SPAWN_TIMEOUT_S)
    try:
        while not ctx.join(timeout=5):
            if datetime.datetime.now() > deadline:
                raise AssertionError(f"broadcast workers did not finish in {SPAWN_TIMEOUT_S}s (hang?)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    out = []
    for rank in range(WORLD):
        path = tmp / f"rank{rank}.json"
        out.append(json.loads(path.read_text()) if path.exists() else {})
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_two_rank_broadcast(results: list[dict[str, str]], name: str) -> None:
    for rank, res in enumerate(results):
        assert name in res, f"rank {rank} never reached case {name}"
        if res[name].startswith("skip: "):
            pytest.skip(res[name].removeprefix("skip: "))
        assert res[name] == "ok", f"rank {rank}:\n{res[name]}"


# -------------------------------------------------------------- bad input, in this process


class _Unreachable:
    """A communicator whose broadcast must never run: the call is refused before any collective."""

    def __init__(self, device: str, world_size: int = 2, rank: int = 0) -> None:
        self.device = torch.device(device)
        self.world_size = world_size
        self.rank = rank

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        raise AssertionError("broadcast reached the communicator")


def test_communicator_on_device_kind_without_backend_is_refused() -> None:
    with pytest.raises(BroadcastError, match=r"xpu:0.*no hwsync backend drives"):
        broadcast(torch.ones(3), 0, _Unreachable("xpu:0"))


def test_communicator_src_out_of_range_is_refused() -> None:
    for bad in (2, -1, 7):
        with pytest.raises(BroadcastError, match=rf"src={bad} is out of range .* world_size 2"):
            broadcast(torch.ones(3), bad, _Unreachable("cpu"))


def test_meta_tensor_is_refused() -> None:
    with pytest.raises(BroadcastError, match="meta device"):
        broadcast(torch.empty(3, device="meta"), 0, _Unreachable("cpu"))


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized dtypes are deprecated, but still exist to be refused
        return torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: torch.ones(2, 2).to_sparse(), "to_dense"),
        (_quantized, "int_repr"),
        (lambda: torch.ones(1, 3).expand(4, 3), "overlapping"),
        (lambda: [1.0, 2.0], "torch.Tensor"),
    ],
    ids=["sparse", "quantized", "expanded", "list"],
)
def test_unsendable_tensors_are_refused(make: Callable[[], Any], match: str) -> None:
    with pytest.raises(BroadcastError, match=match):
        broadcast(make(), 0, _Unreachable("cpu"))


def test_accelerator_kind_mismatch_is_refused() -> None:
    backend = get_backend()
    if backend.device_type == "cpu":
        pytest.skip("needs an accelerator tensor (no GPU/NPU here)")
    with pytest.raises(BroadcastError, match="never between two accelerator kinds"):
        broadcast(torch.ones(3, device=backend.device(0)), 0, _Unreachable("xpu:0"))


def test_not_a_communicator_is_refused() -> None:
    with pytest.raises(BroadcastError, match="neither a torch.distributed ProcessGroup nor a communicator"):
        broadcast(torch.ones(3), 0, object())  # type: ignore[arg-type]


def test_uninitialized_default_group_is_refused() -> None:
    if dist.is_initialized():
        pytest.skip("another test initialized torch.distributed in this process")
    with pytest.raises(BroadcastError, match="init_process_group"):
        broadcast(torch.ones(3), 0)


def test_errors_are_hwsync_errors() -> None:
    assert issubclass(BroadcastError, HwsyncError)
