"""What a receiver declares about its parameters (:class:`Namespace`), read from a live vLLM model."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from hwsync.common.errors import LayoutError
from hwsync.common.layouts import (
    ExpertLayout,
    ExpertSharding,
)


def canonical(live_name: str) -> str:
    """A receiver name without vLLM-LoRA ``base_layer`` segments (so trainer names match with or without LoRA)."""
    return ".".join(p for p in live_name.split(".") if p != "base_layer")


ShardId = str | int | tuple[int, ...]
Spec = tuple[tuple[int, ...], torch.dtype]
Transform = Callable[[Tensor], Tensor]


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
    gated: bool = True
    """w13 stacks gate and up ([E, 2I, H]); ``False``: non-gated experts (Nemotron-H's relu2), w13 is up alone
    ([E, I, H]) and the checkpoint has no gate projection."""
    streamed: tuple[str, ...] = ()
    """Leaves of this layer's parameters (``w13_weight``, ``w13_bias``, ...) that the model's own loader also takes
    one expert at a time, as ``{prefix}.{e}.{leaf}``, through the layer's weight loader (vLLM's GPT-OSS loader,
    whose fused names bypass every weight loader): see :func:`_streamed_leaves`."""

    @property
    def module(self) -> str:
        """Live path of the module owning the stacked parameters (``...mlp.experts.routed_experts``)."""
        return self.w13.rsplit(".", 1)[0] if "." in self.w13 else ""

    @property
    def w13_rows(self) -> int:
        """Rows of one expert's w13 (before TP): gate and up stacked, or up alone for non-gated experts."""
        return (2 if self.gated else 1) * self.intermediate

    @property
    def w13_parts(self) -> tuple[str, ...]:
        """vLLM shard ids w13 is loaded from: ``w1`` (gate) and ``w3`` (up), or ``w1`` alone (non-gated: vLLM's
        mapping feeds the up projection to w1)."""
        return ("w1", "w3") if self.gated else ("w1",)

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
    themselves (not pickled, not part of the signature) so a :class:`NameMap` can write into them.
    """

    params: dict[str, ParamSpec]
    expert_groups: dict[str, ExpertGroup] = field(default_factory=dict)
    packed_modules: dict[str, tuple[str, ...]] = field(default_factory=dict)
    mappers: tuple[tuple[str, Any], ...] = ()  # (module scope, vLLM WeightsMapper), outermost first
    trainer_renames: tuple[Any, ...] = ()  # reversed transformers renames (runtime -> checkpoint)
    aliases: dict[str, str] = field(default_factory=dict)  # tied canonical alias -> canonical owner
    reprocessed_aliases: tuple[str, ...] = ()
    """Tied aliases held by a *different* module than their owner (LFM2-MoE's ``ParallelLMHead.tie_weights``): that
    module derives its own kernel data after loading (vLLM's CPU build packs the LM head), which vLLM's reload redoes
    only for a layer it loads, so a sync of the owner also hands the alias to the loader."""
    num_hidden_layers: int | None = None
    architecture: str = ""
    model_type: str | None = None
    live: dict[str, Tensor] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._by_live = {spec.name: spec for spec in self.params.values()}
        self._group_of_param = {n: g for g in self.expert_groups.values() for n in (g.w13, g.w2)}
        self._group_of_module = {g.module: g for g in self.expert_groups.values()}
        self._roots = sorted(
            {
                n[: -len(tail)]
                for n in self.params
                for tail in ("lm_head.weight", "model.embed_tokens.weight")
                if n.endswith(tail) and (len(n) == len(tail) or n[-len(tail) - 1] == ".")
            }
            - {""}
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
            h.update(repr(self.reprocessed_aliases).encode())
            self._signature = h.hexdigest()[:16]
        return self._signature

    def spec_of(self, live_name: str) -> ParamSpec:
        return self._by_live[live_name]

    def group_of(self, live_name: str) -> ExpertGroup | None:
        return self._group_of_param.get(live_name)

    def group_owning(self, live_name: str) -> ExpertGroup | None:
        """The MoE layer ``live_name`` (any of its parameters: weights, biases, scales) belongs to."""
        return self._group_of_module.get(live_name.rsplit(".", 1)[0] if "." in live_name else "")


def _mapper_repr(m: Any) -> str:
    fields = (
        "orig_to_new_regex",
        "orig_to_new_substr",
        "orig_to_new_stacked",
        "orig_to_new_prefix",
        "orig_to_new_suffix",
        "source_patterns",
        "target_patterns",
    )
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
        own: dict[str, Tensor] = dict(mod.named_parameters(recurse=False))
        if not own:
            continue
        rec = recorded.get(id(mod), {})
        for pname, p in own.items():
            full = f"{mod_name}.{pname}" if mod_name else pname
            ref = rec.get(pname, p)
            params[canonical(full)] = _param_spec(full, mod, ref)
            live[canonical(full)] = p
        if "w13_weight" in own and "w2_weight" in own:
            group = _expert_group(model, mod_name, mod, rec, lay, sharding)
            groups[group.prefix] = group

    aliases: dict[str, str] = {}
    reprocessed: list[str] = []
    first: dict[int, str] = {}
    owner_name: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(p), canonical(name))
        owner_name.setdefault(id(p), name)
        if owner != canonical(name):
            aliases[canonical(name)] = owner
            mod_of = lambda n: model.get_submodule(n.rpartition(".")[0]) if "." in n else model  # noqa: E731
            if mod_of(name) is not mod_of(owner_name[id(p)]):
                reprocessed.append(canonical(name))

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
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    model_type = trainer_model_type or getattr(text, "model_type", None)
    return Namespace(
        params=params,
        expert_groups=groups,
        packed_modules=packed,
        mappers=tuple(sorted(mappers.values(), key=lambda sm: (_depth(sm[0]), sm[0]))),
        trainer_renames=_trainer_renames(model_type),
        aliases=aliases,
        reprocessed_aliases=tuple(reprocessed),
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


def _loader_of(loader: Any, mod: Any) -> bool:
    """Whether ``loader`` is one of ``mod``'s own loader methods. vLLM (0.32) records checkpoint-format parameters
    for reloading with their bound loaders re-bound to a sentinel object (``reload.sanitize.layer_ref_sentinel``, so
    the record does not keep the layer alive): a method of ``type(mod)`` bound to that sentinel is ``mod``'s."""
    owner = getattr(loader, "__self__", None)
    if owner is mod:
        return True
    try:
        from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel
    except Exception:  # noqa: BLE001 - older vLLM: no sanitized records
        return False
    func = getattr(loader, "__func__", None)
    return (
        owner is layer_ref_sentinel
        and func is not None
        and getattr(type(mod), getattr(func, "__name__", ""), None) is func
    )


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
    if (
        tp_size > 1
        and loader is not None
        and not _loader_of(loader, mod)
        and getattr(loader, "__name__", "") != "default_weight_loader"
    ):
        # a loader set on the parameter itself (GDN's conv1d/A_log/dt_bias, ...) splits it its own way
        return ParamSpec(name, shape, dtype, sharding_known=False)
    if _is(mod, "VocabParallelEmbedding") and out_dim is not None:
        idx = mod.shard_indices
        rows = idx.org_vocab_end_index - idx.org_vocab_start_index
        return ParamSpec(
            name, shape, dtype, out_dim, (Shard(None, int(mod.org_vocab_size), 0, idx.org_vocab_start_index, rows),)
        )
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
        parts: list[Shard] = []
        off = 0
        for i, size in enumerate(mod.output_sizes):
            local = size // tp_size
            parts.append(Shard(i, size, off, tp_rank * local, local))
            off += local
        return ParamSpec(name, shape, dtype, out_dim, tuple(parts))
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
    model: Any,
    mod_name: str,
    mod: Any,
    rec: Mapping[str, Tensor],
    lay: ExpertLayout,
    sharding: ExpertSharding | None,
) -> ExpertGroup:
    w13 = rec.get("w13_weight", mod.w13_weight)
    w2 = rec.get("w2_weight", mod.w2_weight)
    # recorded tensors are in checkpoint (preprocessed) orientation; live ones in the declared layout
    pre13 = (
        tuple(w13.shape)
        if "w13_weight" in rec or lay is ExpertLayout.PREPROCESSED
        else (w13.shape[0], w13.shape[2], w13.shape[1])
    )
    pre2 = (
        tuple(w2.shape)
        if "w2_weight" in rec or lay is ExpertLayout.PREPROCESSED
        else (w2.shape[0], w2.shape[2], w2.shape[1])
    )
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
    gated = getattr(cfg, "is_act_and_mul", True) is not False
    if not gated:
        shard, unwritable = None, "non-gated experts (w13 holds only up): write through vLLM's weight_loader"
    names = _expert_names(model, mod)
    prefix = _experts_prefix(mod_name, getattr(mod, "layer_name", None))
    return ExpertGroup(
        prefix=prefix,
        w13=f"{mod_name}.w13_weight" if mod_name else "w13_weight",
        w2=f"{mod_name}.w2_weight" if mod_name else "w2_weight",
        gate=names["w1"],
        up=names["w3"],
        down=names["w2"],
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
        gated=gated,
        streamed=_streamed_leaves(model, mod_name, mod, prefix),
    )


def _streamed_leaves(model: Any, mod_name: str, mod: Any, prefix: str) -> tuple[str, ...]:
    """Parameters of one MoE layer that the model's own loader takes one expert at a time (``{prefix}.{e}.{leaf}``).

    vLLM 0.32's GPT-OSS loader copies its fused expert tensors (``gate_up_proj`` ...) with ``param.copy_``, out of
    sight of the layerwise reload, but also parses per-expert keys (``_get_streamed_expert_info``) and hands those to
    the layer's weight loader, which the reload does see. The model's own parser is asked, for each parameter of this
    layer, whether expert 0's key reaches it; nothing is assumed about a model without such a parser.
    """
    leaves = tuple(p for p, _ in mod.named_parameters(recurse=False))
    parts = mod_name.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        owner_name = ".".join(parts[:cut])
        owner = model.get_submodule(owner_name) if owner_name else model
        parse = getattr(type(owner), "_get_streamed_expert_info", None)
        if not callable(parse):
            continue
        head = owner_name + "." if owner_name else ""
        if not (prefix.startswith(head) and mod_name.startswith(head)):
            return ()
        params = {f"{mod_name[len(head) :]}.{leaf}": None for leaf in leaves}
        out = []
        for leaf, param in zip(leaves, params):
            try:
                found = parse(f"{prefix[len(head) :]}.0.{leaf}", params)
            except Exception:  # noqa: BLE001  (a parser that cannot answer: no per-expert route assumed)
                found = None
            if isinstance(found, tuple) and len(found) >= 2 and found[0] == 0 and found[1] == param:
                out.append(leaf)
        return tuple(out)
    return ()


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
            return canonical(path)
    # no ancestor matches (MiniMax-M2 builds its MoE with prefix "...mlp" but stores it as "block_sparse_moe"): the
    # module path itself, without the LoRA wrapper's "base_layer" segment, which checkpoint names never carry
    return canonical(mod_name.removesuffix(".routed_experts"))


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
    for shard_id, attr, default in (
        ("w1", "ckpt_gate_proj_name", "gate_proj"),
        ("w3", "ckpt_up_proj_name", "up_proj"),
        ("w2", "ckpt_down_proj_name", "down_proj"),
    ):
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
