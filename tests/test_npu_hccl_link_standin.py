"""HcclLink's control flow on CPU against a STAND-IN for torch_npu -- NOT hardware validation.

Nothing here runs HCCL, CANN or an NPU. ``StandInNpu`` replaces exactly what ``hwsync.common.npu.link.TorchNpuRuntime``
takes from torch_npu, and says so in every name:

* ``torch_npu._C._distributed_c10d.ProcessGroupHCCL`` -> gloo's ``ProcessGroupGloo`` on the same PrefixStore (real
  bytes move between real ranks), wrapped to record every call and the stand-in device current at that moment;
* ``torch.npu.device(i)`` / ``current_device()`` -> a per-thread current-device counter (threads start on 0, as
  thread-pool workers do on an NPU);
* NPU tensors -> CPU tensors (``torch_device(i)`` maps every NPU index onto the CPU).

What this shows: every group creation, broadcast and wait runs inside the link device's context, also from
thread-pool workers that start on device 0; the rendezvous uses the spec's prefix; bad calls are refused before any
collective; ``close`` is idempotent. What it cannot show: HCCL's stream ordering, its communicator setup, speed.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hwsync.common.errors import BackendUnavailableError, BroadcastError
from hwsync.common.npu import NpuBackend
from hwsync.common.npu.link import HcclLink
from hwsync.common.transport import Link, LinkSpec


class StandInNpu:
    """Stand-in for torch_npu as seen by HcclLink (see module docstring)."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.calls: list[tuple[str, int, int]] = []  # (what, link rank, stand-in current device at the call)
        self._lock = threading.Lock()

    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    @contextlib.contextmanager
    def device(self, index: int) -> Iterator[None]:
        before = self.current_device()
        self._local.device = index
        try:
            yield
        finally:
            self._local.device = before

    def torch_device(self, index: int) -> torch.device:
        return torch.device("cpu")

    def record(self, what: str, rank: int) -> None:
        with self._lock:
            self.calls.append((what, rank, self.current_device()))

    def process_group(self, store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
        self.record("process_group", rank)
        store.set(f"standin-rank{rank}", b"1")  # lands under the link's prefix in the session store
        return _StandInProcessGroupHCCL(self, dist.ProcessGroupGloo(store, rank, world_size, timeout), rank)


class _StandInProcessGroupHCCL:
    """ProcessGroupHCCL stand-in: gloo underneath, every call recorded."""

    def __init__(self, npu: StandInNpu, gloo: Any, rank: int) -> None:
        self.npu, self.gloo, self.rank = npu, gloo, rank
        self.shutdowns = 0

    def broadcast(self, tensors: list[torch.Tensor], options: Any) -> Any:
        self.npu.record(f"broadcast(src={options.rootRank})", self.rank)
        return _StandInWork(self.npu, self.gloo.broadcast(tensors, options), self.rank)

    def shutdown(self) -> None:
        self.npu.record("shutdown", self.rank)
        self.shutdowns += 1


class _StandInWork:
    def __init__(self, npu: StandInNpu, work: Any, rank: int) -> None:
        self.npu, self.work, self.rank = npu, work, rank

    def wait(self) -> bool:
        self.npu.record("wait", self.rank)
        return self.work.wait()


def _spec(world: int, prefix: str = "hwsync/link/abc123") -> LinkSpec:
    return LinkSpec(host="127.0.0.1", port=0, prefix=prefix, world_size=world, timeout_s=30.0)


def _open_all(store: Any, spec: LinkSpec, npu: StandInNpu, devices: list[int]) -> list[HcclLink]:
    """One link per rank, each opened in its own thread (gloo's rendezvous blocks until all ranks joined)."""
    with ThreadPoolExecutor(len(devices)) as pool:
        futures = [pool.submit(HcclLink, store, spec, r, f"npu:{d}", npu) for r, d in enumerate(devices)]
        return [f.result(timeout=60) for f in futures]


def test_broadcast_moves_bytes_and_runs_in_each_links_device_from_pool_threads():
    npu, store, spec = StandInNpu(), dist.HashStore(), _spec(3)
    devices = [0, 3, 5]  # trainer on npu:0, engine workers on npu:3 and npu:5
    links = _open_all(store, spec, npu, devices)
    assert all(isinstance(link, Link) for link in links)
    assert [(link.rank, link.world_size, link.index) for link in links] == [(0, 3, 0), (1, 3, 3), (2, 3, 5)]
    assert store.get(f"{spec.prefix}/standin-rank2") == b"1"

    payload = torch.arange(4096, dtype=torch.int64).view(torch.uint8).reshape(-1)

    def rank_step(link: HcclLink) -> torch.Tensor:
        assert npu.current_device() == 0  # a pool thread: the submitter's device is not inherited
        buf = payload.clone() if link.rank == 0 else torch.zeros_like(payload)
        link.broadcast(buf, src=0).wait()
        assert npu.current_device() == 0  # the link restored the thread's device
        return buf

    npu.calls.clear()
    with ThreadPoolExecutor(3) as pool:
        received = [f.result(timeout=60) for f in [pool.submit(rank_step, link) for link in links]]
    assert all(torch.equal(r, payload) for r in received)
    for link, dev in zip(links, devices):
        mine = [(what, d) for what, rank, d in npu.calls if rank == link.rank]
        assert mine == [("broadcast(src=0)", dev), ("wait", dev)]


def test_bad_calls_are_refused_before_any_collective():
    npu = StandInNpu()
    (link,) = _open_all(dist.HashStore(), _spec(1), npu, [2])
    npu.calls.clear()
    with pytest.raises(BroadcastError, match="contiguous tensors on cpu"):
        link.broadcast(torch.zeros(4, 4).t())
    with pytest.raises(BroadcastError, match="tensor on meta"):
        link.broadcast(torch.zeros(4, device="meta"))
    with pytest.raises(BroadcastError, match="src=1 is not a rank"):
        link.broadcast(torch.zeros(4), src=1)
    assert npu.calls == []
    with pytest.raises(BroadcastError, match="runs on an npu device"):
        HcclLink(dist.HashStore(), _spec(1), 0, "cuda:0", npu)
    with pytest.raises(BroadcastError, match="outside the link's world"):
        HcclLink(dist.HashStore(), _spec(2), 2, "npu:0", npu)


def test_close_is_idempotent_and_final():
    npu = StandInNpu()
    (link,) = _open_all(dist.HashStore(), _spec(1), npu, [1])
    pg = link._pg
    link.close()
    link.close()
    assert pg.shutdowns == 1 and [(w, d) for w, _, d in npu.calls if w == "shutdown"] == [("shutdown", 1)]
    with pytest.raises(BroadcastError, match="closed"):
        link.broadcast(torch.zeros(4))


def test_device_without_index_uses_the_current_one():
    npu = StandInNpu()
    with npu.device(6):
        link = HcclLink(dist.HashStore(), _spec(1), 0, "npu", npu)
    assert link.index == 6 and ("process_group", 0, 6) in npu.calls


def test_npu_backend_without_torch_npu_refuses_to_open_a_link():
    backend = NpuBackend()
    if backend.unavailable_reason() is None:
        pytest.skip("an NPU is available here")
    with pytest.raises(BackendUnavailableError, match="no HCCL data plane: .*torch_npu"):
        backend.open_link(dist.HashStore(), _spec(2), 1, "npu:0")
