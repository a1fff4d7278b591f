"""In-place expert writes (hwsync.common.layouts) vs a per-expert Python loop, measured in the same run.

The loop is the shape of vLLM's own path (``RoutedExperts.weight_loader`` called once per expert and shard:
narrow the TP slice, narrow the destination rows, ``copy_``) without its Python bookkeeping, so it is a
*lower bound* on what a per-expert load costs. Every case checks that both paths wrote identical bytes.

    python benchmarks/bench_layouts.py                       # CPU, bf16, 32 experts of Qwen3-30B-A3B size
    python benchmarks/bench_layouts.py --device cuda --experts 128 --layers 4
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from hwsync.common.layouts import (
    ExpertLayout,
    ExpertSharding,
    copy_expert_shards_,
    copy_w2_,
    copy_w13_,
    unfuse_experts,
    w2_shape,
    w13_shape,
)


def naive_w13(dst: torch.Tensor, gate_up: torch.Tensor, sh: ExpertSharding, layout: ExpertLayout) -> None:
    pre = dst if layout is ExpertLayout.PREPROCESSED else dst.transpose(1, 2)
    i = gate_up.shape[1] // 2
    start, per = sh.tp_slice(i)
    for g in range(gate_up.shape[0]):
        loc = sh.local_id(g)
        if loc < 0:
            continue
        pre[loc, :per].copy_(gate_up[g, start : start + per])  # shard w1
        pre[loc, per:].copy_(gate_up[g, i + start : i + start + per])  # shard w3


def naive_w2(dst: torch.Tensor, down: torch.Tensor, sh: ExpertSharding, layout: ExpertLayout) -> None:
    pre = dst if layout is ExpertLayout.PREPROCESSED else dst.transpose(1, 2)
    start, per = sh.tp_slice(down.shape[2])
    for g in range(down.shape[0]):
        loc = sh.local_id(g)
        if loc >= 0:
            pre[loc].copy_(down[g, :, start : start + per])


def shuffled(e: int, ep: int, rank: int) -> ExpertSharding:
    """An arbitrary (EPLB-like) placement: no arithmetic pattern, so the gather path runs."""
    perm = torch.randperm(e, generator=torch.Generator().manual_seed(0)).tolist()
    mine = perm[rank::ep]
    emap = [-1] * e
    for loc, g in enumerate(mine):
        emap[g] = loc
    return ExpertSharding(e, ep_size=ep, ep_rank=rank, expert_map=tuple(emap))


def timed(fn: Callable[[], object], device: str, repeat: int) -> float:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--experts", type=int, default=32, help="Qwen3-30B-A3B has 128")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768, help="moe_intermediate_size")
    ap.add_argument("--layers", type=int, default=1, help="layers written per measurement")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tp", type=int, default=2, help="tp size of the TP cases (rank 0 measured)")
    ap.add_argument("--ep", type=int, default=4, help="ep size of the EP cases (rank 1 measured)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default); on a "
                    "loaded machine use 1, or large parallel copies stall on oversubscribed OpenMP threads")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    dev, dtype = args.device, getattr(torch, args.dtype)
    e, h, i, n_layers = args.experts, args.hidden, args.inter, args.layers
    torch.manual_seed(0)
    gate_ups = [torch.randn(e, 2 * i, h, device=dev).to(dtype) for _ in range(n_layers)]
    downs = [torch.randn(e, h, i, device=dev).to(dtype) for _ in range(n_layers)]
    pre, proc = ExpertLayout.PREPROCESSED, ExpertLayout.PROCESSED
    cases = [
        ("all experts", ExpertSharding(e), pre),
        ("all experts, processed (transposed)", ExpertSharding(e), proc),
        (f"tp={args.tp} rank 0", ExpertSharding(e, tp_size=args.tp), pre),
        (f"ep={args.ep} linear, rank 1", ExpertSharding.with_placement(e, ep_size=args.ep, ep_rank=1), pre),
        (f"ep={args.ep} round_robin, rank 1", ExpertSharding.with_placement(e, ep_size=args.ep, ep_rank=1, placement="round_robin"), pre),
        (f"ep={args.ep} shuffled expert_map, rank 1", shuffled(e, args.ep, 1), pre),
    ]
    layer_bytes = (gate_ups[0].numel() + downs[0].numel()) * gate_ups[0].element_size()
    print(f"device={dev} dtype={args.dtype} experts={e} hidden={h} inter={i} layers/measure={n_layers} "
          f"({layer_bytes * n_layers / 2**20:.0f} MiB source per measure), median of {args.repeat}, "
          f"cpu threads={torch.get_num_threads()}")
    print(f"{'case':42} {'hwsync ms':>10} {'loop ms':>10} {'speedup':>8} {'hwsync GB/s':>12}")

    def row(name: str, fast: Callable[[], object], slow: Callable[[], object], moved: int) -> None:
        t_fast, t_slow = timed(fast, dev, args.repeat), timed(slow, dev, args.repeat)
        print(f"{name:42} {t_fast * 1e3:10.2f} {t_slow * 1e3:10.2f} {t_slow / t_fast:7.1f}x {moved / t_fast / 1e9:12.1f}")

    for name, sh, layout in cases:
        w13s = [torch.empty(w13_shape(sh, i, h, layout), dtype=dtype, device=dev) for _ in range(n_layers)]
        w2s = [torch.empty(w2_shape(sh, i, h, layout), dtype=dtype, device=dev) for _ in range(n_layers)]
        ref13 = [torch.empty_like(w) for w in w13s]
        ref2 = [torch.empty_like(w) for w in w2s]

        def fast() -> None:
            for gu, dn, a, b in zip(gate_ups, downs, w13s, w2s):
                copy_w13_(a, gu, sh, layout)
                copy_w2_(b, dn, sh, layout)

        def slow() -> None:
            for gu, dn, a, b in zip(gate_ups, downs, ref13, ref2):
                naive_w13(a, gu, sh, layout)
                naive_w2(b, dn, sh, layout)

        fast()
        slow()
        assert all(torch.equal(x, y) for x, y in zip(w13s + w2s, ref13 + ref2)), name
        moved = sum(w.numel() * w.element_size() for w in w13s + w2s)
        row(name, fast, slow, moved)

    # HF per-expert checkpoint tensors (3 per expert): one _foreach_copy_ vs one copy_ per tensor
    sh = ExpertSharding(e)
    per_layer = []
    for gu, dn in zip(gate_ups, downs):
        g, u, d = unfuse_experts(gu, dn)
        per_layer.append(([(x, "w1", g[x]) for x in range(e)] + [(x, "w3", u[x]) for x in range(e)],
                          [(x, "w2", d[x]) for x in range(e)]))
    w13s = [torch.empty(w13_shape(sh, i, h, pre), dtype=dtype, device=dev) for _ in range(n_layers)]
    w2s = [torch.empty(w2_shape(sh, i, h, pre), dtype=dtype, device=dev) for _ in range(n_layers)]
    ref13 = [torch.empty_like(w) for w in w13s]
    ref2 = [torch.empty_like(w) for w in w2s]

    def fast_hf() -> None:
        for (items13, items2), a, b in zip(per_layer, w13s, w2s):
            copy_expert_shards_(a, items13, sh, pre)
            copy_expert_shards_(b, items2, sh, pre)

    def slow_hf() -> None:
        for gu, dn, a, b in zip(gate_ups, downs, ref13, ref2):
            naive_w13(a, gu, sh, pre)
            naive_w2(b, dn, sh, pre)

    fast_hf()
    slow_hf()
    assert all(torch.equal(x, y) for x, y in zip(w13s + w2s, ref13 + ref2))
    row("per-expert HF tensors (_foreach_copy_)", fast_hf, slow_hf,
        sum(w.numel() * w.element_size() for w in w13s + w2s))


if __name__ == "__main__":
    main()
