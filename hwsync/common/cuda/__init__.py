"""CUDA (and ROCm, which torch exposes as ``cuda``) backend: NCCL/RCCL through ``torch.distributed``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from hwsync.common.backend import AcceleratorBackend
from hwsync.common.gate import Gate

if TYPE_CHECKING:
    from hwsync.common.transport.base import Link, LinkSpec

__all__ = ["CudaBackend"]


class CudaBackend(AcceleratorBackend):
    """NVIDIA / AMD GPUs via ``torch.cuda``."""

    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    priority = 20
    traces_in_float64 = True
    verify_gates = {
        # fp32: the fused-MoE Triton matmuls run in TF32. Measured on an H100 (vLLM 0.32, 20 healthy full syncs,
        # benchmarks/verify_table.py): healthy max mean 0.017, p90 0.0079, mean |Δp| 0.0012; the faults the gate sees
        # start at mean 0.56
        "float32": Gate(mean_abs=0.1, p90_abs=0.3, mean_prob=0.02),
        # bf16, H100, 60 healthy syncs (full/adapter/hybrid): mean <= 0.26, mean |Δp| <= 0.013, but p90 of one
        # 36-token sample reached 0.98 once (a routing flip early in a greedy continuation moves every later token):
        # p90 is a loose backstop here, mean and mean |Δp| carry the gate; faults it sees start at mean 0.64, |Δp| 0.047
        "bfloat16": Gate(mean_abs=0.5, p90_abs=2.0, mean_prob=0.05),
    }

    @property
    def checks_in_copy(self) -> bool:  # type: ignore[override]
        from hwsync.common.cuda.checked_copy import available

        return available()

    def _no_device_hint(self) -> str:
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            return f"this torch build ({torch.__version__}) has no CUDA support: install a CUDA-enabled torch build"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        suffix = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return f"torch has CUDA support but no GPU is visible{suffix}: check the driver with nvidia-smi"

    def open_link(self, store: Any, spec: LinkSpec, rank: int, device: torch.device, secret: bytes = b"") -> Link:
        from hwsync.common.cuda.link import open_cuda_link

        return open_cuda_link(store, spec, rank, device)

    def checked_copy_all(
        self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], flag: torch.Tensor, *, alone: bool = False
    ) -> list[int]:
        from hwsync.common.cuda.checked_copy import MIN_BYTES, checked_copy_all

        return checked_copy_all(dsts, srcs, flag, MIN_BYTES if alone else 0)

    def capture(self, work: Callable[[], None], device: torch.device) -> Callable[[], None] | None:
        """A CUDA graph of ``work``, recorded on a side stream (``thread_local``: other threads' CUDA calls, e.g. an
        in-process engine's, do not break the recording). Memory ``work`` allocates stays with the graph."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(device):
            current = torch.cuda.current_stream()
            side = torch.cuda.Stream()
            side.wait_stream(current)
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    work()
                except BaseException:
                    # the recording is invalid anyway; the caller sees work's own error
                    with contextlib.suppress(RuntimeError):
                        graph.capture_end()
                    raise
                graph.capture_end()
            current.wait_stream(side)
        return graph.replay
