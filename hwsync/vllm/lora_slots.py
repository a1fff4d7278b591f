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
* **The slots, traced the same way.** Each LoRA layer's ``set_lora`` is run once more, with its stacked slot tensors
  swapped for float64 stand-ins (NaN: not written) and the index-valued adapter as input: what lands in the adapter's
  slot says, per slot element, which manifest element vLLM puts there (TP slicing, packing, expert-dim matching
  included). Where every layer's writes are dense blocks, each a strided view of one manifest tensor, and the blocks
  read from the new tensors reproduce the slot vLLM itself filled at install (checked on the real data), later syncs
  write those blocks directly instead of calling ``set_lora`` (which zero-fills every slot and re-slices per module).
* **Per sync:** one copy into each of the installed adapter's tensors (so the adapter vLLM holds stays current, e.g.
  for re-activation after an eviction), then one copy per slot block (or vLLM's own ``set_lora`` per module where
  the slots could not be traced or the adapter moved to another slot). Where a gather is a strided view of one tensor
  (stacking, splitting, slicing and permuting all are; found at trace time) the copy reads that view directly;
  otherwise (vLLM's zero fill, elements from several tensors) it is an ``index_select`` from the concatenated tensors.
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
        step[d] = 1
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


@dataclass(frozen=True)
class _Block:
    """A dense block of one LoRA layer's stacked slot tensor that ``set_lora`` fills from one strided view."""

    module: str
    attr: str
    position: int | None  # index in a tuple/list of stacked tensors, None for a plain tensor
    box: tuple[slice, ...]  # inside ``tensor[slot]``
    shape: tuple[int, ...]
    view: _View


def _stacked(module: Any, n_slots: int) -> dict[str, Any]:
    """The module's per-slot tensors (``lora_a_stacked``, ``w13_lora_b_stacked``, ``adapter_enabled``, ...): every
    tensor attribute, or tuple/list of tensors, whose first dimension counts the slots."""
    out = {}
    for attr, value in vars(module).items():
        items = value if isinstance(value, (tuple, list)) else [value]
        if items and all(isinstance(t, Tensor) and t.dim() >= 1 and t.shape[0] in (n_slots, n_slots + 1)
                         for t in items):
            out[attr] = value
    return out


def _stand_in(value: Any) -> Any:
    if isinstance(value, Tensor):
        return torch.full(value.shape, float("nan"), dtype=torch.float64)
    return type(value)(_stand_in(t) for t in value)


def _trace_blocks(manager: Any, lm: Any, modules: Sequence[str], slot: int, starts: Sequence[int],
                  sizes: Sequence[int]) -> list[_Block] | str:
    """Run each layer's ``set_lora`` into float64 stand-ins of its slot tensors; the dense blocks it writes."""
    n_slots = len(manager.lora_index_to_id)
    blocks: list[_Block] = []
    for name in modules:
        module = manager.modules[name]
        originals = _stacked(module, n_slots)
        if not originals:
            return f"{name}: no per-slot tensors found on {type(module).__name__}"
        stand_ins = {attr: _stand_in(value) for attr, value in originals.items()}
        weights = lm.loras[name]
        try:
            for attr, value in stand_ins.items():
                setattr(module, attr, value)
            module.set_lora(slot, weights.lora_a, weights.lora_b)
        except Exception as e:  # noqa: BLE001 - any surprise: keep vLLM's own set_lora
            return f"{name}: set_lora could not be traced ({type(e).__name__}: {e})"
        finally:
            for attr, value in originals.items():
                setattr(module, attr, value)
        for attr, value in stand_ins.items():
            real = originals[attr]
            for pos, t in (enumerate(value) if isinstance(value, (tuple, list)) else [(None, value)]):
                target = real[pos] if pos is not None else real
                if not target.is_floating_point() or t.shape[0] != n_slots:
                    continue  # flags (adapter_enabled): already set for the installed adapter's slot
                region = t[slot]
                written = (~torch.isnan(region)) & (region != 0)
                if not bool(written.any()):
                    continue
                where = written.nonzero()
                lo, hi = where.min(0).values.tolist(), where.max(0).values.tolist()
                box = tuple(slice(a, b + 1) for a, b in zip(lo, hi))
                codes = region[box]
                if bool(torch.isnan(codes).any()) or bool((codes < 1).any()):
                    return f"{name}.{attr}: set_lora writes a slot region that is not one dense block"
                index = codes.reshape(-1).to(torch.int64) - 1
                view = _strided(index, tuple(codes.shape), starts, sizes)
                if view is None:
                    return f"{name}.{attr}: a slot block is not a strided view of one adapter tensor"
                blocks.append(_Block(name, attr, pos, box, tuple(codes.shape), view))
    return blocks


@dataclass
class SlotWriter:
    """Gathers that rebuild the tensors vLLM hands to ``set_lora``, from the manifest's LoRA tensors."""

    keys: tuple[str, ...]
    numel: int
    gathers: tuple[_Gather, ...]
    modules: tuple[str, ...]
    slot: int | None = None
    blocks: tuple[_Block, ...] = ()
    no_blocks: str = ""
    """Why slots are written by vLLM's ``set_lora`` (empty when :attr:`blocks` write them)."""

    @classmethod
    def trace(cls, manager: Any, build: Any, keys: Sequence[str], shapes: Sequence[tuple[int, ...]],
              device: torch.device, slot: int | None = None) -> SlotWriter | str:
        """Run vLLM's adapter construction on index-valued tensors; the writer, or why there is none.

        ``build(tensors)`` is the applier's ``LoRAModel.from_lora_tensors`` call (same helper, mapper, prefixes).
        ``slot``: where the installed adapter is active (its layers' ``set_lora`` is traced too)."""
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
            validate = getattr(manager, "_validate_moe_lora_format", None)  # vLLM 0.31 has none
            if validate is not None:
                validate(lm)
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
        blocks = _trace_blocks(manager, lm, modules, slot, starts, sizes) if slot is not None else "no active slot"
        if isinstance(blocks, str):
            return cls(tuple(keys), total, tuple(gathers), modules, None, (), blocks)
        return cls(tuple(keys), total, tuple(gathers), modules, slot, tuple(blocks))

    def _flat(self, tensors: Mapping[str, Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
        parts = [tensors[k].detach().reshape(-1) for k in self.keys]
        parts.append(torch.zeros(1, dtype=parts[0].dtype if parts else dtype, device=device))
        flat = torch.cat([p.to(device=device, dtype=dtype) for p in parts])
        if flat.numel() != self.numel + 1:
            raise ValueError("adapter tensors do not match the traced structure")
        return flat

    def _sources(self, tensors: Mapping[str, Tensor], like: Tensor) -> Any:
        """``read(view, shape, index)``: new values for one gather or slot block, in ``like``'s dtype and device -- a
        strided view of one tensor where ``view`` is known, else an ``index_select`` from the concatenation."""
        flat: list[Tensor] = []
        sources: dict[int, Tensor] = {}

        def read(view: _View | None, shape: tuple[int, ...], index: Tensor | None) -> Tensor:
            if view is not None:
                src = sources.get(view.source)
                if src is None:
                    t = tensors[self.keys[view.source]].detach()
                    src = sources[view.source] = t.reshape(-1).to(device=like.device, dtype=like.dtype)
                # as_strided's offset counts from the storage's start: a tensor received in a bucket is a view at
                # an offset into that bucket
                return src.as_strided(shape, view.strides, src.storage_offset() + view.offset)
            assert index is not None
            if not flat:
                flat.append(self._flat(tensors, like.dtype, like.device))
            return flat[0].index_select(0, index.to(like.device)).view(shape)

        return read

    @staticmethod
    def _slot_block(manager: Any, b: _Block, slot: int) -> Tensor:
        value = getattr(manager.modules[b.module], b.attr)
        return (value[b.position] if b.position is not None else value)[slot][b.box]

    def matches(self, lora_model: Any, tensors: Mapping[str, Tensor]) -> bool:
        """Whether the gathers reproduce ``lora_model`` (installed by vLLM's path) from ``tensors`` exactly."""
        for g in self.gathers:
            weights = lora_model.loras.get(g.module)
            if weights is None or tuple(_get(weights, g).shape) != g.shape:
                return False
        if sum(t.numel() for t in tensors.values()) != self.numel:
            return False
        read = None
        for g in self.gathers:
            dst = _get(lora_model.loras[g.module], g)
            read = read or self._sources(tensors, dst)
            if not torch.equal(read(g.view, g.shape, g.index), dst):
                return False
        return True

    def check_blocks(self, manager: Any, tensors: Mapping[str, Tensor]) -> str:
        """Whether the slot blocks reproduce, from ``tensors``, what vLLM's ``set_lora`` put in the slot when it
        installed them; if not, slots stay on ``set_lora`` (and the reason is returned)."""
        if not self.blocks:
            return self.no_blocks
        assert self.slot is not None
        read = None
        for b in self.blocks:
            dst = self._slot_block(manager, b, self.slot)
            read = read or self._sources(tensors, dst)
            if tuple(dst.shape) != b.shape or not torch.equal(read(b.view, b.shape, None), dst):
                self.blocks, self.slot = (), None
                self.no_blocks = f"{b.module}.{b.attr}: the traced slot block differs from what vLLM wrote"
                break
        return self.no_blocks

    def write(self, manager: Any, lora_model: Any, tensors: Mapping[str, Tensor]) -> None:
        """Rewrite the installed adapter's tensors, then its slot: the traced blocks, or vLLM's own ``set_lora``."""
        slot = manager.lora_index_to_id.index(lora_model.id)
        if sum(t.numel() for t in tensors.values()) != self.numel:
            raise ValueError("adapter tensors do not match the traced structure")
        read = None
        with torch.no_grad():
            for g in self.gathers:
                dst = _get(lora_model.loras[g.module], g)
                read = read or self._sources(tensors, dst)
                dst.copy_(read(g.view, g.shape, g.index))
            if self.blocks and slot == self.slot:
                for b in self.blocks:
                    self._slot_block(manager, b, slot).copy_(read(b.view, b.shape, None))  # type: ignore[misc]
                return
            for name in self.modules:
                weights = lora_model.loras[name]
                manager.modules[name].set_lora(slot, weights.lora_a, weights.lora_b)
