"""Broken syncs, made for real: faults written into a live vLLM engine's state, for :func:`hwsync.verify` to catch.

Nothing here mocks vLLM or verify. Base faults send wrong tensors through vLLM's own ``reload_weights`` (the path a
sync takes), adapter faults change the worker's LoRA manager, and "previous step" is a real :func:`hwsync.sync` of
older weights. :class:`FaultInjector` injects one fault and repairs it again, so one engine serves many faults.

=========================== ================================================================================
fault                       what the engine holds afterwards
=========================== ================================================================================
adapter not installed       the adapter removed from vLLM's adapter set (the trainer's last sync installed it)
stale adapter id            the same adapter served under another id than the one the trainer's sync installed
post-load skipped           one MoE layer reloaded with the experts' post-load step skipped (vLLM #42821 family:
                            the CPU prepack; a no-op where the kernel has no post-load step)
layer experts not written   one MoE layer's experts still hold the previous step's values
experts transposed          one MoE layer's expert tensors written with their last two dims transposed
gate/up swapped             one MoE layer's fused gate_up written with the gate and up halves swapped
LoRA scaling 2x             every LoRA B of the installed adapter doubled (and written to the slots by vLLM)
LoRA slot not written       the installed adapter intact, but the B halves of its slot (what the kernels read) zero
scaling folded in another   a real sync whose trainer folded each LoRA scaling into B in fp32 and rounded once (hwsync
order                       before issue 29) instead of vLLM's order (cast to the LoRA dtype, then scaled in it): last
                            bits of B differ where a scaling is not a power of two and the LoRA dtype is 16-bit
                            (reported not applicable elsewhere: both orders give the same bits)
previous step synced        a complete, valid sync of the previous step's weights (the trainer moved on)
=========================== ================================================================================
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["ADAPTER_FAULTS", "BASE_FAULTS", "FAULTS", "FaultInjector", "applicable"]

ADAPTER_FAULTS = (
    "adapter not installed",
    "stale adapter id",
    "LoRA scaling 2x",
    "LoRA slot not written",
    "scaling folded in another order",
)
BASE_FAULTS = ("post-load skipped", "layer experts not written", "experts transposed", "gate/up swapped")
FAULTS = ADAPTER_FAULTS + BASE_FAULTS + ("previous step synced",)


def applicable(fault: str, strategy: str) -> bool:
    """Adapter faults need an adapter on the engine (``adapter``/``hybrid``); "layer experts not written" needs
    expert weights that change between steps (not ``adapter``, whose base stays W0); the rest apply everywhere."""
    if fault == "layer experts not written":
        return strategy != "adapter"
    return strategy != "full" or fault not in ADAPTER_FAULTS


# -- functions run inside the worker (collective_rpc) ----------------------------------------------------------------
def _manager(worker: Any) -> tuple[Any, Any]:
    from hwsync.engine.vllm.applier import lora_manager_of
    from hwsync.engine.vllm.worker import receiver_of, unwrap_worker

    w = unwrap_worker(worker)
    return receiver_of(w), lora_manager_of(w)


def _drop_adapter(worker: Any) -> int:
    rec, manager = _manager(worker)
    lid = rec.state.lora_int_id
    manager.remove_adapter(lid)
    return int(lid)


def _rename_adapter(worker: Any, new_id: int) -> int:
    rec, manager = _manager(worker)
    lid = rec.state.lora_int_id
    lora = manager.get_adapter(lid)
    manager.remove_adapter(lid)
    lora.id = new_id
    manager.add_adapter(lora)
    with contextlib.suppress(NotImplementedError, AttributeError):
        manager.pin_adapter(new_id)
    manager.activate_adapter(new_id)
    rec.state.lora_int_id = new_id
    return int(lid)


def _scale_adapter(worker: Any, factor: float) -> int:
    rec, manager = _manager(worker)
    lid = rec.state.lora_int_id
    lora = manager.get_adapter(lid)
    slot = manager.lora_index_to_id.index(lid)
    with torch.no_grad():
        for name, weights in lora.loras.items():
            bs = weights.lora_b if isinstance(weights.lora_b, list) else [weights.lora_b]
            for b in bs:
                if b is not None:
                    b.mul_(factor)
            if name in manager.modules:
                manager.modules[name].set_lora(slot, weights.lora_a, weights.lora_b)
    return len(lora.loras)


def _zero_slot(worker: Any) -> int:
    from hwsync.engine.vllm.fingerprint import stacked_buffers

    rec, manager = _manager(worker)
    slot = manager.lora_index_to_id.index(rec.state.lora_int_id)
    n = 0
    with torch.no_grad():
        for module in manager.modules.values():
            for attr, _i, t in stacked_buffers(module):
                if attr.startswith("lora_b"):
                    t[slot].zero_()
                    n += 1
    return n


def _reload(worker: Any, items: Sequence[tuple[str, Tensor]], skip_post_load: bool) -> bool:
    """Write trainer tensors into the engine through vLLM's own ``reload_weights`` (the sync's reload path),
    optionally with every MoE kernel's post-load step made a no-op for this reload; whether the parameters the
    tensors land in changed."""
    from hwsync.common.wire import TensorSpec
    from hwsync.engine.vllm.applier import lora_manager_of, model_of, vllm_reload, vllm_spellings
    from hwsync.engine.vllm.worker import receiver_of, unwrap_worker

    w = unwrap_worker(worker)
    rec = receiver_of(w)
    applier: Any = rec.applier  # the VllmApplier behind the receiver's Applier interface
    manager = lora_manager_of(w)
    lid = rec.state.lora_int_id
    lora = manager.get_adapter(lid) if manager is not None and lid is not None else None
    state = (rec.state.lora_name, lid, rec.state.base_key)
    specs = [TensorSpec(n, tuple(t.shape), t.dtype, "base") for n, t in items]
    names_plan = applier.names_plan(specs, cast=True)
    skipped: list[Any] = []
    if skip_post_load:
        for m in model_of(w).modules():
            qm = getattr(m, "quant_method", None)
            while type(qm).__name__ == "FusedMoEModularMethod":
                qm = getattr(qm, "old_quant_method", None)
            experts = getattr(getattr(qm, "moe_kernel", None), "fused_experts", None)
            cls = type(experts)
            if experts is not None and "process_weights_after_loading" in cls.__dict__ and cls not in skipped:
                skipped.append(cls)
    ns = names_plan.namespace
    live = {ns.params[c].name: t for c, t in ns.live.items()}
    touched = {tg.param for targets in names_plan.entries.values() for tg in targets}
    before = {p: live[p].clone() for p in touched if p in live}
    originals = [(cls, cls.__dict__["process_weights_after_loading"]) for cls in skipped]
    for cls in skipped:  # the reload builds new kernel objects: the step is skipped on their class
        cls.process_weights_after_loading = lambda self, layer: None
    try:
        vllm_reload(w.model_runner, vllm_spellings(names_plan, iter(list(items))))
    finally:
        for cls, fn in originals:
            cls.process_weights_after_loading = fn
    if lora is not None and lid not in manager.list_adapters():  # vLLM's reload drops adapters: put it back as is
        manager.add_adapter(lora)
        with contextlib.suppress(NotImplementedError, AttributeError):
            manager.pin_adapter(lid)
        manager.activate_adapter(lid)
    rec.state.lora_name, rec.state.lora_int_id, rec.state.base_key = state
    rec.state.base_writes += 1  # a base fault stands for a sync that wrote it wrong: every sync counts its write
    return any(not torch.equal(live[p], t) for p, t in before.items())
    return len(skipped)


# -- the trainer-side driver -------------------------------------------------------------------------------------------
class FaultInjector:
    """Inject one fault into ``llm`` (synced from ``model`` by :func:`hwsync.sync`), then :meth:`repair` it."""

    def __init__(self, llm: Any, model: torch.nn.Module, layer: int = -1) -> None:
        import hwsync

        self.llm, self.model = llm, model
        self.engine = hwsync.as_engine(llm)
        self.layer = layer
        self._repair: Any = None

    def _layer_experts(self) -> dict[str, Tensor]:
        """The corrupted layer's fused expert tensors as the sync sends them (copies of those alone: a 48-layer
        model's whole base would not fit beside it)."""
        from hwsync.trainer.api import last_plan
        from hwsync.trainer.verify import reference_tensors

        plan = last_plan(self.engine, self.model)
        assert plan is not None, "the model was never synced into this engine"
        _, pairs = reference_tensors(self.model, plan)
        experts = {s.name: (s, t) for s, t in pairs if s.kind == "base" and _fused_experts(s.name)}
        layers = sorted({_layer_of(n) for n in experts})
        if not layers:
            raise RuntimeError("the model has no fused MoE expert tensors to corrupt")
        layer = layers[self.layer]
        return {n: t.detach().to(s.dtype).clone() for n, (s, t) in experts.items() if _layer_of(n) == layer}

    def _rpc(self, fn: Any, *args: Any) -> Any:
        return self.llm.collective_rpc(fn, args=args)[0]

    def _write(self, items: dict[str, Tensor], skip_post_load: bool = False) -> bool:
        with self.engine.lock:
            changed = self._rpc(_reload, list(items.items()), skip_post_load)
            self.llm.reset_prefix_cache()
        return bool(changed)

    @contextlib.contextmanager
    def _weights(self, snap: dict[str, Tensor]) -> Iterator[None]:
        now = {n: p.detach().clone() for n, p in self.model.named_parameters() if n in snap}
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                if n in snap:
                    p.copy_(snap[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.model.named_parameters():
                    if n in now:
                        p.copy_(now[n])

    def inject(self, fault: str, previous: dict[str, Tensor] | None = None) -> bool:
        """Break the engine; ``previous`` (parameter name -> tensor, the step before) is needed by "layer experts
        not written" and "previous step synced". Returns ``False`` when the fault changes nothing here ("post-load
        skipped" where the experts' kernel has no post-load step that changes their storage for this dtype)."""
        import hwsync

        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; one of {FAULTS}")
        self._repair = ("sync", None)
        if fault == "adapter not installed":
            with self.engine.lock:
                self._rpc(_drop_adapter)
        elif fault == "stale adapter id":
            with self.engine.lock:
                self._rpc(_rename_adapter, 0x7777)
        elif fault == "LoRA scaling 2x":
            with self.engine.lock:
                self._rpc(_scale_adapter, 2.0)
        elif fault == "LoRA slot not written":
            with self.engine.lock:
                self._rpc(_zero_slot)
        elif fault == "scaling folded in another order":
            if not self._orders_differ():
                return False
            hwsync.sync(self.llm, self.model, strategy=self._strategy(), fold=fold_fp32)
        elif fault == "previous step synced":
            assert previous is not None, "previous step synced needs the previous weights"
            with self._weights(previous):
                hwsync.sync(self.llm, self.model, strategy=self._strategy())
        else:
            good = self._layer_experts()
            self._repair = ("write", good)
            if fault == "post-load skipped":
                if not self._write(good, skip_post_load=True):
                    return False
            elif fault == "layer experts not written":
                assert previous is not None, "layer experts not written needs the previous weights"
                with self._weights(previous):
                    old = self._layer_experts()
                self._write(old)
            elif fault == "experts transposed":
                self._write({n: t.transpose(-1, -2).contiguous().reshape(t.shape) for n, t in good.items()})
            elif fault == "gate/up swapped":
                self._write({n: _swap_halves(t) if n.endswith("gate_up_proj") else t for n, t in good.items()})
        self.llm.reset_prefix_cache()
        return True

    def _orders_differ(self) -> bool:
        """Whether folding the trainer's LoRA scalings in fp32 (one rounding) gives other bits than vLLM's order in
        the engine's LoRA dtype, for any module (no: every scaling a power of two, or an fp32 LoRA dtype)."""
        from hwsync.common.lora_formats import extract_peft_lora, fold_scaling
        from hwsync.common.wire import dtype_from_name
        from hwsync.trainer.payload import active_adapter_name

        lora_dtype = self.engine.describe().lora_dtype
        if not lora_dtype:
            return False
        dtype = dtype_from_name(lora_dtype)
        adapter = extract_peft_lora(self.model, active_adapter_name(self.model))
        with torch.no_grad():
            return any(
                not torch.equal(fold_scaling(m.lora_B, m.scaling, dtype), fold_fp32(m.lora_B, m.scaling, dtype))
                for m in adapter.modules.values()
            )

    def _strategy(self) -> str:
        from hwsync.trainer.api import last_plan

        plan = last_plan(self.engine, self.model)
        assert plan is not None, "the model was never synced into this engine"
        return plan.manifest.strategy.value

    def repair(self) -> None:
        """Put the engine back to serving the trainer's current weights."""
        import hwsync

        repair: tuple[str, Any] = self._repair or ("sync", None)
        kind, data = repair
        if kind == "write":
            self._write(data)
        else:
            hwsync.sync(self.llm, self.model, strategy=self._strategy())
        self._repair = None


def fold_fp32(b: Tensor, scaling: float, dtype: torch.dtype) -> Tensor:
    """The other order (the fault "scaling folded in another order"): ``b · scaling`` in fp32, rounded once to
    ``dtype``, where vLLM's loading (:func:`hwsync.common.lora_formats.fold_scaling`) casts first."""
    return (b.float() * scaling).to(dtype)


def _swap_halves(t: Tensor) -> Tensor:
    """Gate and up halves of a fused gate_up tensor ``[E, 2I, H]`` (or ``[E, H, 2I]``) swapped."""
    dim = 1 if t.shape[1] % 2 == 0 and (t.shape[2] % 2 or t.shape[1] >= t.shape[2]) else 2
    a, b = t.chunk(2, dim=dim)
    return torch.cat([b, a], dim=dim)


# -- a campaign: healthy syncs, then every fault, on one engine ------------------------------------------------------
def _fused_experts(name: str) -> bool:
    return ".mlp.experts." in name and name.rsplit(".", 1)[-1] in ("gate_up_proj", "down_proj")


def _layer_of(name: str) -> int:
    return int(name.split(".layers.")[1].split(".")[0])


def moving(model: torch.nn.Module, base: bool, budget: float | None = None) -> set[str]:
    """The parameters a campaign's "optimizer step" moves: the LoRA factors, and with ``base`` every floating-point
    weight -- or, where copies of them all would take more than ``budget`` bytes (default: a quarter of the free
    device memory; none on CPU), the weights of the last decoder layer (the one :class:`FaultInjector` corrupts): a
    48-layer model's base is 60 GB, and the campaign keeps up to three copies of what moves."""
    lora = {n for n, _ in model.named_parameters() if "lora_" in n}
    if not base:
        return lora
    weights = {n: p for n, p in model.named_parameters() if "lora_" not in n and p.is_floating_point()}
    if budget is None:
        device = next(iter(weights.values())).device if weights else torch.device("cpu")
        budget = float("inf") if device.type == "cpu" else torch.cuda.mem_get_info(device)[0] / 4
    if sum(p.numel() * p.element_size() for p in weights.values()) <= budget:
        return lora | set(weights)
    layered = [n for n in weights if ".layers." in n]
    last = max((_layer_of(n) for n in layered), default=None)
    return lora | {n for n in layered if _layer_of(n) == last}


def _perturb(model: torch.nn.Module, gen: torch.Generator, names: set[str]) -> None:
    """One "optimizer step" of the parameters ``names`` (:func:`moving`); drawn on each parameter's device (a
    generator per device seeded from ``gen``: a 48-layer model is not drawn on the CPU)."""
    gens: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name not in names:
                continue
            g = gens.get(p.device)
            if g is None:
                g = gens[p.device] = torch.Generator(device=p.device).manual_seed(
                    int(torch.randint(0, 2**31 - 1, (), generator=gen))
                )
            noise = torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32)
            if "lora_" in name:
                p.add_((noise * 0.05).to(p.dtype))
            else:
                p.mul_((1 + noise * 0.02).to(p.dtype))


def _snapshot(model: torch.nn.Module, names: set[str]) -> dict[str, Tensor]:
    """Copies of the parameters a step changes (:func:`moving`)."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if n in names}


def metrics(report: Any) -> dict[str, float]:
    """Check name -> measured value (and the raw logprob statistics) of one :class:`hwsync.verify.VerifyReport`."""
    out = {c.name: float(c.value) for c in report.checks}
    a = report.agreement
    if a is not None:
        out.update(
            {
                "mean |Δlogp|": a.mean_abs_diff,
                "p90 |Δlogp|": a.p90_abs_diff,
                "mean |Δp|": a.mean_prob_diff,
                "max |Δlogp|": a.max_abs_diff,
            }
        )
    return out


def campaign(
    llm: Any,
    model: torch.nn.Module,
    strategy: str,
    prompts: Sequence[Sequence[int]],
    *,
    steps: int = 20,
    faults: Sequence[str] = FAULTS,
    seed: int = 1234,
    log: Any = None,
) -> dict[str, Any]:
    """``steps`` healthy syncs of ``model`` (changing weights; step 8 repeats unchanged weights, step 13 switches back
    to step 4's), each checked by :func:`hwsync.verify.check`; then every applicable fault injected, checked and
    repaired (a healthy check after each repair). Returns ``healthy`` (list of metrics), ``faults`` (fault -> metrics
    and the names of the failed checks), ``repaired`` (fault -> whether the check passed again)."""
    import hwsync
    from hwsync.trainer.verify import check

    gen = torch.Generator().manual_seed(seed)
    steps_move = moving(model, base=strategy == "full")
    healthy: list[dict[str, Any]] = []
    snap = previous = None
    for step in range(steps):
        previous = _snapshot(model, steps_move)
        if step == 13 and snap is not None:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if n in snap:
                        p.copy_(snap[n])
        elif step != 8:
            _perturb(model, gen, steps_move)
        report = hwsync.sync(llm, model, strategy=strategy)
        assert report is not None  # an engine was passed
        r = check(llm, model, prompts)
        healthy.append(
            {**metrics(r), "failed": [c.name for c in r.failed], "message": r.message(), "version": report.version}
        )
        if log:
            log(f"{strategy} healthy sync {step}: {'ok' if r.ok else 'FALSE ALARM: ' + r.message()}")
        if step == 4:
            snap = _snapshot(model, steps_move)
    # one more step: the trainer's "previous" weights differ from the engine's current ones
    last_move = moving(model, base=strategy != "adapter")
    previous = _snapshot(model, last_move)
    _perturb(model, gen, last_move)
    hwsync.sync(llm, model, strategy=strategy)
    out: dict[str, Any] = {"strategy": strategy, "healthy": healthy, "faults": {}, "repaired": {}}
    injector = FaultInjector(llm, model)
    for fault in faults:
        if not applicable(fault, strategy):
            continue
        if not injector.inject(fault, previous=previous):
            out.setdefault("not_applicable", {})[fault] = "the engine's state did not change (no such step here)"
            if log:
                log(f"{strategy} {fault}: not applicable here (injecting it changed nothing)")
            continue
        r = check(llm, model, prompts)
        out["faults"][fault] = {**metrics(r), "failed": [c.name for c in r.failed], "message": r.message()}
        injector.repair()
        again = check(llm, model, prompts)
        out["repaired"][fault] = again.ok
        if log:
            log(
                f"{strategy} {fault}: {'caught by ' + ', '.join(c.name for c in r.failed) if not r.ok else 'MISSED'}"
                f"; repaired: {again.ok}"
            )
    return out
