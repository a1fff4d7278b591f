"""What a steady-state sync does on the trainer side instead of walking the model: one iterative parameter walk
(:func:`hwsync.common.gather.parameters`) whose result decides whether the plan still holds, and the strided views the
in-place LoRA slot writer copies from (:mod:`hwsync.engine.vllm.lora_slots`). CPU-only logic; the end-to-end syncs that
use them are in test_sync_inplace / test_sync_strategies / test_sync_exact."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

from hwsync.common import foreign
from hwsync.common.gather import parameters
from hwsync.engine.vllm.lora_slots import _index_view


def test_parameter_walk_is_torchs_order_and_dedup() -> None:
    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.ReLU(), nn.Sequential(nn.Linear(3, 4), shared), nn.Linear(4, 2, bias=False))
    model.register_parameter("extra", nn.Parameter(torch.zeros(1)))
    model.add_module("gap", None)
    assert [id(p) for p in parameters(model)] == [id(p) for p in model.parameters()]


def test_plan_signature_sees_new_parameters_and_adapter_switches() -> None:
    from hwsync.trainer.api import _sharding

    model = nn.Sequential(nn.Linear(3, 3))
    kind, sig = _sharding(model)
    assert kind == "plain" and _sharding(model)[1] == sig
    with torch.no_grad():
        model[0].weight.add_(1)  # an optimizer step: same parameters, same plan
    assert _sharding(model)[1] == sig
    model[0].weight = nn.Parameter(torch.zeros(3, 3))  # a replaced parameter: a new plan
    assert _sharding(model)[1] != sig
    sig = _sharding(model)[1]
    model.active_adapter = "other"  # PEFT: another adapter made active
    assert _sharding(model)[1] != sig


def test_registrations_on_other_models_do_not_walk_this_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A colocated engine's reload registers parameters on vLLM's modules inside the first sync: the second sync
    must not pay a walk of the trainer for it; a module attached to the trainer, then given a parameter, must."""
    from hwsync.common import gather
    from hwsync.trainer import api

    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 3)))
    sig = api._signature(model)
    walks = []
    real = gather.parameters
    monkeypatch.setattr(gather, "parameters", lambda m: walks.append(m) or real(m))
    other = nn.Linear(5, 5)  # another model: built and given parameters
    other.register_parameter("extra", nn.Parameter(torch.zeros(1)))
    assert api._signature(model) == sig and walks == []
    child = nn.Module()
    model[1].add_module("new", child)  # attached: the parent is watched
    assert api._signature(model) == sig and len(walks) == 1  # same parameters so far, but walked
    child.register_parameter("w", nn.Parameter(torch.zeros(2)))  # the new child is watched since that walk
    assert api._signature(model) != sig and len(walks) == 2


@pytest.mark.parametrize("case", ["transpose", "slice", "stack", "permute3d"])
def test_strided_views_reproduce_the_gather(case: str) -> None:
    """A gather that is a view of one source tensor is found as (source, strides, offset) and reproduces it."""
    a, b = torch.arange(24.0).reshape(2, 3, 4), torch.arange(10.0).reshape(2, 5)
    starts, sizes = [0, 24], [24, 10]
    flat = torch.cat([a.reshape(-1), b.reshape(-1)])
    idx = torch.arange(34)
    ia, ib = idx[:24].reshape(2, 3, 4), idx[24:].reshape(2, 5)
    gather = {
        "transpose": ib.T,
        "slice": ib[:, 1:4],
        "stack": torch.stack([ia[0, 1], ia[1, 1]]),
        "permute3d": ia.permute(2, 0, 1),
    }[case]
    view = _index_view(gather.reshape(-1), tuple(gather.shape), ["a", "b"], starts, sizes)
    assert view is not None
    src = (a if view.source == "a" else b).reshape(-1)
    assert torch.equal(src.as_strided(tuple(gather.shape), view.strides, view.offset), flat[gather])


def test_strided_reads_of_tensors_received_at_an_offset() -> None:
    """Server mode hands the writer views into one received bucket: the strided read must count from the view, not
    from the bucket's start (a bug caught by test_attacks: every in-place adapter rewrite fell back to vLLM's path)."""
    from hwsync.engine.vllm.lora_slots import SlotWriter, _View

    bucket = torch.arange(100.0)
    a, b = bucket[10:34].view(2, 3, 4), bucket[50:60].view(2, 5)
    writer = SlotWriter(("a", "b"), (), (), None)  # type: ignore[arg-type]
    read = writer._reader({"a": a, "b": b})
    got = read(_View("b", (1, 5), 0), (5, 2))
    assert torch.equal(got, b.T)
    assert torch.equal(read(_View("a", (1, 4, 12), 0), (4, 3, 2)), a.permute(2, 1, 0))


def test_gathers_that_are_not_views_are_refused() -> None:
    starts, sizes = [0, 24], [24, 10]
    across = torch.tensor([22, 23, 24, 25])  # two source tensors
    shuffled = torch.tensor([0, 2, 1, 3])  # no single stride
    zero_fill = torch.tensor([0, 1, 34])  # vLLM's zero fill (the element after the tensors)
    for index in (across, shuffled, zero_fill):
        assert _index_view(index, tuple(index.shape), ["a", "b"], starts, sizes) is None


def test_reorderings_that_are_no_strided_view_become_index_gathers() -> None:
    """Llama 4's loader interleaves each head's q/k rows: no strided view of the LoRA B tensor reproduces vLLM's, so
    the trace keeps the positions (an index gather of one tensor); reading and writing back through it round-trip."""
    from hwsync.engine.vllm.lora_slots import SlotWriter

    heads, dim, rank = 2, 4, 3
    b = torch.arange(heads * dim * rank, dtype=torch.float32).reshape(heads * dim, rank)
    rows = torch.arange(heads * dim).view(heads, 2, dim // 2).transpose(1, 2).reshape(-1)  # interleaved halves
    vllm_b = b[rows]
    positions = torch.arange(b.numel()).view_as(b)[rows]
    view = _index_view(positions.reshape(-1), tuple(vllm_b.shape), ["b"], [0], [b.numel()], gather=True)
    assert view is not None and view.index is not None and view.source == "b"
    writer = SlotWriter(("b",), (), (), None)  # type: ignore[arg-type]
    assert torch.equal(writer._reader({"b": b})(view, tuple(vllm_b.shape)), vllm_b)
    back = torch.zeros_like(b)
    view.write(back, vllm_b)
    assert torch.equal(back, b)
    # across two tensors there is still no view of one
    assert _index_view(torch.tensor([22, 23, 24, 25]), (4,), ["a", "b"], [0, 24], [24, 10], gather=True) is None


def test_ranks_learn_whether_they_share_a_device() -> None:
    """The exchange the CUDA link runs before choosing NCCL (distinct GPUs) or gloo (a shared GPU: NCCL refuses
    two ranks on one device). Exercised here over a real TCPStore with two ranks in threads."""
    import datetime

    import torch.distributed as dist

    from hwsync.common.cuda.link import peer_devices
    from hwsync.common.transport.base import LinkSpec

    for idents, shared in ((["GPU-a", "GPU-b"], False), (["GPU-a", "GPU-a"], True)):
        master = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False
        )
        spec = LinkSpec("127.0.0.1", master.port, "p/", 2, 30.0)
        seen: dict[int, list[str]] = {}

        # B023: both threads are joined before the loop moves on, so the loop's current values are the ones meant
        def join(rank: int) -> None:
            store = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=datetime.timedelta(seconds=30))  # noqa: B023
            seen[rank] = peer_devices(store, spec, rank, idents[rank])  # noqa: B023

        threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert seen[0] == seen[1] == idents
        assert (len(set(seen[0])) < 2) is shared


def _moe_lora_layer(cls: type, max_loras: int, e: int, r: int, h: int, i: int, three_d: bool) -> Any:
    """vLLM's real MoE-LoRA layer class with its per-slot buffers, assembled on CPU without a GPU engine (vLLM's CPU
    build never builds one): what ``create_lora_weights`` allocates, at tp=1, so its real ``set_lora`` runs here."""
    layer = cls.__new__(cls)
    nn.Module.__init__(layer)
    layer.tp_size, layer.tp_rank, layer.fully_sharded, layer._base_model = 1, 0, False, "Qwen3MoeForCausalLM"
    layer._w13_slices = 1 if three_d else 2
    layer.adapter_enabled = torch.zeros(max_loras + 1, dtype=torch.int)
    z = torch.zeros
    if three_d:
        layer.w13_lora_a_stacked = (z(max_loras, e, r, h),)
        layer.w13_lora_b_stacked = (z(max_loras, e, 2 * i, r),)
    else:
        layer.w13_lora_a_stacked = (z(max_loras, e, r, h), z(max_loras, e, r, h))
        layer.w13_lora_b_stacked = (z(max_loras, e, i, r), z(max_loras, e, i, r))
    layer.w2_lora_a_stacked = (z(max_loras, e, r, i),)
    layer.w2_lora_b_stacked = (z(max_loras, e, h, r),)
    return layer


@pytest.mark.parametrize("three_d", [False, True], ids=["2d", "3d"])
def test_slot_blocks_reproduce_vllms_moe_set_lora(three_d: bool) -> None:
    """The slot trace (:func:`hwsync.engine.vllm.lora_slots._trace_blocks`) run on vLLM's own ``FusedMoEWithLoRA`` /
    ``FusedMoE3DWithLoRA.set_lora`` (rank 4 adapter in rank-8 slots, slot 1 of 2): the traced blocks, read from new
    adapter tensors, leave the slot exactly as vLLM's ``set_lora`` of the same tensors does."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.lora.layers.fused_moe import FusedMoE3DWithLoRA, FusedMoEWithLoRA

    from hwsync.engine.vllm.lora_slots import SlotWriter

    e, r, max_r, h, i, slot = 4, 4, 8, 32, 16, 1
    cls = FusedMoE3DWithLoRA if three_d else FusedMoEWithLoRA
    # the trainer's wire tensors (keys) and how vLLM's construction hands them to set_lora (2-D: w1, w2, w3 lists;
    # 3-D: w13, w2), built here as views -- what the adapter trace finds for PEFT's layout
    shapes = {"gate_up.A": (e, r, h), "gate_up.B": (e, 2 * i, r), "down.A": (e, r, i), "down.B": (e, h, r)}
    keys = list(shapes)
    starts, sizes, offset = [], [], 0
    for k in keys:
        starts.append(offset)
        sizes.append(int(torch.tensor(shapes[k]).prod()))
        offset += sizes[-1]

    def as_lora(t: dict[str, torch.Tensor]) -> Any:
        if three_d:
            a, b = [t["gate_up.A"], t["down.A"]], [t["gate_up.B"], t["down.B"]]
        else:
            a = [t["gate_up.A"], t["down.A"], t["gate_up.A"]]
            b = [t["gate_up.B"][:, :i], t["down.B"], t["gate_up.B"][:, i:]]
        return SimpleNamespace(lora_a=a, lora_b=b)

    codes, start = {}, 1
    for k in keys:
        n = int(torch.tensor(shapes[k]).prod())
        codes[k] = torch.arange(start, start + n, dtype=torch.float64).reshape(shapes[k])
        start += n
    live = _moe_lora_layer(cls, 2, e, max_r, h, i, three_d)
    manager = SimpleNamespace(lora_index_to_id=[7, 111], modules={"m.experts": live})
    lm = SimpleNamespace(loras={"m.experts": as_lora(codes)})
    foreign.state_of(lm)["code_ranges"] = (keys, starts, sizes)  # what the trace records about vLLM's adapter
    blocks = SlotWriter._trace_blocks(manager, lm, ["m.experts"], slot, torch.device("cpu"))
    assert not isinstance(blocks, str), blocks
    assert all(torch.count_nonzero(t) == 0 for v in (live.w13_lora_a_stacked, live.w2_lora_b_stacked) for t in v)

    torch.manual_seed(0)
    writer = SlotWriter(tuple(keys), (), ("m.experts",), None, blocks=tuple(blocks), no_blocks="")  # type: ignore[arg-type]
    reference = _moe_lora_layer(cls, 2, e, max_r, h, i, three_d)
    for step in range(2):
        new = {k: torch.randn(shapes[k]) for k in keys}
        reference.set_lora(slot, **vars(as_lora(new)))
        read = writer._reader(new)
        for b in blocks:
            writer._slot_block(manager, b, slot).copy_(read(b.view, b.shape))
        for attr in ("w13_lora_a_stacked", "w13_lora_b_stacked", "w2_lora_a_stacked", "w2_lora_b_stacked"):
            for ours, theirs in zip(getattr(live, attr), getattr(reference, attr)):
                assert torch.equal(ours, theirs), (step, attr)
