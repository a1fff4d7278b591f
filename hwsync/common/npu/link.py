"""Server-mode data plane on Ascend: a standalone HCCL group (:class:`hwsync.common.transport.Link`).

Why torch_npu's ``ProcessGroupHCCL`` and not vllm-ascend's ``PyHcclCommunicator``: the group is built like the gloo
and NCCL links -- on a ``PrefixStore`` of the session's store, independent of any default group the trainer or
vLLM initialised -- and needs only ``torch_npu``. ``PyHcclCommunicator`` needs a second, non-HCCL group for its
unique-id exchange and imports vllm_ascend (and with it vLLM) into the trainer process.

Device and streams, as Ascend requires them:

* every call enters ``torch.npu.device(link.device)``: thread-pool workers start on device 0, not on the device
  their submitter used, and HCCL binds its communicator (created at the first collective) to the current device;
* ``broadcast`` is stream-ordered: ProcessGroupHCCL makes its own HCCL stream wait for the work already queued on
  the link device's current stream (so a bucket packed just before is complete), runs the broadcast there and
  returns at once; :meth:`HcclTransfer.wait` orders the current stream after it without blocking the host. vLLM's
  communicators instead default to a process-global cached stream, which is wrong after a device switch.

:class:`NpuRuntime` is the only place that touches ``torch_npu``; tests pass a stand-in runtime
(``tests/test_npu_hccl_link_standin.py``) because nothing here can run without CANN.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any, Protocol

import torch
import torch.distributed as dist

from hwsync.common.errors import BroadcastError
from hwsync.common.transport.base import LinkSpec

__all__ = ["HcclLink", "HcclTransfer", "NpuRuntime", "TorchNpuRuntime"]


class NpuRuntime(Protocol):
    """What the link needs from torch_npu (a protocol so that control flow is testable without CANN)."""

    def process_group(self, store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
        """A c10d backend object with ``broadcast([tensor], BroadcastOptions) -> Work``."""

    def device(self, index: int) -> contextlib.AbstractContextManager[Any]:
        """``torch.npu.device(index)``."""

    def current_device(self) -> int:
        """``torch.npu.current_device()``."""

    def torch_device(self, index: int) -> torch.device:
        """Where the tensors of NPU ``index`` live (``npu:index``)."""


class TorchNpuRuntime:
    """The real runtime: ``torch_npu._C._distributed_c10d.ProcessGroupHCCL`` and ``torch.npu``."""

    def __init__(self) -> None:
        import torch_npu  # only hwsync.common.npu may import it

        self._torch_npu = torch_npu
        self._npu = torch.npu  # type: ignore[attr-defined]  # registered by torch_npu

    def process_group(self, store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
        c10d = self._torch_npu._C._distributed_c10d
        options = c10d.ProcessGroupHCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        return c10d.ProcessGroupHCCL(store, rank, world_size, options)

    def device(self, index: int) -> contextlib.AbstractContextManager[Any]:
        return self._npu.device(index)

    def current_device(self) -> int:
        return int(self._npu.current_device())

    def torch_device(self, index: int) -> torch.device:
        return torch.device("npu", index)


def _npu_index(device: torch.device | str | int) -> int | None:
    """The NPU index of ``device`` (``torch.device`` knows the ``npu`` type only once torch_npu is imported)."""
    if isinstance(device, int):
        return device
    kind, _, index = str(device).partition(":")
    if kind != "npu" or (index and not index.isdigit()):
        raise BroadcastError(f"an HCCL link runs on an npu device, got {device!r}; open the link of its own backend")
    return int(index) if index else None


class HcclTransfer:
    """A broadcast in flight on the link's HCCL stream."""

    def __init__(self, work: Any, runtime: NpuRuntime, index: int) -> None:
        self._work = work
        self._runtime = runtime
        self._index = index

    def wait(self) -> None:
        """Order the caller's current stream (of the link's device) after the broadcast; the host does not block."""
        with self._runtime.device(self._index):
            self._work.wait()


class HcclLink:
    """Rank ``rank`` of a standalone HCCL group on ``device`` (rank 0: the trainer; 1..: engine workers)."""

    persistent = True  # kept between syncs (communicator setup is costly); not flood-tested: no NPU

    def __init__(
        self, store: Any, spec: LinkSpec, rank: int, device: torch.device | str | int, runtime: NpuRuntime | None = None
    ) -> None:
        self._runtime = runtime if runtime is not None else TorchNpuRuntime()
        index = _npu_index(device)
        index = index if index is not None else self._runtime.current_device()
        if not 0 <= rank < spec.world_size:
            raise BroadcastError(f"rank {rank} is outside the link's world of {spec.world_size}")
        self.index = index
        self.device = self._runtime.torch_device(index)
        self.rank = rank
        self.world_size = spec.world_size
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        with self._runtime.device(index):
            self._pg: Any = self._runtime.process_group(
                dist.PrefixStore(spec.prefix, store), rank, spec.world_size, timeout
            )

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> HcclTransfer:
        if self._pg is None:
            raise BroadcastError("the HCCL link is closed; open a new one (a later sync does)")
        if tensor.device != self.device or not tensor.is_contiguous():
            raise BroadcastError(
                f"the HCCL link sends contiguous tensors on {self.device}; got a "
                f"{'non-contiguous ' if not tensor.is_contiguous() else ''}tensor on {tensor.device}"
            )
        if not 0 <= src < self.world_size:
            raise BroadcastError(f"src={src} is not a rank of the link (world size {self.world_size})")
        options = dist.BroadcastOptions()
        options.rootRank = src
        options.rootTensor = 0
        with self._runtime.device(self.index):
            work = self._pg.broadcast([tensor], options)
        return HcclTransfer(work, self._runtime, self.index)

    def close(self) -> None:
        pg, self._pg = self._pg, None
        if pg is None:
            return
        with self._runtime.device(self.index):
            for name in ("shutdown", "abort"):  # release the HCCL communicator now, not at garbage collection
                release = getattr(pg, name, None)
                if callable(release):
                    release()
                    break

    def __repr__(self) -> str:
        state = "closed" if self._pg is None else "open"
        return f"<HcclLink rank={self.rank}/{self.world_size} device={self.device} {state}>"
