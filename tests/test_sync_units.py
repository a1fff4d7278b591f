"""Sync engine pieces that need no engine: manifest, bucket plan, pack/unpack, strategy choice, gloo transport."""

from __future__ import annotations

import datetime
import threading
import types
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hwsync.common.cpu.link import GlooLink
from hwsync.common.errors import AdapterFormatError, OptionError, SyncError
from hwsync.common.transport.base import LinkSpec
from hwsync.common.transport.buckets import _Pool, bucket_lists, receive_buckets, send_buckets
from hwsync.common.transport.pack import pack, views
from hwsync.common.transport.seal import Sealer, derive_secret
from hwsync.common.wire import ALIGN, EngineInfo, Manifest, Strategy, TensorSpec, plan_buckets
from hwsync.trainer.payload import companions
from hwsync.trainer.report import SyncReport
from hwsync.trainer.strategy import choose


def _specs() -> list[TensorSpec]:
    return [
        TensorSpec("a", (3, 5), torch.float32),
        TensorSpec("b", (7,), torch.bfloat16),
        TensorSpec("c", (40, 10), torch.float32),  # 1600 B: larger than the 1 KiB buckets below
        TensorSpec("d", (2,), torch.float32),
        TensorSpec("e", (0, 4), torch.float32),
        TensorSpec("f", (3,), torch.int64),
        TensorSpec("g", (9,), torch.bfloat16, "lora"),
    ]


def _tensors(specs: list[TensorSpec]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(s.shape, generator=g) * 10).to(s.dtype) for s in specs]


def test_bucket_plan_keeps_order_limits_size_and_isolates_oversize() -> None:
    specs = _specs()
    buckets = plan_buckets(specs, 1024)
    flat = [i for b in buckets for i in sorted(b.entries)]
    assert flat == list(range(len(specs)))  # every spec once, order kept across buckets
    assert [b.is_last for b in buckets] == [False] * (len(buckets) - 1) + [True]
    oversize = [b for b in buckets if 2 in b.entries]
    assert len(oversize) == 1 and oversize[0].entries == (2,) and oversize[0].nbytes == 1600
    for b in buckets:
        if b.entries != (2,):
            assert b.nbytes <= 1024
        for i, off in zip(b.entries, b.offsets):
            assert off % specs[i].dtype.itemsize == 0
        runs = [
            off
            for k, (i, off) in enumerate(zip(b.entries, b.offsets))
            if k == 0 or specs[b.entries[k - 1]].dtype != specs[i].dtype
        ]
        assert all(off % ALIGN == 0 for off in runs)  # each dtype run starts aligned


def _unpack(m: Manifest, b: int, buf: torch.Tensor) -> list[torch.Tensor]:
    bucket = m.buckets[b]
    specs = [m.specs[i] for i in bucket.entries]
    return views(buf, bucket.offsets, [s.shape for s in specs], [s.dtype for s in specs])


def _pack(m: Manifest, b: int, tensors: list[torch.Tensor], buf: torch.Tensor) -> None:
    bucket = m.buckets[b]
    pack(buf, bucket.offsets, tensors, [m.specs[i].dtype for i in bucket.entries])


def test_pack_unpack_roundtrip_mixed_dtypes() -> None:
    specs = _specs()
    tensors = _tensors(specs)
    m = Manifest(1, "full", tuple(specs), plan_buckets(specs, 1024))
    buf = torch.empty(4096, dtype=torch.uint8)
    for b in m.buckets:
        _pack(m, b.index, [tensors[i] for i in b.entries], buf)
        for i, view in zip(b.entries, _unpack(m, b.index, buf)):
            assert view.dtype == specs[i].dtype and tuple(view.shape) == specs[i].shape
            assert torch.equal(view, tensors[i])
            assert view.numel() == 0 or view.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()


def test_pack_casts_to_wire_dtype() -> None:
    spec = TensorSpec("w", (4, 4), torch.bfloat16)
    m = Manifest(1, "full", (spec,), plan_buckets([spec], 1 << 20))
    src = torch.randn(4, 4, dtype=torch.float32)
    buf = torch.empty(64, dtype=torch.uint8)
    _pack(m, 0, [src], buf)
    assert torch.equal(_unpack(m, 0, buf)[0], src.to(torch.bfloat16))


def test_manifest_json_roundtrip_and_malformed() -> None:
    specs = _specs()
    m = Manifest(
        7,
        "hybrid",
        tuple(specs),
        plan_buckets(specs, 512),
        {"r": 8, "lora_alpha": 8},
        lora_base_names={"x.weight": (4, 2)},
        base_key="k",
    )
    assert Manifest.from_json(m.to_json()) == m
    with pytest.raises(SyncError, match="malformed"):
        Manifest.from_json('{"version": 1}')
    with pytest.raises(SyncError, match="unknown dtype"):
        TensorSpec.from_json(["x", [1], "float99", "base"])


def test_bucket_lists_checks_producer_shapes_and_calls_progress() -> None:
    specs = _specs()
    tensors = _tensors(specs)
    m = Manifest(1, "full", tuple(specs), plan_buckets(specs, 1024))
    seen: list[tuple[int, int]] = []
    got = list(bucket_lists(m, lambda: iter(tensors), lambda i, n: seen.append((i, n))))
    assert [len(x) for x in got] == [len(b.entries) for b in m.buckets]
    assert seen == [(i, len(m.buckets)) for i in range(len(m.buckets))]
    bad = list(tensors)
    bad[3] = torch.zeros(5)
    with pytest.raises(SyncError, match="produced shape"):
        list(bucket_lists(m, lambda: iter(bad), None))


def test_bucket_lists_hand_over_the_manifest_dtype() -> None:
    """A colocated fp32 trainer feeding a bf16 engine: the manifest declares the engine's dtype and every bucket
    carries it (the receiver's plan refuses any other dtype; found on CUDA, where engines are bf16)."""
    specs = [TensorSpec("a", (4, 4), torch.bfloat16, "base"), TensorSpec("n", (3,), torch.int64, "base")]
    src = [torch.randn(4, 4), torch.arange(3)]
    m = Manifest(1, "full", tuple(specs), plan_buckets(specs, 1 << 20))
    (bucket,) = list(bucket_lists(m, lambda: iter(src), None))
    assert [t.dtype for t in bucket] == [torch.bfloat16, torch.int64]
    assert torch.equal(bucket[0], src[0].to(torch.bfloat16)) and bucket[1] is src[1]


def _info(**kw: object) -> EngineInfo:
    base = dict(engine="vllm", dtype="float32", lora_enabled=True, max_lora_rank=16)
    base.update(kw)
    return EngineInfo.from_dict(base)


class _Lora:  # the shape of hwsync.trainer.payload.TrainerLora that choose() reads (hwsync.trainer.strategy.LoraFacts)
    def __init__(self, by_module: dict[str, list[str]], rank: int = 4) -> None:
        self.by_module = by_module
        self.max_rank = rank
        self.not_lora: dict[str, str] = {}


_ATTN = "model.layers.0.self_attn.q_proj.weight"
_EXP = "model.layers.0.mlp.experts.gate_up_proj"
_BY_MODULE = {
    _ATTN: ["base_model.model.model.layers.0.self_attn.q_proj"],
    _EXP: ["base_model.model.model.layers.0.mlp.experts.0.gate_proj"],
}


def test_auto_choice_follows_what_the_engine_serves() -> None:
    lora = _Lora(_BY_MODULE)
    assert choose("auto", None, _info()).strategy is Strategy.FULL
    c = choose("auto", lora, _info(lora_enabled=False))
    assert (c.strategy, c.reason) == (Strategy.FULL, "the engine was started without enable_lora")
    assert choose("auto", lora, _info()).strategy is Strategy.ADAPTER
    no_moe = _info(unservable={_BY_MODULE[_EXP][0]: "no MoE-LoRA kernels on this platform: X"})
    c = choose("auto", lora, no_moe)
    assert c.strategy is Strategy.HYBRID and c.unservable == (_EXP,) and "MoE-LoRA" in c.reason
    assert "experts" in c.reason
    assert choose("auto", _Lora(_BY_MODULE, rank=64), _info()).strategy is Strategy.FULL
    both = _info(unservable={p[0]: "x" for p in _BY_MODULE.values()})
    assert choose("auto", lora, both).strategy is Strategy.FULL
    assert choose("auto", AdapterFormatError("DoRA"), _info()).strategy is Strategy.FULL


def test_explicit_strategies_refuse_what_cannot_work() -> None:
    lora = _Lora(_BY_MODULE)
    no_moe = _info(unservable={_BY_MODULE[_EXP][0]: "no MoE-LoRA kernels"})
    with pytest.raises(AdapterFormatError, match='strategy="hybrid"'):
        choose("adapter", lora, no_moe)
    with pytest.raises(AdapterFormatError, match="DoRA"):
        choose("adapter", AdapterFormatError("DoRA"), _info())
    with pytest.raises(AdapterFormatError, match="enable_lora"):
        choose("hybrid", lora, _info(lora_enabled=False))
    with pytest.raises(AdapterFormatError, match="no adapter"):
        choose("adapter", None, _info())
    with pytest.raises(OptionError, match="unknown strategy"):  # a caller's option, like a bad bucket_mb=
        choose("merged", lora, _info())
    assert choose("full", lora, no_moe).strategy is Strategy.FULL


def test_hybrid_companions_complete_engine_layers() -> None:
    names = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
        "model.layers.0.mlp.gate.weight",
    ]
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    assert companions(["model.layers.0.mlp.experts.gate_up_proj"], names, packed) == {
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
    }
    assert companions(["model.layers.0.self_attn.k_proj.weight"], names, packed) == set(names[:3])
    assert companions(["model.layers.0.self_attn.o_proj.weight"], names, packed) == {names[3]}


def test_report_line_has_the_metrics() -> None:
    r = SyncReport("hybrid", 20, 2_000_000, 0.5, 3, 4, "why")
    line = r.line()
    for part in (
        "v4",
        "strategy=hybrid",
        "tensors=20",
        "MB=2.000",
        "seconds=0.500",
        "GB/s=0.004",
        "buckets=3",
        "(why)",
    ):
        assert part in line
    assert r.gbps == pytest.approx(0.004)


def _gloo_pair() -> tuple[dict[int, GlooLink], dist.TCPStore]:
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30)
    )
    spec = LinkSpec("127.0.0.1", store.port, "t/", 2, 30)
    links: dict[int, GlooLink] = {}

    def make(rank: int) -> None:  # one store client per rank, as across processes
        client = (
            store
            if rank == 0
            else dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=30))
        )
        links[rank] = GlooLink(client, spec, rank)

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return links, store


def test_gloo_transport_roundtrip_and_abort() -> None:
    specs = _specs()
    tensors = _tensors(specs)
    m = Manifest(1, "full", tuple(specs), plan_buckets(specs, 1024))
    links, _ = _gloo_pair()
    sealer = Sealer(derive_secret("token", "session"))
    received: list[list[torch.Tensor]] = []
    errors: list[BaseException] = []

    def recv(manifest: Manifest) -> None:
        try:
            for got in receive_buckets(
                manifest, links[1], _Pool(torch.device("cpu")), sealer, abort_reason=lambda: "why"
            ):
                received.append([v.clone() for v in got])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def send(progress: object = None) -> None:
        send_buckets(
            m,
            bucket_lists(m, lambda: iter(tensors), progress),
            links[0],  # type: ignore[arg-type]
            _Pool(torch.device("cpu")),
            sealer,
        )

    t = threading.Thread(target=recv, args=(m,))
    t.start()
    send()
    t.join()
    assert not errors
    out = {i: v for b, got in zip(m.buckets, received) for i, v in zip(b.entries, got)}
    assert all(torch.equal(out[i], tensors[i]) for i in range(len(specs)))

    # the sender fails while producing bucket 1: the receiver learns it at once, with the reason
    received.clear()
    t = threading.Thread(target=recv, args=(m,))
    t.start()

    def boom(i: int, n: int) -> None:
        if i == 1:
            raise RuntimeError("trainer died")

    with pytest.raises(RuntimeError, match="trainer died"):
        send(boom)
    t.join()
    assert len(received) == 1 and len(errors) == 1
    assert isinstance(errors[0], SyncError) and "sender aborted before bucket 1: why" in str(errors[0])


class _Recorded:
    """A loopback data plane that records when each receive is posted: what the sender broadcast, replayed in order."""

    device = torch.device("cpu")
    rank, world_size, persistent = 1, 2, True

    def __init__(self, sent: list[torch.Tensor], events: list[tuple[str, int]]) -> None:
        self.sent, self.events, self.posted = sent, events, 0

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Any:
        k = self.posted
        self.posted += 1
        self.events.append(("post", k))
        sent = self.sent

        class _Done:
            def wait(self) -> None:
                tensor[: sent[k].numel()].copy_(sent[k])

        return _Done()


class _Sending:
    device = torch.device("cpu")
    rank, world_size, persistent = 0, 2, True

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Any:
        self.sent.append(tensor.clone())
        return types.SimpleNamespace(wait=lambda: None)


def test_next_bucket_is_on_the_wire_while_this_one_is_checked() -> None:
    """The receiver posts bucket k+1 as soon as bucket k's trailer says OK, before checking k's tag (checked first,
    the check held the wire idle: ~3.6 ms per 617 MB bucket on two H200s); a forged bucket is still rejected before
    it is yielded, and the receive posted meanwhile has landed."""
    specs = _specs()
    m = Manifest(1, "full", tuple(specs), plan_buckets(specs, 1024))
    assert len(m.buckets) >= 3
    sealer = Sealer(derive_secret("token", "session"))
    sender = _Sending()
    send_buckets(
        m,
        bucket_lists(m, lambda: iter(_tensors(specs)), None),
        sender,  # type: ignore[arg-type]
        _Pool(torch.device("cpu")),
        sealer,
    )
    events: list[tuple[str, int]] = []

    class Checking(Sealer):
        def check(self, payload: torch.Tensor, index: int, version: int, tag: bytes) -> None:
            events.append(("check", index))
            super().check(payload, index, version, tag)

    checking = Checking(derive_secret("token", "session"))
    n = sum(1 for _ in receive_buckets(m, _Recorded(sender.sent, events), _Pool(torch.device("cpu")), checking))
    assert n == len(m.buckets)
    for k in range(len(m.buckets) - 1):
        assert events.index(("post", k + 1)) < events.index(("check", k)), events

    forged = [t.clone() for t in sender.sent]
    forged[1][0] ^= 1  # one payload byte of bucket 1 changed on the wire
    got = []
    link = _Recorded(forged, [])
    with pytest.raises(SyncError, match="bucket 1 of sync v1 fails authentication"):
        for views_ in receive_buckets(m, link, _Pool(torch.device("cpu")), sealer):
            got.append(views_)
    assert len(got) == 1 and link.posted == 3  # bucket 2's receive was posted, and waited for, before the error


def test_receive_buffer_is_never_overwritten_while_viewed() -> None:
    pool = _Pool(torch.device("cpu"))
    a = pool.take(64)
    held = a[:16].view(torch.float32)  # e.g. vLLM holding a layer's tensor until the layer is complete
    b = pool.take(64)
    assert b.data_ptr() != a.data_ptr()
    del held
    assert pool.take(64).data_ptr() == a.data_ptr()  # free again: reused
    assert pool.take(128).numel() >= 128


def test_every_sync_meets_the_same_buffers_bucket_by_bucket() -> None:
    """A graph of the per-sync copies reads the receive buffers by address: one plan's syncs must get the same
    buffer for each bucket (the pool used to rotate, so a one-bucket adapter sync after a full sync met a different
    buffer every time and was never replayed)."""
    pool = _Pool(torch.device("cpu"))

    def one_sync(buckets: int) -> list[int]:
        used, busy = [], []
        for _ in range(buckets):  # the receiver posts bucket b+1 while bucket b is still being consumed
            buf = pool.take(64, busy)
            used.append(buf.data_ptr())
            busy = [buf]
        return used

    one_sync(3)  # a full sync creates the buffers
    first = one_sync(1)
    assert all(one_sync(1) == first for _ in range(4))
    three = one_sync(3)
    assert one_sync(3) == three


def test_vllm_plugin_entry_point_and_patch_selection() -> None:
    from importlib.metadata import entry_points

    from hwsync.engine import vllm_plugin

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "hwsync"]
    assert ep.value == "hwsync.engine.vllm_plugin:register" and ep.load() is vllm_plugin.register
    names = vllm_plugin.engine_patches()
    assert "vllm_cpu_moe_lora" in names  # needed before an engine is built
    assert "vllm_cpu_moe_prepack" not in names  # held by the receiver around its own reloads only


def test_nccl_transfer_past_its_deadline_aborts_the_group() -> None:
    """A peer that dies mid-collective leaves NCCL's kernel spinning: the link's wait polls against its deadline,
    aborts the communicator and raises instead of hanging the engine (the CUDA link's logic, on a never-finishing
    stand-in for NCCL's work object; the real path ran in tests/test_sync_server.py on 2 GPUs)."""
    import time

    from hwsync.common.cuda.link import NcclLink, _Pending

    class Stuck:
        waited = False

        def is_completed(self) -> bool:
            return False

        def wait(self) -> None:
            self.waited = True

    class Group:
        aborted = 0

        def abort(self) -> None:
            self.aborted += 1

    link = NcclLink.__new__(NcclLink)  # no process group: only the deadline logic is under test
    link.timeout_s, link.pg = 0.2, Group()
    group = link.pg
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="aborted"):
        _Pending(Stuck(), link).wait()
    assert 0.2 <= time.monotonic() - t0 < 5
    assert group.aborted == 1 and link.pg is None  # the communicator is aborted, the link closed

    class Done(Stuck):
        def is_completed(self) -> bool:
            return True

    done = Done()
    _Pending(done, link).wait()
    assert done.waited  # a finished collective still orders the current stream after it

    from hwsync.common.cuda.link import _QUIET_WATCHDOG, watchdog_timeout_s

    # NCCL's own watchdog must never race the link's abort (on two H200s it did, and the engine stopped answering)
    assert watchdog_timeout_s(20) >= 2 * 20 and _QUIET_WATCHDOG["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"


def test_control_channel_sends_small_frames_without_nagle_delay() -> None:
    """A server-mode sync exchanges small frames both ways ("go", then the result): with Nagle's algorithm the
    second waits for the peer's delayed ACK (~40 ms per sync, measured: 48.8 -> 8.3 ms per tiny adapter sync on CPU)."""
    import socket

    from hwsync.common.protocol import Channel

    with socket.create_server(("127.0.0.1", 0)) as srv:
        cli = socket.create_connection(srv.getsockname())
        conn, _ = srv.accept()
        with cli, conn:
            a, b = Channel(cli, b"k" * 32, "client"), Channel(conn, b"k" * 32, "server")
            for ch in (a, b):
                assert ch.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
            a.send({"op": "ping"})
            assert b.recv() == {"op": "ping"}


def test_device_seal_is_the_keyed_linear_hash_it_documents() -> None:
    """The accelerator seal (int8 products where the device has them, float64 elsewhere) equals the integer hash
    its docstring states, both ways of computing it give the same digest, and any one-bit change -- in a full row or
    in the zero-padded last row -- changes it."""
    import numpy as np

    from hwsync.common.transport.seal import _ROW

    sealer = Sealer(derive_secret("token", "session"))
    n = 20 * _ROW + 77  # 20 full rows (enough for int8 products) and a partial one
    payload = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    digest = sealer._lane_digest(payload)

    w = np.zeros((21, _ROW), np.int64)
    w.reshape(-1)[:n] = payload.view(torch.int8).numpy()
    k1 = sealer._key(torch.device("cpu"), _ROW, "row").numpy().astype(np.int64)
    k2 = sealer._key(torch.device("cpu"), 21, "sum").numpy()
    assert k1.min() >= -128 and k1.max() < 128 and k2.min() >= 0 and k2.max() < 1 << 16
    assert np.frombuffer(digest, np.int64).tolist() == ((w @ k1) * k2).sum(axis=0).tolist()

    slow = Sealer(derive_secret("token", "session"))
    slow._int_mm["cpu"] = False  # the float64 path an accelerator without int8 products takes
    assert slow._lane_digest(payload) == digest
    for at in (0, 5 * _ROW + 3, n - 1):
        changed = payload.clone()
        changed[at] ^= 1
        assert sealer._lane_digest(changed) != digest
    assert Sealer(derive_secret("other", "session"))._lane_digest(payload) != digest
