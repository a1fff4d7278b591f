"""The manifest: everything a receiver must check *before* the first byte of a sync is written.

A sync sends its manifest first (names, shapes, dtypes, kinds, bucket plan, LoRA config, version). The receiver
resolves every name against its live model, checks shapes, layer completeness and the adapter config, and refuses
the whole sync with one :class:`~hwsync.errors.HwsyncError` if anything is off. Only then do tensors travel.

The manifest is plain data with a JSON form (server mode sends it over a ``TCPStore``): no pickle crosses processes.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from hwsync.errors import SyncError

__all__ = ["TensorSpec", "Bucket", "Manifest", "plan_buckets", "dtype_name", "dtype_from_name", "ALIGN"]

Kind = Literal["base", "lora"]
ALIGN = 16
"""Byte alignment of each dtype run inside a bucket (any dtype can view its slot)."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise SyncError(f"manifest names unknown dtype {name!r}; sender and receiver run different torch versions?")
    return dt


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a sync, in trainer naming (``kind="base"``) or vLLM LoRA naming (``kind="lora"``)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: Kind = "base"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def to_json(self) -> list[Any]:
        return [self.name, list(self.shape), dtype_name(self.dtype), self.kind]

    @classmethod
    def from_json(cls, obj: Sequence[Any]) -> TensorSpec:
        name, shape, dtype, kind = obj
        return cls(str(name), tuple(int(s) for s in shape), dtype_from_name(dtype), kind)


@dataclass(frozen=True)
class Bucket:
    """Spec indices carried by one bucket and their byte offsets in its flat buffer.

    Inside a bucket, tensors of one dtype sit back to back in one aligned run, so packing is one ``torch.cat`` per
    dtype run and unpacking is pure views.
    """

    index: int
    entries: tuple[int, ...]
    offsets: tuple[int, ...]
    nbytes: int
    is_last: bool

    def runs(self, specs: Sequence[TensorSpec]) -> list[tuple[torch.dtype, int, list[int]]]:
        """``(dtype, byte offset, entries)`` per contiguous dtype run, in buffer order."""
        out: list[tuple[torch.dtype, int, list[int]]] = []
        for i, off in zip(self.entries, self.offsets):
            dt = specs[i].dtype
            if out and out[-1][0] == dt and off == out[-1][1] + sum(specs[j].nbytes for j in out[-1][2]):
                out[-1][2].append(i)
            else:
                out.append((dt, off, [i]))
        return out


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> tuple[Bucket, ...]:
    """Greedy, order-preserving split of ``specs`` into buckets of at most ``bucket_bytes``.

    Order is kept across buckets (the receiver's layer-wise reload completes each layer as soon as its last tensor
    arrives); a tensor larger than ``bucket_bytes`` travels alone in a bucket of its own size.
    """
    if bucket_bytes <= 0:
        raise SyncError(f"bucket size must be positive, got {bucket_bytes} bytes")
    groups: list[list[int]] = []
    used = 0
    for i, spec in enumerate(specs):
        n = spec.nbytes
        if n > bucket_bytes:
            groups.append([i])
            used = bucket_bytes  # close it: the next tensor starts a new bucket
            continue
        if not groups or used + n + ALIGN > bucket_bytes and groups[-1]:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n + ALIGN
    buckets = []
    for b, group in enumerate(groups):
        # dtype runs, first-seen dtype order, stable within a dtype
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in group:
            by_dtype.setdefault(specs[i].dtype, []).append(i)
        entries: list[int] = []
        offsets: list[int] = []
        off = 0
        for run in by_dtype.values():
            off = (off + ALIGN - 1) // ALIGN * ALIGN
            for i in run:
                entries.append(i)
                offsets.append(off)
                off += specs[i].nbytes
        buckets.append(Bucket(b, tuple(entries), tuple(offsets), off, b == len(groups) - 1))
    return tuple(buckets)


@dataclass(frozen=True)
class Manifest:
    """Everything about one sync except the tensor data."""

    version: int
    strategy: str
    specs: tuple[TensorSpec, ...]
    buckets: tuple[Bucket, ...]
    lora_config: Mapping[str, Any] | None = None
    """vLLM ``adapter_config`` of the LoRA tensors (``None`` when the sync carries none)."""
    lora_base_names: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Trainer name -> shape of each base weight the LoRA adapts: the receiver resolves them (without data) so an
    adapter for a differently shaped model is refused before it is installed."""
    base_key: str | None = None
    """Identity of the base weights this sync leaves on the engine (adapter/hybrid: trainer's W0 set)."""
    layout: str = "checkpoint"
    """Base tensors are in checkpoint (trainer) layout; the receiver's load path converts them."""
    lora_name: str | None = None
    lora_int_id: int | None = None
    """Identity to install the adapter under (``None``: the receiver's default, ``hwsync.vllm_ext.LORA_INT_ID``).
    Frameworks that attach their own ``LoRARequest`` to rollouts (ms-swift: ``swift_lora``/111) pass theirs."""

    @property
    def base_specs(self) -> list[TensorSpec]:
        return [s for s in self.specs if s.kind == "base"]

    @property
    def lora_specs(self) -> list[TensorSpec]:
        return [s for s in self.specs if s.kind == "lora"]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    def to_json(self) -> str:
        return json.dumps({
            "version": self.version,
            "strategy": self.strategy,
            "specs": [s.to_json() for s in self.specs],
            "buckets": [[b.index, list(b.entries), list(b.offsets), b.nbytes, b.is_last] for b in self.buckets],
            "lora_config": self.lora_config,
            "lora_base_names": {k: list(v) for k, v in self.lora_base_names.items()},
            "base_key": self.base_key,
            "layout": self.layout,
            "lora_name": self.lora_name,
            "lora_int_id": self.lora_int_id,
        })

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        try:
            d = json.loads(text)
            return cls(
                version=int(d["version"]),
                strategy=str(d["strategy"]),
                specs=tuple(TensorSpec.from_json(s) for s in d["specs"]),
                buckets=tuple(Bucket(int(i), tuple(e), tuple(o), int(n), bool(last)) for i, e, o, n, last in d["buckets"]),
                lora_config=d.get("lora_config"),
                lora_base_names={k: tuple(int(x) for x in v) for k, v in (d.get("lora_base_names") or {}).items()},
                base_key=d.get("base_key"),
                layout=str(d.get("layout", "checkpoint")),
                lora_name=d.get("lora_name"),
                lora_int_id=None if d.get("lora_int_id") is None else int(d["lora_int_id"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise SyncError(f"malformed sync manifest ({type(e).__name__}: {e}); sender and receiver hwsync differ?") from e
