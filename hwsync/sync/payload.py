"""Trainer side: which tensors a sync sends, per strategy.

* ``full``    -- the merged view ``W0 + ΔW`` (:func:`hwsync.merged.merged_named_weights`) of every parameter, every
  sync. The trainer's weights are never merged/unmerged in place.
* ``adapter`` -- LoRA tensors only (:mod:`hwsync.lora_formats`, scaling folded into B); the base ``W0`` once, on
  the first sync (and again whenever the engine lost it: a failed sync, a ``full`` sync in between, a base
  parameter changed in place).
* ``hybrid``  -- LoRA for the modules the engine serves LoRA on; merged weights for the LoRA-adapted modules it
  cannot (e.g. MoE experts on vLLM's CPU build or Ascend), plus whatever parameters complete the engine layers
  those modules load into. Only those merged bytes travel each step; the rest of ``W0`` travels once, as in
  ``adapter``.
* ``auto``    -- asks the engine what it serves (:class:`EngineInfo`) and picks; the reason is in the report.
"""
from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from hwsync.errors import AdapterFormatError, SyncError
from hwsync.sync.manifest import TensorSpec, dtype_from_name

__all__ = ["STRATEGIES", "EngineInfo", "Payload", "build_payload", "lora_paths"]

STRATEGIES = ("auto", "full", "adapter", "hybrid")
_LORA_SUFFIX = ".lora_A.weight"


@dataclass(frozen=True)
class EngineInfo:
    """What the receiving engine says about itself (plain data: it crosses processes as JSON)."""

    engine: str
    dtype: str
    device_type: str = "cpu"
    version: int = 0
    stale: bool = False
    base_key: str | None = None
    lora_enabled: bool = False
    lora_dtype: str | None = None
    max_lora_rank: int | None = None
    lora_reason: str = ""
    moe_lora: bool = False
    moe_lora_reason: str = ""
    moe_format: str = "2d"
    packed_modules_mapping: Mapping[str, Sequence[str]] = field(default_factory=dict)
    lora_modules: Sequence[str] = ()
    unservable: Mapping[str, str] = field(default_factory=dict)
    """vLLM LoRA module path -> why the engine cannot serve LoRA there (only for paths the sender asked about)."""
    lora_int_id: int | None = None
    lora_name: str | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return {k: (dict(v) if isinstance(v, Mapping) else list(v) if isinstance(v, (list, tuple)) else v)
                for k, v in self.__dict__.items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EngineInfo:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class Payload:
    """One sync's tensors, described up front and produced lazily in manifest order."""

    strategy: str
    reason: str
    specs: list[TensorSpec]
    produce: Callable[[], Iterator[Tensor]]
    """Yields one tensor per spec, in order (merged tensors are computed on demand, one at a time)."""
    lora_config: dict[str, Any] | None = None
    lora_base_names: dict[str, tuple[int, ...]] = field(default_factory=dict)
    base_key: str | None = None
    includes_base: bool = False


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


def _adapter_name(model: nn.Module) -> str:
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
    """A per-object identity for the trainer model (stable for its lifetime, unlike ``id()`` reuse)."""
    key = "_hwsync_uuid"
    value = model.__dict__.get(key)
    if value is None:
        value = uuid.uuid4().hex[:12]
        model.__dict__[key] = value
    return value


def _merged_names(model: nn.Module) -> list[str]:
    """The names :func:`merged_named_weights` yields, in order, without computing anything."""
    from hwsync.merged import merged_named_weights

    names: list[str] = []

    def record(n: str) -> bool:
        names.append(n)
        return False

    for _ in merged_named_weights(model, include=record):
        pass
    return names


def _base_params(model: nn.Module) -> dict[str, Tensor]:
    """Trainer name -> base parameter ``W0`` (LoRA factors and inactive copies left out)."""
    from hwsync.merged import strip_peft_name

    out: dict[str, Tensor] = {}
    for name, p in model.named_parameters():
        if ".lora_" in name or "lora_magnitude_vector" in name:
            continue
        out.setdefault(strip_peft_name(name), p)
    return out


def lora_paths(tensors: Mapping[str, Tensor]) -> list[str]:
    """vLLM LoRA module paths (``base_model.model.`` kept) of an adapter's tensors."""
    return sorted({k[: -len(_LORA_SUFFIX)] for k in tensors if k.endswith(_LORA_SUFFIX)})


def _owner_of(path: str, trainer_modules: Sequence[str]) -> str | None:
    """The trainer LoRA module (parameter name) a vLLM LoRA path came from."""
    p = path.removeprefix("base_model.model.")
    for name in trainer_modules:
        owner = name[: -len(".weight")] if name.endswith(".weight") else name.rpartition(".")[0]
        if p == owner or p.startswith(owner + "."):
            return name
    return None


# ---------------------------------------------------------------------------------------------------------------
# strategy choice
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class _Lora:
    adapter: Any  # hwsync.lora_formats.LoraAdapter
    tensors: dict[str, Tensor]
    config: dict[str, Any]
    by_module: dict[str, list[str]]  # trainer LoRA param name -> vLLM LoRA paths


def read_lora(model: nn.Module, info: EngineInfo) -> _Lora | None | AdapterFormatError:
    """The model's LoRA in vLLM's format; ``None`` without PEFT; the error when it cannot be served as LoRA."""
    from hwsync.lora_formats import LoraAdapter, extract_peft_lora, to_vllm_lora

    if _peft_config(model) is None:
        return None
    try:
        adapter = extract_peft_lora(model, _adapter_name(model))
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
        tensors, config = to_vllm_lora(
            LoraAdapter(adapter.modules, adapter.r, adapter.lora_alpha, adapter.use_rslora, adapter.name),
            moe_format="3d" if info.moe_format == "3d" else "2d",
            packed_modules_mapping=info.packed_modules_mapping or None,
            dtype=dtype,
        )
    except AdapterFormatError as e:
        return e
    by_module: dict[str, list[str]] = {n: [] for n in adapter.modules}
    for path in lora_paths(tensors):
        owner = _owner_of(path, list(adapter.modules))
        if owner is None:
            raise SyncError(f"internal: LoRA path {path} matches no trainer module")
        by_module[owner].append(path)
    return _Lora(adapter, tensors, config, by_module)


def choose(requested: str, lora: _Lora | None | AdapterFormatError, info: EngineInfo) -> tuple[str, str, list[str]]:
    """(strategy, reason, unservable trainer LoRA modules). Refuses impossible explicit requests."""
    if requested not in STRATEGIES:
        raise SyncError(f"unknown strategy {requested!r}; choose one of {STRATEGIES}")
    if requested == "full":
        return "full", "requested", []
    if lora is None:
        if requested != "auto":
            raise AdapterFormatError(f'strategy="{requested}" needs a PEFT LoRA model; this model has no adapter. '
                                     'Use strategy="full"')
        return "full", "model has no LoRA adapter", []
    if isinstance(lora, AdapterFormatError):
        if requested != "auto":
            raise lora
        return "full", f"adapter cannot be served as LoRA ({lora})", []
    if not info.lora_enabled:
        why = info.lora_reason or "the engine was started without enable_lora"
        if requested != "auto":
            raise AdapterFormatError(f'strategy="{requested}": {why}. Start vLLM with enable_lora=True '
                                     f'(max_lora_rank>={lora.adapter.max_rank}) or use strategy="full"')
        return "full", why, []
    if info.max_lora_rank is not None and lora.adapter.max_rank > info.max_lora_rank:
        why = f"adapter rank {lora.adapter.max_rank} > engine max_lora_rank {info.max_lora_rank}"
        if requested != "auto":
            raise AdapterFormatError(f"{why}: restart vLLM with a larger max_lora_rank or use strategy=\"full\"")
        return "full", why, []
    unservable = [m for m, paths in lora.by_module.items() if any(p in info.unservable for p in paths)]
    reasons = sorted({info.unservable[p] for m in unservable for p in lora.by_module[m] if p in info.unservable})
    why_not = "; ".join(reasons)
    if not unservable:
        if requested == "hybrid":
            return "hybrid", "requested (the engine serves LoRA on every adapted module: same bytes as adapter)", []
        return "adapter", "engine serves LoRA on every adapted module" if requested == "auto" else "requested", []
    if requested == "adapter":
        raise AdapterFormatError(
            f"the engine serves no LoRA on {len(unservable)} adapted module(s), e.g. {unservable[0]} ({why_not}); "
            'use strategy="hybrid" (LoRA where served, merged weights for the rest) or "full"'
        )
    if len(unservable) == len(lora.by_module):
        if requested == "hybrid":
            return "hybrid", f"requested; no adapted module is LoRA-servable ({why_not})", unservable
        return "full", f"engine serves LoRA on none of the adapted modules ({why_not})", []
    kinds = sorted({"experts" if ".experts" in m else m.rsplit(".", 2)[-2] for m in unservable})
    why = f"engine serves no LoRA on {', '.join(kinds)} ({why_not}): those travel merged"
    return "hybrid", why if requested == "auto" else f"requested; {why}", unservable


# ---------------------------------------------------------------------------------------------------------------
# payloads
# ---------------------------------------------------------------------------------------------------------------
def _wire_dtype(t: Tensor, info: EngineInfo) -> torch.dtype:
    return info.torch_dtype if t.is_floating_point() else t.dtype


def _companions(unservable: Sequence[str], names: Sequence[str], packed: Mapping[str, Sequence[str]]) -> set[str]:
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
        out.update(n for n in names if n.rpartition(".")[0].rpartition(".")[0] == parent
                   and n.rpartition(".")[0].rpartition(".")[2] in siblings)
        out.add(m)
    return out


def _versions_digest(params: Mapping[str, Tensor], names: Sequence[str]) -> str:
    """Changes when any of ``names`` was modified in place (``Tensor._version``), so a changed base is resent."""
    acc = 0
    for i, n in enumerate(names):
        acc = (acc * 1_000_003 + int(getattr(params[n], "_version", 0)) + i) % (1 << 61)
    return f"{acc:x}"


def build_payload(
    model: nn.Module,
    strategy: str,
    reason: str,
    lora: _Lora | None,
    unservable: Sequence[str],
    info: EngineInfo,
) -> Payload:
    """Describe and (lazily) produce this sync's tensors."""
    from hwsync.merged import merged_named_weights

    names = _merged_names(model)
    base = _base_params(model)
    missing = [n for n in names if n not in base]
    if missing:
        raise SyncError(f"internal: merged view names {missing[:3]} have no base parameter")

    if strategy == "full":
        merged = set(names)
        send = list(names)
        base_key = None
        includes_base = True
    else:
        assert lora is not None
        merged = _companions(unservable, names, info.packed_modules_mapping) if strategy == "hybrid" else set()
        frozen = [n for n in names if n not in merged]
        base_key = f"{model_uuid(model)}:{strategy}:{_versions_digest(base, frozen)}"
        includes_base = info.stale or info.base_key != base_key
        send = list(names) if includes_base else [n for n in names if n in merged]
        if includes_base:
            why = "engine is stale" if info.stale else "first sync" if info.base_key is None else (
                "trainer base changed" if info.base_key.rsplit(":", 1)[0] == base_key.rsplit(":", 1)[0]
                else "engine holds other base weights")
            reason = f"{reason}; base weights sent ({why})"
        elif strategy == "adapter":
            reason = f"{reason}; LoRA only"

    specs = [TensorSpec(n, tuple(base[n].shape), _wire_dtype(base[n], info), "base") for n in send]
    lora_tensors: dict[str, Tensor] = {}
    lora_config = None
    lora_base_names: dict[str, tuple[int, ...]] = {}
    if strategy in ("adapter", "hybrid") and lora is not None:
        keep = {p for m, paths in lora.by_module.items() if m not in unservable for p in paths}
        lora_tensors = {k: v for k, v in lora.tensors.items() if k.rsplit(".", 2)[0] in keep}
        if lora_tensors:
            lora_config = dict(lora.config)
            lora_base_names = {m: tuple(base[m].shape) for m in lora.by_module if m not in unservable and m in base}
        specs += [TensorSpec(k, tuple(v.shape), v.dtype, "lora") for k, v in lora_tensors.items()]

    send_set = set(send)
    merged_send = [n for n in send if n in merged]

    def produce() -> Iterator[Tensor]:
        it = merged_named_weights(model, include=lambda n: n in send_set and n in merged) if merged_send else iter(())
        for name in send:
            if name in merged:
                got, t = next(it)
                if got != name:
                    raise SyncError(f"internal: merged view yielded {got} where {name} was expected")
                yield t
            else:
                yield base[name].detach()
        yield from lora_tensors.values()

    return Payload(strategy, reason, specs, produce, lora_config, lora_base_names, base_key, includes_base)
