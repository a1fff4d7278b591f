"""In-place adapter installs and updates: vLLM's adapter layout, traced once on one layer, applied to all.

Installing an adapter the vLLM way (``LoRAModel.from_lora_tensors``, the manager's packing of q/k/v, stacking of
per-expert MoE LoRA, EP slicing, then ``set_lora`` into the stacked slot tensors) is a Python walk over every tensor
and a stack per expert group: seconds at Qwen3-30B-A3B scale (48 layers x 128 experts), every time. Those steps only
*move* data, and they do the same to every layer of the same structure, so :class:`SlotWriter` learns them once:

* **Traced on a template.** The layers are grouped by structure (names with the layer index taken out, shapes,
  dtypes); one representative layer per group (and every module outside the numbered layers) is replaced by float64
  tensors holding their element indices and run through vLLM's own ``from_lora_tensors``, MoE-format validation and
  ``_create_merged_loras_inplace``. Every element vLLM would hand to ``set_lora`` then says which manifest element it
  came from (0: vLLM's zero fill); anything that is not pure data movement (a scaling other than 1, which hwsync
  never sends) leaves non-index values and disables the writer. The gathers found are strided views of one manifest
  tensor (or, for a reordering no strided view fits, index gathers of one); the other layers of the group get the
  same views of their own tensors. The trace costs one layer per structure, whatever the depth of the model (a
  48-layer model traces as fast as a 2-layer one).
* **The slots, traced the same way** once the adapter is installed: each template module's ``set_lora`` runs once
  more with its stacked slot tensors swapped for float64 stand-ins (NaN: not written) and the index-valued adapter as
  input; what lands in the slot says which manifest element vLLM puts where (TP slicing, packing, expert-dim matching
  included). Dense blocks, each a strided view of one manifest tensor, are what later syncs write directly.
* **Checked on real data.** Before the install, vLLM's own construction of the sampled layers (each group's first
  and last layer, every module outside them) from the real tensors must equal the gathers; after it, every slot
  block read from the real tensors must equal what vLLM's own ``set_lora`` put in the slot. The checks compare one
  tensor at a time: no full-size copy of the adapter.
* **Install** (:meth:`SlotWriter.materialize`): the adapter vLLM registers is built by the gathers -- one copy of the
  adapter in vLLM's LoRA dtype, the same tensors and the same layer-weight objects vLLM's construction makes -- and
  vLLM's own ``add_adapter`` activates it (its validations, ``set_lora`` into the slots).
* **Per sync** (:meth:`SlotWriter.write`): one batched copy (``torch._foreach_copy_``) into the installed adapter's
  tensors (so the adapter vLLM holds stays current, e.g. for re-activation after an eviction) and into the slot
  blocks; vLLM's own ``set_lora`` per module where the slots could not be traced.
"""

from __future__ import annotations

import copy
import logging
import re
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from hwsync.common import foreign
from hwsync.common.errors import BackendUnavailableError
from hwsync.common.replay import Replay, addresses, common_device, copy_all
from hwsync.engine.vllm.compat import check_adapter

__all__ = ["SlotWriter", "LayerGroups", "layer_groups", "held_tensor", "NOT_TRACED", "LAYER_NAME"]

NOT_TRACED = "slots not traced yet"

logger = logging.getLogger("hwsync.vllm")

LAYER_NAME = re.compile(r"^(?P<prefix>.*?\blayers)\.(?P<index>\d+)\.(?P<rest>.+)$")
"""A name inside a numbered layer: what precedes ``layers``, the index, the rest."""


# -- layer groups -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerGroups:
    """The trainer's LoRA modules by layer structure: what the trace runs on, and how it is applied to the rest."""

    traced: tuple[str, ...]
    """Trainer modules the trace runs on: each group's representative layer, and every module outside numbered
    layers."""
    members: Mapping[tuple[str, int], tuple[int, ...]]
    """``(layers prefix, representative index) -> every layer index of that structure`` (representative included)."""
    sampled: tuple[str, ...]
    """Trainer modules checked against vLLM's own construction on real data (each group's first and last layer, and
    the modules outside numbered layers)."""


def layer_groups(modules: Mapping[str, Any], shapes: Mapping[str, tuple[Any, ...]]) -> LayerGroups:
    """Group trainer modules by layer: ``modules`` is the wire metadata (name -> spec), ``shapes`` name -> whatever
    must match for two layers to share a layout (shapes and dtypes of the module's factors)."""
    layers: dict[tuple[str, int], list[tuple[str, str]]] = {}
    outside: list[str] = []
    for name in modules:
        m = LAYER_NAME.match(name)
        if m is None:
            outside.append(name)
        else:
            layers.setdefault((m["prefix"], int(m["index"])), []).append((m["rest"], name))
    groups: dict[tuple[str, Any], list[int]] = {}
    for (prefix, index), items in layers.items():
        key = tuple(sorted((rest, repr(modules[name]), repr(shapes[name])) for rest, name in items))
        groups.setdefault((prefix, key), []).append(index)
    traced = list(outside)
    sampled = list(outside)
    members: dict[tuple[str, int], tuple[int, ...]] = {}
    for (prefix, _), indices in groups.items():
        indices.sort()
        members[(prefix, indices[0])] = tuple(indices)
        for index in sorted({indices[0], indices[-1]}):
            names = [name for _, name in layers[(prefix, index)]]
            sampled += names
            if index == indices[0]:
                traced += names
    order = {n: i for i, n in enumerate(modules)}
    return LayerGroups(
        tuple(sorted(traced, key=order.__getitem__)), members, tuple(sorted(sampled, key=order.__getitem__))
    )


def _renamer(prefix: str, source: int, target: int) -> Callable[[str], str | None]:
    """``name -> name`` with layer ``source`` of ``prefix`` renamed to ``target`` (``None``: not exactly one such
    layer in the name). Trainer names carry ``prefix``; vLLM names may spell what precedes ``layers`` differently."""
    pattern = re.compile(rf"\blayers\.{source}\.")

    def rename(name: str) -> str | None:
        if source == target:
            return name
        new, n = pattern.subn(f"layers.{target}.", name)
        return new if n == 1 else None

    return rename


# -- gathers and blocks -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _View:
    """vLLM's tensor as a view of one (contiguous) manifest tensor: ``as_strided(shape, strides, offset)``, or, where
    vLLM reorders elements no strided view reproduces (Llama 4's loader interleaves the q/k rows of every head), the
    source's flat positions ``index`` (a gather: one extra temporary per read)."""

    source: str
    strides: tuple[int, ...] = ()
    offset: int = 0
    index: Tensor | None = field(default=None, compare=False, repr=False)
    """int64 flat positions in the source, in vLLM's element order (None: the strided view)."""
    _on: dict[Any, Tensor] = field(default_factory=dict, compare=False, repr=False)

    def _positions(self, device: torch.device) -> Tensor:
        assert self.index is not None
        t = self._on.get(device)
        if t is None:
            t = self._on[device] = self.index.to(device)
        return t

    def read(self, t: Tensor, shape: tuple[int, ...]) -> Tensor:
        """The view of contiguous ``t`` (a copy for an index view). ``as_strided``'s offset counts from the storage's
        start: a tensor received in a bucket is a view at an offset into that bucket."""
        if self.index is None:
            return t.as_strided(shape, self.strides, t.storage_offset() + self.offset)
        return t.reshape(-1).index_select(0, self._positions(t.device)).reshape(shape)

    def write(self, t: Tensor, value: Tensor) -> None:
        """Write ``value`` (vLLM's tensor) back through the view into contiguous ``t``."""
        if self.index is None:
            t.as_strided(tuple(value.shape), self.strides, t.storage_offset() + self.offset).copy_(value)
        else:
            t.view(-1).index_copy_(0, self._positions(t.device), value.reshape(-1).to(t.dtype))


@dataclass(frozen=True)
class _Gather:
    """One tensor of vLLM's adapter (``loras[module].<field>[position]``) as a view of one manifest tensor, or zeros
    (vLLM's zero fill)."""

    module: str
    field: str  # "lora_a" | "lora_b"
    position: int | None  # index in a packed list, None for a plain tensor
    shape: tuple[int, ...]
    view: _View | None  # None: all zeros


@dataclass(frozen=True)
class _Block:
    """A dense block of one LoRA layer's stacked slot tensor that ``set_lora`` fills from one strided view."""

    module: str
    attr: str
    position: int | None  # index in a tuple/list of stacked tensors, None for a plain tensor
    box: tuple[slice, ...]  # inside ``tensor[slot]``
    shape: tuple[int, ...]
    view: _View


def _index_view(
    index: Tensor,
    shape: tuple[int, ...],
    keys: Sequence[str],
    starts: Sequence[int],
    sizes: Sequence[int],
    gather: bool = False,
) -> _View | None:
    """``index`` (positions in the concatenated tensors, any device) as a strided view of one of them, if it is
    one; with ``gather``, any reordering of one of them (an index view) where no strided view fits."""
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
    expect = torch.full(shape, offset, dtype=torch.int64, device=index.device)
    for d, (n, st) in enumerate(zip(shape, strides)):
        view = [1] * len(shape)
        view[d] = n
        expect += (torch.arange(n, dtype=torch.int64, device=index.device) * st).view(view)
    if not torch.equal(expect, local):
        return _View(keys[source], index=local.reshape(-1).clone()) if gather else None
    return _View(keys[source], tuple(strides), offset)


def _fields(weights: Any, field: str) -> list[tuple[int | None, Tensor]]:
    value = getattr(weights, field)
    if isinstance(value, list):
        return [(i, t) for i, t in enumerate(value) if t is not None]
    return [] if value is None else [(None, value)]


def held_tensor(weights: Any, g: _Gather | _Block) -> Tensor:
    """The tensor of a layer-weight object (or stacked slot tensors) that gather / block ``g`` stands for."""
    value = getattr(weights, g.field if isinstance(g, _Gather) else g.attr)
    return value[g.position] if g.position is not None else value


def _stacked(module: Any, n_slots: int) -> dict[str, Any]:
    """The module's per-slot tensors (``lora_a_stacked``, ``w13_lora_b_stacked``, ``adapter_enabled``, ...): every
    tensor attribute, or tuple/list of tensors, whose first dimension counts the slots."""
    out = {}
    for attr, value in vars(module).items():
        items = value if isinstance(value, (tuple, list)) else [value]
        if items and all(
            isinstance(t, Tensor) and t.dim() >= 1 and t.shape[0] in (n_slots, n_slots + 1) for t in items
        ):
            out[attr] = value
    return out


def _stand_in(value: Any, device: torch.device) -> Any:
    if isinstance(value, Tensor):
        return torch.full(value.shape, float("nan"), dtype=torch.float64, device=device)
    return type(value)(_stand_in(t, device) for t in value)


def trace_device(engine_device: Any) -> torch.device:
    """Where the trace runs: the engine's device where its backend traces in float64 (a GPU: cheap there, and vLLM
    pins CPU tensors one by one), else the CPU (:attr:`hwsync.common.backend.Backend.traces_in_float64`)."""
    from hwsync.common.backend import backend_for_device

    device = torch.device(engine_device) if engine_device is not None else torch.device("cpu")
    if device.type == "cpu":
        return device
    try:
        traces = backend_for_device(device).traces_in_float64
    except BackendUnavailableError:
        traces = False
    return device if traces else torch.device("cpu")


@dataclass
class SlotWriter:
    """vLLM's adapter layout as views of the manifest's LoRA tensors, for every layer."""

    keys: tuple[str, ...]
    gathers: tuple[_Gather, ...]
    modules: tuple[str, ...]
    """vLLM LoRA modules the adapter sets (the manager's order)."""
    groups: LayerGroups
    template: Any = field(repr=False, default=None)
    """The traced ``LoRAModel`` (float64 codes): its layer-weight objects are the prototypes :meth:`materialize`
    copies."""
    prototypes: Mapping[str, str] = field(default_factory=dict)
    """vLLM module -> the template module it was expanded from."""
    expand: Mapping[str, tuple[tuple[str, int], int]] = field(default_factory=dict)
    """Template vLLM module -> (its group, its layer index) (absent: a module outside numbered layers)."""
    key_maps: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """vLLM module -> (template's manifest key -> this module's), for modules expanded from a template."""
    blocks: tuple[_Block, ...] = ()
    no_blocks: str = NOT_TRACED
    """Why slots are written by vLLM's ``set_lora`` (empty when :attr:`blocks` write them)."""
    traced_modules: int = 0
    """How many vLLM modules the trace ran through vLLM's construction (does not grow with the layer count)."""
    proven: set[str] = field(default_factory=set, init=False, repr=False, compare=False)
    """Modules whose slots, written through :attr:`blocks`, vLLM's own ``set_lora`` re-derived bit for bit
    (:func:`hwsync.engine.vllm.fingerprint._oracle`). The blocks never change for a writer, so a module is proven
    once."""
    _replay: Replay = field(
        default_factory=lambda: Replay("the adapter's slot writes"), init=False, repr=False, compare=False
    )

    # -- phase 1: vLLM's construction, on the template --------------------------------------------------------
    @classmethod
    def trace(
        cls,
        manager: Any,
        build: Any,
        meta: Mapping[str, Any],
        shapes: Mapping[str, tuple[int, ...]],
        device: Any = None,
        wire_name: Callable[[str, str], str] | None = None,
    ) -> SlotWriter | str:
        """Run vLLM's adapter construction on index-valued tensors of one layer per structure; the writer for all
        layers, or why there is none. Touches no engine state (the slots are traced by :meth:`trace_slots` after
        the install).

        ``build(tensors, dtype=, device=, modules=)`` is the applier's ``LoRAModel.from_lora_tensors`` call (same
        helper, mapper, prefixes) on a subset of modules; ``meta`` the wire metadata (``modules``: name -> spec);
        ``shapes`` the manifest's key -> shape (dtype-qualified where it matters)."""
        from hwsync.common.lora_formats import wire_name as default_wire_name

        wire = wire_name or default_wire_name
        modules_meta: Mapping[str, Any] = meta.get("modules", {})
        per_module = {m: (shapes.get(wire(m, "A")), shapes.get(wire(m, "B"))) for m in modules_meta}
        groups = layer_groups(modules_meta, per_module)
        key_of = {wire(m, f): m for m in modules_meta for f in ("A", "B")}
        writer = cls._trace_modules(manager, build, groups.traced, wire, shapes, trace_device(device))
        if isinstance(writer, str):
            return writer
        template, gathers = writer
        group_of: dict[str, tuple[str, int] | None] = {}
        for (prefix, rep), _ in groups.members.items():
            for m in groups.traced:
                mm = LAYER_NAME.match(m)
                if mm is not None and mm["prefix"] == prefix and int(mm["index"]) == rep:
                    group_of[m] = (prefix, rep)
        # each vLLM module of the template belongs to the group of the trainer modules it reads from
        owner: dict[str, tuple[tuple[str, int], int] | None] = {}
        for g in gathers:
            if g.view is None:
                continue
            home = group_of.get(key_of[g.view.source])
            found = (home, home[1]) if home is not None else None
            if owner.setdefault(g.module, found) != found:
                return f"{g.module}: vLLM's LoRA module reads from several layers' tensors"
        vllm_modules = tuple(m for m in manager.modules if m in template.loras)
        missing = [m for m in vllm_modules if m not in owner]
        if missing:
            return f"{missing[0]}: vLLM's LoRA module reads no adapter tensor (only zeros)"
        out = cls(
            tuple(shapes),
            (),
            (),
            groups,
            template,
            {},
            {m: o for m, o in owner.items() if o is not None},
            traced_modules=len(vllm_modules),
        )
        expanded = out._expanded(gathers, manager, wire)
        if isinstance(expanded, str):
            return expanded
        out.gathers, out.prototypes, out.key_maps = expanded
        out.modules = tuple(m for m in manager.modules if m in out.prototypes)
        return out

    @staticmethod
    def _trace_modules(
        manager: Any,
        build: Any,
        traced: Sequence[str],
        wire: Callable[[str, str], str],
        shapes: Mapping[str, tuple[int, ...]],
        device: torch.device,
    ) -> tuple[Any, list[_Gather]] | str:
        keys = [wire(m, f) for m in traced for f in ("A", "B") if wire(m, f) in shapes]
        codes: dict[str, Tensor] = {}
        starts: list[int] = []
        sizes: list[int] = []
        offset = 1
        for k in keys:
            n = 1
            for s in shapes[k]:
                n *= s
            codes[k] = torch.arange(offset, offset + n, dtype=torch.float64, device=device).reshape(shapes[k])
            starts.append(offset - 1)
            sizes.append(n)
            offset += n
        total = offset - 1
        if total >= 1 << 52:
            return "adapter layer too large to trace exactly in float64"
        try:
            lm = build(codes, dtype=torch.float64, device=device, modules=traced)
            check_adapter(manager, lm)
            manager._create_merged_loras_inplace(lm)
        except Exception as e:  # noqa: BLE001 - any surprise in vLLM's pipeline: keep its own path
            return f"vLLM's adapter construction could not be traced ({type(e).__name__}: {e})"
        foreign.state_of(lm)["code_ranges"] = (keys, starts, sizes)
        if getattr(lm, "modules_to_save", None):
            return "adapter carries full modules (modules_to_save)"
        gathers = []
        for name, weights in lm.loras.items():
            for fld in ("lora_a", "lora_b"):
                for pos, t in _fields(weights, fld):
                    values = t.detach().reshape(-1)
                    if (
                        values.dtype != torch.float64
                        or not torch.equal(values, values.round())
                        or bool((values < 0).any())
                        or bool((values > total).any())
                    ):
                        return f"{name}.{fld}: vLLM transforms adapter values (not only moves them)"
                    if not bool(values.any()):
                        gathers.append(_Gather(name, fld, pos, tuple(t.shape), None))
                        continue
                    view = _index_view(values.to(torch.int64) - 1, tuple(t.shape), keys, starts, sizes, gather=True)
                    if view is None:
                        return f"{name}.{fld}: vLLM's tensor reads from several adapter tensors"
                    gathers.append(_Gather(name, fld, pos, tuple(t.shape), view))
        return lm, gathers

    def _layer_renames(
        self, manager: Any, wire: Callable[[str, str], str]
    ) -> list[tuple[int, Callable[[str], str | None], dict[str, str], tuple[str, int]]]:
        """Per (group, member layer): the renamer of names and the manifest-key map from the representative."""
        out = []
        for (prefix, rep), indices in self.groups.members.items():
            for index in indices:
                keys = {}
                for m in self.groups.traced:
                    mm = LAYER_NAME.match(m)
                    if mm is None or mm["prefix"] != prefix or int(mm["index"]) != rep:
                        continue
                    target = f"{prefix}.{index}.{mm['rest']}"
                    for f in ("A", "B"):
                        keys[wire(m, f)] = wire(target, f)
                out.append((index, _renamer(prefix, rep, index), keys, (prefix, rep)))
        return out

    def _expanded(
        self, gathers: Sequence[_Gather], manager: Any, wire: Callable[[str, str], str]
    ) -> tuple[tuple[_Gather, ...], dict[str, str], dict[str, dict[str, str]]] | str:
        out: list[_Gather] = [g for g in gathers if g.module not in self.expand]
        prototypes = {g.module: g.module for g in out}
        key_maps: dict[str, dict[str, str]] = {}
        renames = self._layer_renames(manager, wire)
        by_module: dict[str, list[_Gather]] = {}
        for g in gathers:
            if g.module in self.expand:
                by_module.setdefault(g.module, []).append(g)
        for module, (group, _) in self.expand.items():
            for index, rename, keys, home in renames:
                if home != group:
                    continue
                name = rename(module)
                if name is None or name not in manager.modules or name in prototypes:
                    return f"{module}: layer {index} has no single vLLM LoRA module of the same name"
                prototypes[name] = module
                key_maps[name] = keys
                for g in by_module[module]:
                    view = g.view
                    if view is not None:
                        source = keys.get(view.source)
                        if source is None or source not in self.keys:
                            return f"{module}: layer {index} lacks the adapter tensor {view.source!r} stands for"
                        view = replace(view, source=source)
                    out.append(replace(g, module=name, view=view))
        return tuple(out), prototypes, key_maps

    # -- install --------------------------------------------------------------------------------------------------
    def _reader(self, tensors: Mapping[str, Tensor]) -> Callable[[_View, tuple[int, ...]], Tensor]:
        """``view -> tensor``: the strided view of the manifest tensor (its own dtype and device: ``copy_`` casts)."""
        flat: dict[str, Tensor] = {}

        def read(view: _View, shape: tuple[int, ...]) -> Tensor:
            t = flat.get(view.source)
            if t is None:
                t = tensors[view.source].detach()
                t = flat[view.source] = t if t.is_contiguous() else t.contiguous()
            return view.read(t, shape)

        return read

    def _check_tensors(self, tensors: Mapping[str, Tensor]) -> None:
        if set(tensors) != set(self.keys):
            raise ValueError("adapter tensors do not match the traced structure")

    def materialize(
        self,
        lora_model_id: int,
        tensors: Mapping[str, Tensor],
        dtype: torch.dtype,
        device: Any,
        alias: Callable[[Tensor], bool] | None = None,
    ) -> Any:
        """The ``LoRAModel`` vLLM's construction would make from ``tensors``, built by the gathers: the template's
        layer-weight objects copied per module, each tensor one copy from its view -- or the view itself where
        ``alias`` says its manifest tensor is kept for this purpose (a colocated trainer's fold buffers,
        :func:`hwsync.common.lora_formats.kept_buffer`): vLLM's adapter then reads those buffers, rewritten at every
        sync, and the adapter is held once on the device instead of twice (3.4 GB less at 48 layers r32)."""
        self._check_tensors(tensors)
        read = self._reader(tensors)
        target = torch.device(device)
        # never where vLLM would still fold a scaling into lora_b in place (optimize(): scaling != 1), which would
        # write into the buffers; the wire's scalings are folded already, so this holds wherever hwsync installs
        folded = all(
            sc in (1, None)
            for w in self.template.loras.values()
            for sc in (w.scaling if isinstance(w.scaling, list) else [w.scaling])
        )
        shared = {
            k
            for k, t in tensors.items()
            if alias is not None
            and folded
            and t.dtype == dtype
            and t.is_contiguous()
            and t.device.type == target.type
            and target.index in (None, t.device.index)
            and alias(t)
        }
        loras: dict[str, Any] = {}
        dsts: list[Tensor] = []
        srcs: list[Tensor] = []
        for name in self.prototypes:
            w = copy.copy(self.template.loras[self.prototypes[name]])
            w.module_name = name
            for fld in ("lora_a", "lora_b"):
                value = getattr(w, fld)
                setattr(w, fld, list(value) if isinstance(value, list) else value)
            loras[name] = w
        with torch.no_grad():
            for g in self.gathers:
                # a strided view of a kept buffer is held as it is; an index view (a gather) is a copy anyway
                view = (
                    read(g.view, g.shape)
                    if g.view is not None and g.view.index is None and g.view.source in shared
                    else None
                )
                t = (
                    view
                    if view is not None
                    else torch.zeros(g.shape, dtype=dtype, device=device)
                    if g.view is None
                    else torch.empty(g.shape, dtype=dtype, device=device)
                )
                w = loras[g.module]
                if g.position is None:
                    setattr(w, g.field, t)
                else:
                    getattr(w, g.field)[g.position] = t
                if g.view is not None and t is not view:
                    dsts.append(t)
                    srcs.append(read(g.view, g.shape))
            copy_all(dsts, srcs)
        lm = self.template.clone(lora_model_id)
        lm.loras = loras
        return lm

    def matches(self, reference: Any, tensors: Mapping[str, Tensor]) -> str:
        """Whether the gathers reproduce ``reference`` (vLLM's own construction of some modules from ``tensors``)
        exactly: ``""``, or what differs."""
        read = self._reader(tensors)
        mine: dict[tuple[str, str, int | None], _Gather] = {(g.module, g.field, g.position): g for g in self.gathers}
        for name, weights in reference.loras.items():
            for fld in ("lora_a", "lora_b"):
                for pos, dst in _fields(weights, fld):
                    g = mine.get((name, fld, pos))
                    if g is None or tuple(dst.shape) != g.shape:
                        return f"{name}.{fld}: not in the traced layout"
                    got = read(g.view, g.shape) if g.view is not None else torch.zeros((), device=dst.device)
                    if not torch.equal(dst, got.to(device=dst.device, dtype=dst.dtype).expand(g.shape)):
                        return f"{name}.{fld}: the traced layout differs from vLLM's construction"
        return ""

    # -- phase 2: the slots ---------------------------------------------------------------------------------------
    def trace_slots(self, manager: Any, installed: Any, device: Any = None) -> str:
        """Trace the template modules' ``set_lora`` into stand-ins at the installed adapter's slot, expand to every
        layer, then check every block against what vLLM's ``set_lora`` wrote from the real data. ``""`` when the
        blocks write the slots from now on, else why ``set_lora`` does."""
        if installed.id not in manager.lora_index_to_id:
            self.no_blocks = "the adapter is not active in a slot"
            return self.no_blocks
        slot = manager.lora_index_to_id.index(installed.id)
        templates = [m for m in self.modules if self.prototypes[m] == m]
        try:
            blocks = self._trace_blocks(manager, self.template, templates, slot, trace_device(device))
        finally:
            # the trace ran each template layer's set_lora on stand-ins of the per-slot tensors it found; should a
            # layer keep slot state elsewhere, the trace wrote there: vLLM's own set_lora puts the slot back
            with torch.no_grad():
                for name in templates:
                    weights = installed.loras[name]
                    manager.modules[name].set_lora(slot, weights.lora_a, weights.lora_b)
        if isinstance(blocks, str):
            self.no_blocks = blocks
            return blocks
        by_module: dict[str, list[_Block]] = {}
        for b in blocks:
            by_module.setdefault(b.module, []).append(b)
        out: list[_Block] = []
        for name in self.modules:
            proto = self.prototypes[name]
            keys = self.key_maps.get(name)
            for b in by_module.get(proto, ()):
                source = keys.get(b.view.source) if keys is not None else b.view.source
                if source is None:
                    self.no_blocks = f"{name}.{b.attr}: its slot block reads a tensor outside its layer"
                    return self.no_blocks
                out.append(replace(b, module=name, view=replace(b.view, source=source)))
        self.blocks = tuple(out)
        self.no_blocks = ""
        return ""

    def release_codes(self) -> None:
        """Drop the template's float64 codes once the slots are traced: :meth:`materialize` needs only the
        layer-weight objects (each of its tensors is replaced)."""
        if self.template is None:
            return
        for w in self.template.loras.values():
            for fld in ("lora_a", "lora_b"):
                value = getattr(w, fld)
                setattr(
                    w,
                    fld,
                    [None if t is None else _meta(t) for t in value]
                    if isinstance(value, list)
                    else (None if value is None else _meta(value)),
                )

    @staticmethod
    def _trace_blocks(
        manager: Any, lm: Any, modules: Sequence[str], slot: int, device: torch.device
    ) -> list[_Block] | str:
        """Run each module's ``set_lora`` into float64 stand-ins of its slot tensors; the dense blocks it writes."""
        n_slots = len(manager.lora_index_to_id)
        blocks: list[_Block] = []
        keys, starts, sizes = _code_ranges(lm)
        for name in modules:
            module = manager.modules[name]
            originals = _stacked(module, n_slots)
            if not originals:
                return f"{name}: no per-slot tensors found on {type(module).__name__}"
            stand_ins = {attr: _stand_in(value, device) for attr, value in originals.items()}
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
                for pos, t in enumerate(value) if isinstance(value, (tuple, list)) else [(None, value)]:
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
                    view = _index_view(index, tuple(codes.shape), keys, starts, sizes, gather=True)
                    if view is None:
                        return f"{name}.{attr}: a slot block reads from several adapter tensors"
                    blocks.append(_Block(name, attr, pos, box, tuple(codes.shape), view))
        return blocks

    @staticmethod
    def _slot_block(manager: Any, b: _Block, slot: int) -> Tensor:
        value = getattr(manager.modules[b.module], b.attr)
        return (value[b.position] if b.position is not None else value)[slot][b.box]

    def check_blocks(self, manager: Any, installed: Any, tensors: Mapping[str, Tensor]) -> str:
        """Whether the slot blocks reproduce, from ``tensors``, what vLLM's ``set_lora`` put in the slot when it
        installed them (one block at a time); if not, slots stay on ``set_lora`` (and the reason is returned)."""
        if not self.blocks:
            return self.no_blocks
        slot = manager.lora_index_to_id.index(installed.id)
        read = self._reader(tensors)
        for b in self.blocks:
            dst = self._slot_block(manager, b, slot)
            got = read(b.view, b.shape).to(device=dst.device, dtype=dst.dtype)
            if tuple(dst.shape) != b.shape or not torch.equal(got, dst):
                self.blocks = ()
                self.no_blocks = f"{b.module}.{b.attr}: the traced slot block differs from what vLLM wrote"
                break
        return self.no_blocks

    def compared(
        self, manager: Any, installed: Any, tensors: Mapping[str, Tensor], zero_fill: bool = True
    ) -> tuple[list[tuple[str, Tensor, Tensor | None]], list[tuple[str, Tensor, Tensor]]]:
        """What the engine holds beside what it should hold if it holds ``tensors`` (the trainer's adapter as vLLM's
        own loading folds it), as ``(trainer key, held, expected)``: every tensor of the installed adapter (vLLM's
        zero fill included: expected ``None``, zeros), then ``(module.attr, held, expected)`` for every traced slot
        block (none while the slots are written by ``set_lora``). Views only: nothing is copied but an index view's
        gather. ``tensors`` may be a batch of the adapter: only what reads from it is compared (the zero fill where
        ``zero_fill``, the first batch)."""
        read = self._reader(tensors)
        adapter: list[tuple[str, Tensor, Tensor | None]] = []
        for g in self.gathers:
            if (g.view is None and not zero_fill) or (g.view is not None and g.view.source not in tensors):
                continue
            held = held_tensor(installed.loras[g.module], g)
            adapter.append(
                (
                    g.view.source if g.view is not None else "(zero fill)",
                    held,
                    read(g.view, g.shape) if g.view is not None else None,
                )
            )
        slots: list[tuple[str, Tensor, Tensor]] = []
        if self.blocks and installed.id in manager.lora_index_to_id:
            slot = manager.lora_index_to_id.index(installed.id)
            slots = [
                (f"{b.module}.{b.attr}", self._slot_block(manager, b, slot), read(b.view, b.shape))
                for b in self.blocks
                if b.view.source in tensors
            ]
        return adapter, slots

    # -- per sync -------------------------------------------------------------------------------------------------
    def write(self, manager: Any, lora_model: Any, tensors: Mapping[str, Tensor]) -> None:
        """Rewrite the installed adapter's tensors, then its slot: the traced blocks, or vLLM's own ``set_lora``.
        The copies are one graph launch while the manifest's tensors and the destinations stay put
        (:class:`hwsync.common.replay.Replay`: the reader's fold buffers, a server's receive buffers)."""
        slot = manager.lora_index_to_id.index(lora_model.id)
        self._check_tensors(tensors)
        dsts, version = self._destinations(manager, lora_model, slot)
        sources = [tensors[k] for k in self._sources]
        device = common_device([*sources, *dsts[:1]])
        with torch.no_grad():
            self._replay.run(
                (version, addresses(sources)), device, lambda: _copy_unless_same(dsts, self._read_all(tensors))
            )
            if not self.blocks:
                for name in self.modules:
                    weights = lora_model.loras[name]
                    manager.modules[name].set_lora(slot, weights.lora_a, weights.lora_b)

    def _read_all(self, tensors: Mapping[str, Tensor]) -> list[Tensor]:
        """The sources of every copy, in :attr:`_reads` order."""
        read = self._reader(tensors)
        return [read(view, shape) for view, shape in self._reads]

    def _destinations(self, manager: Any, lora_model: Any, slot: int) -> tuple[list[Tensor], int]:
        """What every steady sync writes, in :attr:`_reads` order: the installed adapter's tensors, then the slot
        blocks -- looked up once per installed adapter and slot, not per sync; with a number that changes whenever
        they are looked up again."""
        cached = getattr(self, "_dst_cache", None)
        if cached is not None and cached[0]() is lora_model and cached[1] == (slot, len(self.blocks)):
            return cached[2], cached[3]
        dsts: list[Tensor] = []
        reads: list[tuple[_View, tuple[int, ...]]] = []
        for g in self.gathers:
            if g.view is not None:
                dsts.append(held_tensor(lora_model.loras[g.module], g))
                reads.append((g.view, g.shape))
        for b in self.blocks:
            dsts.append(self._slot_block(manager, b, slot))
            reads.append((b.view, b.shape))
        self._reads = reads
        self._sources = list(dict.fromkeys(view.source for view, _ in reads))
        version = cached[3] + 1 if cached is not None else 0
        self._dst_cache = (weakref.ref(lora_model), (slot, len(self.blocks)), dsts, version)
        return dsts, version


def _copy_unless_same(dsts: Sequence[Tensor], srcs: Sequence[Tensor]) -> None:
    """:func:`copy_all`, skipping a destination that is its source (vLLM's adapter holding views of a colocated
    trainer's kept fold buffers: :meth:`SlotWriter.materialize`)."""
    pairs = [
        (d, s)
        for d, s in zip(dsts, srcs)
        if not (
            d.data_ptr() == s.data_ptr()
            and d.shape == s.shape
            and d.stride() == s.stride()
            and d.dtype == s.dtype
            and d.device == s.device
        )
    ]
    copy_all([d for d, _ in pairs], [s for _, s in pairs])


def _meta(t: Tensor) -> Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _code_ranges(lm: Any) -> tuple[list[str], list[int], list[int]]:
    """The manifest keys the template's codes stand for, with their ranges in the concatenation."""
    ranges: tuple[list[str], list[int], list[int]] = foreign.state_of(lm)["code_ranges"]
    return ranges
