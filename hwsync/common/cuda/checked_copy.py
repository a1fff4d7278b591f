"""A copy that checks as it copies: ``dst = src`` for a whole group of tensor pairs and "did any ``src`` hold a NaN or
an infinity", in one read of every ``src`` and **one kernel launch per group**.

Why: refusing non-finite weights (:mod:`hwsync.common.finite`) with a separate reduction reads every synced byte a
second time: +75% on a 60 GB in-place full sync on an H200 (32.6 ms over a 43.4 ms copy). Checking inside the copy that
writes the weights costs a compare per element that the copy's memory traffic hides. One launch per tensor was at copy
speed alone but not inside the 48-layer sync, whose host already issues ~530 in-place writes in ~34 ms: the Triton
launches (tens of microseconds of Python each) showed as +21% to +111%. So the receiver queues a bucket's checked
copies and launches them together (:meth:`hwsync.common.finite.FiniteFlags.close`): one launch per bucket.

The kernel is persistent: a fixed grid of programs walks the group's pairs in order, each program taking every
``programs``-th block of ``BLOCK`` elements of each pair, then the pair's partial tail. The pairs' addresses reach it
as element offsets from the first pair's tensors (one flat address space), hinted as multiples of 16 bytes, so every
whole block moves in 16-byte accesses. The flag is an ``int32`` on the device, set to 1 by any program that saw a
non-finite value (no host synchronization). Pairs it cannot take (another dtype, not contiguous, not 16-byte aligned)
are returned to the caller, which copies and reduces them separately.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["checked_copy_all", "available", "MIN_BYTES"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK, WARPS, PROGRAMS_PER_SM = 2048, 4, 16
"""Elements per block, warps per program, programs per multiprocessor. BLOCK 2048 x 4 warps was the fastest of 45
configurations of the one-launch-per-tensor kernel alone on 59.5 GB (30.0 ms, Tensor.copy_ 29.1 ms on an H200);
``benchmarks/bench_isfinite.py --sweep`` times the grouped kernel's (docs/performance.md)."""
MIN_BYTES = 8 << 20
"""A tensor written outside a queued bucket (vLLM's own loaders calling hwsync's layout writers) is checked in its copy
only from this size up; smaller ones are left to the bucket's reduction, which costs less than a launch of their own.
Queued copies have no floor: the launch is shared."""
_TABLES: OrderedDict[tuple[Any, ...], Tensor] = OrderedDict()
_KEEP_TABLES = 4096
"""The pairs' offsets and sizes on the device, per group of addresses: a steady sync writes the same addresses every
time, so its tables are uploaded once."""


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def copy_check_all(
        src_base,
        dst_base,
        table,  # int64 [3, count]: source offsets, destination offsets (elements from the bases), sizes
        count,
        flag,
        BLOCK: tl.constexpr,  # noqa: N803 - Triton's spelling
        VEC: tl.constexpr,  # noqa: N803 - elements in 16 bytes
    ):
        pid = tl.program_id(0).to(tl.int64)
        programs = tl.num_programs(0).to(tl.int64)
        lanes = tl.arange(0, BLOCK)
        seen = tl.zeros([BLOCK], dtype=tl.int32)
        for i in range(count):
            s0 = tl.multiple_of(tl.load(table + i), VEC)
            d0 = tl.multiple_of(tl.load(table + count + i), VEC)
            n = tl.load(table + 2 * count + i)
            whole = n // BLOCK
            for b in range(pid, whole, programs):  # whole blocks: no mask, 16-byte accesses
                offs = b * BLOCK + lanes
                x = tl.load(src_base + s0 + offs)
                tl.store(dst_base + d0 + offs, x)
                y = x.to(tl.float32)
                seen |= ((y != y) | (tl.abs(y) == float("inf"))).to(tl.int32)
            if whole % programs == pid:  # the pair's partial tail, by the program whose turn it is
                offs = whole * BLOCK + lanes
                mask = offs < n
                x = tl.load(src_base + s0 + offs, mask=mask, other=0)
                tl.store(dst_base + d0 + offs, x, mask=mask)
                y = x.to(tl.float32)
                seen |= ((y != y) | (tl.abs(y) == float("inf"))).to(tl.int32)
        if tl.max(seen, axis=0) > 0:
            tl.store(flag, 1)

    return copy_check_all


@functools.cache
def available() -> bool:
    """Whether Triton can run here (the kernel is compiled at its first use)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@functools.cache
def _multiprocessors(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _takes(dst: Tensor, src: Tensor, min_bytes: int) -> bool:
    return (
        src.is_cuda
        and src.numel() * src.element_size() >= min_bytes
        and dst.device == src.device
        and dst.dtype == src.dtype in _DTYPES
        and dst.shape == src.shape
        and src.is_contiguous()
        and dst.is_contiguous()
        and src.data_ptr() % 16 == 0
        and dst.data_ptr() % 16 == 0
    )


def _table(dsts: Sequence[Tensor], srcs: Sequence[Tensor], device: torch.device) -> Tensor:
    size = srcs[0].element_size()
    s_base, d_base = srcs[0].data_ptr(), dsts[0].data_ptr()
    key = (device, size, tuple(s.data_ptr() for s in srcs), tuple(d.data_ptr() for d in dsts),
           tuple(s.numel() for s in srcs))  # fmt: skip
    table = _TABLES.get(key)
    if table is None:
        rows = [[(s - s_base) // size for s in key[2]], [(d - d_base) // size for d in key[3]], list(key[4])]
        table = torch.tensor(rows, dtype=torch.int64).pin_memory().to(device, non_blocking=True)
        _TABLES[key] = table
        if len(_TABLES) > _KEEP_TABLES:
            _TABLES.popitem(last=False)
    else:
        _TABLES.move_to_end(key)
    return table


# Limitation L13 (docs/limitations.md): one launch per bucket; its cost in the 48-layer sync: docs/performance.md
def checked_copy_all(dsts: Sequence[Tensor], srcs: Sequence[Tensor], flag: Tensor, min_bytes: int = 0) -> list[int]:
    """``dst.copy_(src)`` for every pair this kernel takes (contiguous CUDA tensors of one checked dtype and shape,
    16-byte aligned, of at least ``min_bytes``), setting ``flag`` (int32, on their device) to 1 if any of those
    sources holds a NaN or an infinity: one launch per (device, dtype). Returns the indices of the pairs it did not
    take (nothing done)."""
    if not available():
        return list(range(len(srcs)))
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    left: list[int] = []
    for i, (d, s) in enumerate(zip(dsts, srcs)):
        if _takes(d, s, min_bytes) and s.device == flag.device:
            groups.setdefault((s.device, s.dtype), []).append(i)
        else:
            left.append(i)
    for (device, _dtype), idx in groups.items():
        gd, gs = [dsts[i] for i in idx], [srcs[i] for i in idx]
        blocks = sum(-(-s.numel() // BLOCK) for s in gs)
        if not blocks:
            continue
        table = _table(gd, gs, device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        grid = (min(blocks, _multiprocessors(index) * PROGRAMS_PER_SM),)
        vec = 16 // gs[0].element_size()
        launch = _kernel()[grid]
        if device.index is None or device.index == torch.cuda.current_device():  # no device switch per bucket
            launch(gs[0], gd[0], table, len(gs), flag, BLOCK=BLOCK, VEC=vec, num_warps=WARPS)
        else:
            with torch.cuda.device(device):
                launch(gs[0], gd[0], table, len(gs), flag, BLOCK=BLOCK, VEC=vec, num_warps=WARPS)
    return left
