"""Cost of the non-finite check (:mod:`hwsync.common.finite`) against the copy a sync makes of the same bytes.

The receiver queues one ``torch._foreach_norm(ord=inf)`` per bucket and (device, dtype) on the tensors it is given
and reads every flag once after the last bucket. This script builds a model-shaped set of tensors (``--layers``
layers: attention projections, fused experts, norms; ``--gb`` in all, ``--dtype``), splits it into buckets of
``--bucket-mb`` like a sync, and times on ``--device``:

* copy: one ``torch._foreach_copy_`` per bucket into preallocated destinations (the steady colocated in-place write);
* check: ``FiniteFlags.open`` per bucket, one ``non_finite()`` at the end;
* copy+check: both, interleaved per bucket (the reduction where no checking copy exists);
* checking copy: :func:`hwsync.common.finite.copy_all` inside a receive (a Triton kernel on CUDA that checks as it copies),
  a launch per tensor (vLLM's loaders) and queued, one launch per bucket (:func:`hwsync.common.finite.deferred`: the
  in-place write the receiver makes; the overhead the ≤ 2 % budget is about).

It also checks that a NaN and an Inf in one tensor are found on that device. Prints one table.

    PYTHONPATH=. python benchmarks/bench_isfinite.py                                  # small, CPU
    PYTHONPATH=. python benchmarks/bench_isfinite.py --gb 60 --device cuda            # 48 layers on one H200
"""
from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable

import torch

from hwsync.common.finite import FiniteFlags, copy_all, deferred

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def model_tensors(gb: float, layers: int, dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    """``layers`` layers of (q, k, v, o, gate_up experts, down experts, 2 norms), ``gb`` GB in all."""
    per_layer = gb * 1e9 / layers / dtype.itemsize  # elements
    shares = [1 / 24, 1 / 96, 1 / 96, 1 / 24, 0.55, 0.3375]  # ~attention 11 %, experts 89 %
    out = []
    for _ in range(layers):
        for share in shares:  # sizes a multiple of 2048 like real weight shapes (odd sizes stop 16-byte accesses)
            out.append(torch.randn(max(2048, int(per_layer * share) // 2048 * 2048), device=device).to(dtype))
        out.extend(torch.ones(4096, device=device, dtype=dtype) for _ in range(2))
    return out


def buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    groups: list[list[int]] = [[]]
    used = 0
    for i, t in enumerate(tensors):
        n = t.numel() * t.element_size()
        if groups[-1] and used + n > bucket_bytes:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return groups


def timed(fn: Callable[[], object], repeat: int, sync: Callable[[], None]) -> float:
    best = float("inf")
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def sweep(time_checked: Callable[[], float], t_copy: float) -> None:
    """Time the grouped checking copy's kernel per (words per block, warps, streaming cache hints); keep the fastest
    for the rows below, and time the fastest once more without its check (what the check itself costs)."""
    import itertools

    import hwsync.common.cuda.checked_copy as cc
    from hwsync.common import finite

    rows = []
    failed = 0
    for block, warps, streaming in itertools.product((512, 1024, 2048, 4096), (2, 4, 8), (False, True)):
        if not 4 <= block // (32 * warps) <= 64:  # words a thread moves per block
            continue
        cc.BLOCK, cc.WARPS, cc.STREAMING = block, warps, streaming
        seconds = time_checked()
        if finite._UNUSABLE:  # this variant failed to build or run (logged): the copies fell back
            finite._UNUSABLE.clear()
            failed += 1
            continue
        rows.append((seconds, block, warps, streaming))
    rows.sort()
    print("| words / block | warps | streaming hints | seconds | x the fastest copy |")
    print("| --- | --- | --- | --- | --- |")
    for t, block, warps, streaming in rows[:6] + rows[-2:]:
        print(f"| {block} | {warps} | {streaming} | {t:.4f} | {t / t_copy:.3f} |")
    _, cc.BLOCK, cc.WARPS, cc.STREAMING = rows[0]
    cc.CHECK = False
    unchecked = time_checked()
    cc.CHECK = True
    print(f"fastest: BLOCK={cc.BLOCK} WARPS={cc.WARPS} STREAMING={cc.STREAMING} ({len(rows)} ran, {failed} failed): "
          f"{rows[0][0]:.4f} s; the same kernel without the check {unchecked:.4f} s; the fastest copy {t_copy:.4f} s",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=0.25, help="bytes of weights in all, in GB (default 0.25)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--bucket-mb", type=float, default=512.0)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--sweep", action="store_true",
                    help="CUDA: time the checking copy's kernel over tile sizes, tiles per program and warps first, "
                         "and use the fastest")
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    src = model_tensors(args.gb, args.layers, DTYPES[args.dtype], args.device)
    dst = [torch.empty_like(t) for t in src]
    plan = buckets(src, int(args.bucket_mb * 1e6))
    nbytes = sum(t.numel() * t.element_size() for t in src)

    def copy() -> None:
        for b in plan:
            torch._foreach_copy_([dst[i] for i in b], [src[i] for i in b])

    def copy_each() -> None:
        for d, s_ in zip(dst, src):
            d.copy_(s_)

    def check() -> list[int]:
        flags = FiniteFlags()
        for k, b in enumerate(plan):
            flags.open(k, [src[i] for i in b], [str(i) for i in b])
        return flags.non_finite()

    def both() -> None:
        flags = FiniteFlags()
        for k, b in enumerate(plan):
            flags.open(k, [src[i] for i in b], [str(i) for i in b])
            torch._foreach_copy_([dst[i] for i in b], [src[i] for i in b])
        assert not flags.non_finite()

    def checked(queued: bool = True) -> list[int]:
        flags = FiniteFlags()
        with flags.writing(), (deferred() if queued else contextlib.nullcontext()):
            for k, b in enumerate(plan):
                flags.open(k, [src[i] for i in b], [str(i) for i in b])
                copy_all([dst[i] for i in b], [src[i] for i in b])
        found = flags.non_finite()
        fused[0] = flags.checked_in_copy
        return found

    def checked_each() -> list[int]:
        return checked(queued=False)

    fused = [0]
    assert check() == []
    for bad in (float("nan"), float("inf")):  # found on this device
        victim = src[len(src) // 2]
        keep = victim.view(-1)[7].clone()
        victim.view(-1)[7] = bad
        found, found_in_copy = check(), checked()
        victim.view(-1)[7] = keep
        assert found and found_in_copy, f"{bad} was not found on {dev} (separate: {found}, in the copy: {found_in_copy})"

    copy()
    both()  # warm-up
    if args.sweep and cuda:
        sweep(lambda: timed(checked, 3, sync), min(timed(copy, 3, sync), timed(copy_each, 3, sync)))
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
        base_mem = torch.cuda.memory_allocated(dev)
    t_copy = timed(copy, args.repeat, sync)
    t_each = timed(copy_each, args.repeat, sync)
    t_check = timed(check, args.repeat, sync)
    t_both = timed(both, args.repeat, sync)
    t_each_checked = timed(checked_each, args.repeat, sync)
    each_fused = fused[0]
    t_fused = timed(checked, args.repeat, sync)
    assert all(torch.equal(d, s_) for d, s_ in zip(dst, src)), "the checking copy wrote other values"
    peak = (torch.cuda.max_memory_allocated(dev) - base_mem) / 1e6 if cuda else float("nan")

    print(f"device {dev} ({torch.cuda.get_device_name(dev) if cuda else 'cpu'}), torch {torch.__version__}, "
          f"{args.layers} layers, {nbytes / 1e9:.2f} GB {args.dtype} in {len(src)} tensors, {len(plan)} buckets of "
          f"<= {args.bucket_mb:g} MB, best of {args.repeat}")
    print("| operation | seconds | GB/s | x copy |")
    print("| --- | --- | --- | --- |")
    for name, t in (("copy (foreach_copy_ per bucket)", t_copy), ("copy (Tensor.copy_ per tensor)", t_each),
                    ("check (foreach_norm inf per bucket, 1 read)", t_check), ("copy + check, interleaved", t_both),
                    (f"checking copy, a launch per tensor ({each_fused} of {len(src)} tensors checked in their copy)",
                     t_each_checked),
                    (f"checking copy, a launch per bucket ({fused[0]} of {len(src)} checked in their copy)", t_fused)):
        print(f"| {name} | {t:.4f} | {nbytes / t / 1e9:.1f} | {t / t_copy:.3f} |")
    fastest = min(t_copy, t_each)
    print(f"check overhead on the fastest copy: separate {(t_both - fastest) / fastest * 100:+.1f} %, in the copy "
          f"{(t_fused - fastest) / fastest * 100:+.1f} %; extra peak memory during the runs: "
          f"{peak:.1f} MB" + (" (CPU: not measured)" if not cuda else ""))


if __name__ == "__main__":
    main()
