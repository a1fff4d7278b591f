"""How one vLLM worker takes weights: :class:`VllmApplier`, the :class:`~hwsync.engine.receiver.Applier` for vLLM.

Base weights, first sync of a plan: ``model_runner.reload_weights(weights_iterator=..., is_checkpoint_format=True)``
(vLLM 0.32, ``model_executor/model_loader/reload``). It restores every layer in checkpoint format on ``meta`` with
its weight loaders, buffers each layer's loads until the layer is complete, re-runs the layer's
``process_weights_after_loading`` once and copies the result into the *original* kernel storage (identity kept, CUDA
graphs stay valid). This avoids the two ways a second raw ``load_weights`` breaks an engine: MoE checkpoint layout
written over kernel layout (vLLM #42821) and, on the CPU build, repacked linears whose ``weight_loader`` is gone. A
layer that receives only part of its tensors would be processed from empty storage, so incomplete layers are
refused up front (:mod:`hwsync.engine.vllm.dry_run`). Where vLLM skips a post-load step on reload (the CPU MoE prepack,
``hwsync.patches.vllm_cpu_moe_prepack``), a probe-gated patch is held for the duration of the reload.

Later syncs of the same plan write in place where that was proven equal to vLLM's own path
(:mod:`hwsync.engine.vllm.direct`): one copy per tensor into the parameter storage the kernels read.

Adapters: the first install goes through ``LoRAModel.from_lora_tensors`` plus the validations vLLM's disk loader runs
(``PEFTHelper.validate_legal``, MoE 2-D/3-D format, classification heads;
:func:`hwsync.engine.vllm.compat.check_adapter`), built and validated before the engine's adapter set changes, then
added under its id and pinned. Later syncs of the same adapter structure write A/B straight into the manager's slot
tensors (:mod:`hwsync.engine.vllm.lora_slots`).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from hwsync.common import foreign
from hwsync.common.config import read
from hwsync.common.errors import AdapterFormatError, ResolutionError, SyncError
from hwsync.common.lora_layout import PER_EXPERT, LoraLayout
from hwsync.common.progress import counted, phase
from hwsync.common.wire import Manifest, TensorSpec, dtype_name
from hwsync.engine.receiver import Loaded, NothingWritten
from hwsync.engine.vllm.lora_slots import NOT_TRACED
from hwsync.patches.vllm_sleep_watch import observer_of

if TYPE_CHECKING:
    from hwsync.engine.names import NameMap
    from hwsync.engine.vllm.direct import DirectWriter
    from hwsync.engine.vllm.sleep import Discarded

__all__ = ["VllmApplier", "LORA_NAME", "LORA_INT_ID", "vllm_reload", "vllm_spellings", "expert_packing_problem"]

logger = logging.getLogger("hwsync.vllm")

LORA_NAME = "hwsync"
LORA_INT_ID = 0x6873  # "hs": the default adapter id, replaced in place on every sync


def model_of(worker: Any) -> torch.nn.Module:
    return worker.model_runner.get_model()


def lora_manager_of(worker: Any) -> Any:
    wm = getattr(worker.model_runner, "lora_manager", None)
    return None if wm is None else wm._adapter_manager


class _QuietReload(logging.Filter):
    """vLLM warns once per layer that a partial reload did not touch ("Failed to load weights") and lists every
    untouched weight; for a partial sync both are the expected outcome, not news."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not ("Failed to load weights" in msg or "were not loaded from checkpoint" in msg)


@contextlib.contextmanager
def _quiet_partial_reload() -> Iterator[None]:
    from hwsync.engine.vllm.compat import RELOAD_LOGGERS

    loggers = [logging.getLogger(n) for n in RELOAD_LOGGERS]
    flt = _QuietReload()
    for lg in loggers:
        lg.addFilter(flt)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(flt)


def _patch_scope(name: str) -> contextlib.AbstractContextManager[Any]:
    """Hold hwsync patch ``name`` for one reload: probe-gated, skipped when ``HWSYNC_DISABLE_PATCHES`` names it."""
    import importlib

    import hwsync.patches as patches

    importlib.import_module(f"hwsync.patches.{name}")  # registers it (also when the ledger import list lacks it)
    if name in patches.disabled():
        return contextlib.nullcontext()
    return patches.get(name).scoped()


def _lora_signature(tensors: Mapping[str, Tensor], config: Mapping[str, Any]) -> str:
    """Structure of an adapter (names, shapes, dtypes, config): equal signatures differ in values only."""
    return _signature([(k, tuple(v.shape), v.dtype) for k, v in tensors.items()], config)


def _signature(specs: Sequence[tuple[str, tuple[int, ...], torch.dtype]], config: Mapping[str, Any]) -> str:
    import hashlib
    import json

    body = json.dumps([[k, list(shape), str(dtype)] for k, shape, dtype in specs], separators=(",", ":"))
    body += json.dumps(dict(config), sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()


def _direct_enabled() -> bool:
    """``HWSYNC_DIRECT=0`` keeps every write on vLLM's reload path (A/B checks, benchmarks' baseline)."""
    return bool(read("HWSYNC_DIRECT"))


def _observed(weights: Iterator[tuple[str, Tensor]], calibration: Any) -> Iterator[tuple[str, Tensor]]:
    for name, t in weights:
        calibration.observe(name, t)
        yield name, t


def vllm_spellings(names_plan: Any, weights: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """Trainer names -> the spellings vLLM's loader takes, lazily: one bucket in flight, never the whole model (the
    manifest was validated as a whole before the first tensor arrived)."""
    for name, t in weights:
        for load_name, fn in names_plan.vllm_checkpoint_names(name):
            yield load_name, (fn(t) if fn is not None else t)


def vllm_reload(runner: Any, weights: Any) -> None:
    """vLLM's own weight-update path (``reload_weights`` in checkpoint format), with the probe-gated fixes it needs
    held around it (:data:`hwsync.engine.vllm_plugin.RECEIVER_SCOPED`: the CPU MoE prepack, the CPU Mamba2 conv weights,
    partial weight loaders) and, on a LoRA engine, the parameter names the model's loader was written against
    (:mod:`hwsync.engine.vllm.lora_view`): the trusted reference the faster paths are checked against."""
    from hwsync.engine.vllm.lora_view import checkpoint_names
    from hwsync.engine.vllm_plugin import RECEIVER_SCOPED

    with _quiet_partial_reload(), contextlib.ExitStack() as held:
        for name in sorted(RECEIVER_SCOPED):  # held here instead of process-wide (see hwsync.patches on scopes)
            held.enter_context(_patch_scope(name))
        with checkpoint_names(runner.get_model()), torch.no_grad():
            runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)


@dataclass
class LoadPlan:
    """What validation found out about one manifest, reused for every sync with the same digest."""

    groups: dict[str, str] = field(default_factory=dict)
    """Trainer name -> engine layer (module path) its tensor loads into."""
    names: NameMap | None = None
    """:class:`hwsync.engine.names.NameMap`: trainer name -> live parameters, and the spellings vLLM's loader takes."""
    eligible: dict[str, str] = field(default_factory=dict)
    """Trainer names whose parameters the kernels read as stored (:func:`hwsync.engine.vllm.direct.eligible_names`)."""
    ineligible: dict[str, str] = field(default_factory=dict)
    """Trainer name -> why it always goes through vLLM's reload."""
    direct: DirectWriter | None = None
    """:class:`hwsync.engine.vllm.direct.DirectWriter` for the names proven equal to vLLM's own load path (else
    ``None``)."""
    raw: DirectWriter | None = None
    """:class:`hwsync.engine.vllm.direct.DirectWriter` for the names the model's ``load_weights`` copies itself, which
    vLLM's reload cannot see (:func:`hwsync.engine.vllm.dry_run.dry_run_load`): written in place on every sync (else
    ``None``)."""
    calibrated: bool = False
    syncs: int = 0


def _check_routed_dtypes(names_plan: Any, routed: Mapping[str, str], cast: bool) -> None:
    """Names placed by vLLM's loader (resolve(route_unknown=True)) get the dtype check resolution gives every other
    name: a floating tensor whose engine parameter holds another dtype is refused unless the manifest allows casts
    (Granite-MoE-hybrid's ``A_log`` arrives in the engine's bf16, vLLM keeps ``A`` in fp32: precision already lost)."""
    from hwsync.engine.names.plan import resolution_error

    ns = names_plan.namespace
    problems = []
    for name in routed:
        dtype = names_plan.manifest[name][1]
        for tg in names_plan.entries.get(name, ()):
            try:
                held = ns.spec_of(tg.param).dtype
            except KeyError:
                continue
            if held != dtype and not (cast and held.is_floating_point and dtype.is_floating_point):
                problems.append(
                    f"{name!r} -> {tg.param}: dtype does not fit: receiver holds "
                    f"{dtype_name(held)}, got {dtype_name(dtype)}"
                )
    if problems:
        raise resolution_error(problems, "nothing was written", len(names_plan.manifest), ns)


def expert_packing_problem(packed_modules_mapping: Mapping[str, Sequence[str]]) -> str | None:
    """Why vLLM cannot pack per-expert LoRA with a LoRA manager's packing list, or ``None``.

    vLLM packs an experts adapter by walking ``packed_modules_mapping["experts"]`` as one (w1, w2, w3) triplet per
    expert (``PackedLoRALayerWeights.pack_moe``). vLLM 0.32's Transformers modeling backend lists every expert under
    two checkpoint spellings (``TransformersRoutedExperts.get_expert_mapping``: gate/down/up_proj and w1/w2/w3) and
    ``process_packed_modules_mapping`` copies both, so packing any expert adapter asserts -- vLLM's own loading of
    one included. Such experts are not LoRA-servable: ``hybrid`` merges them, ``adapter`` refuses with this reason.
    The engine patch ``vllm_lora_expert_spellings`` (installed by the vLLM plugin) keeps one spelling, so vLLM serves
    them; this is what an engine without it gets.
    """
    spellings: dict[int, list[str]] = {}
    for entry in packed_modules_mapping.get("experts", ()):
        m = re.fullmatch(r"experts\.(\d+)\.(.+)", entry)
        if m:
            spellings.setdefault(int(m.group(1)), []).append(m.group(2))
    for expert, names in sorted(spellings.items()):
        if len(names) > 3:
            return (
                f"vLLM's LoRA packing list names each expert {len(names)} times (expert {expert}: "
                f"{'/'.join(names)}) where PackedLoRALayerWeights.pack_moe packs 3, so vLLM cannot load LoRA on "
                "these experts (its Transformers modeling backend lists two checkpoint spellings per expert)"
            )
    return None


def _whole_layers(proven: set[str], plan: LoadPlan) -> set[str]:
    """The proven names whose engine layer is written in place entirely. vLLM's reload re-materialises every layer
    it loads into and copies *all* of that layer's tensors back, so a name written in place beside one that goes
    through the reload in the same layer (Mamba2's ``D`` beside the ``A`` its loader computes from ``A_log``) would be
    overwritten with the re-materialised layer's uninitialised memory."""
    raw = plan.raw.names if plan.raw is not None else frozenset()
    reloaded = {layer for name, layer in plan.groups.items() if name not in proven and name not in raw}
    return {name for name in proven if plan.groups.get(name) not in reloaded}


class VllmApplier:
    """Loads base weights and adapters into one vLLM worker (see the module docstring)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self._namespace: Any = None
        self._slot_writers: dict[str, Any] = {}  # adapter structure -> SlotWriter (None: vLLM's path only)
        self._lora_validated: set[str] = set()  # adapter structures that passed _validate_lora
        # a failed reload whose restoration failed too left layers holding placeholders (``meta``) instead of their
        # kernel tensors: until one vLLM reload has run to the end, nothing is written in place (see _recover)
        self._layers_unrestored = False
        self._layout: LoraLayout | None = None  # how this engine holds LoRA (lora_layout): read once, row orders added
        self._packing: tuple[Any, str | None] | None = None  # (experts packing list, its expert_packing_problem)
        self._servable_of: Any = None  # the (LoRA manager, expert packing list) _servable's answers are about
        self._servable: dict[str, str | None] = {}
        self._refill: Discarded | None = None  # what vLLM's last level-2 sleep discarded, until a sync refilled it

    # -- facts ----------------------------------------------------------------------------------------------------
    @property
    def vllm_config(self) -> Any:
        return self.worker.model_runner.vllm_config

    def describe(self, lora_paths: Sequence[str], base: Mapping[str, Sequence[int]] | None = None) -> dict[str, Any]:
        import vllm

        from hwsync.common.capabilities import vllm_capabilities

        cfg = self.vllm_config
        caps = vllm_capabilities()
        mc = cfg.model_config
        info: dict[str, Any] = {
            "engine": f"vllm {vllm.__version__} ({caps.get('platform')})",
            "dtype": dtype_name(mc.dtype),
            "device_type": str(caps.get("device_type") or "cpu"),
            "lora_enabled": cfg.lora_config is not None,
            "moe_lora": bool(caps["moe_lora"]["supported"]),
            "moe_lora_reason": str(caps["moe_lora"]["reason"]),
            "workers": int(cfg.parallel_config.world_size),
            "quantization": mc.quantization,
        }
        if base:
            info["kept_dtypes"] = self.kept_dtypes(base)
        manager = lora_manager_of(self.worker)
        if cfg.lora_config is None or manager is None:
            info["lora_reason"] = "the engine was started without enable_lora"
            return info
        lc = cfg.lora_config
        lora_dtype = lc.lora_dtype if isinstance(lc.lora_dtype, torch.dtype) else mc.dtype
        packed = {k: list(v) for k, v in manager.packed_modules_mapping.items() if k != "experts"}
        info.update(
            lora_dtype=dtype_name(lora_dtype),
            max_lora_rank=int(lc.max_lora_rank),
            lora_layout=self.lora_layout.to_wire(),  # what travels: the row orders stay here
            packed_modules_mapping=packed,
            lora_modules=sorted(manager.modules),
            unservable={p: why for p in lora_paths if (why := self._unservable(manager, p)) is not None},
        )
        return info

    def kept_dtypes(self, base: Mapping[str, Sequence[int]]) -> dict[str, str]:
        """Trainer name -> dtype, for the floating ``base`` tensors whose engine parameter vLLM keeps wider than the
        model dtype (Mamba2 / Gated-DeltaNet ``A_log`` in fp32 inside a bf16 engine): sent in the model dtype they
        would be rounded before vLLM's loader sees them, unlike vLLM's own loading of the same checkpoint. Resolved
        as a sync would be (declarations, then the dry run for names only the model's loader places). A problem
        with some names (left to the sync's own validation, which reports them) costs only those names their
        answer: the others are resolved one by one, so one unrelated refusal does not send every kept tensor in
        the model dtype (which the sync would then refuse as well, hiding the actual problem)."""
        dtype = self.vllm_config.model_config.dtype
        specs = [TensorSpec(str(n), tuple(int(d) for d in s), dtype, "base") for n, s in base.items()]
        entries = self._kept_entries(specs)
        ns = self._namespace
        out: dict[str, str] = {}
        for name, targets in entries.items():
            held = set()
            for tg in targets:
                try:
                    held.add(ns.spec_of(tg.param).dtype)
                except KeyError:
                    continue
            if len(held) == 1 and (h := held.pop()).is_floating_point and h.itemsize > dtype.itemsize:
                out[name] = dtype_name(h)
        return out

    def _kept_entries(self, specs: Sequence[TensorSpec]) -> Mapping[str, Sequence[Any]]:
        """Trainer name -> engine targets for :meth:`kept_dtypes`: the whole manifest at once, or, where that is
        refused, every name that resolves on its own (routed names bound by the dry run where it accepts them)."""
        from hwsync.engine.vllm.dry_run import dry_run_load

        try:
            names_plan = self.names_plan(specs, cast=True)
        except ResolutionError:
            entries: dict[str, Sequence[Any]] = {}
            for sp in specs:
                try:
                    one = self.names_plan([sp], cast=True)
                except ResolutionError:
                    continue
                if one.routed():
                    try:
                        dry_run_load(model_of(self.worker), [sp], one)
                    except ResolutionError:
                        continue
                entries.update(one.entries)
            return entries
        routed = names_plan.routed()
        if routed:
            try:
                dry_run_load(model_of(self.worker), specs, names_plan)  # binds what only the loader places
            except ResolutionError:  # one at a time; a name refused stays unbound (the sync's dry run says why)
                for sp in specs:
                    if sp.name in routed:
                        with contextlib.suppress(ResolutionError):
                            dry_run_load(model_of(self.worker), [sp], names_plan)
        return names_plan.entries

    def lora_module(self, manager: Any, path: str) -> tuple[str, Any]:
        """(module name vLLM files the LoRA under, the wrapper module serving it or None)."""
        from vllm.lora.utils import parse_fine_tuned_lora_name

        mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
        mapper = mapper.get_rename_mapper() if mapper is not None else None
        name, _ = parse_fine_tuned_lora_name(f"{path}.lora_A.weight", mapper)
        name = name.removesuffix(".base_layer")
        if name in manager.modules:
            return name, manager.modules[name]
        m = re.match(r"^(.*\.experts)\.\d+\.[^.]+$", name)  # before the packing lists: the experts' one is long
        if m and m.group(1) in manager.modules:
            return name, manager.modules[m.group(1)]
        for packed, parts in manager.packed_modules_mapping.items():
            for part in parts:
                if name.endswith("." + part):
                    owner = name[: -len(part)] + packed
                    if owner in manager.modules:
                        return name, manager.modules[owner]
        return name, None

    def _packing_problem(self, manager: Any) -> str | None:
        """:func:`expert_packing_problem` of ``manager``'s packing list (fixed at engine start: computed once)."""
        entries = manager.packed_modules_mapping.get("experts")
        if self._packing is None or self._packing[0] is not entries:
            self._packing = (entries, expert_packing_problem(manager.packed_modules_mapping))
        return self._packing[1]

    def _unservable(self, manager: Any, path: str) -> str | None:
        """Why vLLM cannot serve LoRA on ``path`` (phrased per module kind, not per instance), or ``None``. Answered
        once per path and LoRA manager (the engine's layers do not change): a 48-layer MoE asks about ~18,600 expert
        paths, and a wake from a level-2 sleep or a new trainer asks again. A new packing list (a patch applied after
        start) asks anew."""
        key = (manager, manager.packed_modules_mapping.get("experts"))
        if self._servable_of is not None and all(a is b for a, b in zip(self._servable_of, key)):
            if path in self._servable:
                return self._servable[path]
        else:
            self._servable_of, self._servable = key, {}
        why = self._servable[path] = self._why_unservable(manager, path)
        return why

    def _why_unservable(self, manager: Any, path: str) -> str | None:
        from hwsync.common.capabilities import vllm_capabilities

        name, module = self.lora_module(manager, path)
        moe = vllm_capabilities()["moe_lora"]
        is_experts = re.search(r"\.experts(\.|$)", name) is not None
        if is_experts and (why := self._packing_problem(manager)) is not None:
            return why
        if module is None:
            if is_experts and not moe["supported"]:
                return f"no MoE-LoRA kernels on this platform: {moe['reason']}"
            leaf = re.sub(r"\.\d+\.", ".N.", name).split(".")[-1]
            targets = self.vllm_config.lora_config.target_modules
            hint = f"engine lora_target_modules={targets}" if targets else "not a LoRA-capable layer in vLLM"
            return f"vLLM wraps no LoRA layer for {leaf} ({hint})"
        if "MoE" in type(module).__name__ and not moe["supported"]:
            return f"no MoE-LoRA kernels on this platform: {moe['reason']}"
        return None

    @property
    def lora_layout(self) -> LoraLayout:
        """How this engine holds LoRA (:mod:`hwsync.common.lora_layout`): the expert format read from vLLM's LoRA
        manager once, with the row orders learned so far (:meth:`_learn_row_orders`)."""
        if self._layout is None:
            manager = lora_manager_of(self.worker)
            if manager is None:
                return PER_EXPERT  # no LoRA served: nothing to read yet
            self._layout = LoraLayout.of_vllm(manager)
        return self._layout

    # -- validation -----------------------------------------------------------------------------------------------
    def validate(self, manifest: Manifest) -> LoadPlan:
        plan = LoadPlan()
        if manifest.base_specs:
            plan = self._resolve_base(manifest.base_specs, require_complete=True, cast=manifest.dtype_policy == "cast")
        if manifest.lora_specs:
            self._validate_lora(manifest)
        return plan

    def names_plan(self, specs: Sequence[TensorSpec], cast: bool) -> Any:
        """Resolve trainer names onto the live model with :mod:`hwsync.engine.names` (all problems in one error)."""
        from hwsync.engine.names import namespace_from_vllm_model, resolve

        if self._namespace is None:
            self._namespace = namespace_from_vllm_model(model_of(self.worker))
        return resolve(
            {sp.name: (sp.shape, sp.dtype) for sp in specs}, self._namespace, cast=cast, route_unknown=True
        )  # the dry run places (or refuses) what no declaration shows

    def _resolve_base(
        self,
        specs: Sequence[TensorSpec],
        *,
        require_complete: bool,
        cast: bool = True,
        transformed: set[str] | None = None,
    ) -> LoadPlan:
        from hwsync.engine.vllm.dry_run import dry_run_load

        names_plan = self.names_plan(specs, cast)
        raw: dict[str, str] = {}
        routed = names_plan.routed()
        groups, partial = dry_run_load(model_of(self.worker), specs, names_plan, raw=raw, transformed=transformed)
        _check_routed_dtypes(names_plan, routed, cast)
        if require_complete and partial:
            layer, (got, total, names) = next(iter(partial.items()))
            raise ResolutionError(
                f"{len(partial)} engine layer(s) would be only partly rewritten, e.g. {layer}: {got} of {total} "
                f"elements from {sorted(names)[:4]}. vLLM re-processes a layer from its complete set of weights, so "
                "a sync must carry all tensors of every layer it touches (all of q/k/v, all experts of a MoE block)"
            )
        plan = LoadPlan(groups, names_plan)
        if raw and require_complete:
            from hwsync.engine.vllm.direct import DirectWriter, raw_writable

            raw_writable(model_of(self.worker), names_plan, raw)  # refuses before any write
            plan.raw = DirectWriter(names_plan, frozenset(raw), self._live(plan))
        if require_complete and _direct_enabled():
            from hwsync.engine.vllm.direct import eligible_names

            plan.eligible, plan.ineligible = eligible_names(model_of(self.worker), names_plan)
            for name in raw:
                plan.eligible.pop(name, None)
        return plan

    def _peft_helper(self, config: Mapping[str, Any]) -> Any:
        from vllm.lora.peft_helper import PEFTHelper

        wm = self.worker.model_runner.lora_manager
        cfg = dict(config)
        cfg["vllm_max_position_embeddings"] = wm.max_position_embeddings
        try:
            helper = PEFTHelper.from_dict(cfg)
            helper.validate_legal(wm.lora_config)
        except (ValueError, TypeError) as e:
            raise AdapterFormatError(f'vLLM refuses this adapter: {e}. Use strategy="full" (merged weights)') from e
        return helper

    def to_vllm_format(
        self, tensors: Mapping[str, Tensor], meta: Mapping[str, Any]
    ) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """The trainer's LoRA modules (:func:`hwsync.common.lora_formats.to_wire`) in the format this engine serves:
        vLLM's keys, per-expert (2-D MoE LoRA) or stacked (3-D), packed modules split -- views where the layout
        allows."""
        from hwsync.common.lora_formats import from_wire, to_vllm_lora

        manager = lora_manager_of(self.worker)
        packed = {k: list(v) for k, v in manager.packed_modules_mapping.items() if k != "experts"}
        return to_vllm_lora(
            from_wire(tensors, meta), layout=self.lora_layout, packed_modules_mapping=packed or None, copy=False
        )

    def _validate_lora(self, manifest: Manifest) -> None:
        manager = lora_manager_of(self.worker)
        if manager is None:
            raise AdapterFormatError(
                'the engine was started without enable_lora: use strategy="full" or restart vLLM with enable_lora=True'
            )
        signature = _signature(
            [(s.name, tuple(s.shape), s.dtype) for s in manifest.lora_specs], manifest.lora_meta or {}
        )
        if signature in self._lora_validated:
            # the same adapter structure passed every check below already (the first sync's manifest carried the
            # base as well, the steady one carries the adapter alone): a second sync costs what the third does
            self._check_install_memory(manifest)
            return
        meta = {s.name: torch.empty(s.shape, dtype=s.dtype, device="meta") for s in manifest.lora_specs}
        vllm_tensors, config = self.to_vllm_format(meta, manifest.lora_meta or {})
        self._peft_helper(config)
        from hwsync.common.lora_formats import lora_paths

        bad = {p: why for p in lora_paths(vllm_tensors) if (why := self._unservable(manager, p)) is not None}
        if bad:
            p, why = next(iter(bad.items()))
            raise AdapterFormatError(
                f"the engine cannot serve LoRA on {len(bad)} module(s), e.g. {p}: {why}. "
                'Use strategy="hybrid" (merged weights there) or "full"'
            )
        self._check_install_memory(manifest)
        if manifest.lora_base_names:
            specs = [TensorSpec(n, tuple(shape), torch.float32) for n, shape in manifest.lora_base_names.items()]
            transformed: set[str] = set()
            plan = self._resolve_base(specs, require_complete=False, transformed=transformed)  # what the LoRA adapts
            self._learn_row_orders(plan.names, [sp for sp in specs if sp.name in transformed])
        self._lora_validated.add(signature)

    def _check_install_memory(self, manifest: Manifest) -> None:
        """Refuse, before anything is written, an adapter install the engine's device has no room for: the adapter
        in vLLM's LoRA dtype (what vLLM holds), the trace of one layer in float64 and vLLM's construction of the
        sampled layers. A steady rewrite of the installed adapter allocates nothing of the kind."""
        from hwsync.common.backend import backend_for_device
        from hwsync.engine.vllm.lora_slots import LAYER_NAME

        device = self._device()
        try:
            free = backend_for_device(device).free_memory(device)
        except Exception:  # noqa: BLE001 - a device the backends do not know: nothing to check against
            free = None
        if free is None:
            return
        manager = lora_manager_of(self.worker)
        signature = _signature(
            [(s.name, tuple(s.shape), s.dtype) for s in manifest.lora_specs], manifest.lora_meta or {}
        )
        if self._slot_writers.get(signature) is not None and any(
            foreign.held(a, "signature") == signature for a in manager.list_adapters().values()
        ):
            return  # a steady rewrite of the installed adapter
        itemsize = self.worker.model_runner.lora_manager.lora_config.lora_dtype.itemsize
        numel = 0
        per_layer: dict[tuple[str, str], int] = {}
        for spec in manifest.lora_specs:
            n = 1
            for s in spec.shape:
                n *= s
            numel += n
            m = LAYER_NAME.match(spec.name)
            key = (m["prefix"], m["index"]) if m is not None else ("", spec.name)
            per_layer[key] = per_layer.get(key, 0) + n
        layer = max(per_layer.values(), default=0)
        need = numel * itemsize + layer * (4 * 8 + 4 * itemsize)
        if need > free:
            raise AdapterFormatError(
                f"installing this adapter needs about {need / 1e9:.2f} GB on the engine's device {device} "
                f"({numel * itemsize / 1e9:.2f} GB for the adapter in vLLM's LoRA dtype, the rest to trace one layer), "
                f"but only {free / 1e9:.2f} GB is free. Free device memory (a lower gpu_memory_utilization or "
                'kv_cache_memory_bytes for vLLM, a smaller trainer footprint) or sync merged weights (strategy="full")'
            )

    def _learn_row_orders(self, names_plan: Any, specs: Sequence[TensorSpec]) -> None:
        """Base weights the model's loader transforms before storing them (Llama 4 permutes q/k rows for its rotary
        layout) while vLLM hands the LoRA of the same module to the kernels as given: the LoRA would not follow its
        weight. Where the transform is a reordering of rows, the adapter's B gets the same reordering
        (:meth:`to_vllm_format`), so the engine serves the trainer's ΔW; anything else is refused here."""
        from hwsync.engine.vllm.dry_run import row_orders

        todo = [sp for sp in specs if sp.name.removesuffix(".weight") not in self.lora_layout.row_orders]
        if not todo:
            return
        found = row_orders(model_of(self.worker), todo, names_plan)
        bad = {n: why for n, why in found.items() if isinstance(why, str)}
        if bad:
            name, why = next(iter(bad.items()))
            raise AdapterFormatError(
                f"vLLM's loader transforms the base weight of {len(bad)} LoRA-adapted module(s), e.g. {name} ({why}), "
                "but serves their LoRA untransformed: the engine would not serve the trainer's policy. Adapt other "
                'modules, or sync these merged (strategy="full")'
            )
        self._layout = self.lora_layout.with_row_orders(
            {n.removesuffix(".weight"): perm for n, perm in found.items() if not isinstance(perm, str)}
        )

    # -- base weights ---------------------------------------------------------------------------------------------
    def load_base(self, plan: LoadPlan, weights: Iterator[tuple[str, Tensor]]) -> Loaded:
        """Proven names in place, the rest through vLLM's reload; the first sync of a plan calibrates. Returns how
        the tensors were written (for the sync report)."""
        from hwsync.engine.vllm.direct import Calibration, DirectWriter

        calibration = None
        # read per sync: a cached plan must not outlive HWSYNC_DIRECT=0; and after a failed restoration only vLLM's
        # reload puts the layers' kernel tensors back (an in-place write would land in a placeholder)
        enabled = _direct_enabled() and not self._layers_unrestored
        direct = plan.direct if enabled else None
        refill = self._refill
        refill_note = ""
        if refill is not None:
            direct, refill_note = self._refill_direct(plan, refill, direct)
        if plan.raw is not None:  # vLLM's reload cannot write these at all (HWSYNC_DIRECT=0 included)
            weights = plan.raw.split(weights)
        if direct is not None:
            weights = direct.split(weights)
        elif enabled and plan.eligible and not plan.calibrated:
            calibration = Calibration(plan.names, plan.eligible, self._live(plan))
            weights = _observed(weights, calibration)
        written = set(direct.names if direct is not None else ()) | set(plan.raw.names if plan.raw is not None else ())
        try:
            if written.issuperset(plan.groups) and not self._layers_unrestored:
                for name, _t in weights:  # everything is written in place: vLLM's reload is not needed at all
                    raise SyncError(f"internal: {name} was not written in place")
            else:
                self._reload(plan, weights)
        except BaseException:
            self._recover()
            raise
        self._layers_unrestored = False
        plan.syncs += 1
        in_place = len(written)
        path = f"base: {in_place} in place, {len(plan.groups) - in_place} through vLLM's reload"
        if refill is not None:
            self._refilled(refill)
            path += refill_note
            path += (
                f"; refilled after {refill.reason.removeprefix('vLLM' + chr(39) + 's ')} ("
                + (
                    f"{len(refill.moved)} tensors at new addresses: in-place plans dropped, first-sync path"
                    if refill.moved
                    else "every address kept"
                )
                + ")"
            )
        if plan.raw is not None:
            path += f" ({len(plan.raw.names)} in place because vLLM's loader copies them where its reload cannot see)"
        if calibration is not None:
            plan.calibrated = True
            checked = calibration.proven()
            proven = _whole_layers(checked, plan)
            if proven:
                plan.direct = DirectWriter(plan.names, frozenset(proven), self._live(plan))
            unproven = sorted(set(plan.eligible) - checked)
            shared = sorted(checked - proven)
            reasons = sorted(set(plan.ineligible.values()))
            path += (
                f"; {len(proven)} proven writable in place for later syncs"
                + (f" ({len(unproven)} eligible but not proven, e.g. {unproven[0]})" if unproven else "")
                + (
                    f" ({len(shared)} proven but reloaded with the rest of their layer, e.g. {shared[0]})"
                    if shared
                    else ""
                )
                + (
                    f"; reloaded because {reasons[0]}" + (f" (+{len(reasons) - 1} reasons)" if len(reasons) > 1 else "")
                    if reasons
                    else ""
                )
            )
            logger.info("hwsync: %s", path)
        return Loaded(path)

    # -- after vLLM's level-2 sleep (hwsync.engine.vllm.sleep) ---------------------------------------------------------
    def woke(self, discarded: Discarded) -> None:
        """The weights woke from a level-2 sleep: every LoRA slot holds garbage, so no adapter stays active (vLLM's
        activation rewrites a slot completely at the next use; hwsync's own at the refill), vLLM's punica mapping and
        TP logits mapping are rebuilt by vLLM's own code, and where any address moved nothing learnt about the old
        storage is used again. The base itself is refilled by the next sync (:meth:`load_base`)."""
        self._refill = discarded
        manager = lora_manager_of(self.worker)
        if manager is not None:
            for lid in [i for i in manager.lora_index_to_id if i is not None]:
                manager.deactivate_adapter(lid)
            for attr in ("_last_mapping", "_last_slot_layout"):  # the punica metadata is rewritten at the next step
                if hasattr(manager, attr):
                    setattr(manager, attr, None)
        for module in model_of(self.worker).modules():
            reset = getattr(module, "reset_sharded_to_full_mapping", None)
            if reset is not None:
                reset()
        if discarded.moved:
            self._namespace = None
            self._slot_writers.clear()

    def _refill_direct(
        self, plan: LoadPlan, refill: Discarded, direct: DirectWriter | None
    ) -> tuple[DirectWriter | None, str]:
        """Before a refill writes anything: refuse one that leaves a discarded parameter unwritten, and keep in place
        only the layers whose every discarded tensor the sync rewrites (a layer holding tensors its post-load
        processing derived goes through vLLM's reload, which rebuilds them). Returns the in-place writer left and,
        for the sync report, what went to vLLM's reload because of derived tensors ("" where nothing did)."""
        from hwsync.engine.vllm.direct import DirectWriter

        missing = sorted(set(plan.names.unwritten() if plan.names is not None else ()) & refill.params)
        if missing:
            raise SyncError(
                f"{refill.reason}, and this sync does not rewrite {len(missing)} of those parameters, e.g. "
                f"{missing[0]}: the engine would serve them undefined. Sync every weight of the model after a wake "
                "(strategy full, or adapter/hybrid with the base), or have vLLM keep these over the sleep "
                "(sleep_preserve_parameter_names); nothing was written"
            )
        if direct is None or not refill.derived:
            return direct, ""
        derived = refill.derived
        why = {n: next((d for d in derived if d.startswith(plan.groups.get(n, "") + ".")), None) for n in direct.names}
        keep = frozenset(n for n, d in why.items() if d is None)
        if keep == direct.names:
            return direct, ""
        examples = sorted({d for d in why.values() if d is not None})
        note = (
            f"; {len(direct.names) - len(keep)} tensors through vLLM's reload for {len(examples)} tensors their "
            f"layers' post-load step derived (e.g. {examples[0]})"
        )
        return (DirectWriter(plan.names, keep, self._live(plan)) if keep else None), note

    def _refilled(self, refill: Discarded) -> None:
        if self._refill is refill:
            self._refill = None
        watch = observer_of(self.worker)
        if watch is not None and watch.discarded is refill:
            watch.refilled()

    def _live(self, plan: LoadPlan) -> dict[str, Tensor]:
        assert plan.names is not None  # a plan with base weights always resolved their names
        ns = plan.names.namespace
        return {ns.params[c].name: t for c, t in ns.live.items()}

    def _reload(self, plan: LoadPlan, weights: Iterator[tuple[str, Tensor]]) -> None:
        if plan.names is not None:
            weights = vllm_spellings(plan.names, weights)
        vllm_reload(self.worker.model_runner, counted("base weights through vLLM's reload", weights))

    def _recover(self) -> None:
        """A reload that raised mid-way leaves layers on ``meta``: put kernel tensors back (vLLM's own
        finalization), so the engine stays structurally usable while marked stale."""
        from vllm.model_executor.model_loader.reload import layerwise
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        try:
            # Every layer that did not complete goes back to its kernel tensors (its previous values). Left alone,
            # vLLM's finalization would process a partly loaded layer with the rest of its weights unset, and leave
            # a layer whose post-processing raised half-processed (unusable by later reloads).
            attention = getattr(layerwise, "is_deferred_attention_layer", lambda layer: False)
            for layer, info in list(getattr(layerwise, "LAYERWISE_INFO", {}).items()):
                if info.can_load() and info.kernel_tensors is not None and not attention(layer):
                    info.load_numel = 0
                    info.loaded_weights = []
        except Exception as e:  # noqa: BLE001
            logger.warning(
                "hwsync: could not roll back unfinished layers after a failed reload: %s: %s", type(e).__name__, e
            )
        try:
            with _quiet_partial_reload(), torch.no_grad():
                finalize_layerwise_reload(model_of(self.worker), self.vllm_config.model_config)
        except Exception as e:  # noqa: BLE001 - the original error is what the caller must see
            self._layers_unrestored = True
            logger.warning(
                "hwsync: restoring the engine's layers after a failed reload failed too: %s: %s; the "
                "next sync goes through vLLM's reload only",
                type(e).__name__,
                e,
            )
        try:
            self.worker.model_runner.reset_lora_state()
        except Exception as e:  # noqa: BLE001
            logger.warning("hwsync: resetting LoRA state after a failed reload failed: %s: %s", type(e).__name__, e)

    # -- adapters -------------------------------------------------------------------------------------------------
    def load_lora(
        self,
        plan: LoadPlan,
        tensors: Mapping[str, Tensor],
        config: Mapping[str, Any],
        name: str | None = None,
        lora_int_id: int | None = None,
        replaces: int | None = None,
    ) -> Loaded:
        """The same adapter structure again: rewrite it in place (:mod:`hwsync.engine.vllm.lora_slots`); anything else:
        build and validate a new adapter aside, then swap it in under its id. ``tensors``/``config`` are the
        trainer's modules (:func:`hwsync.common.lora_formats.to_wire`)."""
        from hwsync.common.lora_formats import kept_buffer
        from hwsync.engine.vllm.compat import check_adapter

        name = LORA_NAME if name is None else name
        lid = LORA_INT_ID if lora_int_id is None else int(lora_int_id)
        manager = lora_manager_of(self.worker)
        signature = _lora_signature(tensors, config)
        writer = self._slot_writers.get(signature)
        if (
            writer is not None
            and replaces == lid
            and lid not in manager.lora_index_to_id
            and _direct_enabled()
            and foreign.held(manager.get_adapter(lid), "signature") == signature
        ):
            # registered but not in a slot (a level-2 wake deactivated it): vLLM's activation rewrites the whole slot
            # from the adapter it holds, then the steady write below brings it to this sync's values
            manager.activate_adapter(lid)
            with contextlib.suppress(NotImplementedError, AttributeError):
                manager.pin_adapter(lid)
        if writer is not None and replaces == lid and lid in manager.lora_index_to_id and _direct_enabled():
            installed = manager.get_adapter(lid)
            if installed is not None and foreign.held(installed, "signature") == signature:
                writer.write(manager, installed, tensors)
                return Loaded(
                    "adapter: rewritten in place"
                    + ("; slots written directly" if writer.blocks else "; slots by vLLM's set_lora"),
                    name,
                    lid,
                )
        try:
            if lid <= 0:
                raise AdapterFormatError(f"LoRA int id must be positive (vLLM reserves 0 for no adapter), got {lid}")
            build = self.adapter_builder(config, lid)
            if signature not in self._slot_writers and _direct_enabled():
                with phase("adapter layout traced"):
                    self._slot_writers[signature] = self._trace_layout(manager, build, tensors, config)
            writer = self._slot_writers.get(signature) if _direct_enabled() else None
            wm = self.worker.model_runner.lora_manager
            if writer is not None:
                # vLLM's layout, learnt on a template layer and checked against vLLM's own construction of the
                # sampled layers: the adapter is built by one copy per tensor, no per-expert Python walk
                with phase("adapter built"):
                    lora = writer.materialize(
                        lid, tensors, wm.lora_config.lora_dtype, self._device(), alias=kept_buffer
                    )
            else:
                lora = build({k: v.detach().clone() for k, v in tensors.items()})
            try:
                check_adapter(manager, lora)  # the checks vLLM's disk loader runs, as this release names them
            except ValueError as e:
                raise AdapterFormatError(f"vLLM refuses this adapter: {e}") from e
            if writer is None:
                # vLLM packs the adapter (q/k/v, gate/up, experts) inside add_adapter, after the previous adapter
                # was removed: pack a scratch copy first, so an adapter vLLM cannot pack fails while the previous one
                # still serves (on an H100 vLLM's pack_moe assert left the engine without its adapter). With a
                # writer, the trace already ran vLLM's packing on the template layers, and the adapter is packed.
                manager._create_merged_loras_inplace(build({k: v.detach().clone() for k, v in tensors.items()}))
        except BaseException as e:
            raise NothingWritten(e) from e  # built and validated aside: the previous adapter serves untouched
        # validated: replace under one id (load_inplace semantics), dropping a previous identity first so an LRU
        # cache of capacity max_cpu_loras never has to evict a pinned adapter
        if replaces is not None and replaces != lid:
            manager.remove_adapter(replaces)
        manager.remove_adapter(lid)
        with phase("adapter activated by vLLM"):
            manager.add_adapter(lora)
            with contextlib.suppress(NotImplementedError, AttributeError):
                manager.pin_adapter(lid)
        foreign.state_of(lora)["signature"] = signature
        how = "built by vLLM"
        if writer is not None:
            how = "built from vLLM's traced layout"
            if writer.no_blocks == NOT_TRACED:
                with phase("adapter slots traced"):
                    why = writer.trace_slots(manager, lora, self._device()) or writer.check_blocks(
                        manager, lora, tensors
                    )
                    writer.release_codes()
                if why:
                    logger.info("hwsync: adapter slots are rewritten by vLLM's set_lora: %s", why)
            if writer.blocks and lora.id in manager.lora_index_to_id:  # in a slot (activated): record its writes
                with phase("adapter slot writes recorded"):
                    # the values are already there: this records the steady sync's copies (one graph where the
                    # device records graphs), so the second sync is as fast as the third
                    writer.write(manager, lora, tensors)
        return Loaded(
            f"adapter: {how}" + ("; later syncs rewrite it in place" if writer is not None else ""), name, lid
        )

    def slot_writer_of(self, installed: Any) -> Any:
        """The :class:`~hwsync.engine.vllm.lora_slots.SlotWriter` that installed and rewrites ``installed`` (``None``:
        vLLM's own path built it)."""
        signature = foreign.held(installed, "signature")
        return self._slot_writers.get(signature) if isinstance(signature, str) else None

    def _device(self) -> Any:
        return getattr(self.worker.model_runner, "device", torch.device("cpu"))

    def adapter_builder(self, meta: Mapping[str, Any], lid: int) -> Any:
        """``trainer-format tensors -> LoRAModel``: converted to this engine's LoRA format, then built exactly as
        vLLM's disk loader would build it (on the engine's device unless told otherwise). ``modules``: build only
        these trainer modules (the trace's template, the sampled layers)."""
        from vllm.lora.lora_model import LoRAModel

        wm = self.worker.model_runner.lora_manager
        model = wm._adapter_manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)

        def build(
            tensors: Mapping[str, Tensor],
            dtype: torch.dtype | None = None,
            device: Any = None,
            modules: Sequence[str] | None = None,
        ) -> Any:
            part = meta
            if modules is not None:
                from hwsync.common.lora_formats import wire_name

                part = {**meta, "modules": {m: meta["modules"][m] for m in modules}}
                tensors = {k: tensors[k] for m in modules for f in ("A", "B") if (k := wire_name(m, f)) in tensors}
            vllm_tensors, vllm_config = self.to_vllm_format(tensors, part)
            lora = LoRAModel.from_lora_tensors(
                lora_model_id=lid,
                tensors=vllm_tensors,
                peft_helper=self._peft_helper(vllm_config),
                device=str(device if device is not None else self._device()),
                dtype=dtype or wm.lora_config.lora_dtype,
                model_vocab_size=wm.vocab_size,
                weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
                skip_prefixes=getattr(model, "lora_skip_prefixes", None),
            )
            lora.is_3d_lora_weight = False
            return lora

        return build

    def _trace_layout(self, manager: Any, build: Any, tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> Any:
        """The adapter's layout in vLLM (:class:`hwsync.engine.vllm.lora_slots.SlotWriter`), traced on a template layer,
        then checked on the real tensors of the sampled layers against vLLM's own construction; ``None`` (with the
        reason logged) where vLLM's path must build every install."""
        from hwsync.engine.vllm.compat import check_adapter
        from hwsync.engine.vllm.lora_slots import SlotWriter

        shapes = {k: tuple(t.shape) for k, t in tensors.items()}
        writer = SlotWriter.trace(manager, build, meta, shapes, self._device())
        if isinstance(writer, str):
            logger.info("hwsync: adapter installs go through vLLM's adapter construction: %s", writer)
            return None
        reference = build({k: v.detach() for k, v in tensors.items()}, modules=writer.groups.sampled)
        check_adapter(manager, reference)
        manager._create_merged_loras_inplace(reference)
        why = writer.matches(reference, tensors)
        if why:
            logger.warning(
                "hwsync: the traced adapter layout does not reproduce vLLM's (%s); adapter installs stay "
                "on vLLM's construction path",
                why,
            )
            return None
        return writer

    def drop_lora(self, lora_int_id: int) -> None:
        manager = lora_manager_of(self.worker)
        if manager is not None:
            manager.remove_adapter(lora_int_id)

    def has_lora(self, lora_int_id: int) -> bool:
        manager = lora_manager_of(self.worker)
        return manager is not None and lora_int_id in set(manager.list_adapters())
