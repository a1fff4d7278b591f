"""Device backends: one small object per device kind, discovered through entry points.

A :class:`Backend` answers the few questions hwsync's device-agnostic code must ask about hardware —
which ``torch.distributed`` backend to use, how to make a device current, which stream is current —
so no module outside ``hwsync/<backend>/`` needs to know whether it runs on CUDA, an Ascend NPU or
a CPU. Backends are found through the ``hwsync.backends`` entry-point group, so a third party can
add one (say XPU) without editing hwsync; :func:`register_backend` does the same in-process.
"""

from __future__ import annotations

import abc
import contextlib
import importlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from importlib import metadata
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from hwsync.common.config import raw
from hwsync.common.errors import BackendUnavailableError
from hwsync.common.gate import Gate

if TYPE_CHECKING:
    from hwsync.common.transport.base import Link, LinkSpec

__all__ = [
    "Backend",
    "AcceleratorBackend",
    "ENTRY_POINT_GROUP",
    "ENV_VAR",
    "register_backend",
    "unregister_backend",
    "refresh_backends",
    "get_backend",
    "available_backends",
    "backend_for_device",
    "open_link",
    "known_backends",
]

ENTRY_POINT_GROUP = "hwsync.backends"
ENV_VAR = "HWSYNC_BACKEND"

DeviceLike = torch.device | str | int | None


class Backend(abc.ABC):
    """What hwsync needs to know about one device kind.

    Subclasses set the three class attributes and implement the abstract methods. Constructing a
    backend must be cheap and must not import a device runtime: availability is asked for
    separately, so that listing backends never fails because one runtime is missing.
    """

    name: ClassVar[str]
    """Registry name, also accepted by ``HWSYNC_BACKEND`` (``"cpu"``, ``"cuda"``, ``"npu"``)."""
    device_type: ClassVar[str]
    """``torch.device`` type this backend drives."""
    dist_backend: ClassVar[str]
    """``torch.distributed`` backend for this device kind (``"gloo"``, ``"nccl"``, ``"hccl"``)."""
    priority: ClassVar[int] = 0
    """Auto-detection order: the available backend with the highest priority wins."""
    checks_in_copy: ClassVar[bool] = False
    """Whether :meth:`checked_copy_all` can take any pair here (otherwise the non-finite check reduces separately)."""
    bucket_mb: ClassVar[float] = 512.0
    """A sync's bucket size where the caller gives none (``HWSYNC_BUCKET_MB`` wins): a device link reaches its speed
    with buckets of 512 MB-1 GB (verl: 2048 MB, ms-swift: 512 MB, vLLM's own transfer: 1 GB x 2)."""
    traces_in_float64: ClassVar[bool] = False
    """Whether LoRA slot layouts are traced on this device (float64 probes): cheap on GPUs; elsewhere (the CPU, NPUs
    without general float64) the trace runs on the host."""
    verify_gates: ClassVar[Mapping[str, Gate]] = {}
    """Engine dtype -> verify's logprob gate measured on this device (:mod:`hwsync.common.gate`, docs/verify.md); a
    dtype without one gets the loosest gate."""

    @abc.abstractmethod
    def is_available(self) -> bool:
        """True when the runtime is importable and at least one device is visible."""

    def unavailable_reason(self) -> str | None:
        """``None`` when available, else a sentence naming what is missing and how to fix it."""
        return None if self.is_available() else f"no {self.device_type} device is visible"

    @abc.abstractmethod
    def device_count(self) -> int:
        """Number of visible devices (0 when unavailable)."""

    @abc.abstractmethod
    def current_device(self) -> torch.device:
        """The calling thread's current device of this kind."""

    def device(self, index: int | None = None) -> torch.device:
        """``torch.device`` of this kind; ``index=None`` means the calling thread's current device."""
        return self.current_device() if index is None else torch.device(self.device_type, index)

    @abc.abstractmethod
    def device_context(self, device: DeviceLike) -> contextlib.AbstractContextManager[None]:
        """Context that makes ``device`` current for the calling thread (thread-pool workers start
        on device 0, not on the device their submitter used)."""

    @abc.abstractmethod
    def current_stream(self, device: DeviceLike = None) -> torch.Stream | None:
        """The current stream of ``device`` as the runtime's own stream class (communicators such as
        vLLM's ``PyNcclCommunicator`` read runtime-specific attributes like ``cuda_stream``), or
        ``None`` for devices without streams."""

    @abc.abstractmethod
    def synchronize(self, device: DeviceLike = None) -> None:
        """Block the host until all work queued on ``device`` has finished."""

    def free_memory(self, device: DeviceLike = None) -> int | None:
        """Bytes a new allocation on ``device`` can still get (the runtime's free memory plus what torch's caching
        allocator holds unused); ``None`` where the backend cannot tell (host memory)."""
        return None

    def open_link(self, store: Any, spec: LinkSpec, rank: int, device: torch.device, secret: bytes = b"") -> Link:
        """This device kind's data plane (:class:`hwsync.common.transport.Link`): rank ``rank`` of the group ``spec``
        describes, rendezvous through ``store`` (a ``torch.distributed.Store``) under ``spec.prefix``; ``secret``
        (the sync's data key) authenticates the peers where the link can (the CPU's framed link)."""
        raise BackendUnavailableError(f"the {self.name} backend has no data plane for server mode")

    def capture(self, work: Callable[[], None], device: torch.device) -> Callable[[], None] | None:
        """``work``'s device work on ``device`` recorded once, returned as one launch that repeats it on the current
        stream (a CUDA graph), or ``None`` where this device kind records no graphs (``work`` then runs as it is).
        Nothing runs while recording. Used for the per-sync copies whose tensors stay put (:mod:`hwsync.common.replay`):
        thousands of kernel launches become one."""
        return None

    def checked_copy_all(
        self, dsts: Sequence[Tensor], srcs: Sequence[Tensor], flag: Tensor, *, alone: bool = False
    ) -> list[int]:
        """``dst.copy_(src)`` for every pair this backend can check as it copies, setting ``flag`` (a device ``int32``)
        to 1 where one of those sources holds a NaN or an infinity, reading each source once and launching once per
        group, not per pair; returns the indices of the pairs it left alone (nothing done: the caller copies and
        checks them separately, :mod:`hwsync.common.finite`). ``alone``: the pairs are one tensor's copy outside a
        queued bucket, taken only where a launch of their own pays. Default: no such copy, every pair left."""
        return list(range(len(srcs)))

    def owns(self, device: DeviceLike) -> bool:
        """True when ``device`` is of this backend's kind."""
        return as_device(device).type == self.device_type

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r} dist_backend={self.dist_backend!r}>"


class AcceleratorBackend(Backend):
    """A backend whose runtime registers a ``torch.<device_type>`` device module.

    Everything goes through ``torch.get_device_module(device_type)`` — the runtime's own module,
    which returns its own stream class — rather than hand-rolled per-runtime dispatch.
    ``torch.accelerator`` answers availability when the runtime is torch's current accelerator.
    Subclasses only override :meth:`_load_runtime` when a runtime needs an import (``torch_npu``).
    """

    def _load_runtime(self) -> None:
        """Import whatever makes ``torch.<device_type>`` exist; raise ImportError if missing."""

    def _runtime_error(self) -> str | None:
        # Cached: a failed import is retried by Python on every attempt, and is slow for big runtimes.
        if not hasattr(self, "_runtime_error_cache"):
            try:
                self._load_runtime()
                error = None
            except ImportError as e:
                error = self._install_hint(e)
            except Exception as e:  # noqa: BLE001 - a broken driver install raises anything
                error = f"the {self.name} runtime failed to import: {type(e).__name__}: {e}"
            self._runtime_error_cache = error
        return self._runtime_error_cache

    def _install_hint(self, error: ImportError) -> str:
        return f"the {self.name} runtime is not installed ({error})"

    def _module(self) -> ModuleType:
        module: ModuleType | None = getattr(self, "_device_module", None)  # cached: on every broadcast's path
        if module is None:
            self._load_runtime()
            module = self._device_module = torch.get_device_module(self.device_type)
        return module

    def device_count(self) -> int:
        if self._runtime_error() is not None:
            return 0
        accel = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
        if accel is not None and accel.type == self.device_type:
            return torch.accelerator.device_count()
        module = self._module()
        return int(module.device_count()) if module.is_available() else 0

    def is_available(self) -> bool:
        return self.device_count() > 0

    def unavailable_reason(self) -> str | None:
        error = self._runtime_error()
        if error is not None:
            return error
        if self.device_count() == 0:
            return self._no_device_hint()
        return None

    def _no_device_hint(self) -> str:
        return f"{self.name} runtime is installed but no {self.device_type} device is visible"

    def _index(self, device: DeviceLike) -> int:
        if device is None:
            return self.current_device().index or 0
        dev = as_device(device, default_type=self.device_type)
        if dev.type != self.device_type:
            raise BackendUnavailableError(
                f"{self.name} backend asked about device {dev}; pass a {self.device_type} device"
            )
        return dev.index if dev.index is not None else (self.current_device().index or 0)

    def current_device(self) -> torch.device:
        return torch.device(self.device_type, self._module().current_device())

    def device_context(self, device: DeviceLike) -> contextlib.AbstractContextManager[None]:
        context: contextlib.AbstractContextManager[None] = self._module().device(self._index(device))
        return context

    def current_stream(self, device: DeviceLike = None) -> torch.Stream:
        stream: torch.Stream = self._module().current_stream(self._index(device))
        return stream

    def synchronize(self, device: DeviceLike = None) -> None:
        self._module().synchronize(self._index(device))

    def free_memory(self, device: DeviceLike = None) -> int | None:
        module, index = self._module(), self._index(device)
        try:
            free, _total = module.mem_get_info(index)
            cached = int(module.memory_reserved(index)) - int(module.memory_allocated(index))
        except (AttributeError, RuntimeError):
            return None
        return int(free) + max(cached, 0)


def as_device(device: DeviceLike, default_type: str = "cpu") -> torch.device:
    if isinstance(device, torch.device):
        return device
    if isinstance(device, int):
        return torch.device(default_type, device)
    if device is None:
        return torch.device(default_type)
    return torch.device(device)


# --------------------------------------------------------------------------------------- registry

# Built-ins also work from a source checkout that was never pip-installed (no entry-point metadata).
_BUILTIN = {
    "cpu": "hwsync.common.cpu:CpuBackend",
    "cuda": "hwsync.common.cuda:CudaBackend",
    "npu": "hwsync.common.npu:NpuBackend",
}

_lock = threading.RLock()
_registered: dict[str, type[Backend]] = {}  # register_backend(): wins over entry points
_discovered: dict[str, type[Backend]] | None = None
_load_errors: dict[str, str] = {}
_instances: dict[str, Backend] = {}
_by_device_type: dict[str, Backend] = {}  # backend_for_device() answers, reset by register_backend()


def register_backend(cls: type[Backend], *, replace: bool = False) -> type[Backend]:
    """Register ``cls`` under ``cls.name`` for this process (usable as a class decorator).

    Entry points (group ``hwsync.backends``) are the way to ship a backend; this is for tests and
    for code that builds a backend at run time. ``replace=True`` overrides an existing name.
    """
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise BackendUnavailableError(f"{cls!r} is not a hwsync.Backend subclass")
    for attr in ("name", "device_type", "dist_backend"):
        if not isinstance(getattr(cls, attr, None), str):
            raise BackendUnavailableError(f"backend {cls.__name__} must set class attribute {attr!r}")
    with _lock:
        if cls.name in _known_locked() and not replace and _known_locked()[cls.name] is not cls:
            raise BackendUnavailableError(
                f"a backend named {cls.name!r} is already registered; pass replace=True to override"
            )
        _registered[cls.name] = cls
        _instances.pop(cls.name, None)
        _by_device_type.clear()
    return cls


def unregister_backend(name: str) -> None:
    """Undo :func:`register_backend` (entry-point backends stay; they come back on next lookup)."""
    with _lock:
        _registered.pop(name, None)
        _instances.pop(name, None)
        _by_device_type.clear()


def refresh_backends() -> None:
    """Forget discovered entry points, e.g. after installing a backend plugin into a live process."""
    global _discovered
    with _lock:
        _discovered = None
        _load_errors.clear()
        _instances.clear()
        _by_device_type.clear()


def _discover() -> dict[str, type[Backend]]:
    found: dict[str, type[Backend]] = {}
    targets = dict(_BUILTIN)
    try:
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            targets[ep.name] = ep.value
    except Exception:  # noqa: BLE001 - broken metadata must not hide the built-ins
        pass
    for name, target in targets.items():
        module_name, _, attr = target.partition(":")
        try:
            cls = importlib.import_module(module_name)
            for part in filter(None, attr.split(".")):
                cls = getattr(cls, part)
        except Exception as e:  # noqa: BLE001 - one broken plugin must not break the others
            _load_errors[name] = f"entry point {name} = {target} failed to load: {type(e).__name__}: {e}"
            continue
        if isinstance(cls, type) and issubclass(cls, Backend):
            found[name] = cls
        else:
            _load_errors[name] = f"entry point {name} = {target} is not a hwsync.Backend subclass"
    return found


def _known_locked() -> dict[str, type[Backend]]:
    global _discovered
    if _discovered is None:
        _discovered = _discover()
    return {**_discovered, **_registered}


def known_backends() -> dict[str, Backend]:
    """Every registered backend by name, available or not (ask each one ``unavailable_reason()``)."""
    with _lock:
        classes = _known_locked()
        for name, cls in classes.items():
            if name not in _instances or type(_instances[name]) is not cls:
                _instances[name] = cls()
        return {name: _instances[name] for name in classes}


def available_backends() -> dict[str, Backend]:
    """The backends usable in this process right now, best (auto-detect winner) first."""
    return {b.name: b for b in _iter_by_priority(known_backends()) if b.unavailable_reason() is None}


def _iter_by_priority(backends: dict[str, Backend]) -> Iterator[Backend]:
    return iter(sorted(backends.values(), key=lambda b: (-b.priority, b.name)))


def get_backend(name: str | None = None) -> Backend:
    """The backend to use: ``name``, else ``$HWSYNC_BACKEND``, else the best available one.

    Auto-detection prefers the highest ``priority`` (npu > cuda > cpu). Raises
    :class:`~hwsync.common.errors.BackendUnavailableError` when the name is unknown or its runtime or
    devices are missing; the message says what to install or check.
    """
    requested = name or raw(ENV_VAR) or None
    backends = known_backends()
    if requested is None:
        for backend in _iter_by_priority(backends):
            if backend.is_available():
                return backend
        raise BackendUnavailableError(
            "no hwsync backend is available (not even cpu): "
            + "; ".join(f"{n}: {b.unavailable_reason()}" for n, b in backends.items())
        )
    requested = requested.strip().lower()
    found = backends.get(requested)
    if found is None:
        origin = f" (from ${ENV_VAR})" if name is None else ""
        extra = f"; {_load_errors[requested]}" if requested in _load_errors else ""
        raise BackendUnavailableError(
            f"unknown hwsync backend {requested!r}{origin}; known: {', '.join(sorted(backends))}. "
            f"Third-party backends register in the {ENTRY_POINT_GROUP!r} entry-point group{extra}"
        )
    reason = found.unavailable_reason()
    if reason is not None:
        raise BackendUnavailableError(f"hwsync backend {requested!r} is unavailable: {reason}")
    return found


def backend_for_device(device: DeviceLike) -> Backend:
    """The available backend that drives ``device``'s kind (``cuda:1`` -> the cuda backend)."""
    dev = as_device(device)
    cached = _by_device_type.get(dev.type)
    if cached is not None:
        return cached
    backend = _backend_for_device_type(dev)
    with _lock:
        _by_device_type[dev.type] = backend
    return backend


def open_link(store: Any, spec: LinkSpec, rank: int, device: torch.device, secret: bytes = b"") -> Link:
    """The link (:class:`hwsync.common.transport.Link`) of ``device``'s backend (gloo / NCCL / HCCL) for rank ``rank``
    of ``spec``."""
    return backend_for_device(device).open_link(store, spec, rank, device, secret)


def _backend_for_device_type(dev: torch.device) -> Backend:
    backends = known_backends()
    matches = [b for b in _iter_by_priority(backends) if b.device_type == dev.type]
    if not matches:
        kinds = sorted({b.device_type for b in backends.values()})
        raise BackendUnavailableError(
            f"no hwsync backend drives device {dev} (backends exist for: {', '.join(kinds)}); "
            f"register one in the {ENTRY_POINT_GROUP!r} entry-point group"
        )
    for backend in matches:
        if backend.unavailable_reason() is None:
            return backend
    raise BackendUnavailableError(
        f"device {dev} needs the {matches[0].name!r} backend, which is unavailable in this "
        f"process: {matches[0].unavailable_reason()}"
    )
