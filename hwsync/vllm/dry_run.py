"""Manifest validation before any write: route every tensor through the model's own loader, writing nothing.

A sync's manifest is checked against the live engine as a whole (unknown names, shapes vLLM's loaders reject, layers
that would be only partly rewritten) before the first byte is written, so a refused sync leaves the engine as it
was. See :func:`dry_run_load`.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from hwsync.errors import ResolutionError
from hwsync.wire import TensorSpec

__all__ = ["dry_run_load"]


def dry_run_load(
    model: torch.nn.Module, specs: Sequence[TensorSpec], names_plan: Any = None,
    transformed: set[str] | None = None,
) -> tuple[dict[str, str], dict[str, tuple[int, int, set[str]]]]:
    """Route ``specs`` through the model's own ``load_weights``, writing nothing.

    Every layer is swapped, for the duration of the call, to ``meta`` parameters: the checkpoint-format ones vLLM
    recorded for reloading (the same ones ``reload_weights`` restores), plus a ``meta`` copy of every parameter vLLM
    keeps live across a reload (``bias``, ``e_score_correction_bias``: their loaders would otherwise copy into the
    serving engine). Each parameter's weight loader is intercepted: the call is recorded (which trainer name lands
    in which engine parameter) and run on the ``meta`` tensors, counting what it would copy (vLLM's own
    ``CopyCounter``). A loader that cannot run on ``meta`` data (e.g. the packed-QKV bias loader: "Cannot copy out of
    meta tensor") is run again on a zero-filled scratch copy of that one parameter and of the loaded tensor, never on
    the live one. This is exactly the decision the reload makes, so it tells, before any write: which names vLLM
    does not know, which shapes its loaders reject, and which layers would be only partly loaded.
    ``names_plan`` (a :class:`hwsync.names.Plan`) renames trainer names to the spellings vLLM's loader takes.
    Returns (trainer name -> engine layer path, {layer: (elements loaded, elements needed, names)} for partial layers).
    ``transformed`` (optional) collects the trainer names whose tensor reached a weight loader as something other
    than a view of what was yielded: the model's ``load_weights`` computed a new tensor from it (Llama 4 permutes
    q/k for its rotary layout), so what the kernels read is not a re-layout of the trainer's values.
    """
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS, SKIP_TENSORS, to_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers, get_layer_tensors, \
        get_tensor_load_numel

    path_of = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    current: list[str] = [""]
    source: list[Tensor | None] = [None]
    loaded: dict[int, int] = {}
    names_of: dict[int, set[str]] = {}
    groups: dict[str, str] = {}
    saved: list[tuple[torch.nn.Module, dict[str, Tensor], dict[str, Tensor], set[str]]] = []

    def weights() -> Iterator[tuple[str, Tensor]]:
        for sp in specs:
            current[0] = sp.name
            meta = torch.empty(sp.shape, dtype=sp.dtype, device="meta")
            if names_plan is None:
                source[0] = meta
                yield sp.name, meta
                continue
            for load_name, fn in names_plan.vllm_checkpoint_names(sp.name):
                source[0] = fn(meta) if fn is not None else meta
                yield load_name, source[0]

    def stand_in(layer: torch.nn.Module, name: str, t: Tensor, counted: bool) -> int:
        """Register ``t`` (a meta tensor) as ``layer.name`` with an intercepting loader; the elements a complete
        load of the layer needs from it (0 for tensors vLLM's reload does not count, e.g. e_score_correction_bias)."""
        original = getattr(t, "weight_loader", None)
        while getattr(original, "__name__", "") == "online_process_loader":  # left by a past reload
            original = original.__wrapped__
        t.weight_loader = _Intercept(layer, f"{path_of.get(id(layer), '?')}.{name}".lstrip("."), original,
                                     current, loaded if counted else {}, names_of, groups, path_of)
        t.weight_loader.source, t.weight_loader.transformed = source, transformed
        layer.register_parameter(name, t)
        return get_tensor_load_numel(t) if counted else 0

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
                if name not in SKIP_TENSORS:
                    total += stand_in(layer, name, to_meta_tensor(restore_layer_refs(meta, layer)),
                                      name not in SKIP_LOAD_TENSORS)
            for name, meta in r_buffers.items():
                if name not in SKIP_TENSORS:
                    layer.register_buffer(name, to_meta_tensor(restore_layer_refs(meta, layer)),
                                          persistent=name not in non_persistent)
            # Parameters vLLM leaves live across a reload (bias, e_score_correction_bias; or a layer without reload
            # metadata): a meta copy keeps their loaders (and attributes) off the serving tensors.
            for name, p in list(layer._parameters.items()):
                if p is not None and not p.is_meta:
                    total += stand_in(layer, name, to_meta_tensor(p), name not in SKIP_LOAD_TENSORS)
            needed[id(layer)] = total
        try:
            with torch.no_grad():
                model.load_weights(weights())
        except _LoaderFailed as e:
            raise ResolutionError(
                f"{current[0]}: the engine cannot load this tensor into {e.param} (loader {e.loader}: "
                f"{type(e.cause).__name__}: {e.cause}). Check the name (trainer naming: transformers runtime names, "
                "PEFT prefixes allowed) and the shape against the model vLLM serves"
            ) from e.cause
        except (KeyError, ValueError, AssertionError, RuntimeError, IndexError, TypeError, NotImplementedError,
                AttributeError) as e:
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


class _LoaderFailed(Exception):
    """A weight loader refused a tensor on meta data and on a scratch copy: a real refusal (name, shape, layout)."""

    def __init__(self, param: str, loader: str, cause: BaseException) -> None:
        super().__init__(f"{param}: {loader}: {cause}")
        self.param, self.loader, self.cause = param, loader, cause


def _derived(t: Tensor, src: Tensor | None) -> bool:
    """Whether ``t`` is ``src`` or a view of it (or of the tensor ``src`` is a view of): a pure re-layout."""
    if src is None:
        return False
    roots = {id(src), id(src._base) if src._base is not None else id(src)}
    return id(t) in roots or (t._base is not None and id(t._base) in roots)


class _Intercept:
    """Stands in for one parameter's ``weight_loader`` during a dry run (see :func:`dry_run_load`)."""

    source: list[Tensor | None] = [None]
    transformed: set[str] | None = None

    def __init__(self, layer: torch.nn.Module, param: str, original: Any, current: list[str],
                 loaded: dict[int, int], names_of: dict[int, set[str]], groups: dict[str, str],
                 path_of: dict[int, str]) -> None:
        import inspect

        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        self.layer, self.param, self.current = layer, param, current
        self.loaded, self.names_of, self.groups, self.path_of = loaded, names_of, groups, path_of
        self.original = default_weight_loader if original is None else original
        if not callable(self.original):
            raise ResolutionError(f"engine parameter {param} has a weight_loader hwsync cannot call "
                                  f"({type(self.original).__name__}); it cannot be validated or synced")
        try:
            self.signature = inspect.signature(self.original)
        except (TypeError, ValueError) as e:
            raise ResolutionError(f"engine parameter {param}: unknown weight loader {self.name} (no signature: {e}); "
                                  "hwsync cannot validate a sync into it") from e
        self.__name__ = getattr(self.original, "__name__", "weight_loader")

    @property
    def name(self) -> str:
        return getattr(self.original, "__qualname__", None) or repr(self.original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from vllm.model_executor.model_loader.reload.meta import get_numel_loaded

        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise _LoaderFailed(self.param, self.name, e) from e
        bound.apply_defaults()
        if self.transformed is not None:
            given = bound.arguments.get("loaded_weight", next(iter(list(bound.arguments.values())[1:2]), None))
            if isinstance(given, Tensor) and not _derived(given, self.source[0]):
                self.transformed.add(self.current[0])
        try:
            n, ret = get_numel_loaded(self.original, bound)
        except Exception as on_meta:  # noqa: BLE001  (loaders raise anything on meta data; decided on scratch)
            try:
                n, ret = get_numel_loaded(self.original, _on_scratch(bound))
            except Exception as e:  # noqa: BLE001  (the loader's own refusal, reported with the parameter)
                raise _LoaderFailed(self.param, self.name, e) from on_meta
        key = id(self.layer)
        self.loaded[key] = self.loaded.get(key, 0) + n
        self.names_of.setdefault(key, set()).add(self.current[0])
        self.groups.setdefault(self.current[0], self.path_of.get(key, "?"))
        return ret


def _on_scratch(bound: Any) -> Any:
    """``bound`` with every meta tensor replaced by a zero-filled CPU tensor of the same shape, class and attributes
    (the parameter itself included): what a loader that needs data runs on. Nothing live is touched."""
    import copy

    def real(value: Any) -> Any:
        if isinstance(value, Tensor) and value.is_meta:
            t = torch.zeros(tuple(value.shape), dtype=value.dtype)
            if type(value) is not Tensor:
                t.__class__ = value.__class__
            t.__dict__ = value.__dict__.copy()
            return t
        return value

    scratch = copy.copy(bound)
    scratch.arguments = {k: real(v) for k, v in bound.arguments.items()}
    return scratch
