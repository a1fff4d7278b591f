"""A copy that checks as it copies: ``dst = src`` for a whole group of tensor pairs and "did any ``src`` hold a NaN or
an infinity", in one read of every ``src`` and **one kernel launch per group**.

Why: refusing non-finite weights (:mod:`hwsync.common.finite`) with a separate reduction reads every synced byte a
second time: +75% on a 60 GB in-place full sync on an H200 (32.6 ms over a 43.4 ms copy). Checking inside the copy that
writes the weights costs a few integer operations per element that the copy's memory traffic hides. One launch per
tensor was at copy speed alone but not inside the 48-layer sync, whose host already issues ~530 in-place writes in
~34 ms: the Triton launches (tens of microseconds of Python each) showed as +21% to +111%. So the receiver queues a
bucket's checked copies and launches them together (:meth:`hwsync.common.finite.FiniteFlags.close`): one launch per
bucket.

The kernel moves 32-bit words whatever the dtype (a pair is taken when its bytes are a whole number of words) and
tests the exponent fields of each word without converting: a field is NaN or infinite exactly when all its exponent
bits are set, and ``(~w & M) + M`` (``M`` the exponent masks of the word's fields) carries into each field's top bit
exactly when the field's exponent is not all ones -- three integer operations per word for two bf16 values, against
a float conversion and two compares per value. The pairs reach it as word offsets from the first pair's tensors (one
flat address space, multiples of 16 bytes: 16-byte accesses) with each pair's first block in the group's sequence of
blocks; a program copies one block, its pair found by a binary search of those first blocks. The flag is an
``int32`` on the device, set to 1 by any program that saw a non-finite value (no host synchronization). Pairs it
cannot take (another dtype, not contiguous, not 16-byte aligned, an odd number of 16-bit values) are returned to the
caller, which copies and reduces them separately.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["checked_copy_all", "available", "MIN_BYTES"]

_FIELDS = {  # per dtype: the exponent masks of one 32-bit word's fields, and their top bits (as signed int32)
    torch.bfloat16: (0x7F807F80, 0x80008000 - (1 << 32)),
    torch.float16: (0x7C007C00, 0x80008000 - (1 << 32)),
    torch.float32: (0x7F800000, 0x80000000 - (1 << 32)),
}
BLOCK, WARPS, STREAMING = 1024, 4, True
"""Words per block (a program each), warps per program, streaming cache hints: the fastest of
``benchmarks/bench_isfinite.py --sweep`` on an H200 (59.5 GB in 29.4 ms, ``Tensor.copy_`` 29.1 ms; docs/performance.md).
A persistent grid (a fixed number of programs walking the group's blocks) was slower: 31.0 ms at best."""
CHECK = True
"""False only in ``bench_isfinite.py --sweep``: the same kernel without the check, to see what the check costs."""
MIN_BYTES = 8 << 20
"""A tensor written outside a queued bucket (vLLM's own loaders calling hwsync's layout writers) is checked in its copy
only from this size up; smaller ones are left to the bucket's reduction, which costs less than a launch of their own.
Queued copies have no floor: the launch is shared."""
_STREAMING = dict(EVICT="evict_first", STORE_CACHE=".cs")  # read once, written once (ptxas refuses .cg + evict_first)
_CACHED = dict(EVICT="", STORE_CACHE="")
_TABLES: OrderedDict[tuple[Any, ...], tuple[Tensor, int]] = OrderedDict()
_KEEP_TABLES = 4096
"""The pairs' offsets, sizes and first blocks on the device, per group of addresses (and block size): a steady sync
writes the same addresses every time, so its tables are uploaded once."""


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["count"])
    def copy_check_all(
        src_base,  # int32 words
        dst_base,
        table,  # int64 [4, count]: source offsets, destination offsets (words from the bases), words, first block
        count,
        flag,
        BLOCK: tl.constexpr,  # noqa: N803 - Triton's spelling
        MASK: tl.constexpr,  # noqa: N803 - the exponent masks of a word's fields
        HIGH: tl.constexpr,  # noqa: N803 - their top bits
        EVICT: tl.constexpr,  # noqa: N803 - "" or streaming hints
        STORE_CACHE: tl.constexpr,  # noqa: N803
        CHECK: tl.constexpr,  # noqa: N803
    ):
        pid = tl.program_id(0).to(tl.int64)
        lanes = tl.arange(0, BLOCK)
        lo = pid * 0  # the program's pair: the last whose first block is <= pid (a binary search of the table)
        hi = lo + count - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            ahead = tl.load(table + 3 * count + mid) > pid
            lo = tl.where(ahead, lo, mid)
            hi = tl.where(ahead, mid - 1, hi)
        src = src_base + tl.multiple_of(tl.load(table + lo), 4)
        dst = dst_base + tl.multiple_of(tl.load(table + count + lo), 4)
        n = tl.load(table + 2 * count + lo)
        start = (pid - tl.load(table + 3 * count + lo)) * BLOCK
        offs = start + lanes
        if start + BLOCK <= n:  # a whole block: no mask, 16-byte accesses
            w = tl.load(src + offs, eviction_policy=EVICT)
            tl.store(dst + offs, w, cache_modifier=STORE_CACHE)
        else:  # the pair's partial tail
            w = tl.load(src + offs, mask=offs < n, other=0)
            tl.store(dst + offs, w, mask=offs < n)
        if CHECK:  # a field's top bit stays clear after the add exactly when its exponent bits are all set
            seen = ~((~w & MASK) + MASK) & HIGH
            if tl.max((seen != 0).to(tl.int32), axis=0) > 0:
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


def _table(pairs: Sequence[tuple[Tensor, Tensor, int, int, int]], device: torch.device) -> tuple[Tensor, int]:
    """The group's table on the device and its number of blocks. ``pairs``: (dst, src, source address, destination
    address, words)."""
    flat = tuple(x for _, _, sp, dp, words in pairs for x in (sp, dp, words))
    key = (device, BLOCK, flat)
    hit = _TABLES.get(key)
    if hit is not None:
        _TABLES.move_to_end(key)
        return hit
    s_base, d_base = flat[0], flat[1]
    firsts, blocks = [], 0
    for words in flat[2::3]:
        firsts.append(blocks)
        blocks += -(-words // BLOCK)
    rows = [
        [(sp - s_base) // 4 for sp in flat[0::3]],
        [(dp - d_base) // 4 for dp in flat[1::3]],
        list(flat[2::3]),
        firsts,
    ]
    hit = torch.tensor(rows, dtype=torch.int64).pin_memory().to(device, non_blocking=True), blocks
    _TABLES[key] = hit
    if len(_TABLES) > _KEEP_TABLES:
        _TABLES.popitem(last=False)
    return hit


def _words(t: Tensor) -> Tensor:
    return t.view(-1).view(torch.int32)


def checked_copy_all(dsts: Sequence[Tensor], srcs: Sequence[Tensor], flag: Tensor, min_bytes: int = 0) -> list[int]:
    """``dst.copy_(src)`` for every pair this kernel takes (contiguous CUDA tensors of one checked dtype and shape,
    16-byte aligned, a whole number of 32-bit words, of at least ``min_bytes``), setting ``flag`` (int32, on their
    device) to 1 if any of those sources holds a NaN or an infinity: one launch per (device, dtype). Returns the
    indices of the pairs it did not take (nothing done)."""
    if not available():
        return list(range(len(srcs)))
    device = flag.device
    groups: dict[torch.dtype, list[tuple[Tensor, Tensor, int, int, int]]] = {}
    left: list[int] = []
    for i, (d, s) in enumerate(zip(dsts, srcs)):  # one pass, each attribute read once: a sync has ~530 pairs
        dtype = s.dtype
        nbytes = s.numel() * s.element_size()
        sp, dp = s.data_ptr(), d.data_ptr()
        if (
            dtype not in _FIELDS
            or d.dtype != dtype
            or nbytes < min_bytes
            or nbytes % 4
            or (sp | dp) % 16
            or s.device != device
            or d.device != device
            or d.shape != s.shape
            or not (s.is_contiguous() and d.is_contiguous())
        ):
            left.append(i)
        elif nbytes:
            groups.setdefault(dtype, []).append((d, s, sp, dp, nbytes // 4))
    for dtype, pairs in groups.items():
        table, blocks = _table(pairs, device)
        mask, high = _FIELDS[dtype]
        launch = _kernel()[(blocks,)]
        args = (_words(pairs[0][1]), _words(pairs[0][0]), table, len(pairs), flag)
        kw = dict(BLOCK=BLOCK, MASK=mask, HIGH=high, CHECK=CHECK, num_warps=WARPS,
                  **(_STREAMING if STREAMING else _CACHED))  # fmt: skip
        if device.index is None or device.index == torch.cuda.current_device():  # no device switch per bucket
            launch(*args, **kw)
        else:
            with torch.cuda.device(device):
                launch(*args, **kw)
    return left
