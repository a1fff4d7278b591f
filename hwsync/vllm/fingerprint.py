"""Engine half of :mod:`hwsync.fingerprint`: what one worker's kernels read, fingerprinted through the sync plan.

Runs in the worker (``collective_rpc``). For every trainer name the trainer asks about:

* **Base tensors**: resolved with the same :mod:`hwsync.names` plan a sync uses; the probe goes through the plan's
  own writers (:func:`hwsync.vllm.direct.write_pieces`: TP slices, packed q/k/v rows, fused experts in the engine's
  layout). What the kernels read is taken where they read it: the parameter itself; on vLLM's CPU build a linear's
  weight is handed to oneDNN / a packed kernel and emptied, so the kernel is asked (``cpu_linear`` on an identity
  matrix gives ``W^T`` exactly: every product is by 1.0, every sum adds zeros); MoE experts whose kernel prepacks
  them (CPU grouped GEMM, or any backend with a ``process_weights_after_loading``) get the probe sent through the
  same post-load step (a pure data movement), so a skipped post-load step shows as a mismatch. Experts whose kernel
  reads them as stored (:func:`hwsync.vllm.direct.why_not_direct`: Triton on CUDA) are read as they are.
* **Adapter**: the installed adapter's id and its slot; every LoRA wrapper's slot is compared with what vLLM's own
  ``set_lora`` writes from the installed ``LoRAModel`` (then put back as it was), and the ``LoRAModel``'s tensors are
  mapped back to the trainer's wire tensors with the gathers of :class:`hwsync.vllm.lora_slots.SlotWriter` (the
  adapter's sync plan, traced on vLLM's own construction code).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from hwsync.fingerprint import dot, probe

__all__ = ["fingerprints"]


def fingerprints(worker: Any, request: Mapping[str, Any]) -> dict[str, Any]:
    """``request``: ``seed``, ``base`` ([name, shape, dtype] of trainer tensors), ``lora`` (None or ``keys``,
    ``shapes``, ``meta``). Returns the receiver state plus ``base``/``lora``: name -> [value, magnitude] or a
    string saying why that tensor cannot be read back here."""
    from hwsync.vllm.worker import receiver_of, unwrap_worker

    w = unwrap_worker(worker)
    rec = receiver_of(w)
    st = rec.refresh()
    out: dict[str, Any] = {"version": st.version, "stale": st.stale, "lora_int_id": st.lora_int_id,
                           "lora_name": st.lora_name, "base": {}, "lora": None}
    seed = int(request.get("seed", 0))
    with torch.no_grad():
        if request.get("base"):
            out["base"] = _base(w, rec.applier, request["base"], seed)
        if request.get("lora") is not None:
            out["lora"] = _lora(w, rec.applier, st.lora_int_id, request["lora"], seed)
    return out


# -- base weights ------------------------------------------------------------------------------------------------
def _base(w: Any, applier: Any, specs_in: list[Any], seed: int) -> dict[str, Any]:
    from hwsync.vllm.applier import model_of
    from hwsync.wire import TensorSpec, dtype_from_name

    specs = [TensorSpec(n, tuple(s), dtype_from_name(d), "base") for n, s, d in specs_in]
    key = "base:" + json.dumps(specs_in)
    cache = w.__dict__.setdefault("_hwsync_fp_plans", {})
    model = model_of(w)
    cached = cache.get(key)
    if cached is None:
        from hwsync.vllm.dry_run import dry_run_load

        name_map = applier._names_plan(specs, cast=True)
        transformed: set[str] = set()  # computed by the model's load_weights, not laid out: no probe can follow
        dry_run_load(model, specs, name_map, transformed=transformed, raw={})  # raw copies: read as written
        cache.clear()
        cache[key] = cached = (name_map, transformed)
    name_map, transformed = cached
    ns = name_map.namespace
    live = {ns.params[c].name: t for c, t in ns.live.items()}
    shapes = {s.name: s.shape for s in specs}
    dtypes = {s.name: s.dtype for s in specs}
    out: dict[str, Any] = {}
    for name, targets in name_map.entries.items():
        if name in name_map.skipped:
            continue
        if name in transformed:
            out[name] = ("computed from the trainer's tensor by the model's own load_weights (not a re-layout, e.g. "
                         "Llama 4's q/k rotary permutation): not fingerprinted")
            continue
        try:
            out[name] = _one_base(model, name_map, name, targets, shapes[name], dtypes[name], live, seed)
        except _Unreadable as e:
            out[name] = str(e)
    return out


class _Unreadable(Exception):
    pass


def _one_base(model: torch.nn.Module, name_map: Any, name: str, targets: Any, shape: tuple[int, ...],
              dtype: torch.dtype, live: Mapping[str, Tensor], seed: int) -> list[float]:
    from hwsync.vllm.direct import owner_module, write_pieces, why_not_direct

    ns = name_map.namespace
    total = magnitude = peak = 0.0
    for tg in targets:
        if tg.kind == "expert" or (tg.kind == "experts" and tg.expert_ids is not None):
            raise _Unreadable("per-expert trainer tensors are not fingerprinted (fused expert tensors are)")
        if tg.kind in ("loader", "routed"):  # the model's own checkpoint layout (Llama 4's [E, in, out] experts): only vLLM's
            raise _Unreadable("tensors in the model's own checkpoint layout, converted by vLLM's loader, are not "
                              "fingerprinted")
        module = owner_module(model, tg.param)
        held = live.get(tg.param)
        if held is None:
            raise _Unreadable(f"{tg.param} is not a live parameter")
        r = probe(name, shape, seed, held.device, dtype)
        if tg.kind == "experts":
            g = ns.group_of(tg.param)
            if g is None or g.sharding is None:
                raise _Unreadable(f"{tg.param}: expert layout unknown ({getattr(g, 'unwritable', None)})")
            ((dst, src),) = write_pieces(name_map, tg, r, held)
            if why_not_direct(module, tg.param, set()) is not None:  # the kernel keeps its own layout: replay it
                src = _moe_post_load(module, g, tg.param, src)
            pairs = [(dst, src)]
        else:
            view = _kernel_view(module, tg.param, held, ns.spec_of(tg.param).shape)
            pairs = write_pieces(name_map, tg, r, view)
        for dst, src in pairs:
            v, m, top = dot(dst, src)
            total += v
            magnitude += m
            peak = max(peak, top)
    return [total, magnitude, peak]


def _kernel_view(module: Any, param: str, held: Tensor, shape: tuple[int, ...]) -> Tensor:
    """The weight as the module's kernel reads it, in checkpoint layout (``shape``)."""
    leaf = param.rsplit(".", 1)[-1]
    cpu_linear = getattr(module, "cpu_linear", None)
    lookup = type(module).__name__ == "VocabParallelEmbedding"  # the lookup reads the parameter itself
    if cpu_linear is None or leaf != "weight" or lookup or len(shape) != 2:
        if tuple(held.shape) != tuple(shape) and held.dim() == len(shape) and all(
                a >= b for a, b in zip(held.shape, shape)):
            return held[tuple(slice(0, s) for s in shape)]  # vocab padding
        return held
    rows, cols = shape
    eye = torch.eye(cols, dtype=module.weight.dtype, device=module.weight.device)
    wt = cpu_linear(eye, module.weight, None)  # eye @ W^T = W^T, exactly
    return wt.t()[:rows]


def _moe_post_load(module: torch.nn.Module, g: Any, param: str, src: Tensor) -> Tensor:
    """``src`` (checkpoint layout) after the experts' own post-load step, when their kernel has one."""
    from hwsync.layouts import w2_shape, w13_shape

    qm = getattr(module, "quant_method", None)
    while type(qm).__name__ == "FusedMoEModularMethod":
        qm = getattr(qm, "old_quant_method", None)
    experts = getattr(getattr(qm, "moe_kernel", None), "fused_experts", None)
    step = getattr(type(experts), "process_weights_after_loading", None) if experts is not None else None
    if step is None:
        return src
    i, h = g.intermediate, g.hidden
    w13 = src if param == g.w13 else torch.zeros(w13_shape(g.sharding, i, h, g.layout), dtype=src.dtype,
                                                   device=src.device)
    w2 = src if param == g.w2 else torch.zeros(w2_shape(g.sharding, i, h, g.layout), dtype=src.dtype,
                                                device=src.device)
    fake = torch.nn.Module()
    fake.w13_weight = torch.nn.Parameter(w13.contiguous(), requires_grad=False)
    fake.w2_weight = torch.nn.Parameter(w2.contiguous(), requires_grad=False)
    for attr in ("w13_bias", "w2_bias"):
        setattr(fake, attr, None)
    try:
        step(experts, fake)
    except Exception as e:  # noqa: BLE001 - a post-load step that needs more of the layer: not read back
        raise _Unreadable(f"{param}: the experts' post-load step cannot be replayed ({type(e).__name__}: {e})") from e
    return fake.w13_weight if param == g.w13 else fake.w2_weight


# -- adapter -----------------------------------------------------------------------------------------------------
def stacked_buffers(module: Any) -> list[tuple[str, int | None, Tensor]]:
    out: list[tuple[str, int | None, Tensor]] = []
    for attr, value in vars(module).items():
        if "stacked" not in attr and attr != "adapter_enabled":
            continue
        if isinstance(value, Tensor):
            out.append((attr, None, value))
        elif isinstance(value, (list, tuple)):
            out += [(attr, i, t) for i, t in enumerate(value) if isinstance(t, Tensor)]
    return out


def _lora(w: Any, applier: Any, lid: int | None, req: Mapping[str, Any], seed: int) -> Any:
    from hwsync.vllm.applier import lora_manager_of
    from hwsync.vllm.lora_slots import SlotWriter, held_tensor

    manager = lora_manager_of(w)
    if manager is None:
        return "the engine has no LoRA manager (started without enable_lora)"
    if lid is None:
        return "no adapter installed"
    installed = manager.get_adapter(lid)
    if installed is None:
        return f"adapter id {lid} is not in the engine's adapter set"
    if lid not in manager.lora_index_to_id:
        return f"adapter id {lid} is not active in a LoRA slot"
    slot = manager.lora_index_to_id.index(lid)
    keys, shapes, meta = list(req["keys"]), [tuple(s) for s in req["shapes"]], dict(req["meta"])
    key = json.dumps([keys, shapes, meta, lid], sort_keys=True, default=str)
    cache = w.__dict__.setdefault("_hwsync_fp_writers", {})
    writer = cache.get(key)
    if writer is None:
        build = applier._adapter_builder(meta, lid)
        writer = SlotWriter.trace(manager, build, meta, dict(zip(keys, shapes)),
                                  getattr(w.model_runner, "device", torch.device("cpu")))
        if isinstance(writer, str):
            return f"the adapter's layout cannot be traced: {writer}"
        cache.clear()
        cache[key] = writer
    # 1. every slot holds what vLLM's own set_lora writes from the installed adapter
    bad_slots = []
    for name in writer.modules:
        module = manager.modules[name]
        weights = installed.loras.get(name)
        if weights is None:
            bad_slots.append(f"{name}: not in the installed adapter")
            continue
        before = [(a, i, t[slot].clone()) for a, i, t in stacked_buffers(module)]
        module.set_lora(slot, weights.lora_a, weights.lora_b)
        now = {(a, i): t[slot] for a, i, t in stacked_buffers(module)}
        if any(not torch.equal(now[(a, i)], b) for a, i, b in before):
            bad_slots.append(name)
        for a, i, b in before:  # leave the slot exactly as it was found
            now[(a, i)].copy_(b)
    # 2. the installed adapter, mapped back to the trainer's tensors through the traced gathers (each a strided view
    # of one trainer tensor: written back through the same view)
    values: dict[str, Any] = {}
    sources: dict[str, Tensor] = {}
    for g in writer.gathers:
        weights = installed.loras.get(g.module)
        if weights is None or tuple(held_tensor(weights, g).shape) != g.shape:
            return f"installed adapter's {g.module}.{g.field} does not have the planned layout"
        if g.view is None:
            continue
        t = held_tensor(weights, g)
        src = sources.get(g.view.source)
        if src is None:
            shape = shapes[keys.index(g.view.source)]
            src = sources[g.view.source] = torch.zeros(shape, dtype=t.dtype, device=t.device)
        g.view.write(src, t)
    for k, shape in zip(keys, shapes):
        src = sources.get(k)
        if src is None:
            return f"no installed tensor holds the trainer's {k}"
        values[k] = list(dot(src, probe(k, shape, seed, src.device, src.dtype)))
    return {"slot": slot, "bad_slots": bad_slots, "tensors": values}
