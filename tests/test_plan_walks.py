"""What a steady-state sync does on the trainer side instead of walking the model: one iterative parameter walk
(:func:`hwsync.gather.parameters`) whose result decides whether the plan still holds, and the strided views the
in-place LoRA slot writer copies from (:mod:`hwsync.vllm.lora_slots`). CPU-only logic; the end-to-end syncs that use
them are in test_sync_inplace / test_sync_strategies / test_sync_exact."""
from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from hwsync.gather import parameters
from hwsync.vllm.lora_slots import _strided


def test_parameter_walk_is_torchs_order_and_dedup() -> None:
    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.ReLU(), nn.Sequential(nn.Linear(3, 4), shared), nn.Linear(4, 2, bias=False))
    model.register_parameter("extra", nn.Parameter(torch.zeros(1)))
    model.add_module("gap", None)
    assert [id(p) for p in parameters(model)] == [id(p) for p in model.parameters()]


def test_plan_signature_sees_new_parameters_and_adapter_switches() -> None:
    from hwsync.api import _layout

    model = nn.Sequential(nn.Linear(3, 3))
    kind, sig = _layout(model)
    assert kind == "plain" and _layout(model)[1] == sig
    with torch.no_grad():
        model[0].weight.add_(1)  # an optimizer step: same parameters, same plan
    assert _layout(model)[1] == sig
    model[0].weight = nn.Parameter(torch.zeros(3, 3))  # a replaced parameter: a new plan
    assert _layout(model)[1] != sig
    sig = _layout(model)[1]
    model.active_adapter = "other"  # PEFT: another adapter made active
    assert _layout(model)[1] != sig


@pytest.mark.parametrize("case", ["transpose", "slice", "stack", "permute3d"])
def test_strided_views_reproduce_the_gather(case: str) -> None:
    """A gather that is a view of one source tensor is found as (source, strides, offset) and reproduces it."""
    a, b = torch.arange(24.0).reshape(2, 3, 4), torch.arange(10.0).reshape(2, 5)
    starts, sizes = [0, 24], [24, 10]
    flat = torch.cat([a.reshape(-1), b.reshape(-1)])
    idx = torch.arange(34)
    ia, ib = idx[:24].reshape(2, 3, 4), idx[24:].reshape(2, 5)
    gather = {"transpose": ib.T, "slice": ib[:, 1:4], "stack": torch.stack([ia[0, 1], ia[1, 1]]),
              "permute3d": ia.permute(2, 0, 1)}[case]
    view = _strided(gather.reshape(-1), tuple(gather.shape), starts, sizes)
    assert view is not None
    src = (a if view.source == 0 else b).reshape(-1)
    assert torch.equal(src.as_strided(tuple(gather.shape), view.strides, view.offset), flat[gather])


def test_gathers_that_are_not_views_keep_the_index() -> None:
    starts, sizes = [0, 24], [24, 10]
    across = torch.tensor([22, 23, 24, 25])  # two source tensors
    shuffled = torch.tensor([0, 2, 1, 3])  # no single stride
    zero_fill = torch.tensor([0, 1, 34])  # vLLM's zero fill (the element after the tensors)
    for index in (across, shuffled, zero_fill):
        assert _strided(index, tuple(index.shape), starts, sizes) is None


def test_ranks_learn_whether_they_share_a_device() -> None:
    """The exchange the CUDA link runs before choosing NCCL (distinct GPUs) or gloo (a shared GPU: NCCL refuses
    two ranks on one device). Exercised here over a real TCPStore with two ranks in threads."""
    import datetime

    import torch.distributed as dist

    from hwsync.cuda.link import peer_devices
    from hwsync.transport.base import LinkSpec

    for idents, shared in ((["GPU-a", "GPU-b"], False), (["GPU-a", "GPU-a"], True)):
        master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30),
                               wait_for_workers=False)
        spec = LinkSpec("127.0.0.1", master.port, "p/", 2, 30.0)
        seen: dict[int, list[str]] = {}

        def join(rank: int) -> None:
            store = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=datetime.timedelta(seconds=30))
            seen[rank] = peer_devices(store, spec, rank, idents[rank])

        threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert seen[0] == seen[1] == idents
        assert (len(set(seen[0])) < 2) is shared
