"""Expert weight layouts and their exact, in-place conversions.

A MoE layer's experts exist in four layouts, and a weight sync moves them from the first two to the last two:

* HF checkpoint, one 2-D tensor per expert: ``experts.{e}.gate_proj.weight`` [I, H], ``up_proj`` [I, H],
  ``down_proj`` [H, I];
* transformers-5 fused runtime: ``experts.gate_up_proj`` [E, 2I, H] (= ``[gate; up]`` on dim 1) and
  ``experts.down_proj`` [E, H, I];
* vLLM ``FusedMoE`` **preprocessed** (checkpoint-like, what ``RoutedExperts.weight_loader`` writes):
  ``w13_weight`` [E_local, 2*I_tp, H] (this rank's gate rows, then its up rows) and ``w2_weight`` [E_local, H, I_tp];
* **processed**, the kernel layout a backend may switch to after loading (vllm-ascend transposes):
  ``w13`` [E_local, H, 2*I_tp], ``w2`` [E_local, I_tp, H].

Tensor parallelism splits I: every rank keeps the same contiguous I/tp slice of gate *and* of up (vLLM's
``_load_w13`` narrows each shard separately, then places gate in the first half and up in the second half of the
rank's rows) and the same slice of down's I columns (``_load_w2``). Expert parallelism keeps a subset of the experts;
the global -> local map is vLLM's ``expert_map`` (``determine_expert_map``: contiguous "linear" blocks, the first
``E % ep`` ranks holding one more, or "round_robin").

The receiver's layout is *declared* (:class:`ExpertLayout`), never guessed from shapes: with I == H or 2I == H the
shapes cannot tell the layouts apart. The ``copy_*_`` writers fill the receiver's existing storage (a Parameter
keeps its identity, its ``weight_loader`` and every other attribute) with one ``copy_`` into a strided view when
the experts form a contiguous block, or one gather plus one ``index_copy_`` otherwise; per-expert tensors are
written with a single ``torch._foreach_copy_``. No Python loop over experts runs on the hot path.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from hwsync.common.errors import LayoutError
from hwsync.common.finite import copy_

__all__ = [
    "ExpertLayout",
    "ExpertSharding",
    "fuse_experts",
    "unfuse_experts",
    "hf_expert_weights",
    "fused_from_hf_expert_weights",
    "w13_from_fused",
    "w2_from_fused",
    "fused_from_w13",
    "fused_from_w2",
    "copy_w13_",
    "copy_w2_",
    "copy_expert_shard_",
    "copy_expert_shards_",
    "w13_shape",
    "w2_shape",
]

_SHARD_IDS = ("w1", "w2", "w3")
_HF_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class ExpertLayout(str, enum.Enum):
    """How the receiver stores its expert weights (a declared property of the receiver)."""

    PREPROCESSED = "preprocessed"  # w13 [E_local, 2*I_tp, H] (gate rows then up rows), w2 [E_local, H, I_tp]
    PROCESSED = "processed"  # w13 [E_local, H, 2*I_tp], w2 [E_local, I_tp, H] (vllm-ascend after post-load)


def _layout(layout: ExpertLayout | str) -> ExpertLayout:
    try:
        return ExpertLayout(layout)
    except ValueError:
        raise LayoutError(
            f"unknown expert layout {layout!r}; declare one of {[x.value for x in ExpertLayout]}"
        ) from None


@dataclass(frozen=True)
class ExpertSharding:
    """Which experts and which slice of I one receiver rank holds.

    ``expert_map`` follows vLLM: ``expert_map[global_id]`` is the local slot or -1. ``None`` means vLLM's default
    "linear" split (``determine_expert_map``): contiguous blocks, the first ``num_experts % ep_size`` ranks holding
    one expert more. EPLB redundant experts (one logical expert in several slots) are not representable.
    """

    num_experts: int
    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    expert_map: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.num_experts <= 0:
            raise LayoutError(f"num_experts must be positive, got {self.num_experts}")
        if self.tp_size <= 0 or not 0 <= self.tp_rank < self.tp_size:
            raise LayoutError(f"tp_rank must be in [0, tp_size): got tp_rank={self.tp_rank}, tp_size={self.tp_size}")
        if self.ep_size <= 0 or not 0 <= self.ep_rank < self.ep_size:
            raise LayoutError(f"ep_rank must be in [0, ep_size): got ep_rank={self.ep_rank}, ep_size={self.ep_size}")
        if self.expert_map is None:
            if self.ep_size > self.num_experts:
                raise LayoutError(
                    f"ep_size={self.ep_size} exceeds num_experts={self.num_experts}: some ranks would hold no expert"
                )
            return
        emap = tuple(int(x) for x in self.expert_map)
        object.__setattr__(self, "expert_map", emap)
        if len(emap) != self.num_experts:
            raise LayoutError(
                f"expert_map must have one entry per global expert: expected {self.num_experts}, got {len(emap)}"
            )
        local = sorted(x for x in emap if x != -1)
        if local != list(range(len(local))) or any(x < -1 for x in emap):
            raise LayoutError(
                f"expert_map must map each local slot 0..n-1 exactly once and use -1 for remote experts; got {emap}"
            )

    # -- construction helpers -------------------------------------------------------------------------------------
    @classmethod
    def with_placement(
        cls,
        num_experts: int,
        *,
        ep_size: int,
        ep_rank: int,
        placement: str = "linear",
        tp_size: int = 1,
        tp_rank: int = 0,
    ) -> ExpertSharding:
        """Build the ``expert_map`` vLLM's ``determine_expert_map`` computes for ``placement``
        ("linear"/"round_robin")."""
        if ep_size <= 0 or not 0 <= ep_rank < ep_size:
            raise LayoutError(f"ep_rank must be in [0, ep_size): got ep_rank={ep_rank}, ep_size={ep_size}")
        base, rem = divmod(num_experts, ep_size)
        n_local = base + 1 if ep_rank < rem else base
        emap = [-1] * num_experts
        if placement == "linear":
            start = ep_rank * base + min(ep_rank, rem)
            ids = range(start, start + n_local)
        elif placement == "round_robin":
            ids = range(ep_rank, num_experts, ep_size)
        else:
            raise LayoutError(f"unknown expert placement {placement!r}; use 'linear' or 'round_robin'")
        for local, g in enumerate(ids):
            emap[g] = local
        return cls(num_experts, tp_size, tp_rank, ep_size, ep_rank, None if ep_size == 1 else tuple(emap))

    @classmethod
    def from_vllm(cls, experts: Any) -> ExpertSharding:
        """Read the sharding of a live vLLM ``RoutedExperts`` (or the ``MoERunner``/``FusedMoE`` owning it).

        Duck-typed: no vLLM import. Refuses EPLB redundant experts, whose slots do not map 1:1 to experts.
        """
        routed = getattr(experts, "routed_experts", experts)
        cfg = getattr(routed, "moe_config", None)
        if cfg is None:
            raise LayoutError(f"{type(experts).__name__} has no moe_config; pass a vLLM RoutedExperts/FusedMoE layer")
        par = cfg.moe_parallel_config
        num = int(cfg.num_experts)
        logical = int(getattr(cfg, "num_logical_experts", num))
        if logical != num:
            raise LayoutError(
                f"EPLB redundant experts ({num - logical} extra slots) are not supported by the stacked writers; "
                "disable EPLB or load through vLLM's weight_loader"
            )
        emap = getattr(routed, "expert_map", None)
        emap_t = None if emap is None else tuple(int(x) for x in emap.tolist()[:num])
        return cls(num, int(par.tp_size), int(par.tp_rank), int(par.ep_size), int(par.ep_rank), emap_t)

    # -- queries --------------------------------------------------------------------------------------------------
    @functools.cached_property
    def local_experts(self) -> tuple[int, ...]:
        """Global ids of this rank's experts, in local slot order."""
        if self.expert_map is not None:
            slots = sorted((loc, g) for g, loc in enumerate(self.expert_map) if loc != -1)
            return tuple(g for _, g in slots)
        base, rem = divmod(self.num_experts, self.ep_size)
        n_local = base + 1 if self.ep_rank < rem else base
        start = self.ep_rank * base + min(self.ep_rank, rem)
        return tuple(range(start, start + n_local))

    @property
    def num_local_experts(self) -> int:
        return len(self.local_experts)

    @functools.cached_property
    def _global_to_local(self) -> dict[int, int]:
        return {g: i for i, g in enumerate(self.local_experts)}

    def local_id(self, global_id: int) -> int:
        """Local slot of ``global_id`` or -1 when another rank holds it (vLLM's convention)."""
        if not 0 <= global_id < self.num_experts:
            raise LayoutError(f"expert id {global_id} out of range [0, {self.num_experts})")
        return self._global_to_local.get(global_id, -1)

    def tp_slice(self, size: int, what: str = "intermediate size") -> tuple[int, int]:
        """(start, length) of this rank's slice of a dimension of ``size`` split over tp ranks."""
        if size % self.tp_size:
            raise LayoutError(
                f"{what} {size} is not divisible by tp_size={self.tp_size}; vLLM pads such shards, which the exact "
                "stacked writers refuse: pick a tp_size that divides it"
            )
        per = size // self.tp_size
        return self.tp_rank * per, per


# ---------------------------------------------------------------------------------------------------------------
# HF per-expert <-> transformers-5 fused
# ---------------------------------------------------------------------------------------------------------------
def _stack(x: Tensor | Sequence[Tensor], what: str) -> Tensor:
    if isinstance(x, Tensor):
        if x.dim() != 3:
            raise LayoutError(f"{what} must be [E, rows, cols] or a list of 2-D tensors; got shape {tuple(x.shape)}")
        return x
    xs = list(x)
    if not xs or any(t.dim() != 2 or t.shape != xs[0].shape for t in xs):
        raise LayoutError(f"{what}: expected a non-empty list of equal 2-D tensors, got {[tuple(t.shape) for t in xs]}")
    return torch.stack(xs)


def fuse_experts(
    gate: Tensor | Sequence[Tensor], up: Tensor | Sequence[Tensor], down: Tensor | Sequence[Tensor]
) -> tuple[Tensor, Tensor]:
    """HF per-expert (``[E, I, H]`` x2 and ``[E, H, I]``, or lists of 2-D) -> fused ``gate_up [E, 2I, H]``, ``down``."""
    g, u, d = _stack(gate, "gate"), _stack(up, "up"), _stack(down, "down")
    if g.shape != u.shape:
        raise LayoutError(f"gate and up must have the same shape: got {tuple(g.shape)} vs {tuple(u.shape)}")
    e, i, h = g.shape
    if tuple(d.shape) != (e, h, i):
        raise LayoutError(f"down must be [E, H, I] = {(e, h, i)}, got {tuple(d.shape)}")
    return torch.cat([g, u], dim=1), d


def unfuse_experts(gate_up: Tensor, down: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Fused -> (gate [E, I, H], up [E, I, H], down [E, H, I]); gate and up are views of ``gate_up``."""
    e, i, h = _fused_dims(gate_up)
    if tuple(down.shape) != (e, h, i):
        raise LayoutError(f"down must be [E, H, I] = {(e, h, i)}, got {tuple(down.shape)}")
    gate, up = gate_up.chunk(2, dim=1)
    return gate, up, down


def _prefix(prefix: str) -> str:
    return prefix if not prefix or prefix.endswith(".") else prefix + "."


def hf_expert_weights(gate_up: Tensor, down: Tensor, prefix: str = "") -> dict[str, Tensor]:
    """Fused -> HF checkpoint names ``{prefix}{e}.{gate,up,down}_proj.weight`` (views, no copy)."""
    gate, up, dn = unfuse_experts(gate_up, down)
    p = _prefix(prefix)
    out: dict[str, Tensor] = {}
    for e in range(gate.shape[0]):
        out[f"{p}{e}.gate_proj.weight"] = gate[e]
        out[f"{p}{e}.up_proj.weight"] = up[e]
        out[f"{p}{e}.down_proj.weight"] = dn[e]
    return out


def fused_from_hf_expert_weights(
    weights: Mapping[str, Tensor], prefix: str = "", num_experts: int | None = None
) -> tuple[Tensor, Tensor]:
    """HF per-expert checkpoint names -> fused ``(gate_up, down)``; every expert must be present."""
    p = _prefix(prefix)
    found: dict[int, dict[str, Tensor]] = {}
    for name, t in weights.items():
        if not name.startswith(p):
            continue
        parts = name[len(p) :].split(".")
        if len(parts) == 3 and parts[0].isdigit() and parts[2] == "weight" and parts[1] in _HF_PROJ.values():
            found.setdefault(int(parts[0]), {})[parts[1]] = t
    n = num_experts if num_experts is not None else (max(found) + 1 if found else 0)
    missing = [f"{p}{e}.{proj}.weight" for e in range(n) for proj in _HF_PROJ.values() if proj not in found.get(e, {})]
    if n == 0 or missing:
        raise LayoutError(
            f"per-expert weights incomplete under {p!r}: missing {missing[:6]}{'...' if len(missing) > 6 else ''}"
        )
    return fuse_experts(
        [found[e]["gate_proj"] for e in range(n)],
        [found[e]["up_proj"] for e in range(n)],
        [found[e]["down_proj"] for e in range(n)],
    )


# ---------------------------------------------------------------------------------------------------------------
# fused <-> vLLM w13 / w2
# ---------------------------------------------------------------------------------------------------------------
def _fused_dims(gate_up: Tensor) -> tuple[int, int, int]:
    if gate_up.dim() != 3 or gate_up.shape[1] % 2:
        raise LayoutError(f"gate_up must be [E, 2I, H] with an even dim 1, got {tuple(gate_up.shape)}")
    e, i2, h = gate_up.shape
    return e, i2 // 2, h


def w13_shape(
    sharding: ExpertSharding, intermediate: int, hidden: int, layout: ExpertLayout | str
) -> tuple[int, int, int]:
    """Receiver w13 shape for the full (un-split) ``intermediate`` size."""
    _, per = sharding.tp_slice(intermediate)
    n = sharding.num_local_experts
    return (n, 2 * per, hidden) if _layout(layout) is ExpertLayout.PREPROCESSED else (n, hidden, 2 * per)


def w2_shape(
    sharding: ExpertSharding, intermediate: int, hidden: int, layout: ExpertLayout | str
) -> tuple[int, int, int]:
    """Receiver w2 shape for the full (un-split) ``intermediate`` size."""
    _, per = sharding.tp_slice(intermediate)
    n = sharding.num_local_experts
    return (n, hidden, per) if _layout(layout) is ExpertLayout.PREPROCESSED else (n, per, hidden)


def _pre_view(dst: Tensor, layout: ExpertLayout) -> Tensor:
    """The receiver tensor seen in preprocessed orientation (a transposed view for the processed layout)."""
    if dst.dim() != 3:
        raise LayoutError(f"expert weights must be 3-D [E_local, ., .], got shape {tuple(dst.shape)}")
    return dst if layout is ExpertLayout.PREPROCESSED else dst.transpose(1, 2)


@dataclass(frozen=True)
class _Selection:
    """Which rows of an incoming expert stack land in which local slots, and the cheapest way to move them.

    ``strided``: source rows and destination slots are both arithmetic progressions (vLLM's linear and round-robin
    placements, any TP slice): one ``copy_`` between two strided views. ``gather``: destination slots form one
    contiguous run (after sorting): one ``index_select`` straight into it. Otherwise ``index_copy_``.
    """

    count: int
    mode: str  # "none" | "strided" | "gather" | "scatter"
    src: tuple[int, int]  # strided: (start, step)
    dst: tuple[int, int]  # strided / gather: (start, step)
    src_index: Tensor | None = None
    dst_index: Tensor | None = None
    _on_device: dict[tuple[str, torch.device], Tensor] = field(default_factory=dict, compare=False, repr=False)

    def index(self, which: str, device: torch.device) -> Tensor:
        """The src/dst index on ``device``, copied there once (no host->device copy per write)."""
        key = (which, device)
        t = self._on_device.get(key)
        if t is None:
            base = self.src_index if which == "src" else self.dst_index
            assert base is not None
            t = self._on_device[key] = base.to(device)
        return t


def _progression(xs: list[int]) -> tuple[int, int] | None:
    if len(xs) == 1:
        return xs[0], 1
    step = xs[1] - xs[0]
    if step <= 0 or any(b - a != step for a, b in zip(xs, xs[1:])):
        return None
    return xs[0], step


@functools.lru_cache(maxsize=4096)
def _selection(sharding: ExpertSharding, experts: tuple[int, ...] | None, n_rows: int) -> _Selection:
    carried = range(sharding.num_experts) if experts is None else experts
    if experts is None and n_rows != sharding.num_experts:
        raise LayoutError(
            f"expected all {sharding.num_experts} experts on dim 0 (pass experts=... for a subset), got {n_rows}"
        )
    if experts is not None:
        if len(experts) != n_rows:
            raise LayoutError(f"experts lists {len(experts)} ids but the tensor carries {n_rows} experts on dim 0")
        if len(set(experts)) != len(experts):
            raise LayoutError(f"duplicate expert ids in {list(experts)}")
    pairs = sorted((loc, pos) for pos, g in enumerate(carried) if (loc := sharding.local_id(int(g))) >= 0)
    if not pairs:
        return _Selection(0, "none", (0, 1), (0, 1))
    dst = [d for d, _ in pairs]
    src = [p for _, p in pairs]
    ps, pd = _progression(src), _progression(dst)
    if ps is not None and pd is not None:
        return _Selection(len(pairs), "strided", ps, pd)
    src_index = torch.tensor(src, dtype=torch.long)
    if pd is not None and pd[1] == 1:
        return _Selection(len(pairs), "gather", (0, 1), pd, src_index)
    return _Selection(len(pairs), "scatter", (0, 1), (0, 1), src_index, torch.tensor(dst, dtype=torch.long))


def _rows(t: Tensor, start: int, step: int, count: int) -> Tensor:
    return t[start : start + step * (count - 1) + 1 : step]


def _scatter_rows(dst_view: Tensor, src: Tensor, sel: _Selection) -> None:
    """``dst_view[slots] = src[rows]`` with one kernel where the selection allows it (see :class:`_Selection`)."""
    with torch.no_grad():
        if sel.mode == "strided":
            copy_(_rows(dst_view, *sel.dst, sel.count), _rows(src, *sel.src, sel.count))  # NaN/Inf checked there
            return
        if sel.mode == "gather":
            region = _rows(dst_view, *sel.dst, sel.count)
            same = src.device == region.device and src.dtype == region.dtype and region.is_contiguous()
            if same:
                torch.index_select(src, 0, sel.index("src", src.device), out=region)
            else:
                region.copy_(src.index_select(0, sel.index("src", src.device)))
            return
        rows = src.index_select(0, sel.index("src", src.device))
        if rows.device != dst_view.device or rows.dtype != dst_view.dtype:
            rows = rows.to(device=dst_view.device, dtype=dst_view.dtype, non_blocking=True)
        dst_view.index_copy_(0, sel.index("dst", dst_view.device), rows)


def _experts_key(experts: Sequence[int] | Tensor | None) -> tuple[int, ...] | None:
    if experts is None:
        return None
    if isinstance(experts, Tensor):
        return tuple(int(x) for x in experts.tolist())
    return tuple(int(x) for x in experts)


def _check_shape(
    what: str, got: torch.Size, expected: tuple[int, ...], layout: ExpertLayout, sharding: ExpertSharding
) -> None:
    if tuple(got) != tuple(expected):
        raise LayoutError(
            f"{what}: receiver tensor has shape {tuple(got)} but layout={layout.value}, tp={sharding.tp_size}, "
            f"ep={sharding.ep_size} ({sharding.num_local_experts} local experts) expects {tuple(expected)}; "
            "check the declared layout/sharding of the receiver"
        )


def copy_w13_(
    dst: Tensor,
    gate_up: Tensor,
    sharding: ExpertSharding,
    layout: ExpertLayout | str,
    experts: Sequence[int] | Tensor | None = None,
) -> int:
    """Write fused ``gate_up`` rows ([n, 2I, H], global ids ``experts``; None = all E) into the receiver's w13.

    Keeps ``dst``'s storage (in place); experts held by other EP ranks are skipped. Returns #experts written.
    """
    lay = _layout(layout)
    e, i, h = _fused_dims(gate_up)
    start, per = sharding.tp_slice(i)
    pre = _pre_view(dst, lay)
    _check_shape("w13", dst.shape, w13_shape(sharding, i, h, lay), lay, sharding)
    sel = _selection(sharding, _experts_key(experts), e)
    if sel.count:
        src = gate_up.unflatten(1, (2, i)).narrow(2, start, per)  # [n, 2, I_tp, H]: gate slice, up slice
        _scatter_rows(pre.unflatten(1, (2, per)), src, sel)
    return sel.count


def copy_w2_(
    dst: Tensor,
    down: Tensor,
    sharding: ExpertSharding,
    layout: ExpertLayout | str,
    experts: Sequence[int] | Tensor | None = None,
) -> int:
    """Write fused ``down`` rows ([n, H, I], global ids ``experts``) into the receiver's w2, in place."""
    lay = _layout(layout)
    if down.dim() != 3:
        raise LayoutError(f"down must be [E, H, I], got {tuple(down.shape)}")
    e, h, i = down.shape
    start, per = sharding.tp_slice(i)
    pre = _pre_view(dst, lay)
    _check_shape("w2", dst.shape, w2_shape(sharding, i, h, lay), lay, sharding)
    sel = _selection(sharding, _experts_key(experts), e)
    if sel.count:
        _scatter_rows(pre, down.narrow(2, start, per), sel)
    return sel.count


def w13_from_fused(gate_up: Tensor, sharding: ExpertSharding, layout: ExpertLayout | str) -> Tensor:
    """This rank's w13 as a new contiguous tensor."""
    _, i, h = _fused_dims(gate_up)
    out = gate_up.new_empty(w13_shape(sharding, i, h, layout))
    copy_w13_(out, gate_up, sharding, layout)
    return out


def w2_from_fused(down: Tensor, sharding: ExpertSharding, layout: ExpertLayout | str) -> Tensor:
    """This rank's w2 as a new contiguous tensor."""
    if down.dim() != 3:
        raise LayoutError(f"down must be [E, H, I], got {tuple(down.shape)}")
    _, h, i = down.shape
    out = down.new_empty(w2_shape(sharding, i, h, layout))
    copy_w2_(out, down, sharding, layout)
    return out


def _gather_fused(
    shards: Sequence[Tensor], shardings: Sequence[ExpertSharding], layout: ExpertLayout | str, which: str
) -> Tensor:
    lay = _layout(layout)
    if len(shards) != len(shardings) or not shards:
        raise LayoutError(f"need one sharding per shard: got {len(shards)} shards and {len(shardings)} shardings")
    e, tp = shardings[0].num_experts, shardings[0].tp_size
    if any(s.num_experts != e or s.tp_size != tp for s in shardings):
        raise LayoutError("all shards must describe the same num_experts and tp_size")
    pre0 = _pre_view(shards[0], lay)
    if which == "w13":
        h, per = pre0.shape[2], pre0.shape[1] // 2
        out = pre0.new_empty((e, 2 * per * tp, h))
    else:
        h, per = pre0.shape[1], pre0.shape[2]
        out = pre0.new_empty((e, h, per * tp))
    covered: set[tuple[int, int]] = set()
    for shard, sh in zip(shards, shardings):
        pre = _pre_view(shard, lay)
        i = per * tp
        start, _ = sh.tp_slice(i)
        expected = w13_shape(sh, i, h, lay) if which == "w13" else w2_shape(sh, i, h, lay)
        _check_shape(which, shard.shape, expected, lay, sh)
        local = sh.local_experts
        sel = _selection(ExpertSharding(e), local, len(local))  # local slot k -> global row local[k]
        if which == "w13":
            _scatter_rows(out.unflatten(1, (2, i)).narrow(2, start, per), pre.unflatten(1, (2, per)), sel)
        else:
            _scatter_rows(out.narrow(2, start, per), pre, sel)
        covered.update((g, sh.tp_rank) for g in local)
    missing = [(g, r) for g in range(e) for r in range(tp) if (g, r) not in covered]
    if missing:
        raise LayoutError(
            f"shards do not cover every (expert, tp_rank): missing {missing[:8]}{'...' if len(missing) > 8 else ''}"
        )
    return out


def fused_from_w13(shards: Sequence[Tensor], shardings: Sequence[ExpertSharding], layout: ExpertLayout | str) -> Tensor:
    """Inverse of :func:`w13_from_fused` over all ranks: rebuild ``gate_up`` [E, 2I, H]."""
    return _gather_fused(shards, shardings, layout, "w13")


def fused_from_w2(shards: Sequence[Tensor], shardings: Sequence[ExpertSharding], layout: ExpertLayout | str) -> Tensor:
    """Inverse of :func:`w2_from_fused` over all ranks: rebuild ``down`` [E, H, I]."""
    return _gather_fused(shards, shardings, layout, "w2")


# ---------------------------------------------------------------------------------------------------------------
# single per-expert shards (HF checkpoint tensors), the weight_loader-shaped path
# ---------------------------------------------------------------------------------------------------------------
def _shard_views(
    dst: Tensor, tensor: Tensor, shard_id: str, expert_id: int, sharding: ExpertSharding, lay: ExpertLayout
) -> tuple[Tensor, Tensor] | None:
    if shard_id not in _SHARD_IDS:
        raise LayoutError(f"shard_id must be one of {_SHARD_IDS}, got {shard_id!r}")
    loc = sharding.local_id(int(expert_id))
    if tensor.dim() != 2:
        raise LayoutError(f"expert {expert_id} {shard_id}: expected a 2-D tensor, got shape {tuple(tensor.shape)}")
    pre = _pre_view(dst, lay)
    if shard_id == "w2":
        h, i = tensor.shape
        start, per = sharding.tp_slice(i)
        _check_shape("w2", dst.shape, w2_shape(sharding, i, h, lay), lay, sharding)
        if loc < 0:
            return None
        return pre[loc], tensor.narrow(1, start, per)
    i, h = tensor.shape
    start, per = sharding.tp_slice(i)
    _check_shape("w13", dst.shape, w13_shape(sharding, i, h, lay), lay, sharding)
    if loc < 0:
        return None
    half = 0 if shard_id == "w1" else per
    return pre[loc].narrow(0, half, per), tensor.narrow(0, start, per)


def copy_expert_shard_(
    dst: Tensor,
    tensor: Tensor,
    shard_id: str,
    expert_id: int,
    sharding: ExpertSharding,
    layout: ExpertLayout | str,
) -> bool:
    """Write one full HF expert tensor (w1=gate [I, H], w3=up [I, H], w2=down [H, I]) into w13/w2 in place.

    Mirrors ``RoutedExperts.weight_loader``: returns False (nothing written) when the expert lives on another rank.
    """
    views = _shard_views(dst, tensor, shard_id, expert_id, sharding, _layout(layout))
    if views is None:
        return False
    with torch.no_grad():
        views[0].copy_(views[1])
    return True


def copy_expert_shards_(
    dst: Tensor,
    items: Iterable[tuple[int, str, Tensor]],
    sharding: ExpertSharding,
    layout: ExpertLayout | str,
) -> int:
    """Write many ``(expert_id, shard_id, tensor)`` HF expert tensors with one ``torch._foreach_copy_``.

    All items target the same receiver tensor: w1/w3 items go to w13, w2 items to w2 (mixing them is refused).
    Returns #tensors written (remote experts are skipped).
    """
    lay = _layout(layout)
    items = list(items)
    if not items:
        return 0
    shard_ids = {sid for _, sid, _ in items}
    if not shard_ids <= set(_SHARD_IDS):
        raise LayoutError(f"shard_id must be one of {_SHARD_IDS}, got {sorted(shard_ids - set(_SHARD_IDS))}")
    if "w2" in shard_ids and len(shard_ids) > 1:
        raise LayoutError("copy_expert_shards_: w2 and w1/w3 tensors target different receivers; split the call")
    shapes = {tuple(t.shape) for _, _, t in items}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise LayoutError(f"copy_expert_shards_: expected 2-D tensors of one shape, got {sorted(shapes)}")
    rows, cols = next(iter(shapes))
    pre = _pre_view(dst, lay)
    # Validate once, then build every destination view in C++ (unbind) instead of per item in Python.
    if shard_ids == {"w2"}:
        start, per = sharding.tp_slice(cols)
        _check_shape("w2", dst.shape, w2_shape(sharding, cols, rows, lay), lay, sharding)
        targets = {"w2": pre.unbind(0)}
        dim = 1
    else:
        start, per = sharding.tp_slice(rows)
        _check_shape("w13", dst.shape, w13_shape(sharding, rows, cols, lay), lay, sharding)
        halves = pre.unflatten(1, (2, per))
        targets = {"w1": halves.select(1, 0).unbind(0), "w3": halves.select(1, 1).unbind(0)}
        dim = 0
    whole = sharding.tp_size == 1
    g2l = sharding._global_to_local
    dsts: list[Tensor] = []
    srcs: list[Tensor] = []
    for expert_id, shard_id, tensor in items:
        if not 0 <= expert_id < sharding.num_experts:
            raise LayoutError(f"expert id {expert_id} out of range [0, {sharding.num_experts})")
        loc = g2l.get(expert_id, -1)
        if loc < 0:
            continue
        dsts.append(targets[shard_id][loc])
        srcs.append(tensor if whole else tensor.narrow(dim, start, per))
    if dsts:
        with torch.no_grad():
            torch._foreach_copy_(dsts, srcs)
    return len(dsts)
