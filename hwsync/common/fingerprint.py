"""Content fingerprints: an exact, numerics-free check that the engine holds the trainer's tensors.

A fingerprint of a tensor ``W`` (trainer name ``n``, trainer layout) is the float64 dot product ``<W, R_n>`` with a
probe ``R_n``: a pseudo-random integer tensor of ``W``'s shape that both sides generate identically from
``(seed, n)`` (:func:`probe`).

* **Trainer side** (:func:`expected`): ``<cast(W, wire dtype), R_n>`` for every tensor a from-scratch sync of the
  current strategy would send (the merged view for merged names, W0 for frozen ones, the folded LoRA A/B).
* **Engine side** (:mod:`hwsync.engine.vllm.fingerprint`): the probe is sent through *the sync plan itself* (the same
  slicing, packing and expert-layout functions the in-place writer uses, and vLLM's own post-load processing where
  the kernels read a repacked tensor), then dotted with what the kernels actually read. Layout moves preserve dot
  products, so a healthy engine gives the same number up to float64 summation order (~1e-16 relative); a tensor
  not written, transposed, with gate/up swapped, from the previous step, or scaled, gives O(1) relative error.

The comparison (:func:`excess`) allows float64 summation order and a few last-bit differences of the largest
elements, nothing more: no kernel numerics are involved (GPU TF32/bf16 matmuls, routing near-ties), so it is exact on
every platform.

Where the engine's memory is in the trainer's process (a colocated engine), no probe is needed: the engine compares
what its kernels read with the trainer's own tensors element by element (:func:`differing`, fused on the device: one
read of each side, one host round trip for the whole check), and only a tensor that differs is measured against the
same allowance (:func:`deviation`). Fingerprints remain the path across processes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["deviation", "differing", "differing_each", "REL_TOL", "ULPS", "dot", "excess", "probe"]

REL_TOL = 1e-9
"""Relative tolerance of a fingerprint for float64 summation order."""
ULPS = 8
"""Last-bit differences of the largest elements a fingerprint tolerates (see :func:`excess`)."""
_CHUNK = 1 << 22


_P = 2147483647  # 2^31 - 1: every product below stays under 2^62 (exact int64 on every device)
_A, _B = 1103515245, 48271


def probe(
    name: str,
    shape: Sequence[int],
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The probe ``R_name`` of ``shape``: integers in [-127, 127] from an integer hash of the element index, salted
    with ``(seed, name)``. Pure int64 arithmetic, so it is generated on the tensor's own device (no copy of a
    model-sized random tensor from the CPU) and is bit-identical on every device; the values are exact in every
    float dtype down to bf16, so the engine can send the probe through dtype-dependent post-load steps unrounded."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    salt = int.from_bytes(digest[:4], "little") & 0x7FFFFFFF
    n = 1
    for s in shape:
        n *= int(s)
    i = torch.arange(n, dtype=torch.int64, device=device)
    h = ((i % _P) * _A) % _P ^ salt  # xor / shift rounds between the multiplications: not an affine sequence
    h = (h * _B) % _P
    h = h ^ (h >> 15)
    h = (h * _A) % _P
    h = h ^ (h >> 13)
    out = ((h % 255) - 127).to(dtype if dtype.is_floating_point else torch.float32)
    return out.reshape(tuple(int(s) for s in shape))


def dot(a: Tensor, b: Tensor) -> tuple[float, float, float]:
    """``(<a, b>, sum|a * b|, max|a * b|)`` in float64 (chunked: no full float64 copy of a large tensor)."""
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"fingerprint shapes differ: {list(a.shape)} vs {list(b.shape)}")
    fa, fb = a.reshape(-1), b.reshape(-1).to(a.device)
    total = magnitude = peak = 0.0
    for s in range(0, fa.numel(), _CHUNK):
        p = fa[s : s + _CHUNK].to(torch.float64) * fb[s : s + _CHUNK].to(torch.float64)
        total += float(p.sum())
        q = p.abs()
        magnitude += float(q.sum())
        peak = max(peak, float(q.max()))
    return total, magnitude, peak


def excess(got: Sequence[float], want: Sequence[float], dtype: torch.dtype, ulps: int = ULPS) -> float:
    """How far the engine's fingerprint ``got`` is from the trainer's ``want``, in units of what a healthy engine may
    differ by (<= 1 passes): float64 summation order (``REL_TOL`` of sum|W * R|) or a few last-bit differences of
    the largest elements (``ulps`` ulps of ``dtype`` at max|W * R|: a merged tensor recomputed by a GPU kernel that
    rounds one element differently is not a broken sync; a layer, a transposition or a step is thousands of them).
    ``ulps=0`` for tensors the engine holds as copies (LoRA factors): then one last bit anywhere fails."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    allowed = max(REL_TOL * max(want[1], got[1]), ulps * eps * max(want[2], got[2]), 1e-300)
    d = abs(got[0] - want[0])
    return d / allowed if d == d else float("inf")


_CMP_CHUNK = 1 << 26
"""Elements compared per kernel pair: bounds the comparison's temporary (a bool per element) to 64 MB."""


def _chunks(a: Tensor, b: Tensor) -> list[tuple[Tensor, Tensor]]:
    """``(a, b)`` split along their first dimension into pieces of at most :data:`_CMP_CHUNK` elements."""
    if a.numel() <= _CMP_CHUNK or a.dim() == 0:
        return [(a, b)]
    rows = max(1, _CMP_CHUNK // max(1, a[0].numel()))
    return [(a[i : i + rows], b[i : i + rows]) for i in range(0, a.shape[0], rows)]


def differing(pairs: Sequence[tuple[Tensor, Tensor]]) -> Tensor:
    """How many elements of the ``(held, expected)`` pairs differ, as one int64 tensor on the first pair's device,
    without a host round trip (NaN differs from everything; ``expected`` is cast to ``held``'s dtype and device)."""
    total: Tensor | None = None
    for held, want in pairs:
        if tuple(held.shape) != tuple(want.shape):
            raise ValueError(f"compared shapes differ: {list(held.shape)} vs {list(want.shape)}")
        want = want.to(device=held.device, dtype=held.dtype)
        for a, b in _chunks(held, want):
            n = a.ne(b).sum()
            total = n if total is None else total.add_(n)
    return total if total is not None else torch.zeros((), dtype=torch.int64)


def deviation(pairs: Sequence[tuple[Tensor, Tensor]], dtype: torch.dtype, ulps: int = ULPS) -> float:
    """How far held tensors are from the expected ones, in units of what a healthy engine may differ by (<= 1
    passes; the allowance of :func:`excess`): the summed |difference| against ``ulps`` ulps of ``dtype`` at the
    largest expected element -- a recomputed merged tensor that rounds a few elements differently passes, a layer, a
    transposition or an older step does not. ``ulps=0``: any difference fails."""
    diff = peak = 0.0
    for held, want in pairs:
        want = want.to(device=held.device)
        for a, b in _chunks(held, want):
            diff += float((a.double() - b.double()).abs().sum())
            peak = max(peak, float(b.double().abs().max())) if b.numel() else peak
    if diff != diff:
        return float("inf")
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    allowed = ulps * eps * peak
    return diff / allowed if allowed > 0 else (0.0 if diff == 0 else float("inf"))


_GROUP_BYTES = 256 << 20
"""Bytes of differences held at once by :func:`differing_each`."""


def differing_each(pairs: Sequence[tuple[Tensor, Tensor | None]]) -> list[Tensor]:
    """Per ``(held, expected)`` pair, ``max |held - expected|`` as a 0-d tensor on the device (0: equal; NaN where
    either side holds NaN; ``expected`` ``None``: zeros), for thousands of small tensors (an adapter's views, its
    slot blocks): ``torch._foreach_sub`` / ``_foreach_norm`` over groups of up to 256 MB, a few kernel launches per
    group instead of two per pair, and no host round trip."""
    out: list[Tensor] = []
    helds: list[Tensor] = []
    wants: list[Tensor] = []
    size = 0

    def flush() -> None:
        nonlocal size
        if helds:
            out.extend(torch._foreach_norm(torch._foreach_sub(helds, wants), float("inf")))
        helds.clear()
        wants.clear()
        size = 0

    for held, want in pairs:
        if want is None:
            flush()
            out.extend(torch._foreach_norm([held], float("inf")))
            continue
        if tuple(held.shape) != tuple(want.shape):
            raise ValueError(f"compared shapes differ: {list(held.shape)} vs {list(want.shape)}")
        helds.append(held)
        wants.append(want.to(device=held.device, dtype=held.dtype))
        size += held.numel() * held.element_size()
        if size >= _GROUP_BYTES:
            flush()
    flush()
    return out
