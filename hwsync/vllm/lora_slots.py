"""In-place adapter updates: the installed adapter rewritten from the new tensors, without a rebuild.

Installing an adapter the vLLM way (``LoRAModel.from_lora_tensors``, the manager's packing of q/k/v, stacking of
per-expert MoE LoRA, EP slicing, then ``set_lora`` into the stacked slot tensors) costs a Python walk over every
tensor and a stack per expert group -- hundreds of milliseconds at MoE scale, every step. A sync of the same adapter
structure only changes values, so :class:`SlotWriter` replays that pipeline as gathers:

* **Traced once, on vLLM's own code.** The manifest's tensors are replaced by float64 tensors holding their element
  indices and run through ``from_lora_tensors`` and the manager's ``_create_merged_loras_inplace``. Those steps only
  move data (stack, reshape, slice, permute), so every element of every tensor vLLM would hand to ``set_lora`` says
  which manifest element it came from (0: vLLM's own zero fill). Anything that is not pure data movement (a scaling
  other than 1, which hwsync never sends) leaves non-index values and disables the fast path.
* **Checked once, on real data.** After the first install through vLLM's path, the gathers are run on the same
  tensors and must reproduce the installed adapter's tensors exactly.
* **Per sync:** one copy into each of the installed adapter's tensors (so the adapter vLLM holds stays current, e.g.
  for re-activation), then vLLM's own ``set_lora`` per module writes the slot (TP slicing included). Where a gather
  is a strided view of one tensor (stacking, splitting, slicing and permuting all are; found at trace time) the copy
  reads that view directly; otherwise (vLLM's zero fill, elements from several tensors) it is an ``index_select``
  from the concatenated tensors.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["SlotWriter"]

logger = logging.getLogger("hwsync.vllm")


@dataclass(frozen=True)
class _View:
    """A gather that is ``flat(keys[source]).as_strided(shape, strides, offset)``."""

    source: int
    strides: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class _Gather:
    module: str
    field: str  # "lora_a" | "lora_b"
    position: int | None  # index in a packed list, None for a plain tensor
    index: Tensor  # int64, into the concatenated tensors (+1 zero element at the end)
    shape: tuple[int, ...]
    view: _View | None = None


def _strided(index: Tensor, shape: tuple[int, ...], starts: Sequence[int], sizes: Sequence[int]) -> _View | None:
    """``index`` (positions in the concatenated tensors) as a strided view of one of them, if it is one."""
    if index.numel() == 0:
        return None
    lo, hi = int(index.min()), int(index.max())
    source = next((k for k, (s, n) in enumerate(zip(starts, sizes)) if s <= lo and hi < s + n), None)
    if source is None:
        return None
    local = index.reshape(shape) - starts[source]
    origin = (0,) * len(shape)
    offset = int(local[origin]) if shape else int(local)
    strides = []
    for d, n in enumerate(shape):
        step = [0] * len(shape)
        step[d] = 1 if n > 1 else 0
        strides.append(int(local[tuple(step)]) - offset if n > 1 else 0)
    expect = torch.full(shape, offset, dtype=torch.int64)
    for d, (n, st) in enumerate(zip(shape, strides)):
        view = [1] * len(shape)
        view[d] = n
        expect += (torch.arange(n, dtype=torch.int64) * st).view(view)
    if not torch.equal(expect, local):
        return None
    return _View(source, tuple(strides), offset)


def _slots(weights: Any, field: str) -> list[tuple[int | None, Tensor]]:
    value = getattr(weights, field)
    if isinstance(value, list):
        return [(i, t) for i, t in enumerate(value) if t is not None]
    return [] if value is None else [(None, value)]


def _get(weights: Any, g: _Gather) -> Tensor:
    value = getattr(weights, g.field)
    return value[g.position] if g.position is not None else value


@dataclass
class SlotWriter:
    """Gathers that rebuild the tensors vLLM hands to ``set_lora``, from the manifest's LoRA tensors."""

    keys: tuple[str, ...]
    numel: int
    gathers: tuple[_Gather, ...]
    modules: tuple[str, ...]

    @classmethod
    def trace(cls, manager: Any, build: Any, keys: Sequence[str], shapes: Sequence[tuple[int, ...]],
              device: torch.device) -> SlotWriter | str:
        """Run vLLM's adapter construction on index-valued tensors; the writer, or why there is none.

        ``build(tensors)`` is the applier's ``LoRAModel.from_lora_tensors`` call (same helper, mapper, prefixes)."""
        codes: dict[str, Tensor] = {}
        starts: list[int] = []
        sizes: list[int] = []
        offset = 1
        for k, shape in zip(keys, shapes):
            n = 1
            for s in shape:
                n *= s
            codes[k] = torch.arange(offset, offset + n, dtype=torch.float64).reshape(shape)
            starts.append(offset - 1)
            sizes.append(n)
            offset += n
        total = offset - 1
        if total >= 1 << 52:
            return "adapter too large to trace exactly in float64"
        try:
            lm = build(codes, dtype=torch.float64)
            manager._validate_moe_lora_format(lm)
            manager._create_merged_loras_inplace(lm)
        except Exception as e:  # noqa: BLE001 - any surprise in vLLM's pipeline: keep its own path
            return f"vLLM's adapter construction could not be traced ({type(e).__name__}: {e})"
        if getattr(lm, "modules_to_save", None):
            return "adapter carries full modules (modules_to_save)"
        gathers = []
        for name, weights in lm.loras.items():
            for field in ("lora_a", "lora_b"):
                for pos, t in _slots(weights, field):
                    values = t.detach().reshape(-1)
                    if values.dtype != torch.float64 or not torch.equal(values, values.round()) \
                            or bool((values < 0).any()) or bool((values > total).any()):
                        return f"{name}.{field}: vLLM transforms adapter values (not only moves them)"
                    index = values.to(torch.int64) - 1
                    index[index < 0] = total  # vLLM's zero fill -> the zero appended after the tensors
                    view = _strided(index, tuple(t.shape), starts, sizes)
                    gathers.append(_Gather(name, field, pos, index.to(device), tuple(t.shape), view))
        modules = tuple(m for m in manager.modules if m in lm.loras)
        return cls(tuple(keys), total, tuple(gathers), modules)

    def _flat(self, tensors: Mapping[str, Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
        parts = [tensors[k].detach().reshape(-1) for k in self.keys]
        parts.append(torch.zeros(1, dtype=parts[0].dtype if parts else dtype, device=device))
        flat = torch.cat([p.to(device=device, dtype=dtype) for p in parts])
        if flat.numel() != self.numel + 1:
            raise ValueError("adapter tensors do not match the traced structure")
        return flat

    def _sources(self, tensors: Mapping[str, Tensor], dst: Tensor) -> Any:
        """``values(gather)``: the tensor (possibly a strided view) holding that gather's new values."""
        flat: list[Tensor] = []
        sources: dict[int, Tensor] = {}

        def values(g: _Gather) -> Tensor:
            if g.view is not None:
                src = sources.get(g.view.source)
                if src is None:
                    t = tensors[self.keys[g.view.source]].detach()
                    src = sources[g.view.source] = t.reshape(-1).to(device=dst.device, dtype=dst.dtype)
                return src.as_strided(g.shape, g.view.strides, g.view.offset)
            if not flat:
                flat.append(self._flat(tensors, dst.dtype, dst.device))
            return flat[0].index_select(0, g.index.to(dst.device)).view(g.shape)

        return values

    def matches(self, lora_model: Any, tensors: Mapping[str, Tensor]) -> bool:
        """Whether the gathers reproduce ``lora_model`` (installed by vLLM's path) from ``tensors`` exactly."""
        for g in self.gathers:
            weights = lora_model.loras.get(g.module)
            if weights is None or tuple(_get(weights, g).shape) != g.shape:
                return False
        if sum(t.numel() for t in tensors.values()) != self.numel:
            return False
        values = None
        for g in self.gathers:
            dst = _get(lora_model.loras[g.module], g)
            values = values or self._sources(tensors, dst)
            if not torch.equal(values(g), dst):
                return False
        return True

    def write(self, manager: Any, lora_model: Any, tensors: Mapping[str, Tensor]) -> None:
        """Rewrite the installed adapter's tensors, then its slot with vLLM's own ``set_lora``."""
        slot = manager.lora_index_to_id.index(lora_model.id)
        if sum(t.numel() for t in tensors.values()) != self.numel:
            raise ValueError("adapter tensors do not match the traced structure")
        values = None
        with torch.no_grad():
            for g in self.gathers:
                dst = _get(lora_model.loras[g.module], g)
                values = values or self._sources(tensors, dst)
                dst.copy_(values(g))
            for name in self.modules:
                weights = lora_model.loras[name]
                manager.modules[name].set_lora(slot, weights.lora_a, weights.lora_b)
