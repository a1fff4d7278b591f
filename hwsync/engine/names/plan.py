"""A resolved sync plan: where each trainer tensor lands, and the in-place writer that puts it there."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from hwsync.common.errors import ResolutionError
from hwsync.common.finite import copy_all
from hwsync.common.layouts import (
    copy_expert_shards_,
    copy_w2_,
    copy_w13_,
    w2_shape,
    w13_shape,
)
from hwsync.common.wire import dtype_name
from hwsync.engine.names.namespace import Namespace, ShardId, Spec, Transform


# ---------------------------------------------------------------------------------------------------------------
# plan
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """Where (part of) one trainer tensor goes.

    ``kind``: ``"param"`` whole parameter (TP-sliced where split), ``"packed"`` one shard of a packed parameter
    (``shard_id`` "q"/"k"/"v", an index, or a tuple of consecutive indices), ``"expert"`` one expert's
    ``w1``/``w3``/``w2`` (or ``w13`` = its fused gate_up) of a stacked MoE parameter, ``"experts"`` all experts
    of a fused transformers tensor (``shard_id`` "w13"/"w2", ``expert_ids`` None = all), ``"loader"`` the whole
    parameter in the model's own checkpoint layout, which only vLLM's loader converts (GPT-OSS experts, Llama 4's
    ``[E, in, out]`` experts): written through vLLM's reload path only (one expert at a time where the model's loader
    takes per-expert keys, :attr:`hwsync.engine.names.ExpertGroup.streamed`). ``"routed"``: a name no declaration
    places, handed to vLLM's loader under its checkpoint spelling (``resolve(route_unknown=True)``); ``param`` is empty
    until :meth:`NameMap.bind_routed` turns it into ``"loader"`` targets on the parameters the loader wrote.
    """

    param: str
    kind: str
    shard_id: ShardId | None = None
    expert_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Resolution:
    targets: tuple[Target, ...]
    load_name: str  # the spelling vLLM's own loader routes to the same targets
    expected: tuple[int, ...] | None  # None: vLLM splits it in a way hwsync cannot read (TP with a custom loader)
    dtype: torch.dtype
    alias: bool = False  # reached through a tied alias (lm_head -> embed_tokens)
    note: str = ""  # why a "routed" name resolved to nothing statically (the error if vLLM's loader takes it nowhere)
    checkpoint: bool = False  # load_name is the exact checkpoint spelling: vLLM's loader takes it as is


class _ExpertSlice:
    """Picklable transform: one expert's gate, up or down (or, for any other ``part``, the whole expert) out of a
    fused transformers tensor."""

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
class NameMap:
    """The name map of a resolved manifest: per trainer name, the receiver targets; reusable every step.

    ``entries`` maps each trainer name (as given) to its targets; ``skipped`` maps names deliberately not
    written to the reason (allowed by the caller). ``manifest`` is what was validated; :meth:`apply` refuses
    tensors that no longer match it.
    """

    entries: dict[str, tuple[Target, ...]]
    skipped: dict[str, str]
    manifest: dict[str, Spec]
    namespace: Namespace = field(repr=False)
    signature: str = ""
    _resolutions: dict[str, Resolution] = field(default_factory=dict, repr=False)

    # -- writing in place -----------------------------------------------------------------------------------------
    def apply(
        self,
        named_tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
        params: Mapping[str, Tensor] | torch.nn.Module | None = None,
    ) -> int:
        """Write trainer tensors into the receiver's parameters in place; returns #tensors written.

        ``params`` (live name -> tensor, or the vLLM model) defaults to the namespace's live parameters. Every
        tensor is checked against the plan first (name, shape, dtype, destination writable in place); on any
        problem one :class:`ResolutionError` is raised and nothing is written. Parameters keep their identity
        (and ``weight_loader``): only their storage is written, with one ``torch._foreach_copy_`` for all
        dense pieces and the stacked expert writers of :mod:`hwsync.common.layouts`.
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
            raise resolution_error(problems, "nothing was written", len(items))
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
                        g = self.namespace.group_of(tg.param)
                        if tg.shard_id == "w13" and g is not None and not g.gated:
                            bucket.append((e, "w1", t))
                        elif tg.shard_id == "w13":
                            gate, up = t.chunk(2, dim=0)
                            bucket += [(e, "w1", gate), (e, "w3", up)]
                        else:
                            bucket.append((e, str(tg.shard_id), t))
            if dense_dst:
                copy_all(dense_dst, dense_src)  # checked for NaN/Inf as it copies, inside a receive
            for pname, bucket in per_expert.items():
                g = self.namespace.group_of(pname)
                assert g is not None and g.sharding is not None
                copy_expert_shards_(dst[pname], bucket, g.sharding, g.layout)
        return len(todo)

    def _check_batch(
        self, items: list[tuple[str, Tensor]]
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
                problems.append(
                    f"{name!r}: plan was made for {list(shape)} {dtype_name(dtype)}, got "
                    f"{list(t.shape)} {dtype_name(t.dtype)}; resolve the new manifest"
                )
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
        if tg.kind in ("loader", "routed"):
            return (
                "vLLM's loader converts this tensor's checkpoint layout; use vllm_checkpoint_names() + reload_weights"
            )
        if tg.kind in ("expert", "experts"):
            g = self.namespace.group_of(tg.param)
            if g is None or g.sharding is None:
                return f"{g.unwritable if g else 'no expert group'}; use vllm_checkpoint_names() + reload_weights"
            i, h = g.intermediate, g.hidden
            want: tuple[int, ...] = (
                w13_shape(g.sharding, i, h, g.layout) if tg.param == g.w13 else w2_shape(g.sharding, i, h, g.layout)
            )
        else:
            spec = self.namespace.spec_of(tg.param)
            if not spec.sharding_known:
                return (
                    "vLLM shards this parameter with a custom loader hwsync cannot read; "
                    "use vllm_checkpoint_names() + reload_weights"
                )
            want = spec.shape
        if tuple(t.shape) != tuple(want):
            return (
                f"receiver tensor is {list(t.shape)}, not the checkpoint-format {list(want)}: vLLM repacked it "
                "after loading (CPU/NPU kernels); feed plan.vllm_weights(...) to reload_weights instead"
            )
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
        also = [
            (a, None)
            for a in self.namespace.reprocessed_aliases  # tied, in another module: reload it too
            if tg.kind == "param" and self.namespace.aliases[a] == _canon(tg.param) and not res.alias
        ]
        if res.checkpoint:
            return [(res.load_name, None), *also]
        if tg.kind == "loader":
            owner = self.namespace.group_owning(tg.param)
            leaf = tg.param.rsplit(".", 1)[-1]
            if owner is not None and leaf in owner.streamed:  # the model's loader takes it one expert at a time
                return [(f"{owner.prefix}.{e}.{leaf}", _ExpertSlice(e, "expert")) for e in range(owner.num_experts)]
            return [(res.load_name, None)]
        if tg.kind != "experts":
            g = self.namespace.group_of(tg.param) if tg.kind == "expert" and tg.shard_id == "w13" else None
            if g is not None and g.gated:  # per-expert fused gate_up: split for any loader
                stem = res.load_name.rsplit(".", 2)[0]
                return [(f"{stem}.{g.gate}.weight", _Chunk(0)), (f"{stem}.{g.up}.weight", _Chunk(1))]
            return [(res.load_name, None), *also]
        g = self.namespace.group_of(tg.param)
        assert g is not None
        head, _, last = res.load_name.rpartition(".")
        stem = head if last != "weight" else res.load_name.rsplit(".", 2)[0]
        fused = g.vllm_fused_gate_up if tg.shard_id == "w13" else g.vllm_fused_down
        if fused is not None:
            return [(f"{stem}.{fused}", _transpose_last if g.fused_transposed else None)]
        if tg.shard_id == "w13":
            parts = ((g.gate, "gate"), (g.up, "up")) if g.gated else ((g.gate, "whole"),)
            return [
                (f"{stem}.{e}.{proj}.weight", _ExpertSlice(e, part))
                for e in range(g.num_experts)
                for proj, part in parts
            ]
        return [(f"{stem}.{e}.{g.down}.weight", _ExpertSlice(e, "down")) for e in range(g.num_experts)]

    def vllm_weights(
        self, named_tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]
    ) -> Iterator[tuple[str, Tensor]]:
        """Trainer tensors renamed (and sliced) for vLLM's own ``load_weights`` / ``reload_weights``.

        The whole batch is checked against the manifest first (one :class:`ResolutionError`, before the first
        tensor is handed to vLLM); tensors of skipped names are left out.
        """
        items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
        todo, problems = self._check_batch(items)
        if problems:
            raise resolution_error(problems, "nothing was handed to vLLM", len(items))
        return self._renamed_weights(todo)

    def _renamed_weights(self, todo: list[tuple[str, Tensor, tuple[Target, ...]]]) -> Iterator[tuple[str, Tensor]]:
        for name, t, _targets in todo:
            for load_name, fn in self.vllm_checkpoint_names(name):
                yield load_name, (fn(t) if fn is not None else t)

    # -- routed names (resolve(route_unknown=True)) ---------------------------------------------------------------
    def routed(self) -> dict[str, str]:
        """Names not yet bound to receiver parameters -> why they resolved to nothing statically."""
        return {n: self._resolutions[n].note for n, ts in self.entries.items() if any(t.kind == "routed" for t in ts)}

    def bind_routed(self, name: str, params: Iterable[str]) -> None:
        """Record where vLLM's own loader put a routed name: ``"loader"`` targets (reload path only)."""
        targets = tuple(Target(p, "loader") for p in sorted(set(params)))
        if not targets:
            raise ValueError(f"{name}: no receiver parameter to bind")
        self.entries[name] = targets
        self._resolutions[name] = dataclasses.replace(self._resolutions[name], targets=targets)

    # -- bookkeeping ---------------------------------------------------------------------------------------------
    def unwritten(self) -> list[str]:
        """Receiver parameters (live names) that no trainer name in the manifest writes completely."""
        return sorted(uncovered(self.namespace, self.entries.values()))

    def rebind(self, ns: Namespace) -> NameMap:
        """The same plan writing into another receiver with an identical namespace signature."""
        if ns.signature != self.namespace.signature:
            raise ResolutionError("cannot rebind a plan to a receiver with a different namespace; resolve again")
        return dataclasses.replace(self, namespace=ns)


def _canon(live_name: str) -> str:
    return ".".join(p for p in live_name.split(".") if p != "base_layer")


class _Chunk:
    """Picklable transform: half ``i`` of a tensor split in two along dim 0 (per-expert fused gate_up)."""

    def __init__(self, i: int) -> None:
        self.i = i

    def __call__(self, t: Tensor) -> Tensor:
        return t.chunk(2, dim=0)[self.i]


def atoms(ns: Namespace, tg: Target) -> list[tuple[str, Any]]:
    """The disjoint pieces of the receiver a target writes (to detect two trainer names writing one place)."""
    if tg.kind == "routed":  # not placed yet: vLLM's loader decides (bound after the dry run)
        return []
    if tg.kind == "loader":
        g = ns.group_of(tg.param)
        if g is not None:
            return atoms(ns, Target(tg.param, "experts", "w13" if tg.param == g.w13 else "w2"))
        return [(tg.param, "*")]
    if tg.kind in ("expert", "experts"):
        g = ns.group_of(tg.param)
        assert g is not None
        ids = tg.expert_ids if tg.expert_ids is not None else range(g.num_experts)
        parts = g.w13_parts if tg.shard_id in ("w13", None) else (tg.shard_id,)
        if tg.param == g.w2:
            parts = ("w2",)
        return [(tg.param, (e, p)) for e in ids for p in parts]
    spec = ns.spec_of(tg.param)
    if spec.shard_ids:
        sel = spec.selected(tg.shard_id if tg.kind == "packed" else None)
        return [(tg.param, s.id) for s in sel]
    return [(tg.param, "*")]


def uncovered(ns: Namespace, targets: Iterable[tuple[Target, ...]]) -> set[str]:
    covered = {a for ts in targets for tg in ts for a in atoms(ns, tg)}
    out = set()
    for spec in ns.params.values():
        g = ns.group_of(spec.name)
        if g is not None:
            full = atoms(ns, Target(spec.name, "experts", "w13" if spec.name == g.w13 else "w2"))
        else:
            full = atoms(ns, Target(spec.name, "param"))
        if not all(a in covered for a in full):
            out.add(spec.name)
    return out


_MAX_LISTED = 40


def resolution_error(problems: list[str], tail: str, total: int, ns: Namespace | None = None) -> ResolutionError:
    where = f" onto {ns.architecture}" if ns is not None and ns.architecture else ""
    shown = problems[:_MAX_LISTED]
    lines = "\n".join(f"  - {p}" for p in shown)
    if len(problems) > len(shown):
        lines += f"\n  ... and {len(problems) - len(shown)} more (all of them in the error's .problems)"
    err = ResolutionError(f"{len(problems)} problem(s) resolving {total} trainer tensor(s){where}; {tail}:\n{lines}")
    err.problems = list(problems)  # type: ignore[attr-defined]
    return err
