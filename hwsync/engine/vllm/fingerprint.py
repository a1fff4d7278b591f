"""Engine half of :mod:`hwsync.common.fingerprint`: what one worker's kernels read, fingerprinted through the sync plan.

Runs in the worker (``collective_rpc``). For every trainer name the trainer asks about:

* **Base tensors**: resolved with the same :mod:`hwsync.engine.names` plan a sync uses; the probe goes through the
  plan's own writers (:func:`hwsync.engine.vllm.direct.write_pieces`: TP slices, packed q/k/v rows, fused experts in the
  engine's layout). What the kernels read is taken where they read it: the parameter itself; on vLLM's CPU build a
  linear's weight is handed to oneDNN / a packed kernel and emptied, so the kernel is asked (``cpu_linear`` on an
  identity matrix gives ``W^T`` exactly: every product is by 1.0, every sum adds zeros); MoE experts whose kernel
  prepacks them (CPU grouped GEMM, or any backend with a ``process_weights_after_loading``) get the probe sent through
  the same post-load step (a pure data movement), so a skipped post-load step shows as a mismatch. Experts whose kernel
  reads them as stored (:func:`hwsync.engine.vllm.direct.why_not_direct`: Triton on CUDA) are read as they are.
* **Adapter**: the installed adapter's id and its slot; every LoRA wrapper's slot is compared with what vLLM's own
  ``set_lora`` writes from the installed ``LoRAModel`` (then put back as it was), and the ``LoRAModel``'s tensors are
  mapped back to the trainer's wire tensors with the gathers of :class:`hwsync.engine.vllm.lora_slots.SlotWriter` (the
  adapter's sync plan, traced on vLLM's own construction code).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from hwsync.common import foreign
from hwsync.common.fingerprint import deviation, differing, differing_each, dot, probe

__all__ = ["compare", "fingerprints"]


def _answer(worker: Any) -> tuple[Any, Any, dict[str, Any]]:
    """The vLLM worker, its receiver and the answer's skeleton: the receiver's state, nothing compared yet."""
    from hwsync.engine.vllm.worker import receiver_of, unwrap_worker

    w = unwrap_worker(worker)
    rec = receiver_of(w)
    st = rec.refresh()
    out: dict[str, Any] = {
        "version": st.version,
        "stale": st.stale,
        "lora_int_id": st.lora_int_id,
        "lora_name": st.lora_name,
        "base_writes": st.base_writes,
        "base": {},
        "lora": None,
    }
    return w, rec, out


def fingerprints(worker: Any, request: Mapping[str, Any]) -> dict[str, Any]:
    """``request``: ``seed``, ``base`` ([name, shape, dtype] of trainer tensors), ``lora`` (None or ``keys``,
    ``shapes``, ``meta``). Returns the receiver state plus ``base``/``lora``: name -> [value, magnitude] or a
    string saying why that tensor cannot be read back here."""
    w, rec, out = _answer(worker)
    seed = int(request.get("seed", 0))
    only = request.get("only")
    with torch.no_grad():
        if request.get("base"):
            out["base"] = _base(w, rec.applier, request["base"], seed, None if only is None else set(only))
        if request.get("lora") is not None:
            out["lora"] = _lora(w, rec.applier, out["lora_int_id"], request["lora"], seed)
    return out


# -- base weights ------------------------------------------------------------------------------------------------
def _base_plan(w: Any, applier: Any, specs_in: list[Any]) -> tuple[Any, Any, set[str], dict[str, Any]]:
    """``(model, name map, names the model's loader computes, specs by name)`` for the trainer's base ``specs_in``
    ([name, shape, dtype]); the dry run that resolves them runs once per spec list."""
    from hwsync.common.wire import TensorSpec, dtype_from_name
    from hwsync.engine.vllm.applier import model_of

    specs = [TensorSpec(n, tuple(s), dtype_from_name(d), "base") for n, s, d in specs_in]
    key = "base:" + json.dumps(specs_in)
    cache = foreign.state_of(w).setdefault("fingerprint_plans", {})
    model = model_of(w)
    cached = cache.get(key)
    if cached is None:
        from hwsync.engine.vllm.dry_run import dry_run_load

        name_map = applier.names_plan(specs, cast=True)
        transformed: set[str] = set()  # computed by the model's load_weights, not laid out: no probe can follow
        dry_run_load(model, specs, name_map, transformed=transformed, raw={})  # raw copies: read as written
        cache.clear()
        cache[key] = cached = (name_map, transformed)
    name_map, transformed = cached
    return model, name_map, transformed, {s.name: s for s in specs}


_TRANSFORMED = (
    "computed from the trainer's tensor by the model's own load_weights (not a re-layout, e.g. Llama 4's "
    "q/k rotary permutation): not checked"
)


def _base(w: Any, applier: Any, specs_in: list[Any], seed: int, only: set[str] | None = None) -> dict[str, Any]:
    model, name_map, transformed, specs = _base_plan(w, applier, specs_in)
    ns = name_map.namespace
    live = {ns.params[c].name: t for c, t in ns.live.items()}
    out: dict[str, Any] = {}
    for name, targets in name_map.entries.items():
        if name in name_map.skipped or (only is not None and name not in only):
            continue
        if name in transformed:
            out[name] = _TRANSFORMED
            continue
        spec = specs[name]
        try:
            total = magnitude = peak = 0.0
            for dst, src in _base_pairs(
                model,
                name_map,
                name,
                targets,
                spec.shape,
                live,
                lambda device, n=name, s=spec: probe(n, s.shape, seed, device, s.dtype),
            ):
                v, m, top = dot(dst, src)
                total, magnitude, peak = total + v, magnitude + m, max(peak, top)
            out[name] = [total, magnitude, peak]
        except _Unreadable as e:
            out[name] = str(e)
    return out


class _Unreadable(Exception):
    pass


def _base_pairs(
    model: torch.nn.Module,
    name_map: Any,
    name: str,
    targets: Any,
    shape: tuple[int, ...],
    live: Mapping[str, Tensor],
    source: Any,
) -> list[tuple[Tensor, Tensor]]:
    """``(what the kernel reads, what it should read)`` for one trainer tensor: ``source(device)`` (the trainer's
    tensor, or a probe of its shape) sent through the sync plan's own writers -- and through the experts' post-load
    step where their kernel reads a repacked layout."""
    from hwsync.engine.vllm.direct import owner_module, why_not_direct, write_pieces

    ns = name_map.namespace
    out: list[tuple[Tensor, Tensor]] = []
    for tg in targets:
        if tg.kind == "expert" or (tg.kind == "experts" and tg.expert_ids is not None):
            raise _Unreadable("per-expert trainer tensors are not checked (fused expert tensors are)")
        if tg.kind in (
            "loader",
            "routed",
        ):  # the model's own checkpoint layout (Llama 4's [E, in, out] experts): only vLLM's
            raise _Unreadable(
                "tensors in the model's own checkpoint layout, converted by vLLM's loader, are not checked"
            )
        module = owner_module(model, tg.param)
        held = live.get(tg.param)
        if held is None:
            raise _Unreadable(f"{tg.param} is not a live parameter")
        r = source(held.device)
        if tg.kind == "experts":
            g = ns.group_of(tg.param)
            if g is None or g.sharding is None:
                raise _Unreadable(f"{tg.param}: expert layout unknown ({getattr(g, 'unwritable', None)})")
            ((dst, src),) = write_pieces(name_map, tg, r, held)
            if why_not_direct(module, tg.param, set()) is not None:  # the kernel keeps its own layout: replay it
                src = _moe_post_load(module, g, tg.param, src)
            out.append((dst, src))
        else:
            view = _kernel_view(module, tg.param, held, ns.spec_of(tg.param).shape)
            out += write_pieces(name_map, tg, r, view)
    return out


def _kernel_view(module: Any, param: str, held: Tensor, shape: tuple[int, ...]) -> Tensor:
    """The weight as the module's kernel reads it, in checkpoint layout (``shape``)."""
    leaf = param.rsplit(".", 1)[-1]
    cpu_linear = getattr(module, "cpu_linear", None)
    lookup = type(module).__name__ == "VocabParallelEmbedding"  # the lookup reads the parameter itself
    if cpu_linear is None or leaf != "weight" or lookup or len(shape) != 2:
        if (
            tuple(held.shape) != tuple(shape)
            and held.dim() == len(shape)
            and all(a >= b for a, b in zip(held.shape, shape))
        ):
            return held[tuple(slice(0, s) for s in shape)]  # vocab padding
        return held
    rows, cols = shape
    eye = torch.eye(cols, dtype=module.weight.dtype, device=module.weight.device)
    wt = cpu_linear(eye, module.weight, None)  # eye @ W^T = W^T, exactly
    return wt.t()[:rows]


def _moe_post_load(module: torch.nn.Module, g: Any, param: str, src: Tensor) -> Tensor:
    """``src`` (checkpoint layout) after the experts' own post-load step, when their kernel has one."""
    from hwsync.common.layouts import w2_shape, w13_shape

    qm = getattr(module, "quant_method", None)
    while type(qm).__name__ == "FusedMoEModularMethod":
        qm = getattr(qm, "old_quant_method", None)
    experts = getattr(getattr(qm, "moe_kernel", None), "fused_experts", None)
    step = getattr(type(experts), "process_weights_after_loading", None) if experts is not None else None
    if step is None:
        return src
    i, h = g.intermediate, g.hidden
    w13 = (
        src
        if param == g.w13
        else torch.zeros(w13_shape(g.sharding, i, h, g.layout), dtype=src.dtype, device=src.device)
    )
    w2 = src if param == g.w2 else torch.zeros(w2_shape(g.sharding, i, h, g.layout), dtype=src.dtype, device=src.device)
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


def _installed(w: Any, lid: int | None) -> tuple[Any, Any, int] | str:
    """``(manager, installed adapter, its slot)``, or why there is none to check."""
    from hwsync.engine.vllm.applier import lora_manager_of

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
    return manager, installed, manager.lora_index_to_id.index(lid)


def _writer(
    w: Any,
    applier: Any,
    manager: Any,
    installed: Any,
    lid: int,
    keys: list[str],
    shapes: list[tuple[int, ...]],
    meta: dict[str, Any],
) -> Any:
    """The adapter's layout: the one that installed it, else traced here once per structure (a ``str``: why not)."""
    from hwsync.engine.vllm.lora_slots import SlotWriter

    live = applier.slot_writer_of(installed)
    if live is not None and set(live.keys) == set(keys):
        return live
    key = json.dumps([keys, shapes, meta, lid], sort_keys=True, default=str)
    cache = foreign.state_of(w).setdefault("fingerprint_writers", {})
    writer = cache.get(key)
    if writer is None:
        build = applier.adapter_builder(meta, lid)
        writer = SlotWriter.trace(
            manager, build, meta, dict(zip(keys, shapes)), getattr(w.model_runner, "device", torch.device("cpu"))
        )
        if isinstance(writer, str):
            return f"the adapter's layout cannot be traced: {writer}"
        cache.clear()
        cache[key] = writer
    return writer


def _oracle(manager: Any, installed: Any, slot: int, names: list[str]) -> list[str]:
    """The modules among ``names`` whose slot differs from what vLLM's own ``set_lora`` writes from the installed
    adapter (each slot is put back exactly as it was found). One host round trip for all of them."""
    counts: list[tuple[str, Tensor]] = []
    missing = []
    for name in names:
        module = manager.modules[name]
        weights = installed.loras.get(name)
        if weights is None:
            missing.append(f"{name}: not in the installed adapter")
            continue
        before = [(a, i, t[slot].clone()) for a, i, t in stacked_buffers(module)]
        module.set_lora(slot, weights.lora_a, weights.lora_b)
        now = {(a, i): t[slot] for a, i, t in stacked_buffers(module)}
        counts.append((name, differing([(now[(a, i)], b) for a, i, b in before])))
        for a, i, b in before:  # leave the slot exactly as it was found
            now[(a, i)].copy_(b)
    if not counts:
        return missing
    values = torch.stack([c.to(counts[0][1].device) for _, c in counts]).tolist()
    return missing + [name for (name, _), n in zip(counts, values) if n]


def _lora(w: Any, applier: Any, lid: int | None, req: Mapping[str, Any], seed: int) -> Any:
    from hwsync.engine.vllm.lora_slots import held_tensor

    found = _installed(w, lid)
    if isinstance(found, str):
        return found
    manager, installed, slot = found
    assert lid is not None
    keys, shapes, meta = list(req["keys"]), [tuple(s) for s in req["shapes"]], dict(req["meta"])
    writer = _writer(w, applier, manager, installed, lid, keys, shapes, meta)
    if isinstance(writer, str):
        return writer
    # 1. slots: vLLM's own set_lora re-run from the installed adapter -- on every module where hwsync's writes go
    # through set_lora anyway, once per module of a traced layout (_oracle_modules)
    bad_slots, _ = _rederive(manager, installed, slot, writer)
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


# -- colocated: the trainer's own tensors, compared element by element ------------------------------------------
def _oracle_modules(writer: Any) -> list[str]:
    """The modules whose slot vLLM's own ``set_lora`` re-derives in this check: every module where the slots are
    written by ``set_lora`` (no traced blocks: the re-derivation is the slot check), else those of the writer's
    traced layout not yet proven (all of them at the writer's first check, none after: the layout is fixed per
    writer, and every slot block is compared with the trainer's tensors through it at every check)."""
    modules = list(writer.modules)
    if not getattr(writer, "blocks", ()):
        return modules
    return [m for m in modules if m not in writer.proven]


def _rederive(manager: Any, installed: Any, slot: int, writer: Any) -> tuple[list[str], int]:
    """:func:`_oracle` on :func:`_oracle_modules`, remembering the traced modules it proved: (what differs, how
    many modules were re-derived)."""
    chosen = _oracle_modules(writer)
    bad = _oracle(manager, installed, slot, chosen)
    if getattr(writer, "blocks", ()):
        failed = {b.split(":", 1)[0] for b in bad}
        writer.proven.update(m for m in chosen if m not in failed)
    return bad, len(chosen)


def compare(worker: Any, request: Mapping[str, Any]) -> dict[str, Any]:
    """Colocated content check: ``request`` holds the trainer's own tensors (this process: no copy, no probe).

    ``specs`` ([name, shape, dtype] of every base tensor the plan sends: resolved once per list), ``base`` (name ->
    the trainer's tensor, in the wire dtype: the ones to check now), ``lora`` (None or ``tensors``: key -> the
    trainer's LoRA tensor as vLLM's own loading folds it, ``meta``). Returns the receiver state plus ``base`` (name
    -> deviation, 0 when bit-equal, <= 1 passes; or why it cannot be read), ``lora`` (``differ``: key -> differing
    elements, ``bad_slots``, ``oracle``: modules re-derived by ``set_lora``; or why not). Every count is reduced on
    the device and read back in one round trip; only a tensor that differs is measured again."""
    w, rec, out = _answer(worker)
    pending: list[tuple[str, str, Tensor]] = []  # (part, label, differing count on the device)
    with torch.no_grad():
        if request.get("base"):
            model, name_map, transformed, specs = _base_plan(w, rec.applier, request["specs"])
            ns = name_map.namespace
            live = {ns.params[c].name: t for c, t in ns.live.items()}

            def pairs_for(name: str) -> list[tuple[Tensor, Tensor]]:
                tensor = request["base"][name]
                return _base_pairs(
                    model,
                    name_map,
                    name,
                    name_map.entries[name],
                    specs[name].shape,
                    live,
                    lambda device: tensor.to(device),
                )

            for name in request["base"]:
                targets = name_map.entries.get(name)
                if targets is None or name in name_map.skipped:
                    continue
                if name in transformed:
                    out["base"][name] = _TRANSFORMED
                    continue
                try:
                    pending.append(("base", name, differing(pairs_for(name))))  # a layout copy lives only here
                except _Unreadable as e:
                    out["base"][name] = str(e)
        lora = request.get("lora")
        lora_out: dict[str, Any] | None = None
        if lora is not None:
            lora_out, more = _lora_compare(w, rec.applier, out["lora_int_id"], lora)
            pending += more
        counts = (
            torch.stack([c.to(pending[0][2].device, torch.float32) for *_, c in pending]).tolist() if pending else []
        )
        for (part, label, _), n in zip(pending, counts):
            if part == "base":
                out["base"][label] = 0.0 if not n else deviation(pairs_for(label), specs[label].dtype)
            elif isinstance(lora_out, dict) and part == "adapter":  # views of one key differing (NaN counts)
                lora_out["differ"][label] = lora_out["differ"].get(label, 0) + int(n != 0)
            elif isinstance(lora_out, dict) and n != 0 and label not in lora_out["bad_slots"]:
                lora_out["bad_slots"].append(label)
        out["lora"] = lora_out
    return out


def _lora_compare(
    w: Any, applier: Any, lid: int | None, req: Mapping[str, Any]
) -> tuple[Any, list[tuple[str, str, Tensor]]]:
    """The installed adapter and its slots against the trainer's tensors: the result skeleton (or why none) and
    the device counts still to read."""
    found = _installed(w, lid)
    if isinstance(found, str):
        return found, []
    manager, installed, slot = found
    assert lid is not None
    tensors: Mapping[str, Tensor] = req["tensors"]
    keys = list(req.get("keys") or tensors)  # a batch of the adapter: the whole adapter's structure rides along
    shapes = [tuple(s) for s in req["shapes"]] if req.get("shapes") else [tuple(t.shape) for t in tensors.values()]
    writer = _writer(w, applier, manager, installed, lid, keys, shapes, dict(req["meta"]))
    if isinstance(writer, str):
        return writer, []
    adapter, slots = writer.compared(manager, installed, tensors, zero_fill=req.get("first", True))
    # every view of the installed adapter and every slot block: grouped foreach reductions, no per-view launches
    flags = differing_each([(held, want) for _, held, want in adapter] + [(held, want) for _, held, want in slots])
    pending = [("adapter", key, f) for (key, _, _), f in zip(adapter, flags)]
    pending += [("slot", label, f) for (label, _, _), f in zip(slots, flags[len(adapter) :])]
    # vLLM's own set_lora: every module not yet proven for this traced layout (all of them where slots are not traced),
    # once per check (with the adapter's last batch)
    bad, rederived = _rederive(manager, installed, slot, writer) if req.get("last", True) else ([], 0)
    return {
        "slot": slot,
        "differ": {},
        "bad_slots": bad,
        "oracle": rederived,
        "modules": len(writer.modules),
        "proven": len(writer.proven),
        "traced_slots": bool(slots),
    }, pending
