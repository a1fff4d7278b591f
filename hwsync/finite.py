"""Non-finite weights (NaN, +-Inf) never serve: one device reduction per bucket, one host read per sync.

Why: a diverged step's NaN outlived the next complete sync. A forward with NaN weights writes NaN into the KV blocks
it uses; the prefix-cache reset frees those blocks without clearing them, and attention reads the unused slots of a
reused block (masked, but ``NaN * 0`` is NaN), so later requests came out NaN or wrong for a few calls
(``tests/test_attacks_reliability.py::test_nan_weights_poison_reused_kv_blocks`` shows it). Refusing to *serve*
non-finite weights keeps every cache clean: no forward ever runs on them.

How: each bucket's floating-point tensors (the sources, before any write, whichever path writes them: vLLM's
loaders, in-place copies or a recorded CUDA graph) get ``torch._foreach_norm(ord=inf)`` per (device, dtype) --
one multi-tensor kernel reading each byte once, NaN propagating, no host synchronization -- reduced to one boolean
on the device. The receiver reads the flags once, after the last bucket and before the adapter is installed or the
sync counts as complete; a non-finite sync leaves the engine stale (it refuses to generate) and names the first
offending tensors. An adapter-only sync is thereby refused before anything is written.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["FiniteFlags"]

_CHECKED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""Dtypes reduced on device (8-bit floats have no foreach norm; they are not checked)."""


class FiniteFlags:
    """Per-bucket "all finite" flags on the tensors' devices, read back once (:meth:`non_finite`)."""

    def __init__(self) -> None:
        self._flags: list[tuple[int, Tensor]] = []
        self._names: dict[int, list[str]] = {}

    def add(self, index: int, tensors: Sequence[Tensor], names: Sequence[str]) -> None:
        """Queue the check of one bucket (no host synchronization)."""
        groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for t in tensors:
            if t.dtype in _CHECKED and t.numel():
                groups.setdefault((t.device, t.dtype), []).append(t.detach())
        for group in groups.values():
            peaks = torch._foreach_norm(group, float("inf"))
            self._flags.append((index, torch.stack(peaks).isfinite().all()))
        self._names[index] = list(names)

    def non_finite(self) -> list[int]:
        """Indices of the buckets that carried a NaN or an infinity (one host read per device)."""
        by_device: dict[torch.device, list[tuple[int, Tensor]]] = {}
        for index, flag in self._flags:
            by_device.setdefault(flag.device, []).append((index, flag))
        bad: set[int] = set()
        for flags in by_device.values():
            ok = torch.stack([f for _, f in flags]).cpu().tolist()
            bad.update(index for (index, _), fine in zip(flags, ok) if not fine)
        return sorted(bad)

    def describe(self, bad: Sequence[int]) -> str:
        """A short list of the tensors in the first offending bucket(s)."""
        names = [n for i in bad[:2] for n in self._names.get(i, [])]
        more = f" (+{len(names) - 4} more)" if len(names) > 4 else ""
        return f"bucket(s) {list(bad[:8])}: {', '.join(names[:4])}{more}"
