"""Both ends of the data plane (hwsync.common.transport.plane) over the CPU backend's real link, without an engine:
the trainer's SendingEnd and a worker's ReceivingEnd in two threads of one process, as a sync drives them."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hwsync.common.backend import open_link
from hwsync.common.errors import SyncError
from hwsync.common.protocol import group_prefix
from hwsync.common.transport.base import LinkSpec
from hwsync.common.transport.buckets import bucket_lists
from hwsync.common.transport.plane import ReceivingEnd, SendingEnd
from hwsync.common.wire import Manifest, Strategy, TensorSpec, plan_buckets

CPU = torch.device("cpu")


def _manifest(version: int = 1) -> tuple[Manifest, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(version)
    tensors = [torch.randn(64, 32, generator=gen), torch.randn(300, generator=gen).to(torch.bfloat16)]
    specs = tuple(TensorSpec(f"t{i}", tuple(t.shape), t.dtype) for i, t in enumerate(tensors))
    return Manifest(version, Strategy.FULL, specs, plan_buckets(specs, 4096)), tensors


def _sync(
    sender: SendingEnd,
    receiver: ReceivingEnd,
    manifest: Manifest,
    tensors: list[torch.Tensor],
    *,
    receiver_key: bytes | None = None,
    produce: Any = None,
) -> tuple[list[torch.Tensor] | BaseException, BaseException | None]:
    """One sync's data plane: the worker joins and receives in a thread while the trainer streams."""
    store = sender.store()
    group_id, _ = sender.group_ids()
    key = secrets.token_bytes(32)
    spec = LinkSpec(sender.data_host, store.port, group_prefix(group_id), 2, 10.0)
    got: list[torch.Tensor | BaseException] = []

    def worker() -> None:
        try:
            receiver.join(dict(spec.__dict__), 1, CPU, receiver_key or key)
            for bucket in receiver.buckets(manifest, receiver_key or key, spec.prefix + "abort"):
                got.extend(t.clone() for t in bucket)
            receiver.done(ok=True)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            receiver.done(ok=False)
            got.append(e)

    thread = threading.Thread(target=worker)
    thread.start()
    sent: BaseException | None = None
    try:
        sender.stream(
            manifest, bucket_lists(manifest, produce or (lambda: iter(tensors)), None), spec, group_id, CPU, key
        )
    except BaseException as e:  # noqa: BLE001 - handed to the test
        sent = e
    thread.join(30)
    sender.done(ok=sent is None)
    failed = next((g for g in got if isinstance(g, BaseException)), None)
    return (failed if failed is not None else [t for t in got if isinstance(t, torch.Tensor)]), sent


@pytest.fixture
def ends() -> Iterator[tuple[SendingEnd, ReceivingEnd]]:
    sender, receiver = SendingEnd("127.0.0.1", 10.0, open_link), ReceivingEnd(open_link)
    yield sender, receiver
    receiver.close()
    sender.close()


def test_buckets_arrive_bit_equal_and_the_cpu_link_does_not_outlive_the_sync(ends: Any) -> None:
    sender, receiver = ends
    for version in (1, 2):  # a second sync forms a fresh group (gloo-like link: nothing listens in between)
        manifest, tensors = _manifest(version)
        got, sent = _sync(sender, receiver, manifest, tensors)
        assert sent is None and not isinstance(got, BaseException), got
        assert len(got) == len(tensors) and all(torch.equal(g, t) and g.dtype == t.dtype for g, t in zip(got, tensors))
        assert sender._link is None and receiver._held is None


def test_an_abort_reaches_the_worker_with_its_reason(ends: Any) -> None:
    sender, receiver = ends
    manifest, tensors = _manifest()

    def failing() -> Iterator[torch.Tensor]:
        yield tensors[0]
        raise RuntimeError("the trainer's producer failed")

    assert len(manifest.buckets) > 1
    got, sent = _sync(sender, receiver, manifest, tensors, produce=failing)
    assert isinstance(sent, RuntimeError)
    assert isinstance(got, SyncError) and "the trainer's producer failed" in str(got), got
    assert receiver._held is None  # closed after the failure: the next sync forms a fresh group


def test_a_worker_with_another_key_takes_no_bucket(ends: Any) -> None:
    sender, receiver = ends
    manifest, tensors = _manifest()
    got, _ = _sync(sender, receiver, manifest, tensors, receiver_key=secrets.token_bytes(32))
    assert isinstance(got, SyncError), got


def test_joining_a_group_nobody_hosts_is_one_sync_error() -> None:
    receiver = ReceivingEnd(open_link)
    spec = {"host": "127.0.0.1", "port": 9, "prefix": "nobody/", "world_size": 2, "timeout_s": 1.0}
    with pytest.raises(SyncError, match="could not join the trainer's data-plane group"):
        receiver.join(spec, 1, CPU, secrets.token_bytes(32))
    assert receiver._held is None
