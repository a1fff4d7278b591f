"""Trainer side: which tensors a sync sends, per strategy (:class:`hwsync.common.wire.Strategy`).

* ``full``    -- the merged view ``W0 + ΔW`` (:func:`hwsync.trainer.merged.merged_named_weights`) of every parameter,
  every sync. The trainer's weights are never merged/unmerged in place.
* ``adapter`` -- LoRA tensors only (:mod:`hwsync.common.lora_formats`, scaling folded into B); the base ``W0`` once, on
  the first sync (and again whenever the engine lost it: a failed sync, a ``full`` sync in between, a base
  parameter changed in place).
* ``hybrid``  -- LoRA for the modules the engine serves LoRA on; merged weights for the LoRA-adapted modules it
  cannot (e.g. MoE experts on vLLM's CPU build or Ascend), plus whatever parameters complete the engine layers
  those modules load into. Only those merged bytes travel each step; the rest of ``W0`` travels once, as in
  ``adapter``.
* ``auto``    -- asks the engine what it serves (:class:`~hwsync.common.wire.EngineInfo`) and picks
  (:func:`hwsync.trainer.strategy.choose`); the reason is in the report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from hwsync.common import foreign
from hwsync.common.errors import AdapterFormatError, SyncError, UnsupportedSetupError
from hwsync.common.lora_formats import NON_GATED_EXPERTS, FoldFn, lora_paths, wire_name
from hwsync.common.wire import EngineInfo, Strategy, TensorSpec, dtype_from_name
from hwsync.trainer.strategy import Choice

__all__ = ["Payload", "TrainerLora", "base_shapes", "build_payload", "has_adapter", "read_lora"]


@dataclass
class Payload:
    """One sync's tensors, described up front and produced lazily in manifest order."""

    strategy: Strategy
    reason: str
    specs: list[TensorSpec]
    produce: Callable[[], Iterator[Tensor]]
    """Yields one tensor per spec, in order (merged tensors are computed on demand, one at a time)."""
    lora_meta: dict[str, Any] | None = None
    """The LoRA tensors' metadata (:attr:`hwsync.common.wire.Manifest.lora_meta`) for the modules this sync sends."""
    lora_base_names: dict[str, tuple[int, ...]] = field(default_factory=dict)
    base_key: str | None = None
    includes_base: bool = False
    current_base_key: Callable[[], str | None] = lambda: None
    """The base key as the trainer's weights are *now* (a steady-state sync resends the base when it changed)."""
    schedule: list[list[str]] | None = None
    """Sharded trainers (:mod:`hwsync.common.gather`): the parameter names gathered per group, in order; ``None`` when
    the model is not sharded."""
    produce_sharded: Callable[[Iterator[None]], Iterator[Tensor]] | None = None
    """Sharded trainers: like ``produce``, advancing ``groups`` (:func:`hwsync.common.gather.run_groups` of
    ``schedule``) once per group and reading the gathered tensors inside it."""
    lora_readers: dict[Any, Any] = field(default_factory=dict)
    """The LoRA readers (:class:`~hwsync.common.lora_formats.PeftLoraReader`) by (adapter, modules), handed to the
    payload of the plan that follows (:meth:`hwsync.trainer.api.SyncPlan.after_sync`): the steady syncs read through
    the first sync's fold buffers, so the copies recorded at the first sync (:mod:`hwsync.common.replay`) replay from
    the second on."""


# ---------------------------------------------------------------------------------------------------------------
# trainer model introspection
# ---------------------------------------------------------------------------------------------------------------
def _peft_config(model: nn.Module) -> Any:
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None
    active = getattr(model, "active_adapter", None)
    if isinstance(active, (list, tuple)):
        active = active[0] if active else None
    return configs.get(active) if active in configs else next(iter(configs.values()))


def has_adapter(model: nn.Module) -> bool:
    """Whether ``model`` carries a PEFT adapter (:func:`read_lora` has something to read)."""
    return _peft_config(model) is not None


def active_adapter_name(model: nn.Module) -> str:
    active = getattr(model, "active_adapter", "default")
    if isinstance(active, (list, tuple)):
        if len(active) != 1:
            raise AdapterFormatError(
                f"{len(active)} active adapters {list(active)}: an adapter sync sends one; "
                'activate one adapter or use strategy="full" (merged view of all active adapters)'
            )
        active = active[0]
    return str(active)


def model_uuid(model: nn.Module) -> str:
    """A per-object identity for the trainer model (stable for its lifetime, unlike ``id()`` reuse). Kept with the
    ``id()`` it was made for: a copy of the model (``copy.deepcopy``, as a reference model is often made) carries the
    record along but is another model, with plans of its own."""
    held: tuple[int, str] | None = foreign.held(model, "uuid")
    if held is None or held[0] != id(model):
        held = foreign.unshare(model)["uuid"] = (id(model), uuid.uuid4().hex[:12])
    return held[1]


def merged_names(model: nn.Module) -> list[str]:
    """The names :func:`merged_named_weights` yields, in order, without computing anything."""
    from hwsync.trainer.merged import merged_named_weights

    names: list[str] = []

    def record(n: str) -> bool:
        names.append(n)
        return False

    for _ in merged_named_weights(model, include=record):
        pass
    return names


def _base_params(model: nn.Module) -> dict[str, Tensor]:
    """Trainer name -> base parameter ``W0`` (LoRA factors and inactive copies left out)."""
    return {clean: p for clean, (_, p) in _base_params_raw(model).items()}


def _base_params_raw(model: nn.Module) -> dict[str, tuple[str, Tensor]]:
    """Trainer name -> (name in the wrapped model, base parameter)."""
    from hwsync.common.trainer_names import strip_peft_name

    out: dict[str, tuple[str, Tensor]] = {}
    for name, p in model.named_parameters():
        if ".lora_" in name or "lora_magnitude_vector" in name:
            continue
        out.setdefault(strip_peft_name(name), (name, p))
    return out


def _owners(trainer_modules: Sequence[str]) -> dict[str, list[str]]:
    """Module path -> the trainer LoRA parameter names adapting it (``...q_proj`` -> ``...q_proj.weight``; a fused
    experts module carries two: ``...experts.gate_up_proj`` and ``...experts.down_proj``)."""
    owners: dict[str, list[str]] = {}
    for n in trainer_modules:
        owners.setdefault(n[: -len(".weight")] if n.endswith(".weight") else n.rpartition(".")[0], []).append(n)
    return owners


_DOWN = ("down_proj", "w2")


def _owner_of(path: str, owners: Mapping[str, list[str]]) -> str | None:
    """The trainer LoRA parameter a vLLM LoRA path came from: the one adapting its longest owning module; for fused
    experts, the down projection for ``experts.{e}.down_proj`` (2-D keys) / ``experts`` (3-D), gate_up otherwise."""
    p = path.removeprefix("base_model.model.")
    while p:
        names = owners.get(p)
        if names:
            if len(names) == 1:
                return names[0]
            rest = path.removeprefix("base_model.model.")[len(p) :].strip(".")
            down = rest.rpartition(".")[2] in _DOWN if rest else True  # 3-D: "experts" is down, "base_layer" not
            picked = [n for n in names if n.rpartition(".")[2].startswith(_DOWN) == down]
            return picked[0] if picked else names[0]
        p = p.rpartition(".")[0]
    return None


# ---------------------------------------------------------------------------------------------------------------
# strategy choice
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class TrainerLora:
    """The trainer's adapter: its modules (scaling folded into B), and where each lands in vLLM's LoRA format."""

    adapter: Any  # hwsync.common.lora_formats.LoraAdapter
    tensors: dict[str, Tensor]
    """What travels, on ``meta`` (shapes and dtypes): one A and one B per trainer module
    (:func:`hwsync.common.lora_formats.to_wire`)."""
    meta: dict[str, Any]
    by_module: dict[str, list[str]]
    """Trainer LoRA parameter name -> the vLLM LoRA module paths it becomes (for the engine's capability check)."""
    not_lora: dict[str, str] = field(default_factory=dict)
    """Trainer LoRA modules no vLLM engine serves as LoRA, whatever it runs on (-> why): ``hybrid`` merges them
    (:func:`_not_lora`); they have no vLLM paths in :attr:`by_module`."""

    @property
    def max_rank(self) -> int:
        return int(self.adapter.max_rank)

    @property
    def vllm_paths(self) -> list[str]:
        return sorted(p for paths in self.by_module.values() for p in paths)


def read_lora(model: nn.Module, info: EngineInfo) -> TrainerLora | None | AdapterFormatError:
    """The model's LoRA as it travels; ``None`` without PEFT; the error when it cannot be served as LoRA."""
    from hwsync.common.gather import placeholders

    if not has_adapter(model):
        return None
    try:
        with placeholders():  # sharded parameters: shapes only (values are read, gathered, at every sync)
            return _read_lora(model, info)
    except AdapterFormatError as e:
        return e


def _read_lora(model: nn.Module, info: EngineInfo) -> TrainerLora:
    from hwsync.common.lora_formats import extract_peft_lora, to_vllm_lora, to_wire

    adapter = extract_peft_lora(model, active_adapter_name(model))
    cfg = _peft_config(model)
    experts = [n for n, m in adapter.modules.items() if m.kind.value != "linear" or ".experts." in n]
    dropout = float(getattr(cfg, "lora_dropout", 0.0) or 0.0)
    if dropout > 0 and experts:
        raise AdapterFormatError(
            f"adapter {adapter.name!r} sets lora_dropout={dropout} and adapts MoE experts ({experts[0]}, ...): "
            "expert LoRA cannot apply dropout (PEFT's ParamWrapper refuses it; vLLM serves none), so the trained "
            "experts do not mean what the config says. Set lora_dropout=0 (ms-swift: --lora_dropout 0), or sync "
            'merged weights with strategy="full"'
        )
    dtype = dtype_from_name(info.lora_dtype) if info.lora_dtype else None
    tensors, meta = to_wire(adapter, dtype, values=False)  # shapes only: values are read at every sync
    not_lora = _not_lora(adapter.modules)
    # where each module lands in vLLM's format, worked out on meta tensors (shapes only: folding the scaling into
    # real tensors would hold a copy of the adapter for a moment, 2.6 GB at 48 layers r32, which a check planned
    # beside a full GPU does not have): what the engine is asked whether it serves
    served = {
        n: dataclasses.replace(m, lora_A=m.lora_A.to("meta"), lora_B=m.lora_B.to("meta"))
        for n, m in adapter.modules.items()
        if n not in not_lora
    }
    vllm_tensors = (
        to_vllm_lora(
            dataclasses.replace(adapter, modules=served),
            layout=info.lora_layout,
            packed_modules_mapping=info.packed_modules_mapping or None,
            copy=False,
        )[0]
        if served
        else {}
    )
    by_module: dict[str, list[str]] = {n: [] for n in adapter.modules}
    owners = _owners(list(adapter.modules))
    for path in lora_paths(vllm_tensors):
        owner = _owner_of(path, owners)
        if owner is None:
            raise SyncError(f"internal: LoRA path {path} matches no trainer module")
        by_module[owner].append(path)
    return TrainerLora(adapter, tensors, meta, by_module, not_lora)


def _not_lora(modules: Mapping[str, Any]) -> dict[str, str]:
    """Trainer LoRA modules vLLM cannot serve as LoRA on any engine (-> why): stacked-expert LoRA on a parameter
    other than gate_up/down (non-gated experts, Nemotron-H's ``experts.up_proj``), and with it every other expert
    LoRA of the same experts block, since ``hybrid`` merges a block whole (:func:`companions`): a sibling left as
    LoRA would be applied twice."""
    from hwsync.common.lora_formats import LoraKind

    blocks = {m.module for m in modules.values() if m.kind is LoraKind.EXPERTS_OTHER}
    return {n: NON_GATED_EXPERTS for n, m in modules.items() if m.kind is not LoraKind.LINEAR and m.module in blocks}


# ---------------------------------------------------------------------------------------------------------------
# payloads
# ---------------------------------------------------------------------------------------------------------------
def _wire_dtype(name: str, t: Tensor, info: EngineInfo) -> torch.dtype:
    """The engine's model dtype for floating (and dequantized 4-bit) tensors, or the wider dtype the engine keeps
    that parameter in (:attr:`EngineInfo.kept_dtypes`); other tensors as they are."""
    from hwsync.trainer.merged import is_quantized

    if not (t.is_floating_point() or is_quantized(t)):
        return t.dtype
    kept = info.kept_dtypes.get(name)
    return dtype_from_name(kept) if kept else info.torch_dtype


def base_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Trainer base name -> the shape the engine gets (a describe asks the engine which of them it keeps wider)."""
    from hwsync.trainer.merged import is_quantized, logical_shape

    return {n: logical_shape(p) for n, p in _base_params(model).items() if p.is_floating_point() or is_quantized(p)}


def companions(unservable: Sequence[str], names: Sequence[str], packed: Mapping[str, Sequence[str]]) -> set[str]:
    """Parameters that must travel with merged ``unservable`` ones so every engine layer they touch is complete:
    all parameters of the same experts block, and the other parts of a packed projection (q/k/v)."""
    out: set[str] = set()
    for m in unservable:
        if ".experts." in m or m.endswith(".experts"):
            owner = m[: m.index(".experts") + len(".experts")]
            out.update(n for n in names if n.startswith(owner + "."))
            continue
        module = m[: -len(".weight")] if m.endswith(".weight") else m.rpartition(".")[0]
        parent, _, leaf = module.rpartition(".")
        siblings = {leaf}
        for parts in packed.values():
            if leaf in parts:
                siblings.update(parts)
        out.update(
            n
            for n in names
            if n.rpartition(".")[0].rpartition(".")[0] == parent and n.rpartition(".")[0].rpartition(".")[2] in siblings
        )
        out.add(m)
    return out


def _reparametrized(model: nn.Module) -> set[int]:
    """Parameters PEFT re-registers around every forward (``target_parameters``: ``ParamWrapper`` swaps the tensor
    into a ``torch.nn.utils.parametrize`` list and back), which bumps their version counter without a write."""
    ids: set[int] = set()
    for module in model.modules():
        name = getattr(module, "parameter_name", None)
        get_base = getattr(module, "get_base_layer", None)
        if isinstance(name, str) and callable(get_base):
            param = getattr(get_base(), name, None)
            if isinstance(param, Tensor):
                ids.add(id(param))
    return ids


def _versions_digest(params: Mapping[str, Tensor], names: Sequence[str], reparametrized: set[int]) -> str:
    """Changes when any of ``names`` was modified in place (``Tensor._version``), so a changed base is resent.

    For parameters PEFT re-parametrizes on every forward the version counter moves without a write, so only their
    identity and storage count (an in-place edit of such a frozen expert weight is not detected: sync once with
    ``strategy="full"`` after editing one). A 4-bit QLoRA base is frozen by construction: its storage identifies it."""
    from hwsync.trainer.merged import is_quantized

    acc = 0
    for i, n in enumerate(names):
        p = params[n]
        if is_quantized(p):  # bitsandbytes re-wraps its packed parameters (a new Params4bit, same storage)
            ident, mark = 0, p.data_ptr()
        else:
            ident, mark = id(p), p.data_ptr() if id(p) in reparametrized else int(getattr(p, "_version", 0))
        acc = (acc * 1_000_003 + ident % 1_000_033 + mark + i) % (1 << 61)
    return f"{acc:x}"


def build_payload(
    model: nn.Module,
    choice: Choice,
    lora: TrainerLora | None,
    info: EngineInfo,
    gather_bytes: int = 512 << 20,
    fold: FoldFn | None = None,
    readers: dict[Any, Any] | None = None,
) -> Payload:
    """Describe this sync's tensors and how to produce them (lazily, values read at produce time, so a payload
    can be produced again at every sync while the model's structure stays the same). ``fold``: how LoRA scalings are
    folded into B (default :func:`hwsync.common.lora_formats.fold_scaling`, vLLM's rounding order; :mod:`hwsync.verify`
    passes vLLM's own ``LoRALayerWeights.optimize`` to compute what the engine should hold)."""
    from hwsync.trainer.merged import is_quantized, logical_shape

    strategy, reason, unservable = choice.strategy, choice.reason, choice.unservable
    reparametrized = _reparametrized(model)

    names = merged_names(model)
    raw_base = _base_params_raw(model)
    base = {clean: p for clean, (_, p) in raw_base.items()}
    missing = [n for n in names if n not in base]
    if missing:
        raise SyncError(f"internal: merged view names {missing[:3]} have no base parameter")

    frozen: list[str] = []
    if strategy is Strategy.FULL:
        merged = set(names)
        send = list(names)
        base_key = None
        includes_base = True
    else:
        assert lora is not None
        merged = companions(unservable, names, info.packed_modules_mapping) if strategy is Strategy.HYBRID else set()
        frozen = [n for n in names if n not in merged]
        base_key = f"{model_uuid(model)}:{strategy.value}:{_versions_digest(base, frozen, reparametrized)}"
        includes_base = info.stale or info.base_key != base_key
        if info.quantization and any(is_quantized(base[n]) for n in frozen):
            if merged:
                raise UnsupportedSetupError(
                    f"the engine serves a {info.quantization}-quantized checkpoint: merged weights cannot be written "
                    'into it. With a QLoRA base use strategy="adapter" (the engine keeps serving its quantized base) '
                    'or an unquantized engine with strategy="full"'
                )
            # the engine was started from the trainer's quantized checkpoint: its base is W0, and a packed 4-bit
            # W0 cannot go through a weight reload anyway
            from hwsync.common.lora_formats import base_init

            init = base_init(_peft_config(model))
            if init is not None:
                raise UnsupportedSetupError(
                    f"init_lora_weights={init!r} rewrote the trainer's base weights into a residual, but the engine "
                    f"serves its own {info.quantization}-quantized checkpoint, which cannot be rewritten: the adapter "
                    "would act on the wrong base. Convert the adapter to plain LoRA (PEFT's "
                    "path_initial_model_for_weight_conversion) or start the engine from the residual base"
                )
            includes_base, base_key = False, None
            reason = (
                f"{reason}; base weights not sent (the engine serves the {info.quantization} checkpoint the "
                "trainer's quantized base was loaded from)"
            )
        send = list(names) if includes_base else [n for n in names if n in merged]
        if includes_base:
            assert base_key is not None  # None only for an engine serving its own quantized base: never sent
            why = (
                "engine is stale"
                if info.stale
                else "first sync"
                if info.base_key is None
                else (
                    "trainer base changed"
                    if info.base_key.rsplit(":", 1)[0] == base_key.rsplit(":", 1)[0]
                    else "engine holds other base weights"
                )
            )
            reason = f"{reason}; base weights sent ({why})"
        elif strategy is Strategy.ADAPTER:
            reason = f"{reason}; LoRA only"

    specs = [TensorSpec(n, logical_shape(base[n]), _wire_dtype(n, base[n], info), "base") for n in send]
    lora_modules: list[str] = []
    lora_meta = None
    lora_base_names: dict[str, tuple[int, ...]] = {}
    lora_dtype = dtype_from_name(info.lora_dtype) if info.lora_dtype else None
    if strategy is not Strategy.FULL and lora is not None:
        lora_modules = [m for m in lora.adapter.modules if m not in unservable]
        if lora_modules:
            lora_meta = dict(lora.meta, modules={m: lora.meta["modules"][m] for m in lora_modules})
            lora_base_names = {m: logical_shape(base[m]) for m in lora_modules if m in base}
        for m in lora_modules:
            for factor in ("A", "B"):
                t = lora.tensors[wire_name(m, factor)]
                specs.append(TensorSpec(wire_name(m, factor), tuple(t.shape), t.dtype, "lora"))

    items: list[tuple[str, str]] = [("base", n) for n in send] + [("lora", m) for m in lora_modules]
    stream = _Stream(model, merged, raw_base, lora_dtype, fold, {} if readers is None else readers)

    def current_base_key() -> str | None:
        if strategy is Strategy.FULL or base_key is None:  # full: no base identity; None: the engine's own base
            return None
        return f"{model_uuid(model)}:{strategy.value}:{_versions_digest(base, frozen, reparametrized)}"

    payload = Payload(
        strategy,
        reason,
        specs,
        lambda: stream.read([items]),
        lora_meta,
        lora_base_names,
        base_key,
        includes_base,
        current_base_key,
        lora_readers=stream.readers,
    )
    from hwsync.common.gather import sharding

    if sharding(model) != "plain":
        _add_sharded(payload, model, stream, items, merged, raw_base, gather_bytes)
    return payload


class _Stream:
    """Reads a payload's tensors in manifest order, group by group: one group for a plain model; for a sharded one
    (:mod:`hwsync.common.gather`) the groups of its gather schedule, each read while gathered. Merged tensors are
    computed on demand, base tensors read as they are, LoRA factors through one
    :class:`~hwsync.common.lora_formats.PeftLoraReader` per module list, resolved at the first read and reused (values
    are read at every sync; ``readers`` may come from an earlier payload of the same plan:
    :attr:`Payload.lora_readers`)."""

    def __init__(
        self,
        model: nn.Module,
        merged: set[str],
        raw_base: Mapping[str, tuple[str, Tensor]],
        lora_dtype: torch.dtype | None,
        fold: FoldFn | None = None,
        readers: dict[Any, Any] | None = None,
    ) -> None:
        self.model, self.merged, self.raw_base, self.lora_dtype = model, merged, raw_base, lora_dtype
        self.fold = fold
        self.readers: dict[Any, Any] = {} if readers is None else readers

    def read(
        self,
        groups: Sequence[Sequence[tuple[str, str]]],
        steps: Iterator[None] | None = None,
        wire: Mapping[str, torch.dtype] | None = None,
    ) -> Iterator[Tensor]:
        """The tensors of ``groups`` (``("base" | "lora", name)`` items, LoRA last in each group). With ``steps``
        (:func:`hwsync.common.gather.run_groups`), advanced once per group, every tensor is checked to come from a
        gathered parameter and cast to its ``wire`` dtype while the group is gathered: the bucket then holds wire-sized
        copies and the gathered tensor is released with its group (an fp32 trainer feeding a bf16 engine would
        otherwise keep twice a bucket of gathered fp32 tensors pending in the transport)."""
        from hwsync.trainer.merged import merged_named_weights, plain_weight

        for g, group in enumerate(groups):
            if steps is not None:
                next(steps)  # this group's parameters are gathered until the next step
            in_group = {name for kind, name in group if kind == "base" and name in self.merged}
            it = merged_named_weights(self.model, include=in_group.__contains__) if in_group else iter(())
            lora = [name for kind, name in group if kind == "lora"]
            for kind, name in group:
                if kind != "base":
                    continue
                if name in self.merged:
                    got, t = next(it)
                    if got != name:
                        raise SyncError(f"internal: merged view yielded {got} where {name} was expected")
                else:
                    raw, param = self.raw_base[name]
                    t = plain_weight(self.model, raw, param)  # W0 as is; dequantized for a 4-bit (QLoRA) base
                yield t if steps is None else _gathered(name, t, wire)
            if lora:  # A, B per module; no cast: read in the engine's LoRA dtype
                for i, t in enumerate(self._lora(g, lora, sharded=steps is not None)):
                    yield t if steps is None else _gathered(lora[i // 2], t, None)
            del it

    def _lora(self, group: int, modules: Sequence[str], sharded: bool) -> Iterable[Tensor]:
        """A and B (scaling folded, in the engine's LoRA dtype) of ``modules``, as of now."""
        from hwsync.common import gather
        from hwsync.common.lora_formats import PeftLoraReader

        with gather.placeholders() if sharded else contextlib.nullcontext():  # other groups' modules: shapes only
            key = (active_adapter_name(self.model), tuple(modules))
            reader = self.readers.get(key)
            if reader is None:
                reader = self.readers[key] = PeftLoraReader(self.model, key[0], modules)
            got = reader.read(self.lora_dtype, self.fold)
            return list(got) if sharded else got  # folded lazily only where nothing is gathered for it


def _gathered(name: str, t: Tensor, wire: Mapping[str, torch.dtype] | None) -> Tensor:
    """``t`` read inside its gather, in its wire dtype (:meth:`_Stream.read`)."""
    if t.is_meta:
        raise SyncError(f"internal: {name} was produced from a parameter that was not gathered")
    dtype = wire.get(name) if wire is not None else None
    return t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t


def _add_sharded(
    payload: Payload,
    model: nn.Module,
    stream: _Stream,
    items: Sequence[tuple[str, str]],
    merged: set[str],
    raw_base: Mapping[str, tuple[str, Tensor]],
    gather_bytes: int,
) -> None:
    """The gather schedule of a sharded model: the payload's tensors in order, grouped so the parameters gathered
    for one group stay within ``gather_bytes`` (one bucket); each group is read while gathered, then dropped."""
    from hwsync.common import gather
    from hwsync.common.lora_formats import extract_peft_lora
    from hwsync.trainer.merged import read_sets

    params = dict(model.named_parameters())
    reads = read_sets(model) if any(kind == "base" and n in merged for kind, n in items) else {}
    sources: dict[tuple[str, str], list[str]] = {}
    if any(kind == "lora" for kind, _ in items):
        with gather.placeholders():
            adapter = extract_peft_lora(model, active_adapter_name(model))
    for kind, name in items:
        if kind == "base":
            sources[(kind, name)] = reads[name] if name in merged else [raw_base[name][0]]
            continue
        pair = [s for s in adapter.modules[name].sources if s]
        if len(pair) != 2:
            raise SyncError(f"internal: LoRA module {name} has no parameter names to gather")
        sources[(kind, name)] = pair
    sizes = {n: gather.global_nbytes(params[n]) for names in sources.values() for n in names}
    groups = gather.plan_groups(list(sources.items()), sizes, gather_bytes)
    payload.schedule = [gather.group_params(g) for g in groups]
    wire = {s.name: s.dtype for s in payload.specs}
    keys = [[key for key, _ in g] for g in groups]
    payload.produce_sharded = lambda steps: stream.read(keys, steps, wire)
