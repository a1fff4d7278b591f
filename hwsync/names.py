"""Receiver-side name resolution: which live vLLM parameter (and which rows of it) each trainer tensor writes.

Why: a trainer names weights the transformers way (``q_proj``/``k_proj``/``v_proj`` apart, experts per expert or
fused ``experts.gate_up_proj``, PEFT wrappers such as ``base_model.model.`` and ``.base_layer``), while vLLM stores
them packed and sharded (``qkv_proj``, ``gate_up_proj``, ``in_proj_qkvz``, ``experts.routed_experts.w13_weight``,
tensor-parallel slices). Instead of a per-model name table (which breaks on the next MoE family), resolution reads
what the receiver itself declares (the verl #5599 idea, done generally):

* its live parameters, in the checkpoint-format shapes vLLM recorded before post-load repacking;
* each module's ``hf_to_vllm_mapper`` (vLLM's own renames and stacked shards), applied at that module's scope;
* ``packed_modules_mapping`` (packed owner -> constituents) for vLLM versions whose stacking is not in a mapper;
* every fused-MoE layer's expert mapping (``get_expert_mapping``), its TP/EP sharding and declared layout;
* transformers' checkpoint conversion renames for the model type, reversed (transformers-5 runtime names ->
  checkpoint names, e.g. Mixtral's ``.mlp.`` -> ``.block_sparse_moe.``).

The whole manifest (name -> shape, dtype) is resolved once into a :class:`Plan`; every problem (unknown name,
ambiguity, shape or dtype that does not fit) is reported together in one :class:`~hwsync.errors.ResolutionError`
before any tensor is written. The plan is reused every step: :meth:`Plan.apply` writes in place (packed rows, TP
slices, experts through :mod:`hwsync.layouts`), :meth:`Plan.vllm_checkpoint_names` translates names for vLLM's own
``load_weights`` / ``reload_weights`` path (needed where vLLM repacks weights after loading, e.g. its CPU build).
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from hwsync.errors import LayoutError, ResolutionError
from hwsync.layouts import (
    ExpertLayout,
    ExpertSharding,
    copy_expert_shards_,
    copy_w2_,
    copy_w13_,
    w2_shape,
    w13_shape,
)

__all__ = [
    "ExpertGroup",
    "Namespace",
    "ParamSpec",
    "Plan",
    "PlanCache",
    "Shard",
    "Target",
    "manifest_of",
    "manifest_signature",
    "namespace_from_vllm_model",
    "normalize_trainer_name",
    "resolve",
]

ShardId = str | int | tuple[int, ...]
Spec = tuple[tuple[int, ...], torch.dtype]
Transform = Callable[[Tensor], Tensor]

# ---------------------------------------------------------------------------------------------------------------
# trainer-side wrappers
# ---------------------------------------------------------------------------------------------------------------
_PEFT_ROOT = "base_model.model."
# Module wrappers that add a path segment without changing the weight: activation checkpointing, torch.compile,
# FSDP1, PEFT/vLLM-LoRA base layers.
_WRAPPER_SEGMENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module", "base_layer"})
_ADAPTER_SEGMENTS = frozenset(
    {"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"}
)
ADAPTER = "adapter"
PEFT_ORIGINAL = "peft_original"


def normalize_trainer_name(name: str) -> tuple[str, str | None]:
    """Strip training-time wrappers from a trainer name; say when it is not a base weight at all.

    Returns ``(clean_name, category)``; ``category`` is ``None`` for a base weight, ``"adapter"`` for LoRA
    tensors (``lora_A``/``lora_B``/...), ``"peft_original"`` for the frozen ``original_module`` copy that PEFT
    keeps beside a trained ``modules_to_save`` copy. ``.base_layer`` is dropped wherever it occurs: PEFT nests it
    before the leaf (``q_proj.base_layer.weight``) and, for ``target_parameters``, before the module
    (``experts.base_layer.base_layer.gate_up_proj``).
    """
    parts = name.split(".")
    if name.startswith(_PEFT_ROOT):
        parts = parts[2:]
    out: list[str] = []
    category: str | None = None
    i = 0
    while i < len(parts):
        p = parts[i]
        if p in _WRAPPER_SEGMENTS:
            i += 1
            continue
        if p == "modules_to_save" and i + 1 < len(parts):  # modules_to_save.<adapter>.
            i += 2
            continue
        if p == "original_module":
            category = category or PEFT_ORIGINAL
            i += 1
            continue
        if p in _ADAPTER_SEGMENTS:
            category = ADAPTER
        out.append(p)
        i += 1
    return ".".join(out), category


def _canonical(live_name: str) -> str:
    """A receiver name without vLLM-LoRA ``base_layer`` segments (so trainer names match with or without LoRA)."""
    return ".".join(p for p in live_name.split(".") if p != "base_layer")


# ---------------------------------------------------------------------------------------------------------------
# receiver description
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shard:
    """One sub-tensor of a receiver parameter along its split dimension, as this rank holds it.

    ``full`` rows come from the trainer; this rank keeps ``length`` of them, starting at ``src_start``, and
    stores them at ``dst_start`` of its parameter.
    """

    id: ShardId | None
    full: int
    dst_start: int
    src_start: int
    length: int


@dataclass(frozen=True)
class ParamSpec:
    """A receiver parameter in checkpoint format (before any post-load repacking) and how TP splits it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    split_dim: int | None = None
    shards: tuple[Shard, ...] = ()
    sharding_known: bool = True  # False: vLLM splits it with a loader whose slicing we cannot read

    def shard(self, shard_id: ShardId) -> Shard:
        for s in self.shards:
            if s.id == shard_id:
                return s
        raise KeyError(shard_id)

    @property
    def shard_ids(self) -> tuple[ShardId, ...]:
        return tuple(s.id for s in self.shards if s.id is not None)

    def selected(self, shard_id: ShardId | None) -> tuple[Shard, ...]:
        """The shards a trainer tensor for ``shard_id`` covers (None = the whole parameter)."""
        if shard_id is None:
            return self.shards
        if isinstance(shard_id, tuple):
            return tuple(self.shards[i] for i in shard_id)
        return (self.shard(shard_id),)

    def trainer_shape(self, shard_id: ShardId | None = None) -> tuple[int, ...]:
        """The unsharded shape a trainer tensor for ``shard_id`` must have."""
        if self.split_dim is None or not self.shards:
            return self.shape
        shape = list(self.shape)
        shape[self.split_dim] = sum(s.full for s in self.selected(shard_id))
        return tuple(shape)


@dataclass(frozen=True)
class ExpertGroup:
    """One fused-MoE layer: trainer-side names it accepts and where its experts live."""

    prefix: str  # checkpoint-side module path of the experts, e.g. "model.layers.0.mlp.experts"
    w13: str  # live names of the stacked parameters
    w2: str
    gate: str  # checkpoint projection names ("gate_proj"/"up_proj"/"down_proj", Mixtral "w1"/"w3"/"w2")
    up: str
    down: str
    num_experts: int  # global (logical)
    hidden: int
    intermediate: int  # full, before TP
    dtype: torch.dtype
    layout: ExpertLayout
    sharding: ExpertSharding | None  # None: not writable by the stacked writers (reason in `unwritable`)
    vllm_fused_gate_up: str | None = None  # fused names vLLM's own loader accepts (None: per-expert only)
    vllm_fused_down: str | None = None
    fused_transposed: bool = False  # vLLM expects fused checkpoint tensors as [E, H, 2I] / [E, I, H]
    unwritable: str | None = None

    @property
    def fused_gate_up_names(self) -> frozenset[str]:
        # transformers >= 5 fuses every MoE's experts under these names, whatever the checkpoint calls them
        return frozenset({"gate_up_proj"} | ({self.vllm_fused_gate_up} if self.vllm_fused_gate_up else set()))

    @property
    def fused_down_names(self) -> frozenset[str]:
        return frozenset({"down_proj"} | ({self.vllm_fused_down} if self.vllm_fused_down else set()))


@dataclass
class Namespace:
    """What a receiver holds and declares; built from a live vLLM model by :func:`namespace_from_vllm_model`.

    ``params`` is keyed by canonical name (vLLM-LoRA ``base_layer`` removed); ``live`` holds the parameters
    themselves (not pickled, not part of the signature) so a :class:`Plan` can write into them.
    """

    params: dict[str, ParamSpec]
    expert_groups: dict[str, ExpertGroup] = field(default_factory=dict)
    packed_modules: dict[str, tuple[str, ...]] = field(default_factory=dict)
    mappers: tuple[tuple[str, Any], ...] = ()  # (module scope, vLLM WeightsMapper), outermost first
    trainer_renames: tuple[Any, ...] = ()  # reversed transformers renames (runtime -> checkpoint)
    aliases: dict[str, str] = field(default_factory=dict)  # tied canonical alias -> canonical owner
    num_hidden_layers: int | None = None
    architecture: str = ""
    model_type: str | None = None
    live: dict[str, Tensor] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._by_live = {spec.name: spec for spec in self.params.values()}
        self._group_of_param = {n: g for g in self.expert_groups.values() for n in (g.w13, g.w2)}
        self._roots = sorted(
            {n[: -len(tail)] for n in self.params for tail in ("lm_head.weight", "model.embed_tokens.weight")
             if n.endswith(tail) and (len(n) == len(tail) or n[-len(tail) - 1] == ".")} - {""}
        )
        self._signature: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        state["live"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)
        self.__post_init__()

    @property
    def signature(self) -> str:
        """Stable digest of everything resolution depends on (a plan cache key)."""
        if self._signature is None:
            h = hashlib.sha256()
            h.update(self.architecture.encode())
            for key in sorted(self.params):
                h.update(repr(self.params[key]).encode())
            for key in sorted(self.expert_groups):
                h.update(repr(self.expert_groups[key]).encode())
            h.update(repr(sorted(self.packed_modules.items())).encode())
            h.update(repr([(s, _mapper_repr(m)) for s, m in self.mappers]).encode())
            h.update(repr([_mapper_repr(r) for r in self.trainer_renames]).encode())
            h.update(repr(sorted(self.aliases.items())).encode())
            self._signature = h.hexdigest()[:16]
        return self._signature

    def spec_of(self, live_name: str) -> ParamSpec:
        return self._by_live[live_name]

    def group_of(self, live_name: str) -> ExpertGroup | None:
        return self._group_of_param.get(live_name)


def _mapper_repr(m: Any) -> str:
    fields = ("orig_to_new_regex", "orig_to_new_substr", "orig_to_new_stacked", "orig_to_new_prefix",
              "orig_to_new_suffix", "source_patterns", "target_patterns")
    return repr({f: getattr(m, f) for f in fields if hasattr(m, f)}) or type(m).__name__


# ---------------------------------------------------------------------------------------------------------------
# building a namespace from a vLLM model (duck-typed: no vLLM import needed for the model itself)
# ---------------------------------------------------------------------------------------------------------------
def namespace_from_vllm_model(
    model: torch.nn.Module,
    *,
    layout: ExpertLayout | str = ExpertLayout.PREPROCESSED,
    sharding: ExpertSharding | None = None,
    trainer_model_type: str | None = None,
) -> Namespace:
    """Describe a live vLLM model (the one ``llm.apply_model(lambda m: m)`` returns) for :func:`resolve`.

    ``layout`` declares how the receiver keeps its experts *now* (vllm-ascend's processed layout after
    post-load processing); it is never guessed from shapes. ``sharding`` overrides the TP/EP sharding read from
    every MoE layer (for simulations). ``trainer_model_type`` picks transformers' conversion renames (default:
    the receiver's ``config.model_type``). Shapes are the checkpoint-format ones vLLM recorded at construction
    (its reload bookkeeping), so a model whose linear weights were repacked after loading still resolves.
    """
    lay = ExpertLayout(layout)
    recorded = _recorded_checkpoint_tensors(model)
    params: dict[str, ParamSpec] = {}
    live: dict[str, Tensor] = {}
    groups: dict[str, ExpertGroup] = {}
    for mod_name, mod in model.named_modules():
        own = dict(mod.named_parameters(recurse=False))
        if not own:
            continue
        rec = recorded.get(id(mod), {})
        for pname, p in own.items():
            full = f"{mod_name}.{pname}" if mod_name else pname
            ref = rec.get(pname, p)
            params[_canonical(full)] = _param_spec(full, mod, ref)
            live[_canonical(full)] = p
        if "w13_weight" in own and "w2_weight" in own:
            group = _expert_group(model, mod_name, mod, rec, lay, sharding)
            groups[group.prefix] = group

    aliases: dict[str, str] = {}
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(p), _canonical(name))
        if owner != _canonical(name):
            aliases[_canonical(name)] = owner

    mappers: dict[int, tuple[str, Any]] = {}
    for mod_name, mod in model.named_modules():  # parents before children
        m = getattr(mod, "hf_to_vllm_mapper", None)
        if m is not None:
            # one mapper object declared at several levels (Qwen3MoeForCausalLM reuses its model's) is applied
            # once, by the innermost module: that is the one whose load_weights uses it
            mappers[id(m)] = (mod_name, m)
    packed: dict[str, tuple[str, ...]] = {}
    for _, mod in model.named_modules():
        for k, v in (getattr(mod, "packed_modules_mapping", None) or {}).items():
            packed.setdefault(k, tuple(v))

    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = trainer_model_type or getattr(text, "model_type", None)
    return Namespace(
        params=params,
        expert_groups=groups,
        packed_modules=packed,
        mappers=tuple(sorted(mappers.values(), key=lambda sm: (_depth(sm[0]), sm[0]))),
        trainer_renames=_trainer_renames(model_type),
        aliases=aliases,
        num_hidden_layers=getattr(text, "num_hidden_layers", None),
        architecture=type(model).__name__,
        model_type=model_type,
        live=live,
    )


def _depth(module_path: str) -> int:
    return module_path.count(".") + 1 if module_path else 0


def _recorded_checkpoint_tensors(model: torch.nn.Module) -> dict[int, dict[str, Tensor]]:
    """Checkpoint-format (meta) parameters vLLM recorded per module before post-load processing."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except Exception:  # older vLLM or none: the live parameters are the checkpoint-format ones
        return {}
    out: dict[int, dict[str, Tensor]] = {}
    for mod in model.modules():
        info = LAYERWISE_INFO.get(mod)
        meta = getattr(info, "restore_metadata", None)
        if meta and meta[0]:
            out[id(mod)] = dict(meta[0])
    return out


def _is(mod: Any, cls_name: str) -> bool:
    return any(c.__name__ == cls_name for c in type(mod).__mro__)


def _param_spec(name: str, mod: Any, ref: Tensor) -> ParamSpec:
    """Shape, dtype and TP split of one parameter, from the vLLM layer that owns it."""
    shape, dtype = tuple(ref.shape), ref.dtype
    tp_size = int(getattr(mod, "tp_size", 1) or 1)
    tp_rank = int(getattr(mod, "tp_rank", 0) or 0)
    out_dim = getattr(ref, "output_dim", None)
    in_dim = getattr(ref, "input_dim", None)
    if getattr(ref, "packed_dim", None) is not None or getattr(ref, "is_sharded_weight", False):
        return ParamSpec(name, shape, dtype, sharding_known=False)  # quantized packing: not ours to slice
    loader = getattr(ref, "weight_loader", None)
    if tp_size > 1 and loader is not None and getattr(loader, "__self__", None) is not mod \
            and getattr(loader, "__name__", "") != "default_weight_loader":
        # a loader set on the parameter itself (GDN's conv1d/A_log/dt_bias, ...) splits it its own way
        return ParamSpec(name, shape, dtype, sharding_known=False)
    if _is(mod, "VocabParallelEmbedding") and out_dim is not None:
        idx = mod.shard_indices
        rows = idx.org_vocab_end_index - idx.org_vocab_start_index
        return ParamSpec(name, shape, dtype, out_dim,
                         (Shard(None, int(mod.org_vocab_size), 0, idx.org_vocab_start_index, rows),))
    if _is(mod, "QKVParallelLinear") and out_dim is not None:
        hs, vhs = mod.head_size, getattr(mod, "v_head_size", mod.head_size)
        kv_rank = tp_rank // max(1, int(getattr(mod, "num_kv_head_replicas", 1)))
        q_len, k_len, v_len = mod.num_heads * hs, mod.num_kv_heads * hs, mod.num_kv_heads * vhs
        shards = (
            Shard("q", mod.total_num_heads * hs, 0, tp_rank * q_len, q_len),
            Shard("k", mod.total_num_kv_heads * hs, q_len, kv_rank * k_len, k_len),
            Shard("v", mod.total_num_kv_heads * vhs, q_len + k_len, kv_rank * v_len, v_len),
        )
        return ParamSpec(name, shape, dtype, out_dim, shards)
    if _is(mod, "MergedColumnParallelLinear") and out_dim is not None:
        shards, off = [], 0
        for i, size in enumerate(mod.output_sizes):
            local = size // tp_size
            shards.append(Shard(i, size, off, tp_rank * local, local))
            off += local
        return ParamSpec(name, shape, dtype, out_dim, tuple(shards))
    if _is(mod, "ReplicatedLinear") or tp_size == 1:
        return ParamSpec(name, shape, dtype)
    if _is(mod, "RowParallelLinear"):
        if in_dim is None:  # the bias of a row-parallel layer is replicated
            return ParamSpec(name, shape, dtype)
        local = shape[in_dim]
        return ParamSpec(name, shape, dtype, in_dim, (Shard(None, local * tp_size, 0, tp_rank * local, local),))
    if _is(mod, "ColumnParallelLinear") and out_dim is not None:
        local = shape[out_dim]
        return ParamSpec(name, shape, dtype, out_dim, (Shard(None, local * tp_size, 0, tp_rank * local, local),))
    # tp > 1, not a layer whose split we know: replicated only if vLLM loads it with its plain default loader
    plain = loader is None or getattr(loader, "__name__", "") == "default_weight_loader"
    return ParamSpec(name, shape, dtype, sharding_known=plain)


def _expert_group(
    model: Any, mod_name: str, mod: Any, rec: Mapping[str, Tensor], lay: ExpertLayout,
    sharding: ExpertSharding | None,
) -> ExpertGroup:
    w13 = rec.get("w13_weight", mod.w13_weight)
    w2 = rec.get("w2_weight", mod.w2_weight)
    # recorded tensors are in checkpoint (preprocessed) orientation; live ones in the declared layout
    pre13 = tuple(w13.shape) if "w13_weight" in rec or lay is ExpertLayout.PREPROCESSED else \
        (w13.shape[0], w13.shape[2], w13.shape[1])
    pre2 = tuple(w2.shape) if "w2_weight" in rec or lay is ExpertLayout.PREPROCESSED else \
        (w2.shape[0], w2.shape[2], w2.shape[1])
    cfg = getattr(mod, "moe_config", None)
    par = getattr(cfg, "moe_parallel_config", None)
    tp_size = int(getattr(par, "tp_size", 1)) if par is not None else 1
    num_experts = int(getattr(cfg, "num_logical_experts", 0) or getattr(mod, "global_num_experts", 0) or pre13[0])
    unwritable = None
    shard = sharding
    if shard is None:
        try:
            shard = ExpertSharding.from_vllm(mod) if cfg is not None else ExpertSharding(pre13[0])
        except LayoutError as e:
            shard, unwritable = None, str(e)
    if getattr(cfg, "is_act_and_mul", True) is False:
        shard, unwritable = None, "non-gated experts (w13 holds only up): write through vLLM's weight_loader"
    names = _expert_names(model, mod)
    return ExpertGroup(
        prefix=_experts_prefix(mod_name, getattr(mod, "layer_name", None)),
        w13=f"{mod_name}.w13_weight" if mod_name else "w13_weight",
        w2=f"{mod_name}.w2_weight" if mod_name else "w2_weight",
        gate=names["w1"], up=names["w3"], down=names["w2"],
        num_experts=num_experts,
        hidden=int(pre13[2]),
        intermediate=int(pre2[2]) * tp_size,
        dtype=w13.dtype,
        layout=lay,
        sharding=shard,
        vllm_fused_gate_up=names.get("fused_w13"),
        vllm_fused_down=names.get("fused_w2"),
        fused_transposed=bool(getattr(mod, "is_fused_checkpoint_transposed", False)),
        unwritable=unwritable,
    )


def _experts_prefix(mod_name: str, layer_name: str | None) -> str:
    """Module path under which the checkpoint names this layer's experts (``...mlp.experts``).

    vLLM's ``layer_name`` says it, but carries the prefix the model was built with; the module path is relative to
    the model. The answer is the ancestor of the parameter-owning module (``experts.routed_experts`` in vLLM
    >= 0.20, ``experts`` before) that ``layer_name`` ends with.
    """
    parts = mod_name.split(".")
    for cut in range(len(parts), 0, -1):
        path = ".".join(parts[:cut])
        if layer_name and (layer_name == path or layer_name.endswith("." + path)):
            return path
    return mod_name.removesuffix(".routed_experts")


def _expert_names(model: Any, mod: Any) -> dict[str, str]:
    """Checkpoint projection names of one MoE layer, read from vLLM's own expert mapping."""
    mapping: Sequence[tuple[str, str, int, str]] = ()
    if callable(getattr(mod, "get_expert_mapping", None)):
        try:
            mapping = mod.get_expert_mapping(include_fused=True)
        except TypeError:
            mapping = mod.get_expert_mapping()
    elif callable(getattr(model, "get_expert_mapping", None)):  # older vLLM: one model-level mapping
        mapping = model.get_expert_mapping()
    names: dict[str, str] = {}
    per_expert: dict[str, set[str]] = {}  # checkpoint projection name -> shard ids it feeds
    for _param, weight_name, _eid, shard_id in mapping:
        parts = [p for p in weight_name.strip(".").split(".") if p and p != "base_layer"]
        if len(parts) == 3 and parts[1].isdigit():  # experts.{e}.{proj}
            per_expert.setdefault(parts[2], set()).add(shard_id)
        elif len(parts) == 2:  # experts.{fused}: all experts stacked
            names.setdefault("fused_w2" if shard_id == "w2" else "fused_w13", parts[1])
    for proj, shard_ids in per_expert.items():
        if len(shard_ids) == 1:  # a projection feeding both w1 and w3 is a per-expert fused gate_up
            names.setdefault(next(iter(shard_ids)), proj)
    for shard_id, attr, default in (("w1", "ckpt_gate_proj_name", "gate_proj"),
                                    ("w3", "ckpt_up_proj_name", "up_proj"),
                                    ("w2", "ckpt_down_proj_name", "down_proj")):
        names.setdefault(shard_id, getattr(mod, attr, None) or default)
    return names


def _trainer_renames(model_type: str | None) -> tuple[Any, ...]:
    """transformers' checkpoint->runtime renames for ``model_type``, reversed (pure renames only)."""
    if not model_type:
        return ()
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except Exception:  # transformers < 5: runtime names are checkpoint names
        return ()
    out = []
    for t in get_checkpoint_conversion_mapping(model_type) or ():
        if isinstance(t, WeightConverter) or not hasattr(t, "reverse_transform"):
            continue  # tensor-merging converters: fused experts are handled by the expert groups
        try:
            out.append(t.reverse_transform())
        except Exception:
            continue
    return tuple(out)


# ---------------------------------------------------------------------------------------------------------------
# plan
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """Where (part of) one trainer tensor goes.

    ``kind``: ``"param"`` whole parameter (TP-sliced where split), ``"packed"`` one shard of a packed parameter
    (``shard_id`` "q"/"k"/"v", an index, or a tuple of consecutive indices), ``"expert"`` one expert's
    ``w1``/``w3``/``w2`` (or ``w13`` = its fused gate_up) of a stacked MoE parameter, ``"experts"`` all experts
    of a fused transformers tensor (``shard_id`` "w13"/"w2", ``expert_ids`` None = all).
    """

    param: str
    kind: str
    shard_id: ShardId | None = None
    expert_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class _Resolution:
    targets: tuple[Target, ...]
    load_name: str  # the spelling vLLM's own loader routes to the same targets
    expected: tuple[int, ...] | None  # None: vLLM splits it in a way hwsync cannot read (TP with a custom loader)
    dtype: torch.dtype
    alias: bool = False  # reached through a tied alias (lm_head -> embed_tokens)


class _ExpertSlice:
    """Picklable transform: one expert's gate, up or down out of a fused transformers tensor."""

    def __init__(self, expert: int, part: str) -> None:
        self.expert, self.part = expert, part

    def __call__(self, t: Tensor) -> Tensor:
        x = t[self.expert]
        if self.part == "gate":
            return x.chunk(2, dim=0)[0]
        if self.part == "up":
            return x.chunk(2, dim=0)[1]
        return x

    def __repr__(self) -> str:
        return f"_ExpertSlice(expert={self.expert}, part={self.part!r})"


def _transpose_last(t: Tensor) -> Tensor:
    return t.transpose(-1, -2)


@dataclass
class Plan:
    """A resolved manifest: per trainer name, the receiver targets; reusable every step.

    ``entries`` maps each trainer name (as given) to its targets; ``skipped`` maps names deliberately not
    written to the reason (allowed by the caller). ``manifest`` is what was validated; :meth:`apply` refuses
    tensors that no longer match it.
    """

    entries: dict[str, tuple[Target, ...]]
    skipped: dict[str, str]
    manifest: dict[str, Spec]
    namespace: Namespace = field(repr=False)
    signature: str = ""
    _resolutions: dict[str, _Resolution] = field(default_factory=dict, repr=False)

    # -- writing in place -----------------------------------------------------------------------------------------
    def apply(self, named_tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
              params: Mapping[str, Tensor] | torch.nn.Module | None = None) -> int:
        """Write trainer tensors into the receiver's parameters in place; returns #tensors written.

        ``params`` (live name -> tensor, or the vLLM model) defaults to the namespace's live parameters. Every
        tensor is checked against the plan first (name, shape, dtype, destination writable in place); on any
        problem one :class:`ResolutionError` is raised and nothing is written. Parameters keep their identity
        (and ``weight_loader``): only their storage is written, with one ``torch._foreach_copy_`` for all
        dense pieces and the stacked expert writers of :mod:`hwsync.layouts`.
        """
        items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
        dst = self._destinations(params)
        todo, problems = self._check_batch(items)
        for name, _t, targets in todo:
            for tg in targets:
                why = self._unwritable(tg, dst)
                if why:
                    problems.append(f"{name!r} -> {tg.param}: {why}")
        if problems:
            raise _error(problems, "nothing was written", len(items))
        dense_dst: list[Tensor] = []
        dense_src: list[Tensor] = []
        per_expert: dict[str, list[tuple[int, str, Tensor]]] = {}
        with torch.no_grad():
            for _name, t, targets in todo:
                for tg in targets:
                    if tg.kind in ("param", "packed"):
                        self._dense_pieces(tg, t, dst[tg.param], dense_dst, dense_src)
                    elif tg.kind == "experts":
                        g = self.namespace.group_of(tg.param)
                        assert g is not None and g.sharding is not None
                        writer = copy_w13_ if tg.shard_id == "w13" else copy_w2_
                        writer(dst[tg.param], t, g.sharding, g.layout, tg.expert_ids)
                    else:  # one expert
                        (e,) = tg.expert_ids or (0,)
                        bucket = per_expert.setdefault(tg.param, [])
                        if tg.shard_id == "w13":
                            gate, up = t.chunk(2, dim=0)
                            bucket += [(e, "w1", gate), (e, "w3", up)]
                        else:
                            bucket.append((e, str(tg.shard_id), t))
            if dense_dst:
                torch._foreach_copy_(dense_dst, dense_src)
            for pname, bucket in per_expert.items():
                g = self.namespace.group_of(pname)
                assert g is not None and g.sharding is not None
                copy_expert_shards_(dst[pname], bucket, g.sharding, g.layout)
        return len(todo)

    def _check_batch(self, items: list[tuple[str, Tensor]]
                     ) -> tuple[list[tuple[str, Tensor, tuple[Target, ...]]], list[str]]:
        """Tensors of a batch that the plan writes, and every way the batch departs from the manifest."""
        problems: list[str] = []
        todo: list[tuple[str, Tensor, tuple[Target, ...]]] = []
        for name, t in items:
            if name in self.skipped:
                continue
            targets = self.entries.get(name)
            if targets is None:
                problems.append(f"{name!r} is not in the plan's manifest; resolve a manifest that lists it")
                continue
            shape, dtype = self.manifest[name]
            if tuple(t.shape) != shape or t.dtype != dtype:
                problems.append(f"{name!r}: plan was made for {list(shape)} {_dt(dtype)}, got "
                                f"{list(t.shape)} {_dt(t.dtype)}; resolve the new manifest")
                continue
            todo.append((name, t, targets))
        return todo, problems

    def _destinations(self, params: Mapping[str, Tensor] | torch.nn.Module | None) -> Mapping[str, Tensor]:
        if params is None:
            return {self.namespace.params[c].name: t for c, t in self.namespace.live.items()}
        if isinstance(params, torch.nn.Module):
            return dict(params.named_parameters())
        return params

    def _unwritable(self, tg: Target, dst: Mapping[str, Tensor]) -> str | None:
        t = dst.get(tg.param)
        if t is None:
            return "not among the given receiver parameters (pass params=the vLLM model or its named_parameters())"
        if tg.kind in ("expert", "experts"):
            g = self.namespace.group_of(tg.param)
            if g is None or g.sharding is None:
                return (g.unwritable if g else "no expert group") + "; use vllm_checkpoint_names() + reload_weights"
            i, h = g.intermediate, g.hidden
            want = w13_shape(g.sharding, i, h, g.layout) if tg.param == g.w13 else w2_shape(g.sharding, i, h, g.layout)
        else:
            spec = self.namespace.spec_of(tg.param)
            if not spec.sharding_known:
                return ("vLLM shards this parameter with a custom loader hwsync cannot read; "
                        "use vllm_checkpoint_names() + reload_weights")
            want = spec.shape
        if tuple(t.shape) != tuple(want):
            return (f"receiver tensor is {list(t.shape)}, not the checkpoint-format {list(want)}: vLLM repacked it "
                    "after loading (CPU/NPU kernels); feed plan.vllm_weights(...) to reload_weights instead")
        return None

    def _dense_pieces(self, tg: Target, t: Tensor, dst: Tensor, dsts: list[Tensor], srcs: list[Tensor]) -> None:
        spec = self.namespace.spec_of(tg.param)
        if spec.split_dim is None or not spec.shards:
            dsts.append(dst)
            srcs.append(t)
            return
        d = spec.split_dim
        src_off = 0
        for s in spec.selected(tg.shard_id if tg.kind == "packed" else None):
            dsts.append(dst.narrow(d, s.dst_start, s.length))
            srcs.append(t.narrow(d, src_off + s.src_start, s.length))
            src_off += s.full

    # -- vLLM's own loader path ----------------------------------------------------------------------------------
    def vllm_checkpoint_names(self, name: str) -> list[tuple[str, Transform | None]]:
        """Names (and tensor transforms) under which vLLM's ``load_weights``/``reload_weights`` accepts ``name``.

        Usually one ``(checkpoint_name, None)``; a fused transformers expert tensor becomes per-expert names with
        slicing transforms when vLLM's loader does not take fused tensors. Skipped names give ``[]``.
        """
        if name in self.skipped:
            return []
        res = self._resolutions.get(name)
        if res is None:
            raise KeyError(f"{name!r} is not in this plan's manifest")
        tg = res.targets[0]
        if tg.kind != "experts":
            if tg.kind == "expert" and tg.shard_id == "w13":  # per-expert fused gate_up: split for any loader
                g = self.namespace.group_of(tg.param)
                assert g is not None
                stem = res.load_name.rsplit(".", 2)[0]
                return [(f"{stem}.{g.gate}.weight", _Chunk(0)), (f"{stem}.{g.up}.weight", _Chunk(1))]
            return [(res.load_name, None)]
        g = self.namespace.group_of(tg.param)
        assert g is not None
        leaf = res.load_name.rsplit(".", 1)
        stem = leaf[0] if leaf[-1] != "weight" else res.load_name.rsplit(".", 2)[0]
        fused = g.vllm_fused_gate_up if tg.shard_id == "w13" else g.vllm_fused_down
        if fused is not None:
            return [(f"{stem}.{fused}", _transpose_last if g.fused_transposed else None)]
        if tg.shard_id == "w13":
            return [(f"{stem}.{e}.{proj}.weight", _ExpertSlice(e, part))
                    for e in range(g.num_experts) for proj, part in ((g.gate, "gate"), (g.up, "up"))]
        return [(f"{stem}.{e}.{g.down}.weight", _ExpertSlice(e, "down")) for e in range(g.num_experts)]

    def vllm_weights(self, named_tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]
                     ) -> Iterator[tuple[str, Tensor]]:
        """Trainer tensors renamed (and sliced) for vLLM's own ``load_weights`` / ``reload_weights``.

        The whole batch is checked against the manifest first (one :class:`ResolutionError`, before the first
        tensor is handed to vLLM); tensors of skipped names are left out.
        """
        items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
        todo, problems = self._check_batch(items)
        if problems:
            raise _error(problems, "nothing was handed to vLLM", len(items))
        return self._renamed_weights(todo)

    def _renamed_weights(self, todo: list[tuple[str, Tensor, tuple[Target, ...]]]) -> Iterator[tuple[str, Tensor]]:
        for name, t, _targets in todo:
            for load_name, fn in self.vllm_checkpoint_names(name):
                yield load_name, (fn(t) if fn is not None else t)

    # -- bookkeeping ---------------------------------------------------------------------------------------------
    def unwritten(self) -> list[str]:
        """Receiver parameters (live names) that no trainer name in the manifest writes completely."""
        return sorted(_uncovered(self.namespace, self.entries.values()))

    def rebind(self, ns: Namespace) -> Plan:
        """The same plan writing into another receiver with an identical namespace signature."""
        if ns.signature != self.namespace.signature:
            raise ResolutionError("cannot rebind a plan to a receiver with a different namespace; resolve again")
        return dataclasses.replace(self, namespace=ns)


class _Chunk:
    """Picklable transform: half ``i`` of a tensor split in two along dim 0 (per-expert fused gate_up)."""

    def __init__(self, i: int) -> None:
        self.i = i

    def __call__(self, t: Tensor) -> Tensor:
        return t.chunk(2, dim=0)[self.i]


def _atoms(ns: Namespace, tg: Target) -> list[tuple[str, Any]]:
    """The disjoint pieces of the receiver a target writes (to detect two trainer names writing one place)."""
    if tg.kind in ("expert", "experts"):
        g = ns.group_of(tg.param)
        assert g is not None
        ids = tg.expert_ids if tg.expert_ids is not None else range(g.num_experts)
        parts = ("w1", "w3") if tg.shard_id in ("w13", None) else (tg.shard_id,)
        if tg.param == g.w2:
            parts = ("w2",)
        return [(tg.param, (e, p)) for e in ids for p in parts]
    spec = ns.spec_of(tg.param)
    if spec.shard_ids:
        sel = spec.selected(tg.shard_id if tg.kind == "packed" else None)
        return [(tg.param, s.id) for s in sel]
    return [(tg.param, "*")]


def _uncovered(ns: Namespace, targets: Iterable[tuple[Target, ...]]) -> set[str]:
    covered = {a for ts in targets for tg in ts for a in _atoms(ns, tg)}
    out = set()
    for spec in ns.params.values():
        g = ns.group_of(spec.name)
        if g is not None:
            full = _atoms(ns, Target(spec.name, "experts", "w13" if spec.name == g.w13 else "w2"))
        else:
            full = _atoms(ns, Target(spec.name, "param"))
        if not all(a in covered for a in full):
            out.add(spec.name)
    return out


# ---------------------------------------------------------------------------------------------------------------
# resolution
# ---------------------------------------------------------------------------------------------------------------
def manifest_of(named_tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]) -> dict[str, Spec]:
    """``{name: (shape, dtype)}`` of trainer tensors: what :func:`resolve` needs (no data)."""
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    return {n: (tuple(t.shape), t.dtype) for n, t in items}


def manifest_signature(specs: Mapping[str, Spec]) -> str:
    """Stable digest of a manifest (names, shapes, dtypes), independent of order."""
    h = hashlib.sha256()
    for n in sorted(specs):
        shape, dtype = specs[n]
        h.update(f"{n}|{tuple(shape)}|{dtype}\n".encode())
    return h.hexdigest()[:16]


def resolve(
    specs: Mapping[str, Spec],
    ns: Namespace,
    *,
    allow_skip_prefixes: Sequence[str] = (),
    skip_adapter_tensors: bool = False,
    cast: bool = False,
    require_complete: bool = False,
) -> Plan:
    """Resolve a whole manifest against a receiver namespace; raise one ResolutionError listing every problem.

    ``allow_skip_prefixes``: trainer-name prefixes (as given or normalized) that may be left unwritten when they
    have no counterpart in the receiver (e.g. ``("mtp.",)`` for a receiver without MTP layers); such names land
    in ``plan.skipped`` with the reason instead of failing. ``skip_adapter_tensors``: LoRA tensors
    (``lora_A``/``lora_B``) are skipped instead of refused (merge them first, see :mod:`hwsync.merged`, or sync
    them as an adapter, see :mod:`hwsync.lora_formats`). ``cast``: accept a floating dtype different from the
    receiver's (the copy casts); by default dtypes must match. ``require_complete``: also refuse a manifest that
    leaves any receiver parameter (or part of one) unwritten.
    """
    problems: list[str] = []
    entries: dict[str, tuple[Target, ...]] = {}
    skipped: dict[str, str] = {}
    resolutions: dict[str, _Resolution] = {}
    normalized = {name: normalize_trainer_name(name) for name in specs}
    trained_copies = {clean for clean, cat in normalized.values() if cat is None}
    by_clean = {clean: name for name, (clean, cat) in normalized.items() if cat is None}
    shapes = {clean: tuple(int(x) for x in specs[name][0]) for clean, name in by_clean.items()}

    def allowed(name: str, clean: str) -> bool:
        return any(name.startswith(p) or clean.startswith(p) for p in allow_skip_prefixes)

    for name, (shape, dtype) in specs.items():
        clean, category = normalized[name]
        shape = tuple(int(x) for x in shape)
        if category == ADAPTER:
            if skip_adapter_tensors:
                skipped[name] = "LoRA adapter tensor (skip_adapter_tensors=True)"
            else:
                problems.append(
                    f"{name!r} is a LoRA adapter tensor, not a base weight: merge it first "
                    "(hwsync.merged.merged_named_weights), sync it as an adapter (hwsync.lora_formats), or pass "
                    "skip_adapter_tensors=True")
            continue
        if category == PEFT_ORIGINAL and clean in trained_copies:
            skipped[name] = f"frozen PEFT original; its trained copy {by_clean[clean]!r} is synced"
            continue
        outcome = _resolve_one(ns, clean, shape, shapes)
        if isinstance(outcome, _Resolution):
            why = _fit_problem(outcome, shape, dtype, cast)
            if why:
                problems.append(f"{name!r} -> {_describe(outcome.targets)}: {why}")
                continue
            entries[name] = outcome.targets
            resolutions[name] = outcome
            continue
        kind, message, skip_prefix = outcome
        if kind == "skip" and allowed(name, clean):
            skipped[name] = message
        elif kind == "skip":
            problems.append(f"{name!r}: {message}; pass allow_skip_prefixes=({skip_prefix!r},) to skip it")
        elif kind == "missing" and allowed(name, clean):
            skipped[name] = "no receiver parameter (allowed by allow_skip_prefixes)"
        else:
            problems.append(f"{name!r} {list(shape)} {_dt(dtype)}: {message}")

    # a tied alias (lm_head.weight of a tied model) is redundant when its owner is sent too
    direct = {a for n, ts in entries.items() if not resolutions[n].alias for tg in ts for a in _atoms(ns, tg)}
    for name in [n for n in entries if resolutions[n].alias]:
        if all(a in direct for tg in entries[name] for a in _atoms(ns, tg)):
            skipped[name] = f"tied to {entries[name][0].param} in the receiver, which another trainer name writes"
            del entries[name], resolutions[name]
    # two trainer names writing the same receiver rows
    owner: dict[tuple[str, Any], str] = {}
    for name, targets in entries.items():
        for tg in targets:
            for atom in _atoms(ns, tg):
                first = owner.setdefault(atom, name)
                if first != name:
                    problems.append(f"ambiguous: {first!r} and {name!r} both write {atom[0]} [{_atom_str(atom[1])}]"
                                    "; send only one of them")
                    break
    if require_complete:
        for pname in sorted(_uncovered(ns, entries.values())):
            problems.append(f"receiver parameter {pname} is not (fully) written by any trainer name")
    if problems:
        raise _error(_dedupe(problems), "nothing was written", len(specs), ns)
    plan = Plan(entries, skipped, {n: (tuple(s), d) for n, (s, d) in specs.items()}, ns,
                f"{ns.signature}:{manifest_signature(specs)}", resolutions)
    return plan


def _dedupe(xs: list[str]) -> list[str]:
    return list(dict.fromkeys(xs))


def _atom_str(a: Any) -> str:
    if isinstance(a, tuple) and len(a) == 2:
        return f"expert {a[0]} {a[1]}"
    return "whole" if a == "*" else f"shard {a!r}"


def _fit_problem(res: _Resolution, shape: tuple[int, ...], dtype: torch.dtype, cast: bool) -> str | None:
    msgs = []
    if res.expected is not None and shape != res.expected:
        msgs.append(f"shape does not fit: expected {list(res.expected)}, got {list(shape)}")
    if dtype != res.dtype:
        castable = dtype.is_floating_point and res.dtype.is_floating_point
        if not (cast and castable):
            hint = " (pass cast=True to let the copy cast)" if castable else ""
            msgs.append(f"dtype does not fit: receiver holds {_dt(res.dtype)}, got {_dt(dtype)}{hint}")
    return "; ".join(msgs) or None


def _dt(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def _describe(targets: Sequence[Target]) -> str:
    out = []
    for t in targets:
        extra = []
        if t.shard_id is not None:
            extra.append(f"shard {t.shard_id!r}")
        if t.expert_ids is not None:
            extra.append(f"expert {t.expert_ids[0]}" if len(t.expert_ids) == 1 else f"{len(t.expert_ids)} experts")
        out.append(t.param + (f" ({', '.join(extra)})" if extra else ""))
    return " + ".join(out)


_Failure = tuple[str, str, str]  # (kind "skip" | "missing" | "ambiguous", message, prefix to allow)


def _resolve_one(ns: Namespace, clean: str, shape: tuple[int, ...], shapes: Mapping[str, tuple[int, ...]]
                 ) -> _Resolution | _Failure:
    # 1. the name as sent; 2. fallbacks, which must agree: transformers' runtime->checkpoint renames, and the
    # name re-rooted under each language-model root of the receiver (text-only trainer vs VL receiver and back).
    # A name the receiver's own mapper drops is a declaration, not a miss: no fallback for it.
    found, dropped = _try_spellings(ns, [clean], shape, shapes)
    if not found and not dropped:
        renamed = _renamed(ns, clean)
        spellings = [renamed, *_rooted_spellings(ns, clean), *_rooted_spellings(ns, renamed)]
        found, dropped = _try_spellings(ns, [x for x in dict.fromkeys(spellings) if x != clean], shape, shapes)
    if len(found) == 1:
        return next(iter(found.values()))
    if len(found) > 1:
        options = "; ".join(f"{r.load_name} -> {_describe(t)}" for t, r in found.items())
        return ("ambiguous", f"ambiguous: it fits several receiver parameters ({options}); send it under the "
                             "receiver's own spelling", "")
    skip = _mtp_skip(ns, clean)
    if skip is not None:
        return skip
    if dropped:
        return ("skip", "the receiver model's hf_to_vllm_mapper drops it (vLLM would not load it)", clean)
    return ("missing", "resolves to no receiver parameter; nearest receiver names: " + _nearest(ns, clean), "")


def _try_spellings(ns: Namespace, spellings: Sequence[str], shape: tuple[int, ...],
                   shapes: Mapping[str, tuple[int, ...]]) -> tuple[dict[tuple[Target, ...], _Resolution], bool]:
    """Distinct resolutions of the spellings, and whether the receiver's mapper dropped any of them."""
    found: dict[tuple[Target, ...], _Resolution] = {}
    dropped = False
    for spelling in spellings:
        mapped = _map(ns, spelling)
        if mapped is None:
            dropped = True
            continue
        res = _match(ns, spelling, mapped[0], mapped[1], shape, shapes)
        if res is not None:
            found.setdefault(res.targets, res)
    return found, dropped


def _renamed(ns: Namespace, clean: str) -> str:
    """``clean`` through transformers' reversed renames (runtime -> checkpoint spelling)."""
    for r in ns.trainer_renames:
        clean = r.rename_source_key(clean)[0]
    return clean


_NESTINGS = (("model.language_model.", "model."), ("language_model.model.", "model."), ("language_model.", ""))


def _rooted_spellings(ns: Namespace, clean: str) -> list[str]:
    """The name under each language-model root of the receiver (``language_model.`` in VL classes) and
    without a trainer-side VL nesting (``model.language_model.``), for text-only <-> VL mismatches."""
    bodies = {clean}
    for outer, inner in _NESTINGS:
        if clean.startswith(outer):
            bodies.add(inner + clean[len(outer):])
    out = []
    for body in sorted(bodies):
        if body != clean:
            out.append(body)
        out.extend(root + body for root in ns._roots if not body.startswith(root))
    return [s for s in dict.fromkeys(out) if s != clean]


def _map(ns: Namespace, name: str) -> tuple[str, Any] | None:
    """Apply the receiver's scoped ``hf_to_vllm_mapper`` chain; None when a mapper drops the name."""
    shard: Any = None
    for scope, mapper in ns.mappers:
        if scope:
            if not name.startswith(scope + "."):
                continue
            rel = name[len(scope) + 1:]
        else:
            rel = name
        if hasattr(mapper, "_map_name_with_shard"):
            r = mapper._map_name_with_shard(rel)
        else:
            m = mapper.map_name(rel) if hasattr(mapper, "map_name") else mapper._map_name(rel)
            r = None if m is None else (m, None)
        if r is None:
            return None
        rel, sh = r
        if sh is not None:
            shard = sh
        name = f"{scope}.{rel}" if scope else rel
    return name, shard


def _match(ns: Namespace, spelling: str, internal: str, shard: Any, shape: tuple[int, ...],
           shapes: Mapping[str, tuple[int, ...]]) -> _Resolution | None:
    c = _canonical(internal)
    alias_of = ns.aliases.get(c)
    if alias_of is not None:  # tied weights (lm_head -> embed_tokens): one receiver tensor under two names
        res = _match(ns, spelling, alias_of, shard, shape, shapes)
        return None if res is None else dataclasses.replace(res, alias=True)
    spec = ns.params.get(c)
    if spec is not None and ns.group_of(spec.name) is None:
        if shard is None:
            expected = spec.trainer_shape() if spec.sharding_known else None
            return _Resolution((Target(spec.name, "param"),), spelling, expected, spec.dtype)
        shard_ids = shard if isinstance(shard, list) else [shard]
        try:
            expected = {spec.trainer_shape(s) for s in shard_ids}
        except (KeyError, IndexError):
            return None
        if len(expected) != 1:
            return None
        targets = tuple(Target(spec.name, "packed", s) for s in shard_ids)
        return _Resolution(targets, spelling, expected.pop(), spec.dtype)
    if spec is not None:  # a stacked expert parameter named directly (vLLM-native trainer names)
        return _Resolution((Target(spec.name, "param"),), spelling, spec.shape, spec.dtype)
    packed = _match_packed(ns, spelling, c, shape, shapes)
    if packed is not None:
        return packed
    return _match_experts(ns, spelling, c)


def _match_packed(ns: Namespace, spelling: str, c: str, shape: tuple[int, ...],
                  shapes: Mapping[str, tuple[int, ...]]) -> _Resolution | None:
    """``x.q_proj.weight`` -> ``x.qkv_proj.weight`` shard, from ``packed_modules_mapping`` (older vLLM)."""
    module, _, leaf = c.rpartition(".")
    owner, _, last = module.rpartition(".")
    for packed, constituents in ns.packed_modules.items():
        if last not in constituents:
            continue
        spec = ns.params.get(f"{owner}.{packed}.{leaf}" if owner else f"{packed}.{leaf}")
        if spec is None or not spec.shards:
            continue
        k = constituents.index(last)
        if len(constituents) == len(spec.shards):
            sid: ShardId = spec.shards[k].id  # type: ignore[assignment]
        else:  # fewer constituents than shards (Qwen3.5 in_proj_qkv spans q,k,v): spans from sibling row counts
            sid_or_none = _span(spec, constituents, k, spelling, shape, shapes)
            if sid_or_none is None:
                continue
            sid = sid_or_none
        return _Resolution((Target(spec.name, "packed", sid),), spelling, spec.trainer_shape(sid), spec.dtype)
    return None


def _span(spec: ParamSpec, constituents: Sequence[str], k: int, spelling: str, shape: tuple[int, ...],
          shapes: Mapping[str, tuple[int, ...]]) -> ShardId | None:
    """Which consecutive shards constituent ``k`` fills, from its and its earlier siblings' trainer row counts."""
    d = spec.split_dim
    if d is None:
        return None
    module, _, leaf = spelling.rpartition(".")
    owner, _, _ = module.rpartition(".")
    i = 0
    for j in range(k + 1):
        if j == k:
            rows = shape[d] if len(shape) > d else None
        else:
            sib = shapes.get(f"{owner}.{constituents[j]}.{leaf}" if owner else f"{constituents[j]}.{leaf}")
            rows = sib[d] if sib is not None and len(sib) > d else None
        if rows is None:
            return None
        start, total = i, 0
        while i < len(spec.shards) and total < rows:
            total += spec.shards[i].full
            i += 1
        if total != rows:
            return None
        if j == k:
            ids = tuple(range(start, i))
            return ids[0] if len(ids) == 1 else ids
    return None


_EXPERT_LEAF = re.compile(r"^(\d+)\.([^.]+)\.weight$")


def _match_experts(ns: Namespace, spelling: str, c: str) -> _Resolution | None:
    parts = c.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        g = ns.expert_groups.get(".".join(parts[:cut]))
        if g is not None:
            break
    else:
        return None
    rest = ".".join(parts[cut:])
    e_, i, h = g.num_experts, g.intermediate, g.hidden
    m = _EXPERT_LEAF.match(rest)
    if m:
        e, proj = int(m.group(1)), m.group(2)
        if e >= e_:
            return None
        if proj == g.gate:
            return _Resolution((Target(g.w13, "expert", "w1", (e,)),), spelling, (i, h), g.dtype)
        if proj == g.up:
            return _Resolution((Target(g.w13, "expert", "w3", (e,)),), spelling, (i, h), g.dtype)
        if proj == g.down:
            return _Resolution((Target(g.w2, "expert", "w2", (e,)),), spelling, (h, i), g.dtype)
        if proj in g.fused_gate_up_names:
            return _Resolution((Target(g.w13, "expert", "w13", (e,)),), spelling, (2 * i, h), g.dtype)
        return None
    leaf = rest[: -len(".weight")] if rest.endswith(".weight") else rest
    if leaf in g.fused_gate_up_names:
        return _Resolution((Target(g.w13, "experts", "w13"),), spelling, (e_, 2 * i, h), g.dtype)
    if leaf in g.fused_down_names:
        return _Resolution((Target(g.w2, "experts", "w2"),), spelling, (e_, h, i), g.dtype)
    return None


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _mtp_skip(ns: Namespace, clean: str) -> _Failure | None:
    """Multi-token-prediction weights the receiver has no layers for: a skip the caller must allow."""
    parts = clean.split(".")
    for k, p in enumerate(parts):
        if p == "mtp" or p.startswith("mtp_"):
            return ("skip", "receiver has no MTP (multi-token prediction) layers", ".".join(parts[: k + 1]) + ".")
    m = _LAYER.search(clean)
    if m and ns.num_hidden_layers is not None and int(m.group(1)) >= ns.num_hidden_layers:
        prefix = clean[: m.end()]
        return ("skip", f"receiver has no MTP layers: layer {m.group(1)} is beyond num_hidden_layers="
                        f"{ns.num_hidden_layers}", prefix)
    return None


def _nearest(ns: Namespace, clean: str, n: int = 3) -> str:
    vocab = _trainer_vocabulary(ns)
    m = _LAYER.search(clean)
    if m:  # compare within the same layer first: fast and what a typo most likely means
        same = [v for v in vocab if f"layers.{m.group(1)}." in v]
        vocab = same or vocab
    best = difflib.get_close_matches(clean, vocab, n=n, cutoff=0.5)
    return ", ".join(best) if best else "(none close)"


def _trainer_vocabulary(ns: Namespace) -> list[str]:
    """Names the receiver accepts, spelled the trainer way (for 'did you mean')."""
    cached = getattr(ns, "_vocab", None)
    if cached is not None:
        return cached
    out: set[str] = set()
    inv = {p: cons for p, cons in ns.packed_modules.items()}
    for c, spec in ns.params.items():
        if ns.group_of(spec.name) is not None:
            continue
        module, _, leaf = c.rpartition(".")
        owner, _, last = module.rpartition(".")
        if last in inv:
            out.update(f"{owner}.{x}.{leaf}" if owner else f"{x}.{leaf}" for x in inv[last])
        else:
            out.add(c)
    for g in ns.expert_groups.values():
        out.update({f"{g.prefix}.gate_up_proj", f"{g.prefix}.down_proj"})
        out.update(f"{g.prefix}.{e}.{p}.weight" for e in range(g.num_experts) for p in (g.gate, g.up, g.down))
    vocab = sorted(out)
    ns._vocab = vocab  # type: ignore[attr-defined]
    return vocab


_MAX_LISTED = 40


def _error(problems: list[str], tail: str, total: int, ns: Namespace | None = None) -> ResolutionError:
    where = f" onto {ns.architecture}" if ns is not None and ns.architecture else ""
    shown = problems[:_MAX_LISTED]
    lines = "\n".join(f"  - {p}" for p in shown)
    if len(problems) > len(shown):
        lines += f"\n  ... and {len(problems) - len(shown)} more (all of them in the error's .problems)"
    err = ResolutionError(
        f"{len(problems)} problem(s) resolving {total} trainer tensor(s){where}; {tail}:\n{lines}")
    err.problems = list(problems)  # type: ignore[attr-defined]
    return err


# ---------------------------------------------------------------------------------------------------------------
# caching
# ---------------------------------------------------------------------------------------------------------------
class PlanCache:
    """Plans keyed by (namespace signature, manifest signature, options): resolve once, reuse every step."""

    def __init__(self) -> None:
        self._plans: dict[tuple[Any, ...], Plan] = {}

    def get(self, specs: Mapping[str, Spec], ns: Namespace, **options: Any) -> Plan:
        key = (ns.signature, manifest_signature(specs), tuple(sorted((k, repr(v)) for k, v in options.items())))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = resolve(specs, ns, **options)
        elif plan.namespace is not ns:
            plan = plan.rebind(ns)
        return plan

    def __len__(self) -> int:
        return len(self._plans)
