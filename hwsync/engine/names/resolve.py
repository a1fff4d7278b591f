"""Resolution: trainer names -> :class:`~hwsync.engine.names.plan.NameMap`, every problem in one error."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from hwsync.common.trainer_names import ADAPTER, PEFT_ORIGINAL, normalize_trainer_name
from hwsync.common.wire import dtype_name
from hwsync.engine.names.namespace import Namespace, ParamSpec, ShardId, Spec, canonical
from hwsync.engine.names.plan import (
    NameMap,
    Resolution,
    Target,
    atoms,
    resolution_error,
    uncovered,
)


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
    route_unknown: bool = False,
) -> NameMap:
    """Resolve a whole manifest against a receiver namespace; raise one ResolutionError listing every problem.

    ``allow_skip_prefixes``: trainer-name prefixes (as given or normalized) that may be left unwritten when they
    have no counterpart in the receiver (e.g. ``("mtp.",)`` for a receiver without MTP layers); such names land
    in ``plan.skipped`` with the reason instead of failing. ``skip_adapter_tensors``: LoRA tensors
    (``lora_A``/``lora_B``) are skipped instead of refused (merge them first, see :mod:`hwsync.trainer.merged`, or sync
    them as an adapter, see :mod:`hwsync.common.lora_formats`). ``cast``: accept a floating dtype different from the
    receiver's (the copy casts); by default dtypes must match. ``require_complete``: also refuse a manifest that
    leaves any receiver parameter (or part of one) unwritten. ``route_unknown``: a name that resolves to no receiver
    parameter is not refused here but left to the model's own loader, spelled the checkpoint way (transformers'
    renames reversed), as a ``"routed"`` target: models rename inside ``load_weights`` where no declaration shows it
    (Ernie 4.5's ``moe_statics``, Granite-MoE-hybrid's ``router.layer``). The caller must find where vLLM's loader
    puts it (:func:`hwsync.engine.vllm.dry_run.dry_run_load` binds it with :meth:`NameMap.bind_routed`) or refuse it.
    """
    problems: list[str] = []
    entries: dict[str, tuple[Target, ...]] = {}
    skipped: dict[str, str] = {}
    resolutions: dict[str, Resolution] = {}
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
                    "(hwsync.trainer.merged.merged_named_weights), sync it as an adapter (hwsync.common.lora_formats), "
                    "or pass skip_adapter_tensors=True"
                )
            continue
        if category == PEFT_ORIGINAL and clean in trained_copies:
            skipped[name] = f"frozen PEFT original; its trained copy {by_clean[clean]!r} is synced"
            continue
        outcome = _resolve_one(ns, clean, shape, shapes)
        if isinstance(outcome, Resolution):
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
        elif kind == "missing" and route_unknown:
            res = Resolution(
                (Target("", "routed"),),
                _renamed(ns, clean),
                None,
                dtype,
                note=f"{name!r} {list(shape)} {dtype_name(dtype)}: {message}",
            )
            entries[name], resolutions[name] = res.targets, res
        else:
            problems.append(f"{name!r} {list(shape)} {dtype_name(dtype)}: {message}")

    # a tied alias (lm_head.weight of a tied model) is redundant when its owner is sent too
    direct = {a for n, ts in entries.items() if not resolutions[n].alias for tg in ts for a in atoms(ns, tg)}
    for name in [n for n in entries if resolutions[n].alias]:
        if all(a in direct for tg in entries[name] for a in atoms(ns, tg)):
            skipped[name] = f"tied to {entries[name][0].param} in the receiver, which another trainer name writes"
            del entries[name], resolutions[name]
    # two trainer names writing the same receiver rows
    owner: dict[tuple[str, Any], str] = {}
    for name, targets in entries.items():
        for tg in targets:
            for atom in atoms(ns, tg):
                first = owner.setdefault(atom, name)
                if first != name:
                    problems.append(
                        f"ambiguous: {first!r} and {name!r} both write {atom[0]} [{_atom_str(atom[1])}]"
                        "; send only one of them"
                    )
                    break
    if require_complete:
        for pname in sorted(uncovered(ns, entries.values())):
            problems.append(f"receiver parameter {pname} is not (fully) written by any trainer name")
    if problems:
        raise resolution_error(_dedupe(problems), "nothing was written", len(specs), ns)
    plan = NameMap(
        entries,
        skipped,
        {n: (tuple(s), d) for n, (s, d) in specs.items()},
        ns,
        f"{ns.signature}:{manifest_signature(specs)}",
        resolutions,
    )
    return plan


def _dedupe(xs: list[str]) -> list[str]:
    return list(dict.fromkeys(xs))


def _atom_str(a: Any) -> str:
    if isinstance(a, tuple) and len(a) == 2:
        return f"expert {a[0]} {a[1]}"
    return "whole" if a == "*" else f"shard {a!r}"


def _fit_problem(res: Resolution, shape: tuple[int, ...], dtype: torch.dtype, cast: bool) -> str | None:
    msgs = []
    if res.expected is not None and shape != res.expected:
        msgs.append(f"shape does not fit: expected {list(res.expected)}, got {list(shape)}")
    if dtype != res.dtype:
        castable = dtype.is_floating_point and res.dtype.is_floating_point
        if not (cast and castable):
            hint = " (pass cast=True to let the copy cast)" if castable else ""
            msgs.append(f"dtype does not fit: receiver holds {dtype_name(res.dtype)}, got {dtype_name(dtype)}{hint}")
    return "; ".join(msgs) or None


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


def _resolve_one(
    ns: Namespace, clean: str, shape: tuple[int, ...], shapes: Mapping[str, tuple[int, ...]]
) -> Resolution | _Failure:
    # 1. the name as sent; 2. fallbacks, which must agree: transformers' runtime->checkpoint renames, and the
    # name re-rooted under each language-model root of the receiver (text-only trainer vs VL receiver and back).
    # A name the receiver's own mapper drops is a declaration, not a miss: no fallback for it.
    found, dropped = _try_spellings(ns, [clean], shape, shapes)
    if not found and not dropped:
        renamed = _renamed(ns, clean)
        spellings = [renamed, *_rooted_spellings(ns, clean), *_rooted_spellings(ns, renamed)]
        found, dropped = _try_spellings(ns, [x for x in dict.fromkeys(spellings) if x != clean], shape, shapes)
    if len(found) == 1:
        res = next(iter(found.values()))
        renamed = _renamed(ns, clean)
        if (
            res.load_name == clean
            and renamed != clean
            and _map(ns, renamed) is not None
            and not _try_spellings(ns, [renamed], shape, shapes)[0]
        ):
            # the checkpoint spells it in a way no declaration places (Granite-MoE-hybrid's fused experts are
            # ``input_linear.weight`` on disk): the model's load_weights renames it itself, so that spelling is the
            # one its loader takes (the dry run checks it)
            return dataclasses.replace(res, load_name=renamed, checkpoint=True)
        return res
    if len(found) > 1:
        options = "; ".join(f"{r.load_name} -> {_describe(t)}" for t, r in found.items())
        return (
            "ambiguous",
            f"ambiguous: it fits several receiver parameters ({options}); send it under the receiver's own spelling",
            "",
        )
    skip = _mtp_skip(ns, clean)
    if skip is not None:
        return skip
    if dropped:
        return ("skip", "the receiver model's hf_to_vllm_mapper drops it (vLLM would not load it)", clean)
    return ("missing", "resolves to no receiver parameter; nearest receiver names: " + _nearest(ns, clean), "")


def _try_spellings(
    ns: Namespace, spellings: Sequence[str], shape: tuple[int, ...], shapes: Mapping[str, tuple[int, ...]]
) -> tuple[dict[tuple[Target, ...], Resolution], bool]:
    """Distinct resolutions of the spellings, and whether the receiver's mapper dropped any of them."""
    found: dict[tuple[Target, ...], Resolution] = {}
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
            bodies.add(inner + clean[len(outer) :])
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
            rel = name[len(scope) + 1 :]
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


def _match(
    ns: Namespace,
    spelling: str,
    internal: str,
    shard: Any,
    shape: tuple[int, ...],
    shapes: Mapping[str, tuple[int, ...]],
) -> Resolution | None:
    c = canonical(internal)
    alias_of = ns.aliases.get(c)
    if alias_of is not None:  # tied weights (lm_head -> embed_tokens): one receiver tensor under two names
        res = _match(ns, spelling, alias_of, shard, shape, shapes)
        return None if res is None else dataclasses.replace(res, alias=True)
    spec = ns.params.get(c)
    if spec is not None and ns.group_of(spec.name) is None:
        if shard is None:
            expected = spec.trainer_shape() if spec.sharding_known else None
            return Resolution((Target(spec.name, "param"),), spelling, expected, spec.dtype)
        shard_ids = shard if isinstance(shard, list) else [shard]
        try:
            shape_set = {spec.trainer_shape(s) for s in shard_ids}
        except (KeyError, IndexError):
            return None
        if len(shape_set) != 1:
            return None
        targets = tuple(Target(spec.name, "packed", s) for s in shard_ids)
        return Resolution(targets, spelling, shape_set.pop(), spec.dtype)
    if spec is not None:  # a stacked expert parameter named directly (vLLM-native trainer names)
        return Resolution((Target(spec.name, "param"),), spelling, spec.shape, spec.dtype)
    packed = _match_packed(ns, spelling, c, shape, shapes)
    if packed is not None:
        return packed
    return _match_experts(ns, spelling, c, shape)


def _match_packed(
    ns: Namespace, spelling: str, c: str, shape: tuple[int, ...], shapes: Mapping[str, tuple[int, ...]]
) -> Resolution | None:
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
        return Resolution((Target(spec.name, "packed", sid),), spelling, spec.trainer_shape(sid), spec.dtype)
    return None


def _span(
    spec: ParamSpec,
    constituents: Sequence[str],
    k: int,
    spelling: str,
    shape: tuple[int, ...],
    shapes: Mapping[str, tuple[int, ...]],
) -> ShardId | None:
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


def _match_experts(ns: Namespace, spelling: str, c: str, shape: tuple[int, ...] | None = None) -> Resolution | None:
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
            return Resolution((Target(g.w13, "expert", "w1", (e,)),), spelling, (i, h), g.dtype)
        if proj == g.up:
            return Resolution((Target(g.w13, "expert", "w3", (e,)),), spelling, (i, h), g.dtype)
        if proj == g.down:
            return Resolution((Target(g.w2, "expert", "w2", (e,)),), spelling, (h, i), g.dtype)
        if proj in g.fused_gate_up_names:
            return Resolution((Target(g.w13, "expert", "w13", (e,)),), spelling, (g.w13_rows, h), g.dtype)
        return None
    leaf = rest[: -len(".weight")] if rest.endswith(".weight") else rest
    # The receiver's mapper renamed the tensor onto a parameter of the experts module itself (GPT-OSS:
    # ``experts.gate_up_proj`` -> ``w13_weight``, ``gate_up_proj_bias`` -> ``w13_bias``): the tensor is in the
    # model's own checkpoint layout, which only its loader converts (GPT-OSS: [E, H, 2I] with gate/up interleaved).
    owner = canonical(g.w13).rsplit(".", 1)[0]
    native = ns.params.get(f"{owner}.{rest}") if "." not in rest else None
    if native is not None:
        return Resolution((Target(native.name, "loader"),), spelling, None, native.dtype)
    fused = (
        {"w13": (g.w13, (e_, g.w13_rows, h))}
        if leaf in g.fused_gate_up_names
        else {"w2": (g.w2, (e_, h, i))}
        if leaf in g.fused_down_names
        else {}
    )
    for shard, (param, expected) in fused.items():
        transposed = (expected[0], expected[2], expected[1])
        if shape is not None and tuple(shape) == transposed and transposed != expected:
            # the trainer keeps the original [E, in, out] layout (transformers' Llama 4), as its checkpoint does:
            # vLLM's loader takes it as in the checkpoint (its own transposition), so it goes there unchanged
            return Resolution((Target(param, "loader"),), spelling, None, g.dtype)
        return Resolution((Target(param, "experts", shard),), spelling, expected, g.dtype)
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
        return (
            "skip",
            f"receiver has no MTP layers: layer {m.group(1)} is beyond num_hidden_layers={ns.num_hidden_layers}",
            prefix,
        )
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


# ---------------------------------------------------------------------------------------------------------------
# caching
# ---------------------------------------------------------------------------------------------------------------
class NameMapCache:
    """Plans keyed by (namespace signature, manifest signature, options): resolve once, reuse every step."""

    def __init__(self) -> None:
        self._plans: dict[tuple[Any, ...], NameMap] = {}

    def get(self, specs: Mapping[str, Spec], ns: Namespace, **options: Any) -> NameMap:
        key = (ns.signature, manifest_signature(specs), tuple(sorted((k, repr(v)) for k, v in options.items())))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = resolve(specs, ns, **options)
        elif plan.namespace is not ns:
            plan = plan.rebind(ns)
        return plan

    def __len__(self) -> int:
        return len(self._plans)
