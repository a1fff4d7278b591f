"""vLLM's sleep mode as hwsync sees it, per worker: asleep or not, and what a level-2 sleep discarded.

vLLM 0.32 sleeps a worker through ``Worker.sleep(level)`` / ``Worker.wake_up(tags)`` / ``Worker.discard(tags)``
(``LLM.sleep``, the ``/sleep`` route and ``collective_rpc`` all end there, called by name through the executor's RPC).
Level 1 offloads the weights pool to host memory and copies it back; level 2 (and a discard of the ``weights`` tag)
saves the parameters named in ``model_config.sleep_preserve_parameter_names`` and every buffer, then unmaps the pool:
on wake CuMemAllocator maps fresh memory at the same virtual addresses, contents undefined, and vLLM copies the saved
parameters and buffers back. Everything else in the pool -- parameters, LoRA slot tensors, tensors a layer's post-load
processing derived -- holds garbage until someone writes it.

:class:`SleepWatch` observes those three calls of one worker. vLLM has no hook for it: a worker extension is
appended behind the worker class's bases and may not name ``sleep`` (vLLM asserts), and the sleep-mode backend
(``SleepModeBackendFactory``) only the GPU worker reaches. Every sleep path does reach the worker through its
``WorkerWrapperBase``, by name: the ledgered patch ``vllm_sleep_watch`` (:mod:`hwsync.patches.vllm_sleep_watch`) hands
the watch each of those calls there, around whatever the worker's method is (any worker class: GPU, CPU, NPU). The
watch holds that patch while its worker lives; nothing of vLLM stays patched once no watched worker is left.

On a level-2 sleep the watch

* records what is discarded (:class:`Discarded`): parameters not preserved by vLLM, module paths holding other device
  tensors (LoRA slots and vLLM's logits mapping are refilled by hwsync; anything else only a layer's post-load
  processing rebuilds, so those layers are refilled through vLLM's reload), and every tensor's address;
* tells the receiver the base is gone (:meth:`hwsync.engine.receiver.Receiver.forget`): the engine is stale and the next
  sync must carry the base, adapter strategy included (a "full refill");
* on wake compares the addresses: where all survived, the refill writes in place as before; where any moved, every
  in-place plan is dropped and the refill takes the first-sync path (vLLM's reload, vLLM's adapter activation).

While the weights are asleep (any level) nothing that reads or writes them may run: :func:`check_awake`; while the KV
cache sleeps (integrations wake ``weights`` for the sync and ``kv_cache`` only after it) vLLM pauses the engine's
scheduler, so nothing may generate: :func:`check_engine_awake`. A worker vLLM slept before hwsync attached to it
(ms-swift and TRL sleep the engine right after building it) is adopted by the watch: what that sleep discarded is
unknown, so its weights count as discarded and the first sync carries the base.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from hwsync.common.errors import EngineAsleepError
from hwsync.patches.vllm_sleep_watch import observe, observer_of

__all__ = [
    "Discarded",
    "SleepWatch",
    "check_awake",
    "check_engine_awake",
    "device_tensors",
    "engine_asleep",
    "pool_asleep",
    "sleep_backend",
    "watch",
]

logger = logging.getLogger("hwsync.vllm")

AWAKE_NOT_NEEDED = frozenset({"describe", "state", "check_servable", "mark_stale"})
"""Worker functions that read no weight contents: they run while the engine sleeps."""

LORA_SLOT_ATTRS = ("_stacked", "adapter_enabled")
"""Suffixes / names of the LoRA layers' slot tensors (refilled by the adapter sync or vLLM's activation)."""
NOT_WEIGHTS = frozenset({"kv_cache"})
"""Tensor attributes outside the weights pool: the KV cache (vLLM's ``kv_cache`` tag; it resets the prefix cache on
sleep). Attributes ending in ``_cpu`` are host copies (``_k_scale_cpu``), never in device memory."""
LOGITS_MAPPING = "sharded_to_full_mapping_gpu"
"""vLLM's TP logits mapping of ``LogitsProcessorWithLoRA``: rebuilt by its own ``reset_sharded_to_full_mapping``."""


Location = tuple[torch.nn.Module, str, str, "int | None"]
"""Where a module holds a tensor: ``(module, "param" | "buffer" | "attr", name, index in a tuple / list attribute or
None)``."""


def device_tensors(model: torch.nn.Module) -> Iterator[tuple[str, str, Tensor]]:
    """``(kind, name, tensor)`` for every weights-pool tensor a module of ``model`` holds: ``param``, ``buffer``,
    ``slot`` (LoRA slot tensors), ``mapping`` (vLLM's logits mapping) or ``derived`` (any other tensor attribute: what
    post-load processing made; :data:`NOT_WEIGHTS` and host copies left out). ``name`` is
    ``<module path>.<attribute>[<index>]``."""
    for kind, name, t, _where in _located(model):
        yield kind, name, t


def _located(model: torch.nn.Module) -> Iterator[tuple[str, str, Tensor, Location]]:
    """:func:`device_tensors` with where each tensor is held (:data:`Location`), to read it again without a walk."""
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        for n, p in module._parameters.items():
            if p is not None:
                yield "param", prefix + n, p, (module, "param", n, None)
        for n, b in module._buffers.items():
            if b is not None:
                yield "buffer", prefix + n, b, (module, "buffer", n, None)
        for attr, value in vars(module).items():
            if attr in NOT_WEIGHTS or attr.endswith("_cpu"):
                continue
            items = value if isinstance(value, (tuple, list)) else (value,)
            kind = (
                "slot"
                if attr.endswith(LORA_SLOT_ATTRS[0]) or attr == LORA_SLOT_ATTRS[1]
                else "mapping"
                if attr == LOGITS_MAPPING
                else "derived"
            )
            for i, t in enumerate(items):
                if isinstance(t, Tensor) and not isinstance(t, torch.nn.Parameter) and t.numel():
                    index = i if value is not t else None
                    yield (
                        kind,
                        f"{prefix}{attr}" + (f"[{i}]" if index is not None else ""),
                        t,
                        (module, "attr", attr, index),
                    )


def _read(where: Location) -> Tensor | None:
    """The tensor held at ``where`` now (``None`` where nothing is)."""
    module, how, name, index = where
    if how == "param":
        value: Any = module._parameters.get(name)
    elif how == "buffer":
        value = module._buffers.get(name)
    else:
        value = vars(module).get(name)
        if index is not None:
            value = value[index] if isinstance(value, (tuple, list)) and index < len(value) else None
    return value if isinstance(value, Tensor) else None


def _address(t: Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    return id(t), t.data_ptr(), tuple(t.shape), tuple(t.stride())


@dataclass
class Discarded:
    """What one level-2 sleep left undefined (``moved`` is known once the weights woke)."""

    reason: str
    params: frozenset[str]
    """Live parameter names vLLM does not restore (not in ``sleep_preserve_parameter_names``; empty ones skipped)."""
    derived: frozenset[str]
    """``derived`` tensors (``<module path>.<attribute>[<index>]``): their layers are refilled through vLLM's reload."""
    addresses: dict[str, tuple[int, int, tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    where: dict[str, Location] = field(default_factory=dict, repr=False)
    """Where each tensor of ``addresses`` is held: the wake reads them there again (:func:`_read`), no model walk."""
    moved: tuple[str, ...] = ()
    """Parameters and slot tensors whose storage (object, address, shape or strides) changed across the sleep."""
    woke: bool = False


def _inventory(worker: Any, reason: str) -> Discarded:
    model = worker.model_runner.get_model()
    patterns = list(getattr(worker.model_runner.vllm_config.model_config, "sleep_preserve_parameter_names", None) or [])
    params, derived, addresses, where = set(), set(), {}, {}
    for kind, name, t, at in _located(model):
        if kind in ("param", "slot"):
            addresses[name] = _address(t)
            where[name] = at
        if kind == "param" and t.numel() and not any(fnmatch.fnmatchcase(name, p) for p in patterns):
            params.add(name)
        elif kind == "derived":
            derived.add(name)
    return Discarded(reason, frozenset(params), frozenset(derived), addresses, where)


class SleepWatch:
    """The sleep state of one worker. vLLM's dispatch hands it each ``sleep`` / ``wake_up`` / ``discard`` of the worker
    (patch ``vllm_sleep_watch``) as ``(the worker's method, *args)``; it runs that method and keeps the state."""

    def __init__(
        self, worker: Any, on_discard: Callable[[Discarded], None], on_wake: Callable[[Discarded], None]
    ) -> None:
        self.worker = worker
        self.asleep: str | None = None
        """Why the weights are not resident (``None``: awake)."""
        self.discarded: Discarded | None = None
        """The last level-2 sleep's discard, until a sync refilled it (:meth:`refilled`)."""
        self.sleeps = 0
        self.observed = False
        """Whether vLLM's calls reach this watch (the patch is held); ``False``: sleeps go unseen."""
        self._on_discard = on_discard
        self._on_wake = on_wake

    def sleep(self, inner: Callable[..., Any], level: int = 1, *args: Any, **kwargs: Any) -> Any:
        level = int(kwargs.pop("level", level))
        if level >= 2:
            self._lose(f"vLLM's level-{level} sleep discarded the engine's weights")
        result = inner(*args, level=level, **kwargs)
        self.sleeps += 1
        self.asleep = f"vLLM sleep level {level}"
        return result

    def discard(self, inner: Callable[..., Any], tags: Any, *args: Any, **kwargs: Any) -> Any:
        if "weights" in tuple(tags):
            self._lose("vLLM discarded the engine's weights (discard of the weights tag)")
        result = inner(tags, *args, **kwargs)
        if "weights" in tuple(tags):
            self.asleep = "vLLM discarded the weights tag"
        return result

    def _lose(self, reason: str) -> None:
        """Before the memory goes: what it holds and where, then the receiver learns the base is gone."""
        self.discarded = _inventory(self.worker, reason)
        self._on_discard(self.discarded)

    def wake_up(self, inner: Callable[..., Any], tags: list[str] | None = None, *args: Any, **kwargs: Any) -> Any:
        tags = kwargs.pop("tags", tags)
        result = inner(*args, tags=tags, **kwargs)
        if tags is None or "weights" in tags:
            self.asleep = None
            d = self.discarded
            if d is not None and not d.woke:
                # each tensor read again where the sleep found it (~1 ms at 48 layers; a walk of every module's
                # attributes took 15-24 ms): a new object, address, shape or strides there is a move
                now = {name: _read(at) for name, at in d.where.items()}
                d.moved = tuple(sorted(n for n, t in now.items() if t is None or _address(t) != d.addresses.get(n)))
                d.woke = True
                logger.info(
                    "hwsync: %s; woke with %s",
                    d.reason,
                    f"{len(d.moved)} tensors at new addresses, e.g. {d.moved[0]}" if d.moved else "every address kept",
                )
                self._on_wake(d)
        return result

    def refilled(self) -> None:
        """A sync carried the base after the discard: nothing of it is pending any more."""
        self.discarded = None

    def adopt(self) -> None:
        """A worker vLLM slept before this watch existed: what that sleep discarded is unknown, so its weights count
        as discarded (the next sync refills the base); asleep while vLLM's pool still holds them unmapped."""
        asleep = pool_asleep()
        if sleep_backend(self.worker) is None and not asleep:
            return  # never slept
        self._lose("vLLM slept the engine before hwsync attached (what that sleep discarded is unknown)")
        if "weights" in asleep:
            self.asleep = "vLLM sleep before hwsync attached"
        else:  # already woken: its addresses are the ones now
            assert self.discarded is not None
            self.discarded.woke = True
            self._on_wake(self.discarded)


def watch(worker: Any, on_discard: Callable[[Discarded], None], on_wake: Callable[[Discarded], None]) -> SleepWatch:
    """The worker's :class:`SleepWatch` (one per worker), registered as its sleep observer, holding the patch that
    lets vLLM's dispatch reach it until the worker is collected. Where the patch is switched off
    (``HWSYNC_DISABLE_PATCHES``) or its probe does not apply, sleeps go unseen, and the log says so."""
    import hwsync.patches as patches

    held = observer_of(worker)
    if isinstance(held, SleepWatch):
        return held
    w = SleepWatch(worker, on_discard, on_wake)
    observe(worker, w)
    w.adopt()
    release, why = patches.hold("vllm_sleep_watch", worker)
    w.observed = release is not None
    if not w.observed:
        logger.warning(
            "hwsync: vLLM's sleep and wake of this worker are not observed (patch vllm_sleep_watch: %s); "
            "sync after a level-2 sleep with strategy='full'",
            why,
        )
    return w


def check_awake(worker: Any, what: str) -> None:
    """Refuse ``what`` (a worker function that reads or writes weights) while the weights are not resident."""
    w = observer_of(worker)
    asleep = w.asleep if isinstance(w, SleepWatch) else None
    backend = sleep_backend(worker)  # vLLM's GPU worker, before hwsync watched it
    if asleep is None and backend is not None and getattr(backend, "state", lambda: "RUNNING")() != "RUNNING":
        asleep = f"vLLM's sleep-mode backend is {backend.state()}"
    if asleep is None and "weights" in pool_asleep():
        asleep = "vLLM's sleep-mode pool holds the weights unmapped"
    # Limitation L11 (docs/limitations.md): an asleep engine refuses weight work
    if asleep is not None:
        raise EngineAsleepError(
            f"{what} refused: the engine is asleep ({asleep}) and its weights are not in device memory; nothing "
            "was read or written. Wake it first (llm.wake_up(), or wake_up(tags=['weights']) before the sync), "
            "then sync: after a level-2 sleep the next hwsync.sync refills the weights"
        )


def sleep_backend(worker: Any) -> Any:
    """vLLM's GPU worker's sleep-mode backend (``_sleep_mode_backend``), made at the worker's first sleep: ``None``
    where it never slept (or a worker without one)."""
    return getattr(worker, "__dict__", {}).get("_sleep_mode_backend")


def engine_asleep(llm: Any) -> tuple[str, ...]:
    """What of an in-process engine sleeps (its executor's ``sleeping_tags``, plus ``scheduling`` where its scheduler is
    paused otherwise): vLLM resumes scheduling only once every tag is awake, so while this is not empty a generation
    would wait forever. ms-swift and TRL wake the weights for the sync and the KV cache only after it."""
    engine = getattr(llm, "llm_engine", None)
    tags = sorted(getattr(getattr(engine, "model_executor", None), "sleeping_tags", None) or ())
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)  # in-process: vLLM's EngineCore
    paused = getattr(core, "is_scheduler_paused", None)
    if not tags and callable(paused) and paused():
        tags = ["scheduling"]
    return tuple(tags)


def check_engine_awake(llm: Any, what: str) -> None:
    """Refuse ``what`` (a generation) while the engine sleeps in part: it would wait forever (:func:`engine_asleep`)."""
    asleep = engine_asleep(llm)
    if asleep:
        raise EngineAsleepError(
            f"{what} refused: vLLM pauses this engine's scheduler while {', '.join(asleep)} sleep(s) (sleep mode; "
            "ms-swift and TRL wake the weights for the sync and the KV cache only after it): a request would wait "
            "forever. Wake it first: llm.wake_up() (or wake_up(tags=['kv_cache']) after the weights)"
        )


def pool_asleep() -> frozenset[str]:
    """The tags (``weights``, ``kv_cache``, ...) of vLLM's sleep-mode pool unmapped now, read from vLLM's
    ``CuMemAllocator`` in this process without making one: empty where sleep mode is not in use (or on a build
    without it: vLLM's CPU build)."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except Exception:  # no CUDA build of vLLM's allocator here: no pool, nothing asleep
        return frozenset()
    pool = getattr(CuMemAllocator, "instance", None)
    if pool is None:
        return frozenset()
    return frozenset(d.tag for d in list(pool.pointer_to_data.values()) if getattr(d, "is_asleep", False))
