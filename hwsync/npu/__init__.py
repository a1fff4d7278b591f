"""Ascend NPU backend: HCCL through ``torch.distributed``; ``torch_npu`` is imported lazily.

Only this package may import ``torch_npu`` / ``vllm_ascend``; merely listing backends (or importing
hwsync) never imports them, so hwsync stays importable on machines without CANN.
"""
from __future__ import annotations

import importlib
import importlib.util
import os

from hwsync.backend import AcceleratorBackend

__all__ = ["NpuBackend", "INSTALL_HINT"]

INSTALL_HINT = "torch_npu is not installed: pip install 'hwsync[npu]' (needs Ascend CANN)"


class NpuBackend(AcceleratorBackend):
    """Huawei Ascend NPUs via ``torch_npu`` (which registers ``torch.npu``)."""

    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"
    priority = 30

    def _load_runtime(self) -> None:
        # find_spec first: a missing torch_npu costs a dict lookup, not a failed import per call.
        if importlib.util.find_spec("torch_npu") is None:
            raise ImportError(INSTALL_HINT)
        importlib.import_module("torch_npu")

    def _install_hint(self, error: ImportError) -> str:
        return str(error) if str(error) == INSTALL_HINT else f"torch_npu failed to import: {error}"

    def _no_device_hint(self) -> str:
        visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
        suffix = f" (ASCEND_RT_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return f"torch_npu is installed but no NPU is visible{suffix}: check the CANN driver (npu-smi info)"
