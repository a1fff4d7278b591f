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
