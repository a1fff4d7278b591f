"""Device-agnostic broadcast over a ``torch.distributed`` group or a vLLM-style communicator.

Why this exists: weight sync broadcasts from trainer to rollout workers through whatever the
deployment has — a ProcessGroup (gloo / nccl / hccl) or a vLLM device communicator
(``PyNcclCommunicator``, vllm-ascend's ``PyHcclCommunicator``). Those are easy to misuse in ways that
hang or silently corrupt: a tensor on the wrong device, a thread-pool worker whose current device is
0 instead of the rank's, vllm-ascend's process-global default stream used after a device switch, a
dtype the communicator's type table lacks (``bool`` in PyNccl). :func:`broadcast` handles all of
these the same way on every backend.

Semantics (identical for groups and communicators):

* Every rank passes a tensor of the same shape and dtype. On return, the *caller's* tensor holds the
  source's data on every rank (receivers are filled in place) and is returned.
* The transfer happens on the communicator's device. A tensor elsewhere (CPU, or another device of
  the same kind) is staged through a contiguous buffer there and copied back; a non-contiguous
  tensor is staged the same way. Copying between two *different accelerator kinds* is refused.
* The device's context is entered, and for communicators its current stream is passed explicitly,
  so the call is correct from threads that never set a current device.
* Data travels as raw bytes (a ``uint8`` view): broadcast is a bit copy, so every dtype — bf16,
  bool, fp8, uint16, complex, 0-d, empty — works on every transport.
* Invalid calls raise :class:`~hwsync.common.errors.BroadcastError` on *every* rank before any collective
  starts (checks depend only on arguments all ranks share), so a bad call never hangs a peer.
"""

from __future__ import annotations

import abc
import functools
import weakref
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from hwsync.common.backend import Backend, backend_for_device, known_backends
from hwsync.common.errors import BackendUnavailableError, BroadcastError
from hwsync.common.transport.pack import as_bytes, copy_all, pack, views

__all__ = ["Communicator", "broadcast", "broadcast_coalesced", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 512 << 20


@runtime_checkable
class Communicator(Protocol):
    """What :func:`broadcast` needs from a vLLM-style device communicator.

    ``src`` is the rank *inside* the communicator. ``world_size`` and ``rank`` are optional; when
    present, ``src`` is range-checked and the source skips its copy-back.
    """

    device: torch.device

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> Any: ...


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group_or_communicator: dist.ProcessGroup | Communicator | None = None,
) -> torch.Tensor:
    """Broadcast ``tensor`` from ``src`` to all ranks and return it, filled in place on receivers.

    ``group_or_communicator`` is a ``torch.distributed`` ProcessGroup (``src`` is a *global* rank,
    as in ``torch.distributed.broadcast``; ``None`` means the default group) or a communicator with
    ``.broadcast(tensor, src, stream=...)`` and ``.device`` (``src`` is its group rank).
    """
    _check_tensor(tensor)
    transport = _transport(group_or_communicator)
    transport.check_src(src)
    device = transport.device_for(tensor)
    _check_devices(tensor.device, device, transport)
    backend = _backend_for(device, transport)
    if tensor.numel() == 0:  # every rank has the same shape, so every rank skips: nothing to send
        return tensor
    with torch.no_grad(), backend.device_context(device):
        stream = backend.current_stream(device)
        in_place = tensor.device == device and tensor.is_contiguous()
        work = tensor if in_place else torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        is_src = transport.is_src(src)
        if not in_place and is_src is not False:
            work.copy_(tensor)
        transport.send(_as_bytes(work), src, stream)
        if not in_place and is_src is not True:
            tensor.copy_(work)
    return tensor


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor],
    src: int,
    group_or_communicator: dist.ProcessGroup | Communicator | None = None,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> list[torch.Tensor]:
    """Broadcast many tensors with one collective per ``bucket_bytes`` bucket instead of one each.

    Tensors (any mix of dtypes, shapes and devices) are packed back to back as bytes into one
    buffer on the communicator's device with :mod:`hwsync.common.transport.pack` (one ``_foreach_copy_`` on
    each side), so a bucket of thousands of LoRA tensors costs a handful of kernel launches, not
    one per tensor. A tensor larger than a bucket is sent alone. Same semantics as
    :func:`broadcast`: every rank passes the same shapes/dtypes in the same order and receivers are
    filled in place. Returns ``list(tensors)``.
    """
    tensors = list(tensors)
    if bucket_bytes <= 0:
        raise BroadcastError(f"bucket_bytes must be positive, got {bucket_bytes}")
    for t in tensors:
        _check_tensor(t)
    if not tensors:
        return tensors
    transport = _transport(group_or_communicator)
    transport.check_src(src)
    device = transport.device_for(tensors[0])
    for dev in {t.device for t in tensors}:
        _check_devices(dev, device, transport)
    backend = _backend_for(device, transport)
    is_src = transport.is_src(src)

    def flush(batch: list[torch.Tensor], sizes: list[int]) -> None:
        used = sum(sizes)
        buffer = pool[:used]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        byte_views = [_as_bytes(t) if t.is_contiguous() else _as_bytes(t.contiguous()) for t in batch]
        if is_src is not False:
            pack(buffer, offsets, byte_views, [torch.uint8] * len(batch))
        transport.send(buffer, src, backend.current_stream(device))
        if is_src is True:
            return
        slots = views(buffer, offsets, [(n,) for n in sizes], [torch.uint8] * len(batch))
        direct = [i for i, t in enumerate(batch) if t.device == device and t.is_contiguous()]
        if direct:
            copy_all([_as_bytes(batch[i]) for i in direct], [slots[i] for i in direct])
        for i in sorted(set(range(len(batch))) - set(direct)):
            t = batch[i]  # staged: off-device or non-contiguous receiver
            staged = torch.empty(t.shape, dtype=t.dtype, device=device)
            _as_bytes(staged).copy_(slots[i])
            t.copy_(staged)

    with torch.no_grad(), backend.device_context(device):
        nbytes = [t.numel() * t.element_size() for t in tensors]
        pool_size = min(bucket_bytes, sum(n for n in nbytes if n <= bucket_bytes))
        pool = torch.empty(pool_size, dtype=torch.uint8, device=device)
        batch: list[torch.Tensor] = []
        sizes: list[int] = []
        used = 0
        for t, n in zip(tensors, nbytes):
            if n == 0:
                continue
            if n > bucket_bytes:
                broadcast(t, src, group_or_communicator)
                continue
            if used + n > pool.numel():
                flush(batch, sizes)
                batch, sizes, used = [], [], 0
            batch.append(t)
            sizes.append(n)
            used += n
        if batch:
            flush(batch, sizes)
    return tensors


# ------------------------------------------------------------------------------------ internals


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_as_bytes = as_bytes


_SENDABLE_DTYPES: set[torch.dtype] = set()  # dtypes seen to pass the full check


def _check_tensor(tensor: Any) -> None:
    """Refuse what cannot travel as raw bytes; a fast path keeps this ~1 us for plain tensors."""
    cls = type(tensor)
    if (
        (cls is torch.Tensor or cls is torch.nn.Parameter)
        and tensor.dtype in _SENDABLE_DTYPES
        and tensor.layout is torch.strided
        and not tensor.is_nested
        and tensor.is_contiguous()
        and not tensor.is_meta
    ):
        return
    _check_tensor_fully(tensor)
    _SENDABLE_DTYPES.add(tensor.dtype)


def _check_tensor_fully(tensor: Any) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise BroadcastError(f"broadcast needs a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_quantized:
        raise BroadcastError(
            f"quantized tensor ({tensor.dtype}) cannot be broadcast as raw bytes: broadcast "
            "tensor.int_repr() and its quantization parameters, or tensor.dequantize()"
        )
    if tensor.layout != torch.strided:
        raise BroadcastError(f"tensor layout {tensor.layout} is not supported: call .to_dense() first")
    if getattr(tensor, "is_nested", False):
        raise BroadcastError("nested tensors are not supported: broadcast their components")
    if hasattr(tensor, "device_mesh") and hasattr(tensor, "to_local"):
        raise BroadcastError("DTensor is not supported: pass tensor.full_tensor() or tensor.to_local()")
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) and hasattr(tensor, "__tensor_flatten__"):
        raise BroadcastError(
            f"tensor subclass {type(tensor).__name__} wraps other tensors: broadcast its plain components"
        )
    if tensor.device.type == "meta":
        raise BroadcastError("tensor is on the meta device and holds no data: materialize it first")
    if any(st == 0 and sz > 1 for st, sz in zip(tensor.stride(), tensor.shape)):
        raise BroadcastError(
            "tensor has overlapping memory (an expand()ed view) and cannot receive data: pass .clone()"
        )
    error = _byte_view_error(tensor.dtype)
    if error is not None:
        raise BroadcastError(f"dtype {tensor.dtype} cannot be sent as raw bytes ({error})")


@functools.cache
def _byte_view_error(dtype: torch.dtype) -> str | None:
    try:
        torch.empty(1, dtype=dtype).view(torch.uint8)
    except (RuntimeError, TypeError) as e:
        return str(e)
    return None


def _check_devices(tensor_dev: torch.device, comm_dev: torch.device, transport: _Transport) -> None:
    if tensor_dev.type == comm_dev.type or "cpu" in (tensor_dev.type, comm_dev.type):
        return
    raise BroadcastError(
        f"tensor is on {tensor_dev} but {transport.describe()} runs on {comm_dev}: hwsync stages "
        f"between the CPU and the communicator's device, never between two accelerator kinds; "
        f"move the tensor to {comm_dev.type} (or the CPU) first, or use a {tensor_dev.type} communicator"
    )


def _backend_for(device: torch.device, transport: _Transport) -> Backend:
    try:
        return backend_for_device(device)
    except BackendUnavailableError as e:
        raise BroadcastError(f"{transport.describe()} runs on {device}, which this process cannot drive: {e}") from e


class _Transport(abc.ABC):
    @abc.abstractmethod
    def check_src(self, src: int) -> None: ...
    @abc.abstractmethod
    def is_src(self, src: int) -> bool | None: ...  # None: unknown (communicator without .rank)
    @abc.abstractmethod
    def device_for(self, tensor: torch.Tensor) -> torch.device: ...
    @abc.abstractmethod
    def send(self, buffer: torch.Tensor, src: int, stream: Any) -> None: ...
    @abc.abstractmethod
    def describe(self) -> str: ...


def _transport(obj: Any) -> _Transport:
    if obj is None or (dist.is_available() and isinstance(obj, dist.ProcessGroup)):
        return _GroupTransport(obj)
    if callable(getattr(obj, "broadcast", None)) and getattr(obj, "device", None) is not None:
        return _CommunicatorTransport(obj)
    raise BroadcastError(
        f"{type(obj).__name__} is neither a torch.distributed ProcessGroup nor a communicator with "
        ".broadcast(tensor, src, stream=...) and .device"
    )


class _GroupTransport(_Transport):
    # Facts about a group never change; caching them keeps per-call overhead to a few microseconds,
    # which matters when a LoRA adapter is sent as tens of thousands of small tensors.
    _facts: weakref.WeakKeyDictionary[Any, tuple[list[int], int, str, Any]] = weakref.WeakKeyDictionary()

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise BroadcastError(
                "torch.distributed is not initialized: call torch.distributed.init_process_group() "
                "or pass a communicator"
            )
        self.group = group
        world = group if group is not None else dist.group.WORLD
        facts = self._facts.get(world)
        if facts is None:
            if dist.get_rank(world) < 0:
                raise BroadcastError(f"this process (global rank {dist.get_rank()}) is not a member of the group")
            facts = (
                dist.get_process_group_ranks(world),
                dist.get_rank(),
                str(dist.get_backend(world)),
                getattr(world, "bound_device_id", None),
            )
            self._facts[world] = facts
        self.ranks, self.rank, self.dist_backend, self.bound = facts
        self.device_types = _device_types(self.dist_backend)

    def describe(self) -> str:
        return f"the {self.dist_backend} process group"

    def check_src(self, src: int) -> None:
        if not isinstance(src, int) or src not in self.ranks:
            shown = self.ranks if len(self.ranks) <= 8 else f"{self.ranks[:8]}..."
            raise BroadcastError(
                f"src={src!r} is not a rank of {self.describe()} (size {len(self.ranks)}, global "
                f"ranks {shown}); for a ProcessGroup src is a global rank, as in torch.distributed.broadcast"
            )

    def is_src(self, src: int) -> bool:
        return self.rank == src

    def device_for(self, tensor: torch.Tensor) -> torch.device:
        if self.device_types is None or tensor.device.type in self.device_types:
            return tensor.device
        kind = self.device_types[0]
        if kind == "cpu":
            return torch.device("cpu")
        if isinstance(self.bound, torch.device) and self.bound.type == kind:
            return self.bound
        # No bound device (init_process_group(device_id=...) not used): the thread's current one.
        return backend_for_device(kind).current_device()

    def send(self, buffer: torch.Tensor, src: int, stream: Any) -> None:
        dist.broadcast(buffer, src, group=self.group)


@functools.lru_cache(maxsize=64)
def _device_types(dist_backend: str) -> list[str] | None:
    """Device kinds a torch.distributed backend string serves ("cpu:gloo,cuda:nccl" -> cpu, cuda)."""
    by_dist: dict[str, list[str]] = {}
    for b in sorted(known_backends().values(), key=lambda b: -b.priority):
        by_dist.setdefault(b.dist_backend, []).append(b.device_type)
    kinds: list[str] = []
    for part in dist_backend.lower().split(","):
        dev, _, name = part.strip().rpartition(":")
        kinds.extend([dev] if dev else by_dist.get(name, []))
    return kinds or None


class _CommunicatorTransport(_Transport):
    def __init__(self, comm: Any) -> None:
        self.comm = comm
        try:
            self.device = torch.device(comm.device)
        except (RuntimeError, TypeError) as e:
            raise BroadcastError(f"communicator .device {comm.device!r} is not a torch device: {e}") from e
        self.world_size = getattr(comm, "world_size", None)
        self.rank = getattr(comm, "rank", None)

    def describe(self) -> str:
        return f"communicator {type(self.comm).__name__}"

    def check_src(self, src: int) -> None:
        bad = not isinstance(src, int) or src < 0
        if isinstance(self.world_size, int):
            bad = bad or src >= self.world_size
        if bad:
            size = f" of world_size {self.world_size}" if isinstance(self.world_size, int) else ""
            raise BroadcastError(
                f"src={src!r} is out of range for {self.describe()}{size}; for a communicator src is "
                "the rank inside the communicator's group, not a global rank"
            )

    def is_src(self, src: int) -> bool | None:
        return self.rank == src if isinstance(self.rank, int) else None

    def device_for(self, tensor: torch.Tensor) -> torch.device:
        return self.device

    def send(self, buffer: torch.Tensor, src: int, stream: Any) -> None:
        self.comm.broadcast(buffer, src, stream=stream)
