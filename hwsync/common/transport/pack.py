"""The one packer: many tensors into one flat byte buffer and back, with multi-tensor kernels.

Packing is one ``torch._foreach_copy_`` from the sources into typed views of the buffer (casting to the wire dtype
on the way), unpacking is pure views, so a bucket of thousands of small LoRA tensors costs a handful of kernel
launches, not one per tensor. Used by server-mode buckets (:mod:`hwsync.common.transport.buckets`) and by
:func:`hwsync.common.comm.broadcast_coalesced`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["as_bytes", "copy_all", "views", "pack"]


def as_bytes(t: Tensor) -> Tensor:
    """A ``uint8`` view of a contiguous tensor (any dtype: bool, fp8, complex, 0-d)."""
    return t.reshape(-1).view(torch.uint8)


def copy_all(dst: Sequence[Tensor], src: Sequence[Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all i, as multi-tensor kernels where the pairs allow it."""
    if not dst:
        return
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is None:  # pragma: no cover - every torch hwsync supports has it
        for d, s in zip(dst, src):
            d.copy_(s)
        return
    same = [i for i, (d, s) in enumerate(zip(dst, src)) if d.device == s.device]
    if len(same) == len(dst):
        foreach(list(dst), list(src))
        return
    if same:
        foreach([dst[i] for i in same], [src[i] for i in same])
    for i in sorted(set(range(len(dst))) - set(same)):  # cross-device pairs: one copy each
        dst[i].copy_(src[i], non_blocking=True)


def views(
    buf: Tensor, offsets: Sequence[int], shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype]
) -> list[Tensor]:
    """Typed views of ``buf`` (``uint8``) at byte ``offsets``: no copies."""
    out = []
    for off, shape, dt in zip(offsets, shapes, dtypes):
        n = dt.itemsize
        for s in shape:
            n *= s
        out.append(buf[off : off + n].view(dt).view(shape))
    return out


def pack(buf: Tensor, offsets: Sequence[int], tensors: Sequence[Tensor], dtypes: Sequence[torch.dtype]) -> None:
    """Copy ``tensors`` into ``buf`` at ``offsets``, cast to ``dtypes`` (one multi-tensor kernel per device)."""
    dst = views(buf, offsets, [tuple(t.shape) for t in tensors], dtypes)
    copy_all(dst, [t.detach() for t in tensors])
