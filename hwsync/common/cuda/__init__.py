"""CUDA (and ROCm, which torch exposes as ``cuda``) backend: NCCL/RCCL through ``torch.distributed``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from hwsync.common.backend import AcceleratorBackend

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
