"""The vLLM side of a sync: a worker extension plus the :class:`VllmApplier` it drives.

Use it with ``LLM(..., worker_extension_cls="hwsync.vllm_ext.HwsyncWorkerExtension")`` (or ``--worker-extension-cls``)
and ``collective_rpc("hwsync_...")``; :func:`hwsync.sync` does that for you, and also works on an in-process engine
started without the extension (it then calls the same methods with the worker as ``self``).

How weights land (vLLM 0.32, read from ``vllm/model_executor/model_loader/reload``): base tensors go through
``model_runner.reload_weights(weights_iterator=..., is_checkpoint_format=True)``. That restores every layer in
checkpoint format on ``meta`` with its weight loaders, buffers each layer's loads until the layer is complete,
re-runs the layer's ``process_weights_after_loading`` once, and copies the result into the *original* kernel
storage (identity kept, CUDA graphs stay valid). This avoids the two ways a second raw ``load_weights`` breaks an
engine: MoE checkpoint layout written over kernel layout (vLLM #42821) and, on the CPU build, repacked linears
whose ``weight_loader`` is gone. A layer that receives only part of its tensors would be processed from empty
storage, so the receiver refuses incomplete layers up front. Where vLLM skips a post-load step on reload (the CPU
MoE prepack, ``hwsync.patches.vllm_cpu_moe_prepack``), a probe-gated patch is held for the duration of the reload.

Adapters are installed from memory: ``LoRAModel.from_lora_tensors`` plus the validations vLLM's disk loader runs
(``PEFTHelper.validate_legal``, MoE 2-D/3-D format, classification heads), then the manager's remove + add under one
adapter id (what ``LoRARequest(load_inplace=True)`` does), pinned so the LRU never evicts it.
"""
from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from hwsync.errors import AdapterFormatError, ResolutionError, SyncError
from hwsync.sync.manifest import Manifest, TensorSpec, dtype_name
from hwsync.sync.receiver import Receiver

__all__ = ["HwsyncWorkerExtension", "VllmApplier", "LORA_NAME", "LORA_INT_ID"]

LORA_NAME = "hwsync"
LORA_INT_ID = 0x6873  # "hs": one adapter id, replaced in place on every sync
_PREPACK_PATCH = "vllm_cpu_moe_prepack"


# ---------------------------------------------------------------------------------------------------------------
# small vLLM helpers
# ---------------------------------------------------------------------------------------------------------------
def _model(worker: Any) -> torch.nn.Module:
    return worker.model_runner.get_model()


def _lora_manager(worker: Any) -> Any:
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
    loggers = [logging.getLogger(n) for n in (
        "vllm.model_executor.model_loader.reload.layerwise", "vllm.model_executor.model_loader.reload.inplace")]
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


def _names_plan(applier: VllmApplier, specs: Sequence[TensorSpec]) -> Any:
    """Resolve trainer names onto the live model with :mod:`hwsync.names` (all problems in one error)."""
    from hwsync.names import namespace_from_vllm_model, resolve

    ns = applier.__dict__.get("_namespace")
    if ns is None:
        ns = namespace_from_vllm_model(_model(applier.worker))
        applier.__dict__["_namespace"] = ns
    return resolve({sp.name: (sp.shape, sp.dtype) for sp in specs}, ns, cast=True)


def _vllm_spellings(names_plan: Any, weights: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """Trainer names -> the spellings vLLM's loader takes, lazily: one bucket in flight, never the whole model (the
    manifest was validated as a whole before the first tensor arrived)."""
    for name, t in weights:
        for load_name, fn in names_plan.vllm_checkpoint_names(name):
            yield load_name, (fn(t) if fn is not None else t)


def dry_run_load(
    model: torch.nn.Module, specs: Sequence[TensorSpec], names_plan: Any = None
) -> tuple[dict[str, str], dict[str, tuple[int, int, set[str]]]]:
    """Route ``specs`` through the model's own ``load_weights`` on ``meta`` tensors, writing nothing.

    Every layer is swapped, for the duration of the call, to the checkpoint-format ``meta`` parameters vLLM recorded
    for reloading (the same ones ``reload_weights`` restores), with weight loaders that only *count* what they would
    copy (vLLM's own ``CopyCounter``). This is exactly the decision the reload makes, so it tells, before any write:
    which names vLLM does not know, which shapes its loaders reject, and which layers would be only partly loaded.
    ``names_plan`` (a :class:`hwsync.names.Plan`) renames trainer names to the spellings vLLM's loader takes.
    Returns (trainer name -> engine layer path, {layer: (elements loaded, elements needed, names)} for partial layers).
    """
    import inspect

    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS, SKIP_TENSORS, get_numel_loaded, \
        to_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers, get_layer_tensors, \
        get_tensor_load_numel
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    path_of = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    current: list[str] = [""]
    loaded: dict[int, int] = {}
    names_of: dict[int, set[str]] = {}
    groups: dict[str, str] = {}
    saved: list[tuple[torch.nn.Module, dict[str, Tensor], dict[str, Tensor], set[str]]] = []

    def counting(layer: torch.nn.Module, original: Any) -> Any:
        signature = inspect.signature(original)

        def loader(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            n, ret = get_numel_loaded(original, bound)
            loaded[id(layer)] = loaded.get(id(layer), 0) + n
            names_of.setdefault(id(layer), set()).add(current[0])
            groups.setdefault(current[0], path_of.get(id(layer), "?"))
            return ret

        return loader

    def weights() -> Iterator[tuple[str, Tensor]]:
        for sp in specs:
            current[0] = sp.name
            meta = torch.empty(sp.shape, dtype=sp.dtype, device="meta")
            if names_plan is None:
                yield sp.name, meta
                continue
            for load_name, fn in names_plan.vllm_checkpoint_names(sp.name):
                yield load_name, fn(meta) if fn is not None else meta

    needed: dict[int, int] = {}
    try:
        for layer in model.modules():
            params, buffers = get_layer_params_buffers(layer)
            non_persistent = set(layer._non_persistent_buffers_set)
            saved.append((layer, params, buffers, non_persistent))
            r_params, r_buffers = get_layerwise_info(layer).restore_metadata
            for name in set(get_layer_tensors(layer)) | set(r_params) | set(r_buffers):
                if name not in SKIP_TENSORS and hasattr(layer, name):
                    delattr(layer, name)
            total = 0
            for name, meta in r_params.items():
                if name in SKIP_TENSORS:
                    continue
                t = to_meta_tensor(restore_layer_refs(meta, layer))
                if name not in SKIP_LOAD_TENSORS:
                    original = getattr(t, "weight_loader", default_weight_loader)
                    while getattr(original, "__name__", "") == "online_process_loader":  # left by a past reload
                        original = original.__wrapped__
                    t.weight_loader = counting(layer, original)
                    total += get_tensor_load_numel(t)
                layer.register_parameter(name, t)
            for name, meta in r_buffers.items():
                if name not in SKIP_TENSORS:
                    layer.register_buffer(name, to_meta_tensor(restore_layer_refs(meta, layer)),
                                          persistent=name not in non_persistent)
            needed[id(layer)] = total
        try:
            with torch.no_grad():
                model.load_weights(weights())
        except (KeyError, ValueError, AssertionError, RuntimeError, IndexError, TypeError) as e:
            raise ResolutionError(
                f"{current[0]}: the engine cannot load this tensor ({type(e).__name__}: {e}). Check the name "
                "(trainer naming: transformers runtime names, PEFT prefixes allowed) and the shape against the "
                "model vLLM serves"
            ) from e
    finally:
        for layer, params, buffers, non_persistent in saved:
            for name in list(get_layer_tensors(layer)):
                delattr(layer, name)
            for name, p in params.items():
                layer.register_parameter(name, p)
            for name, b in buffers.items():
                layer.register_buffer(name, b, persistent=name not in non_persistent)
    skipped = getattr(names_plan, "skipped", {})
    unknown = [sp.name for sp in specs if sp.name not in groups and sp.name not in skipped]
    if unknown:
        raise ResolutionError(
            f"{len(unknown)} tensor(s) map to no engine parameter, e.g. {unknown[:3]}: vLLM would silently drop them. "
            "Send only weights of the served model (trainer naming), or sync the model vLLM was started with"
        )
    by_layer = {id(m): m for m in model.modules()}
    partial = {
        path_of.get(lid, "?"): (n, needed.get(lid, 0), names_of.get(lid, set()))
        for lid, n in loaded.items()
        if n < needed.get(lid, 0) and lid in by_layer
    }
    return groups, partial


# ---------------------------------------------------------------------------------------------------------------
# the applier
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class _Plan:
    groups: dict[str, str] = field(default_factory=dict)  # trainer name -> engine layer (module path)
    names: Any = None  # hwsync.names.Plan: trainer name -> the spellings vLLM's loader takes


class VllmApplier:
    """Loads base weights and adapters into one vLLM worker (see the module docstring)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    # -- facts ----------------------------------------------------------------------------------------------------
    @property
    def vllm_config(self) -> Any:
        return self.worker.model_runner.vllm_config

    def describe(self, lora_paths: Sequence[str]) -> dict[str, Any]:
        import vllm

        from hwsync.capabilities import vllm_capabilities

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
        }
        manager = _lora_manager(self.worker)
        if cfg.lora_config is None or manager is None:
            info["lora_reason"] = "the engine was started without enable_lora"
            return info
        lc = cfg.lora_config
        lora_dtype = lc.lora_dtype if isinstance(lc.lora_dtype, torch.dtype) else mc.dtype
        packed = {k: list(v) for k, v in manager.packed_modules_mapping.items() if k != "experts"}
        info.update(
            lora_dtype=dtype_name(lora_dtype),
            max_lora_rank=int(lc.max_lora_rank),
            moe_format="3d" if getattr(manager, "_is_3d_moe_model", False) else "2d",
            packed_modules_mapping=packed,
            lora_modules=sorted(manager.modules),
            unservable={p: why for p in lora_paths if (why := self._unservable(manager, p)) is not None},
        )
        return info

    def _lora_module(self, manager: Any, path: str) -> tuple[str, Any]:
        """(module name vLLM files the LoRA under, the wrapper module serving it or None)."""
        from vllm.lora.utils import parse_fine_tuned_lora_name

        mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
        mapper = mapper.get_rename_mapper() if mapper is not None else None
        name, _ = parse_fine_tuned_lora_name(f"{path}.lora_A.weight", mapper)
        name = name.removesuffix(".base_layer")
        if name in manager.modules:
            return name, manager.modules[name]
        for packed, parts in manager.packed_modules_mapping.items():
            for part in parts:
                if name.endswith("." + part):
                    owner = name[: -len(part)] + packed
                    if owner in manager.modules:
                        return name, manager.modules[owner]
        m = re.match(r"^(.*\.experts)\.\d+\.[^.]+$", name)
        if m and m.group(1) in manager.modules:
            return name, manager.modules[m.group(1)]
        return name, None

    def _unservable(self, manager: Any, path: str) -> str | None:
        """Why vLLM cannot serve LoRA on ``path`` (phrased per module kind, not per instance), or ``None``."""
        from hwsync.capabilities import vllm_capabilities

        name, module = self._lora_module(manager, path)
        moe = vllm_capabilities()["moe_lora"]
        is_experts = re.search(r"\.experts(\.|$)", name) is not None
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

    # -- validation -----------------------------------------------------------------------------------------------
    def validate(self, manifest: Manifest) -> _Plan:
        if manifest.layout != "checkpoint":
            raise SyncError(f"manifest layout {manifest.layout!r} is not supported; send checkpoint-layout tensors")
        plan = _Plan()
        if manifest.base_specs:
            plan = self._resolve_base(manifest.base_specs, require_complete=True)
        if manifest.lora_specs:
            self._validate_lora(manifest)
        return plan

    def _resolve_base(self, specs: Sequence[TensorSpec], *, require_complete: bool) -> _Plan:
        key = (require_complete, tuple((sp.name, sp.shape, sp.dtype) for sp in specs))
        cache = self.__dict__.setdefault("_validated", {})
        if key in cache:
            return cache[key]
        model = _model(self.worker)
        names_plan = _names_plan(self, specs)
        groups, partial = dry_run_load(model, specs, names_plan)
        if require_complete and partial:
            layer, (got, total, names) = next(iter(partial.items()))
            raise ResolutionError(
                f"{len(partial)} engine layer(s) would be only partly rewritten, e.g. {layer}: {got} of {total} "
                f"elements from {sorted(names)[:4]}. vLLM re-processes a layer from its complete set of weights, so "
                "a sync must carry all tensors of every layer it touches (all of q/k/v, all experts of a MoE block)"
            )
        plan = _Plan(groups, names_plan)
        if len(cache) > 16:
            cache.clear()
        cache[key] = plan
        return plan

    def _peft_helper(self, config: Mapping[str, Any]) -> Any:
        from vllm.lora.peft_helper import PEFTHelper

        wm = self.worker.model_runner.lora_manager
        cfg = dict(config)
        cfg["vllm_max_position_embeddings"] = wm.max_position_embeddings
        try:
            helper = PEFTHelper.from_dict(cfg)
            helper.validate_legal(wm.lora_config)
        except ValueError as e:
            raise AdapterFormatError(f"vLLM refuses this adapter: {e}. Use strategy=\"full\" (merged weights)") from e
        return helper

    def _validate_lora(self, manifest: Manifest) -> None:
        manager = _lora_manager(self.worker)
        if manager is None:
            raise AdapterFormatError('the engine was started without enable_lora: use strategy="full" or restart '
                                     "vLLM with enable_lora=True")
        self._peft_helper(manifest.lora_config or {})
        if manifest.lora_int_id is not None and int(manifest.lora_int_id) <= 0:
            raise AdapterFormatError(f"lora_int_id must be positive (vLLM reserves 0 for 'no adapter'), got "
                                     f"{manifest.lora_int_id}")
        paths = sorted({s.name.rsplit(".", 2)[0] for s in manifest.lora_specs})
        for s in manifest.lora_specs:
            if not re.search(r"\.lora_[AB]\.weight$", s.name):
                raise AdapterFormatError(f"{s.name}: not a LoRA A/B tensor name")
        bad = {p: why for p in paths if (why := self._unservable(manager, p)) is not None}
        if bad:
            p, why = next(iter(bad.items()))
            raise AdapterFormatError(f"the engine cannot serve LoRA on {len(bad)} module(s), e.g. {p}: {why}. "
                                     'Use strategy="hybrid" (merged weights there) or "full"')
        if manifest.lora_base_names:
            specs = [TensorSpec(n, tuple(shape), torch.float32) for n, shape in manifest.lora_base_names.items()]
            self._resolve_base(specs, require_complete=False)  # names and shapes of what the LoRA adapts

    # -- loading --------------------------------------------------------------------------------------------------
    def load_base(self, plan: _Plan, weights: Iterator[tuple[str, Tensor]]) -> None:
        runner = self.worker.model_runner
        try:
            if plan.names is not None:
                weights = _vllm_spellings(plan.names, weights)
            with _quiet_partial_reload(), _patch_scope(_PREPACK_PATCH), torch.no_grad():
                runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        except BaseException:
            self._recover()
            raise

    def _recover(self) -> None:
        """A reload that raised mid-way leaves layers on ``meta``: put kernel tensors back (vLLM's own
        finalization), so the engine stays structurally usable while marked stale."""
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        model = _model(self.worker)
        with contextlib.suppress(Exception), _quiet_partial_reload(), torch.no_grad():
            finalize_layerwise_reload(model, self.vllm_config.model_config)
        with contextlib.suppress(Exception):
            self.worker.model_runner.reset_lora_state()

    def load_lora(self, tensors: Mapping[str, Tensor], config: Mapping[str, Any], name: str | None = None,
                  lora_int_id: int | None = None, replaces: int | None = None) -> tuple[str, int]:
        from vllm.lora.lora_model import LoRAModel

        name = LORA_NAME if name is None else name
        lid = LORA_INT_ID if lora_int_id is None else int(lora_int_id)
        if lid <= 0:
            raise AdapterFormatError(f"LoRA int id must be positive (vLLM reserves 0 for no adapter), got {lid}")
        wm = self.worker.model_runner.lora_manager
        manager = wm._adapter_manager
        helper = self._peft_helper(config)
        model = manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        lora = LoRAModel.from_lora_tensors(
            lora_model_id=lid,
            tensors=dict(tensors),
            peft_helper=helper,
            device="cpu",
            dtype=wm.lora_config.lora_dtype,
            model_vocab_size=wm.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        lora.is_3d_lora_weight = False
        try:
            manager._validate_moe_lora_format(lora)
            manager._validate_modules_to_save(lora)
            manager._validate_token_classification_lora(lora)
        except ValueError as e:
            raise AdapterFormatError(f"vLLM refuses this adapter: {e}") from e
        # validated: now replace in place under one id (load_inplace semantics), and drop a previous identity first
        # so an LRU cache of capacity max_cpu_loras never has to evict a pinned adapter
        if replaces is not None and replaces != lid:
            manager.remove_adapter(replaces)
        manager.remove_adapter(lid)
        manager.add_adapter(lora)
        with contextlib.suppress(NotImplementedError, AttributeError):
            manager.pin_adapter(lid)
        return name, lid

    def drop_lora(self, lora_int_id: int) -> None:
        manager = _lora_manager(self.worker)
        if manager is not None:
            manager.remove_adapter(lora_int_id)

    def has_lora(self, lora_int_id: int) -> bool:
        manager = _lora_manager(self.worker)
        return manager is not None and lora_int_id in set(manager.list_adapters())

    def after_sync(self) -> None:
        # reload_weights already reset LoRA/encoder/mm caches; the prefix cache lives in the scheduler and is
        # reset by the engine-side caller (LocalEngine / SyncServer).
        return None


# ---------------------------------------------------------------------------------------------------------------
# the worker extension
# ---------------------------------------------------------------------------------------------------------------
def _receiver(worker: Any) -> Receiver:
    rec = worker.__dict__.get("_hwsync_receiver")
    if rec is None:
        rec = Receiver(VllmApplier(worker))
        worker.__dict__["_hwsync_receiver"] = rec
    return rec


def _manifest(m: Manifest | str | bytes) -> Manifest:
    return m if isinstance(m, Manifest) else Manifest.from_json(m)


class HwsyncWorkerExtension:
    """Methods mixed into vLLM workers (``worker_extension_cls``); call them with ``collective_rpc``."""

    def hwsync_describe(self, lora_paths: Sequence[str] = ()) -> dict[str, Any]:
        """Engine facts for ``strategy="auto"`` plus receiver state; ``unservable`` covers ``lora_paths``."""
        return _receiver(self).describe(lora_paths)

    def hwsync_state(self) -> dict[str, Any]:
        """Version, staleness, served adapter."""
        return _receiver(self).refresh().to_dict()

    def hwsync_prepare(self, manifest: Manifest | str) -> dict[str, Any]:
        """Validate a manifest completely (nothing is written); raises the error a sync would."""
        m = _manifest(manifest)
        rec = _receiver(self)
        plan = rec.prepare(m)
        self.__dict__["_hwsync_plan"] = (m.version, plan)
        return {"ok": True, "version": m.version}

    def _hwsync_plan_for(self, m: Manifest) -> Any:
        cached = self.__dict__.pop("_hwsync_plan", None)
        if cached is not None and cached[0] == m.version:
            return cached[1]
        return _receiver(self).prepare(m)

    def hwsync_receive(self, manifest: Manifest | str, buckets: Any) -> dict[str, Any]:
        """Colocate: ``buckets`` is an in-process iterable of tensor lists (one per manifest bucket)."""
        m = _manifest(manifest)
        plan = HwsyncWorkerExtension._hwsync_plan_for(self, m)
        return _receiver(self).receive(m, plan, buckets)

    def hwsync_receive_dist(self, manifest: Manifest | str, link: Mapping[str, Any]) -> dict[str, Any]:
        """Server mode: join the sender's group described by ``link`` and receive the buckets by broadcast."""
        from hwsync.sync.remote import abort_reason, receive_buckets, worker_link

        m = _manifest(manifest)
        plan = HwsyncWorkerExtension._hwsync_plan_for(self, m)
        comm = worker_link(self, link)
        buckets = receive_buckets(m, comm, src=0, owner=self.__dict__, abort_reason=abort_reason(comm, link))
        return _receiver(self).receive(m, plan, buckets)

    def hwsync_check_servable(self) -> None:
        """Raise :class:`~hwsync.errors.StaleEngineError` while a partial weight set is loaded."""
        _receiver(self).check_servable()
