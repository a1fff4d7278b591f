"""A copy that checks as it copies: ``dst = src`` and "did ``src`` hold a NaN or an infinity", in one read of ``src``.

Why: refusing non-finite weights (:mod:`hwsync.common.finite`) with a separate reduction reads every synced byte a
second time: +75% on a 60 GB in-place full sync on an H200 (32.6 ms over a 43.4 ms copy). Checking inside the copy that
writes the weights costs a compare per element that the copy's memory traffic hides.

One Triton kernel per contiguous pair of equal dtype (bf16, fp16, fp32); the flag is an ``int32`` on the device,
set to 1 by any block that saw a non-finite value (no host synchronization). Anything else is left to the caller
(:func:`hwsync.common.finite.copy_`), which copies and reduces separately.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

__all__ = ["checked_copy", "available"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK, TILES, WARPS = 4096, 4, 4
"""Elements per tile, tiles per program (the flag is reduced once per program, not per tile), warps per program:
from ``benchmarks/bench_isfinite.py --sweep`` on an H200. Alone on 59.5 GB, BLOCK 2048 x 1 x 4 was fastest (30.0 ms,
Tensor.copy_ 29.1); inside the 48-layer sync 4096 x 4 x 4 measured best (41 ms against 48-88 ms): fewer programs
(docs/performance.md)."""
MIN_BYTES = 8 << 20
"""Smaller tensors are left to the bucket's reduction: a Triton launch costs the host tens of microseconds, and the
check's extra time in the 48-layer sync varied with the host, not with the bytes (+21 % to +111 % over a steady
34 ms unchecked sync across runs on one H200; the kernel alone runs at copy speed). Below 8 MiB are the norms, the
router and the k/v projections: 0.4 % of Qwen3-30B-A3B's bytes, read once more by one multi-tensor kernel per
bucket. The launches that remain are still the cost: docs/performance.md, "Non-finite check"."""


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def copy_check(
        src,
        dst,
        n,
        flag,
        BLOCK: tl.constexpr,
        TILES: tl.constexpr,  # noqa: N803 - Triton's spelling
        EVEN: tl.constexpr,
    ):  # noqa: N803
        start = tl.program_id(0).to(tl.int64) * (BLOCK * TILES)
        seen = tl.zeros([BLOCK], dtype=tl.int32)
        for t in range(TILES):
            offs = start + t * BLOCK + tl.arange(0, BLOCK)
            if EVEN:  # every program's tiles are whole: no mask, nothing that could stop 16-byte accesses
                x = tl.load(src + offs)
                tl.store(dst + offs, x)
            else:
                mask = offs < n
                x = tl.load(src + offs, mask=mask, other=0)
                tl.store(dst + offs, x, mask=mask)
            y = x.to(tl.float32)
            seen |= ((y != y) | (tl.abs(y) == float("inf"))).to(tl.int32)
        if tl.max(seen, axis=0) > 0:
            tl.store(flag, 1)

    return copy_check


@functools.cache
def available() -> bool:
    """Whether Triton can run here (the kernel is compiled at its first use)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


# Limitation L13 (docs/limitations.md): one launch per tensor; launch-bound inside the 48-layer full sync
def checked_copy(dst: Tensor, src: Tensor, flag: Tensor) -> bool:
    """``dst.copy_(src)``, setting ``flag`` (int32, on the tensors' device) to 1 if ``src`` holds a NaN or an
    infinity. ``False`` (nothing done) unless both are contiguous CUDA tensors of one checked dtype and size, of at
    least :data:`MIN_BYTES`."""
    if not (
        src.is_cuda
        and src.numel() * src.element_size() >= MIN_BYTES
        and dst.device == src.device == flag.device
        and dst.dtype == src.dtype in _DTYPES
        and dst.numel() == src.numel()
        and src.is_contiguous()
        and dst.is_contiguous()
        and available()
    ):
        return False
    n = src.numel()
    if n:
        per = BLOCK * TILES
        launch = _kernel()[(-(-n // per),)]
        if src.device.index == torch.cuda.current_device():  # the usual case: no device switch per tensor
            launch(src, dst, n, flag, BLOCK=BLOCK, TILES=TILES, EVEN=n % per == 0, num_warps=WARPS)
        else:
            with torch.cuda.device(src.device):
                launch(src, dst, n, flag, BLOCK=BLOCK, TILES=TILES, EVEN=n % per == 0, num_warps=WARPS)
    return True
