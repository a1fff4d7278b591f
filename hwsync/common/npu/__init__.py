"""Ascend NPU backend: HCCL through ``torch.distributed``; ``torch_npu`` is imported lazily.

Only this package may import ``torch_npu`` / ``vllm_ascend``; merely listing backends (or importing
hwsync) never imports them, so hwsync stays importable on machines without CANN.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import TYPE_CHECKING, Any

import torch

from hwsync.common.backend import AcceleratorBackend
from hwsync.common.errors import BackendUnavailableError

if TYPE_CHECKING:
    from hwsync.common.transport.base import Link, LinkSpec

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
        if str(error) == INSTALL_HINT:
            return INSTALL_HINT
        if ".so" in str(error):  # the PyPI wheel without CANN: libhccl.so / libascendcl.so not found
            return (
                f"torch_npu failed to import: {error}; Ascend CANN is not installed or not on the library path "
                "(source /usr/local/Ascend/ascend-toolkit/set_env.sh)"
            )
        return f"torch_npu failed to import: {error}"

    def open_link(self, store: Any, spec: LinkSpec, rank: int, device: torch.device, secret: bytes = b"") -> Link:
        """A standalone HCCL group (:class:`hwsync.common.npu.link.HcclLink`) on ``device``."""
        reason = self.unavailable_reason()
        if reason is not None:
            raise BackendUnavailableError(f"no HCCL data plane: {reason}")
        from hwsync.common.npu.link import HcclLink

        return HcclLink(store, spec, rank, device)

    def _no_device_hint(self) -> str:
        visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
        suffix = f" (ASCEND_RT_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return f"torch_npu is installed but no NPU is visible{suffix}: check the CANN driver (npu-smi info)"
