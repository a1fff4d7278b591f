"""What runs inside each vLLM worker: the functions :func:`hwsync.sync` calls through ``collective_rpc``.

They take the worker as their first argument, so an engine can call them as plain callables
(``llm.collective_rpc(fn, args=...)``, no setup needed) or, through :class:`hwsync.vllm.HwsyncWorkerExtension`
(``worker_extension_cls``), by name — e.g. from another process over vLLM's own RPC. Either way the state lives on
the worker itself (one :class:`~hwsync.engine.receiver.Receiver` per worker).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from hwsync.common import foreign
from hwsync.common.transport.plane import ReceivingEnd
from hwsync.common.wire import Manifest
from hwsync.engine.receiver import Receiver
from hwsync.engine.vllm.sleep import AWAKE_NOT_NEEDED, check_awake

__all__ = [
    "AdapterGuard",
    "answered",
    "check_servable",
    "describe",
    "guard_adapters",
    "mark_stale",
    "prepare",
    "rank",
    "receive",
    "receive_remote",
    "receiver_of",
    "state",
    "unwrap_worker",
    "worker_of_model",
]

_BY_MODEL: weakref.WeakKeyDictionary[Any, weakref.ref[Any]] = weakref.WeakKeyDictionary()
"""The model a worker serves -> that worker (weakly, both ways: gone with either), registered when hwsync's receiver
is created on the worker. What vLLM's weight-transfer factory hands a backend is the model
(``WeightTransferEngineFactory.create_engine(config, vllm_config, device, model)``), never the worker; hwsync's
backend (:mod:`hwsync.engine.vllm.weight_transfer`) finds its receiver here."""


def unwrap_worker(obj: Any) -> Any:
    """The worker itself, also when vLLM hands its ``WorkerWrapperBase`` (in-process callables)."""
    inner = obj.__dict__.get("worker") if hasattr(obj, "__dict__") else None
    return inner if inner is not None else obj


def answered(worker: Any, local: bool, fn: Any, *args: Any) -> tuple[str, Any]:
    """``fn(worker, *args)`` as ``("ok", result)`` or ``("error", error)``: a worker always answers.

    vLLM's multiprocess executor raises at the first failed reply and leaves the other workers' replies in their
    queues, where the next ``collective_rpc`` reads them as its own (seen on a TP=2 engine: a failed sync's leftover
    error answered the next ``state()``). ``local``: this is the caller's process (the exception object itself goes
    back); otherwise it travels as :func:`hwsync.common.errors.encode_error` data, which keeps hwsync's error types."""
    try:
        name = getattr(fn, "__name__", "")
        if name not in AWAKE_NOT_NEEDED:
            check_awake(unwrap_worker(worker), f"hwsync {name}")
        return "ok", fn(worker, *args)
    except Exception as e:  # noqa: BLE001 - re-raised by the caller (hwsync.engine.vllm.local.LocalEngine.rpc_all)
        if local:
            return "error", e
        import logging

        from hwsync.common.errors import encode_error

        logging.getLogger("hwsync.worker").debug(
            "hwsync: %s failed on worker rank %d", getattr(fn, "__name__", fn), rank(worker), exc_info=True
        )
        return "error", encode_error(e)


def receiver_of(worker: Any) -> Receiver:
    from hwsync.engine.vllm.applier import VllmApplier

    w = unwrap_worker(worker)
    rec: Receiver | None = foreign.held(w, "receiver")
    if rec is None:
        applier = VllmApplier(w)
        rec = foreign.state_of(w)["receiver"] = Receiver(applier)
        model = served_model(w)
        if model is not None:
            _BY_MODEL[model] = weakref.ref(w)
        guard_adapters(w)
        watch_sleep(w, rec, applier)
    return rec


def served_model(worker: Any) -> Any:
    """The model vLLM's worker serves: the object vLLM hands its weight-transfer backend (``get_model()``); ``None``
    for a worker without one (a stand-in)."""
    get_model = getattr(getattr(worker, "model_runner", None), "get_model", None)
    return get_model() if callable(get_model) else None


def worker_of_model(model: Any) -> Any:
    """The worker whose hwsync receiver serves ``model`` (registered by :func:`receiver_of`), or ``None`` where
    hwsync has not attached to that worker yet (or the worker is gone)."""
    try:
        ref = _BY_MODEL.get(model)
    except TypeError:  # not weak-referenceable: never registered
        return None
    return ref() if ref is not None else None


def watch_sleep(worker: Any, rec: Receiver, applier: Any) -> None:
    """vLLM's sleep and wake of this worker, as the receiver and applier must know them
    (:mod:`hwsync.engine.vllm.sleep`): watched from before hwsync's first write, so no level-2 sleep after it goes
    unseen."""
    from hwsync.engine.vllm.sleep import watch

    def woke(d: Any) -> None:
        rec.forget(d.reason, plans=bool(d.moved))
        applier.woke(d)

    watch(worker, lambda d: rec.forget(d.reason), woke)


class AdapterGuard:
    """The two refusals hwsync needs on a worker's LoRA manager, called by the ledgered patch
    ``vllm_lora_manager_guards`` (:mod:`hwsync.patches.vllm_lora_manager_guards`) for a guarded manager only.

    * :meth:`add_adapter`: a user's ``LoRARequest`` under hwsync's default adapter id (``LORA_INT_ID``, 26739) is
      refused with one error. vLLM keys adapters by id alone: such a request would silently be served hwsync's
      in-memory adapter (or, once that is evicted, hwsync's next sync would overwrite the user's in place). Requests
      that carry hwsync's in-memory path (the ``lora_request`` a sync reports) pass. An id chosen by the caller of
      ``hwsync.sync`` (ms-swift's) is shared on purpose and not guarded.
    * :meth:`load_adapter`: a request for hwsync's adapter after vLLM dropped it is one clear error. hwsync installs
      its adapter from memory; its ``LoRARequest`` carries the path ``hwsync-in-memory://<name>``. Once vLLM evicts it
      (another adapter took its slot: ``max_loras`` / ``max_cpu_loras``) or a reload dropped it, vLLM would load that
      path from disk or the Hugging Face Hub and fail with an unrelated ``HFValidationError``; the guard says what
      happened and that a sync installs the adapter again.
    """

    def add_adapter(self, add: Any, lora_request: Any) -> Any:
        from hwsync.common.target import IN_MEMORY_LORA
        from hwsync.engine.vllm.applier import LORA_INT_ID

        if getattr(lora_request, "lora_int_id", None) == LORA_INT_ID and not str(
            getattr(lora_request, "lora_path", "") or ""
        ).startswith(IN_MEMORY_LORA):
            from hwsync.common.errors import SyncError

            raise SyncError(
                f"LoRARequest '{lora_request.lora_name}' uses lora_int_id {LORA_INT_ID}, the id of the adapter hwsync "
                "syncs into this engine: vLLM would serve hwsync's weights for it. Give your LoRARequest another "
                "lora_int_id (or generate with the lora_request hwsync.sync reported)"
            )
        return add(lora_request)

    def load_adapter(self, load: Any, lora_request: Any) -> Any:
        from hwsync.common.target import IN_MEMORY_LORA

        if str(getattr(lora_request, "lora_path", "") or "").startswith(IN_MEMORY_LORA):
            from hwsync.common.errors import SyncError

            raise SyncError(
                f"LoRA adapter '{lora_request.lora_name}' (id {lora_request.lora_int_id}) was synced by hwsync and is "
                "no longer in the engine: vLLM evicted it for another adapter (max_loras / max_cpu_loras) or a "
                "reload dropped it, and it exists only in memory, so vLLM cannot load it again. Run hwsync.sync(...) "
                "to install it again (and keep max_cpu_loras above the adapters served beside it)"
            )
        return load(lora_request)


def guard_adapters(worker: Any) -> bool:
    """Put :class:`AdapterGuard` on ``worker``'s LoRA manager (no-op without one, or when already there) and hold the
    patch ``vllm_lora_manager_guards`` that routes vLLM's adapter loading through it, until the worker is collected.
    Returns whether the guard is in force. Where the patch is switched off (``HWSYNC_DISABLE_PATCHES``) or its probe
    does not apply, vLLM's own behaviour stays, and the log says so."""
    import logging

    import hwsync.patches as patches
    from hwsync.patches.vllm_lora_manager_guards import guard, guard_of, unguard

    manager = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
    if manager is None or not hasattr(manager, "add_adapter"):
        return False
    if isinstance(guard_of(manager), AdapterGuard):
        return patches.get("vllm_lora_manager_guards").active
    ref = weakref.ref(manager)

    def unguard_manager() -> None:
        m = ref()
        if m is not None:
            unguard(m)

    release, reason = patches.hold("vllm_lora_manager_guards", worker, then=unguard_manager)
    if release is not None:
        guard(manager, AdapterGuard())
        return True
    logging.getLogger("hwsync.worker").warning(
        "hwsync: LoRA requests under hwsync's adapter id, and for its evicted adapter, are not guarded on this worker "
        "(patch vllm_lora_manager_guards: %s)",
        reason,
    )
    return False


def _manifest(m: Manifest | str | bytes) -> Manifest:
    return m if isinstance(m, Manifest) else Manifest.from_json(m)


def rank(worker: Any) -> int:
    return int(getattr(unwrap_worker(worker), "rank", 0) or 0)


def describe(
    worker: Any, lora_paths: Sequence[str] = (), base: Mapping[str, Sequence[int]] | None = None
) -> dict[str, Any]:
    """Engine facts for ``strategy="auto"`` plus receiver state; ``unservable`` covers ``lora_paths``,
    ``kept_dtypes`` the trainer's ``base`` tensors (name -> shape)."""
    return receiver_of(worker).describe(lora_paths, base)


def state(worker: Any) -> dict[str, Any]:
    return receiver_of(worker).refresh().to_dict()


def check_servable(worker: Any) -> None:
    receiver_of(worker).check_servable()


def mark_stale(worker: Any, reason: str) -> None:
    """The engine must not serve until a complete sync lands (e.g. its prefix cache still holds the old weights' KV)."""
    receiver_of(worker).mark_stale(reason)


def prepare(worker: Any, manifest: Manifest | str) -> dict[str, Any]:
    """Validate a manifest completely (nothing is written; the plan is kept for the receive that follows)."""
    m = _manifest(manifest)
    receiver_of(worker).prepare(m)
    return {"ok": True, "version": m.version}


def receive(worker: Any, manifest: Manifest | str, buckets: Iterable[Sequence[Tensor]]) -> dict[str, Any]:
    """Colocate: ``buckets`` is an in-process iterable of tensor lists (one per manifest bucket)."""
    return receiver_of(worker).receive(_manifest(manifest), buckets)


def _device(worker: Any) -> torch.device:
    w = unwrap_worker(worker)
    dev = getattr(w, "device", None) or getattr(getattr(w, "model_runner", None), "device", None)
    return torch.device(dev) if dev is not None else torch.device("cpu")


def data_plane(worker: Any) -> ReceivingEnd:
    """The worker's end of the data plane (:mod:`hwsync.common.transport.plane`), kept with the worker."""
    from hwsync.common.backend import open_link

    w = unwrap_worker(worker)
    end: ReceivingEnd | None = foreign.held(w, "data plane")
    if end is None:
        end = foreign.state_of(w)["data plane"] = ReceivingEnd(open_link)
    return end


def receive_remote(
    worker: Any, manifest: Manifest | str, spec: Mapping[str, Any], first_rank: int, secret: bytes, abort_key: str
) -> dict[str, Any]:
    """Server mode: join the trainer's data-plane group (rank ``first_rank`` + this worker's rank) and receive the
    buckets it broadcasts, each authenticated with ``secret`` before it reaches a loader."""
    t0 = time.perf_counter()
    m = _manifest(manifest)
    end = data_plane(worker)
    end.join(spec, first_rank + rank(worker), _device(worker), secret)
    t1 = time.perf_counter()
    try:
        result = receiver_of(worker).receive(m, end.buckets(m, secret, abort_key))
    except BaseException:
        end.done(ok=False)
        raise
    t2 = time.perf_counter()
    kept = end.done(ok=True)
    timings = {
        "worker join": (t1 - t0) * 1e3,
        "worker receive+apply": (t2 - t1) * 1e3,
        "worker close": (time.perf_counter() - t2) * 1e3,
    }
    return {**result, "link_kept": kept, "worker_ms": timings}
