"""In-place writes of base weights: one copy per tensor into the storage the engine's kernels read.

vLLM's reload path (``reload_weights``) is always correct but slow: it restores every layer in checkpoint format,
calls each parameter's loader once per expert and projection, re-runs post-load processing and copies the result
back. Where the kernels read a parameter exactly as checkpoint layout puts it, all of that is a copy: this module
writes those parameters directly (:meth:`hwsync.engine.names.NameMap.apply`: TP slices, packed rows, fused experts
through :mod:`hwsync.common.layouts`) and leaves every other layer to the reload path.

A parameter is written in place only when both hold:

* **Its module is known to read it as stored** (:func:`why_not_direct`): unquantized linears / embeddings on CUDA
  (vLLM repacks them on CPU), unquantized fused MoE with the Triton kernel on CUDA (the CPU kernel prepacks into the
  parameter itself), plain modules without post-load processing (norms). Never a parameter another layer derives
  weights from after loading (MLA's ``kv_b_proj``).
* **It was proven on this engine**: the first sync of a plan goes through vLLM's own reload; meanwhile a checksum of
  what the in-place writer *would* have written is taken per parameter region, and after the reload it is compared
  with what vLLM actually left in the parameter. Only parameters that match are written in place afterwards.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from hwsync.common.finite import deferred
from hwsync.common.layouts import w2_from_fused, w13_from_fused

__all__ = ["Calibration", "DirectWriter", "raw_writable", "why_not_direct"]

logger = logging.getLogger("hwsync.vllm")

_CHUNK = 1 << 24
_MLA_CONSUMED = ("kv_b_proj",)


def _platform() -> str:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_cuda():
        return "cuda"
    return str(getattr(current_platform, "device_type", "") or "other")


def why_not_direct(module: torch.nn.Module, param_name: str, mla_consumed: set[int]) -> str | None:
    """``None`` when the kernels of ``module`` read ``param_name`` as stored; otherwise why not."""
    if id(module) in mla_consumed:
        return "MLA attention derives weights from it after loading"
    qm = getattr(module, "quant_method", None)
    while type(qm).__name__ == "FusedMoEModularMethod":  # the LoRA-enabled wrapper reads the same parameters
        qm = getattr(qm, "old_quant_method", None)
    platform = _platform()
    if qm is None:
        if "process_weights_after_loading" in type(module).__dict__:
            return f"{type(module).__name__} processes its weights after loading"
        return None
    kind = type(qm).__name__
    if kind in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"):
        return None if platform == "cuda" else f"{kind} repacks weights on {platform}"
    if kind == "UnquantizedFusedMoEMethod":
        backend = getattr(getattr(qm, "unquantized_backend", None), "name", "")
        if backend == "TRITON" and platform == "cuda":
            return None
        return f"fused MoE backend {backend or '?'} on {platform} keeps a kernel-specific layout"
    return f"{kind} (quantized or custom) weights"


def mla_consumed_modules(model: torch.nn.Module) -> set[int]:
    out: set[int] = set()
    for m in model.modules():
        if "MLA" in type(m).__name__:
            for attr in _MLA_CONSUMED:
                sub = getattr(m, attr, None)
                if isinstance(sub, torch.nn.Module):
                    out.add(id(sub))
    return out


def owner_module(model: torch.nn.Module, live_name: str) -> torch.nn.Module:
    return model.get_submodule(live_name.rsplit(".", 1)[0]) if "." in live_name else model


def eligible_names(model: torch.nn.Module, name_map: Any) -> tuple[dict[str, str], dict[str, str]]:
    """(trainer name -> live parameters it writes, for names whose every target is direct-eligible;
    trainer name -> why not, for the others)."""
    ns = name_map.namespace
    mla = mla_consumed_modules(model)
    out: dict[str, str] = {}
    why: dict[str, str] = {}
    for name, targets in name_map.entries.items():
        reason = None
        for tg in targets:
            if tg.kind in ("loader", "routed"):
                reason = "in the model's own checkpoint layout, which only vLLM's loader converts"
            elif tg.kind == "expert" or (tg.kind == "experts" and tg.expert_ids is not None):
                reason = "per-expert tensors (only whole fused expert tensors are written in place)"
            elif tg.kind in ("param", "packed") and not ns.spec_of(tg.param).sharding_known:
                reason = f"{tg.param}: vLLM shards it with a loader hwsync cannot read"
            elif tg.kind == "experts" and ((g := ns.group_of(tg.param)) is None or g.sharding is None):
                # the stacked writers need the group's sharding; groups without one (non-gated experts: Nemotron-H,
                # or a layout hwsync cannot read) go through vLLM's reload (an H100 run hit the writer's assert)
                reason = (g.unwritable if g is not None else None) or "expert group not writable"
            else:
                reason = why_not_direct(owner_module(model, tg.param), tg.param, mla)
            if reason is not None:
                break
        if reason is None:
            out[name] = ",".join(tg.param for tg in targets)
        else:
            why[name] = reason
    return out, why


def raw_writable(model: torch.nn.Module, name_map: Any, raw: dict[str, str]) -> None:
    """Refuse (one :class:`~hwsync.common.errors.ResolutionError`, before any write) names the model's loader copies
    itself (``raw``, see :func:`hwsync.engine.vllm.dry_run.dry_run_load`) where hwsync cannot write them in place: a
    kernel that reads a processed copy, or a split hwsync cannot read. vLLM's reload cannot write them either."""
    from hwsync.common.errors import ResolutionError

    mla = mla_consumed_modules(model)
    problems = []
    for name in sorted(raw):
        for tg in name_map.entries[name]:
            why = why_not_direct(owner_module(model, tg.param), tg.param, mla)
            if why is None and not name_map.namespace.spec_of(tg.param).sharding_known:
                why = "vLLM shards it with a loader hwsync cannot read"
            if why is not None:
                problems.append(f"{name} -> {tg.param}: {why}")
    if problems:
        raise ResolutionError(
            f"{len(problems)} tensor(s) are written by the model's own load_weights with a plain copy, which vLLM's "
            f"reload_weights cannot see, and hwsync cannot write them in place either: {'; '.join(problems[:3])}. "
            "Sync them with a fresh engine (restart vLLM from a checkpoint) or leave them out of the sync"
        )


def _checksum(x: Tensor) -> tuple[float, float]:
    """A position-weighted float64 sum and the magnitude it is compared at (layout and value sensitive)."""
    flat = x.reshape(-1)
    total = magnitude = 0.0
    for start in range(0, flat.numel(), _CHUNK):
        c = flat[start : start + _CHUNK].to(torch.float64)
        i = torch.arange(start, start + c.numel(), device=c.device, dtype=torch.int64)
        w = ((i * 2654435761) % 4294967291).to(torch.float64) / 4294967291.0 - 0.5
        total += float((c * w).sum())
        magnitude += float(c.abs().sum())
    return total, magnitude


def write_pieces(name_map: Any, tg: Any, t: Tensor, live: Tensor) -> list[tuple[Tensor, Tensor]]:
    """(destination view of ``live``, what the in-place writer puts there) for one target of ``t``."""
    if tg.kind in ("param", "packed"):
        dsts: list[Tensor] = []
        srcs: list[Tensor] = []
        name_map._dense_pieces(tg, t, live, dsts, srcs)
        return list(zip(dsts, srcs))
    g = name_map.namespace.group_of(tg.param)
    assert g is not None and g.sharding is not None
    make = w13_from_fused if tg.shard_id == "w13" else w2_from_fused
    return [(live, make(t, g.sharding, g.layout))]


@dataclass
class Calibration:
    """Checksums of what the in-place writer would write, taken while vLLM's reload writes the real thing."""

    name_map: Any
    eligible: dict[str, str]
    live: dict[str, Tensor]
    expected: dict[str, list[tuple[str, tuple[float, float]]]] = field(default_factory=dict)

    def observe(self, name: str, t: Tensor) -> None:
        if name not in self.eligible:
            return
        sums = []
        with torch.no_grad():
            for tg in self.name_map.entries[name]:
                live = self.live[tg.param]
                for dst, src in write_pieces(self.name_map, tg, t, live):
                    sums.append((tg.param, _checksum(src.to(dst.dtype))))
        self.expected[name] = sums

    def proven(self) -> set[str]:
        """Names whose every piece holds, after the reload, exactly what the in-place writer would have put."""
        ok: set[str] = set()
        with torch.no_grad():
            for name, sums in self.expected.items():
                shape = tuple(self.name_map.manifest[name][0])
                actual = [
                    _checksum(dst)
                    for tg in self.name_map.entries[name]
                    for dst in _destinations(self.name_map, tg, shape, self.live[tg.param])
                ]
                if len(actual) == len(sums) and all(_same(a, e) for a, (_, e) in zip(actual, sums)):
                    ok.add(name)
        return ok


def _same(a: tuple[float, float], b: tuple[float, float]) -> bool:
    tol = 1e-9 * max(a[1], b[1]) + 1e-30
    return abs(a[0] - b[0]) <= tol and abs(a[1] - b[1]) <= tol


def _destinations(name_map: Any, tg: Any, src_shape: tuple[int, ...], live: Tensor) -> list[Tensor]:
    """The views of ``live`` a target writes (the geometry of :func:`write_pieces` without the source data)."""
    if tg.kind not in ("param", "packed"):
        return [live]
    stand_in = torch.zeros((), dtype=live.dtype, device=live.device).expand(src_shape)
    return [dst for dst, _ in write_pieces(name_map, tg, stand_in, live)]


@dataclass
class DirectWriter:
    """Writes the proven names in place; hands every other name on to vLLM's reload path."""

    name_map: Any
    names: frozenset[str]
    live: dict[str, Tensor]

    def split(self, weights: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """Write the direct names as they arrive; yield the rest (for vLLM's reload)."""
        with torch.no_grad():
            for name, t in weights:
                if name in self.names:
                    dtype = self.name_map.manifest[name][1]
                    if t.dtype != dtype and t.is_floating_point():  # colocate hands the trainer's dtype; vLLM's
                        t = t.to(dtype)  # loaders cast on copy, and so must the in-place writer (bf16 engines)
                    with deferred():  # this bucket's checked copies launch together when it closes
                        self.name_map.apply([(name, t)], self.live)
                else:
                    yield name, t
