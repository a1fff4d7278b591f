"""Expert layouts: exact round trips, in-place writes, vLLM loader semantics, refusals."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hwsync.common.errors import LayoutError
from hwsync.common.layouts import (
    ExpertLayout,
    ExpertSharding,
    copy_expert_shard_,
    copy_expert_shards_,
    copy_w2_,
    copy_w13_,
    fuse_experts,
    fused_from_hf_expert_weights,
    fused_from_w2,
    fused_from_w13,
    hf_expert_weights,
    unfuse_experts,
    w2_from_fused,
    w13_from_fused,
)

PRE, PROC = ExpertLayout.PREPROCESSED, ExpertLayout.PROCESSED


# -- an independent reference: vLLM's RoutedExperts.weight_loader semantics, one expert and one shard at a time --
def ref_w13(gate_up: torch.Tensor, sh: ExpertSharding, layout: ExpertLayout) -> torch.Tensor:
    e, i2, h = gate_up.shape
    i = i2 // 2
    per = i // sh.tp_size
    out = torch.zeros(sh.num_local_experts, 2 * per, h, dtype=gate_up.dtype)
    for g in range(e):
        loc = sh.local_id(g)
        if loc < 0:
            continue
        gate, up = gate_up[g, :i], gate_up[g, i:]
        out[loc, :per] = gate[sh.tp_rank * per : (sh.tp_rank + 1) * per]  # _load_w13, shard "w1"
        out[loc, per:] = up[sh.tp_rank * per : (sh.tp_rank + 1) * per]  # _load_w13, shard "w3"
    return out if layout is PRE else out.transpose(1, 2).contiguous()


def ref_w2(down: torch.Tensor, sh: ExpertSharding, layout: ExpertLayout) -> torch.Tensor:
    e, h, i = down.shape
    per = i // sh.tp_size
    out = torch.zeros(sh.num_local_experts, h, per, dtype=down.dtype)
    for g in range(e):
        loc = sh.local_id(g)
        if loc >= 0:
            out[loc] = down[g, :, sh.tp_rank * per : (sh.tp_rank + 1) * per]  # _load_w2
    return out if layout is PRE else out.transpose(1, 2).contiguous()


def rank_shardings(e: int, tp: int, ep: int, placement: str, seed: int = 0) -> list[ExpertSharding]:
    """All (tp_rank, ep_rank) shardings of one layer; placement 'random' = an arbitrary expert_map per rank."""
    out = []
    if placement == "random":
        perm = list(range(e))
        random.Random(seed).shuffle(perm)
        owners = [perm.index(g) % ep for g in range(e)]
    for t, r in itertools.product(range(tp), range(ep)):
        if placement == "random":
            mine = [g for g in range(e) if owners[g] == r]
            random.Random(seed + r).shuffle(mine)  # any local order
            emap = [-1] * e
            for loc, g in enumerate(mine):
                emap[g] = loc
            out.append(ExpertSharding(e, tp, t, ep, r, tuple(emap)))
        else:
            out.append(
                ExpertSharding.with_placement(e, ep_size=ep, ep_rank=r, placement=placement, tp_size=tp, tp_rank=t)
            )
    return out


def _shapes(rng: random.Random) -> list[tuple[int, int, int]]:
    shapes = [(4, 8, 8), (3, 8, 16), (5, 16, 8), (8, 4, 4)]  # square I == H and 2I == H included
    shapes += [(rng.randint(2, 9), 4 * rng.randint(1, 6), rng.randint(1, 24)) for _ in range(4)]
    return shapes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", [PRE, PROC])
def test_round_trip_all_ranks_bit_identical(dtype: torch.dtype, layout: ExpertLayout) -> None:
    rng = random.Random(0)
    for (e, i, h), tp, ep, placement in itertools.product(
        _shapes(rng), (1, 2, 4), (1, 2), ("linear", "round_robin", "random")
    ):
        if ep > e:
            continue
        gen = torch.Generator().manual_seed(e * 1000 + i * 10 + h)
        gate_up = torch.randn(e, 2 * i, h, generator=gen).to(dtype)
        down = torch.randn(e, h, i, generator=gen).to(dtype)
        shs = rank_shardings(e, tp, ep, placement, seed=e + i)
        w13s = [w13_from_fused(gate_up, s, layout) for s in shs]
        w2s = [w2_from_fused(down, s, layout) for s in shs]
        for s, a, b in zip(shs, w13s, w2s):
            assert torch.equal(a, ref_w13(gate_up, s, layout)), (e, i, h, tp, ep, placement, s)
            assert torch.equal(b, ref_w2(down, s, layout)), (e, i, h, tp, ep, placement, s)
            assert a.is_contiguous() and b.is_contiguous()
        assert torch.equal(fused_from_w13(w13s, shs, layout), gate_up)
        assert torch.equal(fused_from_w2(w2s, shs, layout), down)


def test_hf_per_expert_round_trip_and_transformers_convention(tmp_path) -> None:
    """fused [gate; up] is what transformers 5 itself writes per expert (save_pretrained of a real model)."""
    from safetensors.torch import load_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg)
    model.save_pretrained(tmp_path)
    saved = {}
    for f in tmp_path.glob("*.safetensors"):
        saved.update(load_file(f))
    experts = model.model.layers[0].mlp.experts
    gu, dn = fused_from_hf_expert_weights(saved, "model.layers.0.mlp.experts")
    assert torch.equal(gu, experts.gate_up_proj.detach()) and torch.equal(dn, experts.down_proj.detach())

    per = hf_expert_weights(gu, dn, "model.layers.0.mlp.experts.")
    assert {k: v for k, v in saved.items() if ".experts." in k}.keys() == per.keys()
    assert all(torch.equal(per[k], saved[k]) for k in per)
    g, u, d = unfuse_experts(gu, dn)
    gu2, dn2 = fuse_experts(list(g.unbind()), list(u.unbind()), list(d.unbind()))
    assert torch.equal(gu2, gu) and torch.equal(dn2, dn)
    with pytest.raises(LayoutError, match="missing"):
        fused_from_hf_expert_weights(
            {k: v for k, v in saved.items() if "experts.2.up_proj" not in k}, "model.layers.0.mlp.experts"
        )


def _vllm_param(shape, dtype=torch.float32) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.full(shape, -7.0, dtype=dtype), requires_grad=False)

    def weight_loader(*args, **kwargs):  # stands in for vLLM's attribute; must survive the write
        raise AssertionError("hwsync must not call the loader")

    p.weight_loader = weight_loader
    return p


@pytest.mark.parametrize("layout", [PRE, PROC])
@pytest.mark.parametrize("placement", ["linear", "round_robin"])
def test_in_place_writes_keep_parameter(layout: ExpertLayout, placement: str) -> None:
    e, i, h, tp, ep = 6, 8, 8, 2, 2  # square: I == H
    gen = torch.Generator().manual_seed(1)
    gate_up, down = torch.randn(e, 2 * i, h, generator=gen), torch.randn(e, h, i, generator=gen)
    for s in rank_shardings(e, tp, ep, placement):
        w13 = _vllm_param(ref_w13(gate_up, s, layout).shape)
        w2 = _vllm_param(ref_w2(down, s, layout).shape)
        ids = (id(w13), w13.data_ptr(), w13.weight_loader, id(w2), w2.data_ptr(), w2.weight_loader)
        assert copy_w13_(w13, gate_up, s, layout) == s.num_local_experts
        assert copy_w2_(w2, down, s, layout) == s.num_local_experts
        assert ids == (id(w13), w13.data_ptr(), w13.weight_loader, id(w2), w2.data_ptr(), w2.weight_loader)
        assert isinstance(w13, torch.nn.Parameter) and not w13.requires_grad
        assert torch.equal(w13.data, ref_w13(gate_up, s, layout)) and torch.equal(w2.data, ref_w2(down, s, layout))


@pytest.mark.parametrize("layout", [PRE, PROC])
def test_subset_of_experts_in_any_order(layout: ExpertLayout) -> None:
    e, i, h = 8, 8, 16
    gen = torch.Generator().manual_seed(2)
    gate_up, down = torch.randn(e, 2 * i, h, generator=gen), torch.randn(e, h, i, generator=gen)
    for s in rank_shardings(e, 2, 2, "random", seed=3):
        w13 = torch.full(ref_w13(gate_up, s, layout).shape, -7.0)
        w2 = torch.full(ref_w2(down, s, layout).shape, -7.0)
        carried = [5, 0, 3, 6]  # global ids on dim 0 of the incoming tensors
        n = copy_w13_(w13, gate_up[carried], s, layout, experts=carried)
        assert n == copy_w2_(w2, down[carried], s, layout, experts=torch.tensor(carried))
        assert n == sum(s.local_id(g) >= 0 for g in carried)
        full13, full2 = ref_w13(gate_up, s, layout), ref_w2(down, s, layout)
        for g in range(e):
            loc = s.local_id(g)
            if loc < 0:
                continue
            if g in carried:
                assert torch.equal(w13[loc], full13[loc]) and torch.equal(w2[loc], full2[loc])
            else:  # untouched
                assert bool((w13[loc] == -7).all()) and bool((w2[loc] == -7).all())


class _CountWrites(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_one_write_kernel_per_tensor_no_expert_loop() -> None:
    e, i, h = 16, 8, 8
    gate_up, down = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    emap = [-1] * e
    for loc, g in enumerate([9, 2, 14, 5, 0, 11, 7, 3]):
        emap[g] = loc
    shuffled = ExpertSharding(e, ep_size=2, ep_rank=0, expert_map=tuple(emap))
    cases = [  # (sharding, layout, carried experts, write ops expected)
        (ExpertSharding.with_placement(e, ep_size=2, ep_rank=1, tp_size=2, tp_rank=1), PROC, None, ["copy_"]),
        (ExpertSharding.with_placement(e, ep_size=4, ep_rank=1, placement="round_robin"), PRE, None, ["copy_"]),
        (shuffled, PRE, None, ["index_select"]),  # gathered straight into w13/w2
        (shuffled, PROC, None, ["copy_", "index_select"]),  # transposed receiver: gather, then one strided copy
        (shuffled, PRE, [9, 0, 7, 4], ["index_copy_", "index_select"]),  # scattered subset
    ]
    for sh, layout, carried, writes in cases:
        w13 = torch.full(ref_w13(gate_up, sh, layout).shape, -7.0)
        w2 = torch.full(ref_w2(down, sh, layout).shape, -7.0)
        src13 = gate_up if carried is None else gate_up[carried]
        src2 = down if carried is None else down[carried]
        for fn, dst, src, ref in ((copy_w13_, w13, src13, ref_w13), (copy_w2_, w2, src2, ref_w2)):
            fn(dst, src, sh, layout, carried)  # warm the selection cache
            with _CountWrites() as mode:
                fn(dst, src, sh, layout, carried)
            heavy = [
                op for op in mode.ops if op in {"copy_", "index_copy_", "index_select", "index_put_", "_foreach_copy_"}
            ]
            assert sorted(heavy) == writes, (fn.__name__, sh, layout, mode.ops)
            full = ref(gate_up if ref is ref_w13 else down, sh, layout)
            for g in carried or range(e):
                if sh.local_id(g) >= 0:
                    assert torch.equal(dst[sh.local_id(g)], full[sh.local_id(g)])


@pytest.mark.parametrize("layout", [PRE, PROC])
def test_single_and_batched_expert_shards(layout: ExpertLayout) -> None:
    e, i, h, tp, ep = 4, 8, 8, 2, 2
    gen = torch.Generator().manual_seed(4)
    gate_up, down = torch.randn(e, 2 * i, h, generator=gen), torch.randn(e, h, i, generator=gen)
    gate, up, dn = unfuse_experts(gate_up, down)
    for s in rank_shardings(e, tp, ep, "linear"):
        w13 = torch.zeros(ref_w13(gate_up, s, layout).shape)
        w2 = torch.zeros(ref_w2(down, s, layout).shape)
        for g in range(e):
            local = s.local_id(g) >= 0
            assert copy_expert_shard_(w13, gate[g], "w1", g, s, layout) is local
            assert copy_expert_shard_(w13, up[g], "w3", g, s, layout) is local
            assert copy_expert_shard_(w2, dn[g], "w2", g, s, layout) is local
        assert torch.equal(w13, ref_w13(gate_up, s, layout)) and torch.equal(w2, ref_w2(down, s, layout))

        b13 = torch.zeros_like(w13)
        b2 = torch.zeros_like(w2)
        items = [(g, "w1", gate[g]) for g in range(e)] + [(g, "w3", up[g]) for g in range(e)]
        assert copy_expert_shards_(b13, items, s, layout) == 2 * s.num_local_experts
        assert copy_expert_shards_(b2, [(g, "w2", dn[g]) for g in range(e)], s, layout) == s.num_local_experts
        assert torch.equal(b13, w13) and torch.equal(b2, w2)
        with pytest.raises(LayoutError, match="different receivers"):
            copy_expert_shards_(b13, [(0, "w1", gate[0]), (0, "w2", dn[0])], s, layout)


def test_cross_dtype_write_matches_copy_semantics() -> None:
    e, i, h = 4, 4, 8
    gate_up = torch.randn(e, 2 * i, h)
    sh = ExpertSharding.with_placement(e, ep_size=2, ep_rank=0, placement="round_robin")
    dst = torch.zeros(ref_w13(gate_up, sh, PRE).shape, dtype=torch.bfloat16)
    copy_w13_(dst, gate_up, sh, PRE)
    assert torch.equal(dst, ref_w13(gate_up, sh, PRE).to(torch.bfloat16))


def test_refusals_name_expected_and_got() -> None:
    e, i, h = 4, 8, 24
    gate_up, down = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    sh = ExpertSharding(e)
    # wrong declared layout (non-square): a processed receiver declared preprocessed, and the reverse
    with pytest.raises(LayoutError, match=r"shape \(4, 24, 16\) but layout=preprocessed.*expects \(4, 16, 24\)"):
        copy_w13_(torch.empty(e, h, 2 * i), gate_up, sh, PRE)
    with pytest.raises(LayoutError, match=r"shape \(4, 24, 8\) but layout=processed.*expects \(4, 8, 24\)"):
        copy_w2_(torch.empty(e, h, i), down, sh, PROC)
    with pytest.raises(LayoutError, match="not divisible by tp_size=3"):
        w13_from_fused(gate_up, ExpertSharding(e, tp_size=3), PRE)
    with pytest.raises(LayoutError, match="out of range"):
        copy_w13_(torch.empty(e, 2 * i, h), gate_up[:1], sh, PRE, experts=[4])
    with pytest.raises(LayoutError, match="duplicate"):
        copy_w13_(torch.empty(e, 2 * i, h), gate_up[:2], sh, PRE, experts=[1, 1])
    with pytest.raises(LayoutError, match="carries 4"):
        copy_w13_(torch.empty(e, 2 * i, h), gate_up, sh, PRE, experts=[0, 1])
    with pytest.raises(LayoutError, match="all 4 experts"):
        copy_w13_(torch.empty(e, 2 * i, h), gate_up[:3], sh, PRE)
    with pytest.raises(LayoutError, match="exactly once"):
        ExpertSharding(4, ep_size=2, expert_map=(0, 0, -1, -1))
    with pytest.raises(LayoutError, match="one entry per global expert"):
        ExpertSharding(4, ep_size=2, expert_map=(0, 1, -1))
    with pytest.raises(LayoutError, match="tp_rank"):
        ExpertSharding(4, tp_size=2, tp_rank=2)
    with pytest.raises(LayoutError, match="unknown expert layout"):
        copy_w13_(torch.empty(e, 2 * i, h), gate_up, sh, "nz")
    only_rank0 = ExpertSharding.with_placement(e, ep_size=2, ep_rank=0)
    with pytest.raises(LayoutError, match=r"missing \[\(2, 0\)"):
        fused_from_w13([w13_from_fused(gate_up, only_rank0, PRE)], [only_rank0], PRE)


def test_square_shapes_follow_the_declared_layout() -> None:
    """I == H: both layouts accept the same shape, so only the declaration decides, and each is exact."""
    e, i = 3, 8
    down = torch.randn(e, i, i)
    sh = ExpertSharding(e)
    pre, proc = w2_from_fused(down, sh, PRE), w2_from_fused(down, sh, PROC)
    assert pre.shape == proc.shape and torch.equal(proc, pre.transpose(1, 2))
    assert torch.equal(fused_from_w2([proc], [sh], PROC), down) and torch.equal(fused_from_w2([pre], [sh], PRE), down)


def test_linear_placement_gives_remainder_to_first_ranks() -> None:
    """vLLM's determine_expert_map: base = E // ep, the first E % ep ranks hold one more."""
    got = [ExpertSharding(10, ep_size=4, ep_rank=r).local_experts for r in range(4)]
    assert got == [(0, 1, 2), (3, 4, 5), (6, 7), (8, 9)]
    assert [ExpertSharding.with_placement(10, ep_size=4, ep_rank=r).local_experts for r in range(4)] == got
    rr = [
        ExpertSharding.with_placement(10, ep_size=4, ep_rank=r, placement="round_robin").local_experts for r in range(4)
    ]
    assert rr == [(0, 4, 8), (1, 5, 9), (2, 6), (3, 7)]


@pytest.mark.vllm
@pytest.mark.parametrize("layout", [PRE, PROC])
def test_matches_vllm_loader_code(layout: ExpertLayout) -> None:
    """vLLM's own expert map (determine_expert_map) and per-expert TP slicing (RoutedExperts._load_w13/_load_w2),
    run expert by expert, produce exactly what the stacked writers produce."""
    import types

    from hwsync.testing import require_vllm

    require_vllm()
    from vllm.model_executor.layers.fused_moe.expert_map_manager import (
        determine_expert_map,
    )
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    for (e, i, h), tp, ep, placement in itertools.product(
        [(6, 8, 8), (5, 16, 4)], (1, 2, 4), (1, 2), ("linear", "round_robin")
    ):
        gen = torch.Generator().manual_seed(e + i + h)
        gate_up, down = torch.randn(e, 2 * i, h, generator=gen), torch.randn(e, h, i, generator=gen)
        gate, up, dn = unfuse_experts(gate_up, down)
        vllm_self = types.SimpleNamespace(
            moe_config=types.SimpleNamespace(
                is_act_and_mul=True, moe_parallel_config=types.SimpleNamespace(tp_size=tp)
            ),
            _get_hidden_dim=RoutedExperts._get_hidden_dim,
            _narrow_expert_data_for_padding=RoutedExperts._narrow_expert_data_for_padding,
        )
        for ep_rank, tp_rank in itertools.product(range(ep), range(tp)):
            n_local, emap, _ = determine_expert_map(ep, ep_rank, e, placement)
            ours = ExpertSharding.with_placement(
                e, ep_size=ep, ep_rank=ep_rank, placement=placement, tp_size=tp, tp_rank=tp_rank
            )
            vmap = list(range(e)) if emap is None else emap.tolist()
            assert [ours.local_id(g) for g in range(e)] == vmap and ours.num_local_experts == n_local
            w13 = torch.zeros(n_local, 2 * i // tp, h)
            w2 = torch.zeros(n_local, h, i // tp)
            for g in range(e):
                if vmap[g] < 0:
                    continue
                RoutedExperts._load_w13(vllm_self, w13[vmap[g]], 0, "w1", gate[g], tp_rank)
                RoutedExperts._load_w13(vllm_self, w13[vmap[g]], 0, "w3", up[g], tp_rank)
                RoutedExperts._load_w2(vllm_self, w2[vmap[g]], 1, dn[g], tp_rank)
            if layout is PROC:
                w13, w2 = w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
            assert torch.equal(w13_from_fused(gate_up, ours, layout), w13)
            assert torch.equal(w2_from_fused(down, ours, layout), w2)
