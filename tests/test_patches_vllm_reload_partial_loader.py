"""``vllm_reload_partial_loader``: vLLM's layerwise reload wraps a layer whose weight loader is a
``functools.partial`` (MiniMax-M2's q/k RMSNorm), instead of stopping every reload with AttributeError. Real vLLM
reload code on a real module, no engine (the model itself cannot be served by vLLM's CPU build)."""

from __future__ import annotations

import functools

import pytest
import torch

import hwsync.patches as patches
from hwsync.testing import require_vllm

pytestmark = pytest.mark.vllm


def _layer() -> torch.nn.Module:
    calls = []

    def sharded_loader(param: torch.Tensor, loaded: torch.Tensor, shard: int) -> None:
        calls.append(shard)
        param.data.copy_(loaded)

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
    layer.weight.weight_loader = functools.partial(sharded_loader, shard=0)
    layer.calls = calls
    return layer


def test_probe_finds_the_bug_and_the_patch_fixes_it() -> None:
    require_vllm()
    from vllm.model_executor.model_loader.reload import layerwise

    p = patches.get("vllm_reload_partial_loader")
    assert p.probe(refresh=True).state == patches.APPLIES, p.probe().reason
    with pytest.raises(AttributeError, match="__name__"):  # the bug, on the unpatched vLLM
        layerwise._wrap_parameters_weight_loader(_layer())
    original = layerwise._wrap_parameters_weight_loader
    with p.scoped():
        layer = _layer()
        layerwise.initialize_online_processing(layer)  # what reload_weights runs per layer
        wrapped = layer.weight.weight_loader
        assert wrapped.__name__ == "online_process_loader"
        layerwise._wrap_parameters_weight_loader(layer)  # idempotent: not wrapped twice
        assert layer.weight.weight_loader is wrapped
        assert layerwise._get_original_loader(layer.weight).func.__name__ == "sharded_loader"
    assert layerwise._wrap_parameters_weight_loader is original  # removed exactly
