"""``hwsync.sync``: the call a trainer makes after each optimizer step.

A sync is planned once per (engine, model, options): the engine is described, the strategy chosen
(:mod:`hwsync.strategy`), the payload described (:mod:`hwsync.payload`) and the manifest built (:mod:`hwsync.wire`).
Later syncs whose plan still holds -- same parameters, the engine at the version this trainer left it, the base
weights unchanged -- reuse all of that and only stream tensors; the engine in turn reuses its validated plan for the
same manifest digest (:mod:`hwsync.receiver`). Anything that no longer holds re-plans: a changed model, another
writer on the engine (it answers :class:`~hwsync.errors.PlanChangedError` before writing), an error.
"""
from __future__ import annotations

import os
import time
import weakref
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from hwsync.engine import Engine, ProgressFn
from hwsync.errors import OptionError, PlanChangedError, SyncError
from hwsync.payload import Payload, base_shapes, build_payload, model_uuid, read_lora
from hwsync.report import SyncReport
from hwsync.strategy import choose
from hwsync.wire import EngineInfo, Manifest, Strategy, plan_buckets

__all__ = ["sync", "generate", "as_engine", "default_bucket_mb", "parse_bucket_mb", "BUCKET_ENV"]

BUCKET_ENV = "HWSYNC_BUCKET_MB"
# Measured with benchmarks/bench_sync.py (vLLM CPU build, 105 MB fp32 MoE, server mode over gloo/loopback, 2 shared
# cores, two runs): a full sync takes 0.40-0.52 s for any bucket size from 1 to 256 MB -- flat within noise, because
# vLLM's reload, not the transfer, dominates on CPU. 64 MB keeps per-bucket overhead negligible with two receive
# buffers in flight. On GPUs (NCCL) buckets of 512 MB-1 GB reach link speed (verl: 2048 MB, ms-swift: 512 MB, vLLM's
# native transfer: 1 GB x 2).
_DEFAULT_MB = {"cpu": 64, "cuda": 512, "npu": 512}


def parse_bucket_mb(value: str | float | None, what: str = BUCKET_ENV) -> float | None:
    """A bucket size in megabytes (``None``/empty: the default); one parser for the API and the env variable."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    try:
        mb = float(value)
    except (TypeError, ValueError):
        raise OptionError(f"{what}={value!r} is not a number of megabytes") from None
    if not mb > 0:
        raise OptionError(f"{what} must be a positive number of megabytes, got {value!r}")
    return mb


def default_bucket_mb(device_type: str = "cpu") -> float:
    """Bucket size used when ``bucket_mb`` is not given: ``$HWSYNC_BUCKET_MB`` or the measured per-device default."""
    env = parse_bucket_mb(os.environ.get(BUCKET_ENV))
    return env if env is not None else float(_DEFAULT_MB.get(device_type, 512))


@dataclass
class _SyncPlan:
    """What the trainer resolved for one (engine, model, options); reused while it holds."""

    signature: tuple[Any, ...]
    payload: Payload
    manifest: Manifest
    synced_version: int = 0
    """The engine version the last sync of this plan left (the next one expects the engine there)."""


def _signature(model: nn.Module) -> tuple[Any, ...]:
    """Cheap identity of the model's parameter set (objects and shapes) and active adapter: a new or reshaped
    parameter, or another adapter made active, re-plans."""
    from hwsync.gather import parameters

    active = getattr(model, "active_adapter", None)  # PEFT: a str (transformers' own mixin: a method, ignored)
    active = tuple(active) if isinstance(active, (list, tuple)) else active if isinstance(active, str) else None
    return active, tuple((id(p), p.shape) for p in parameters(model))


_LAYOUTS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[Any, ...], str]] = weakref.WeakKeyDictionary()


def _layout(model: nn.Module) -> tuple[str, tuple[Any, ...]]:
    """The model's :func:`hwsync.gather.layout` and :func:`_signature`: one walk of the model per sync (the layout
    is looked at again only when the signature changes, e.g. after ``fully_shard``)."""
    from hwsync.gather import layout

    signature = _signature(model)
    known = _LAYOUTS.get(model)
    if known is None or known[0] != signature:
        known = (signature, layout(model))
        _LAYOUTS[model] = known
    return known[1], signature


def describe_for(engine: Engine, model: nn.Module) -> tuple[EngineInfo, Any]:
    """The engine's facts for syncing ``model`` and the trainer's LoRA (:func:`hwsync.payload.read_lora`): what it
    serves, whether it serves LoRA on the trainer's modules, and which of the trainer's base tensors it keeps in a
    wider dtype (those travel in it)."""
    info = engine.describe()
    lora = read_lora(model, info)
    paths = lora.vllm_paths if lora is not None and not isinstance(lora, Exception) and info.lora_enabled else ()
    info = engine.describe(paths, base_shapes(model))
    return info, lora


def _plan(engine: Engine, model: nn.Module, request: Strategy, bucket_mb: float | None, lora_name: str | None,
          lora_int_id: int | None) -> _SyncPlan:
    info, lora = describe_for(engine, model)
    choice = choose(request, lora, info)
    mb = default_bucket_mb(info.device_type) if bucket_mb is None else bucket_mb
    payload = build_payload(model, choice, lora if choice.strategy is not Strategy.FULL else None, info,  # type: ignore[arg-type]
                            gather_bytes=max(1, int(mb * (1 << 20))))
    manifest = Manifest(
        version=info.version + 1,
        strategy=choice.strategy,
        specs=tuple(payload.specs),
        buckets=plan_buckets(payload.specs, max(1, int(mb * (1 << 20)))),
        lora_config=payload.lora_config,
        lora_base_names=dict(payload.lora_base_names),
        base_key=payload.base_key,
        lora_name=lora_name,
        lora_int_id=lora_int_id,
    )
    return _SyncPlan(_signature(model), payload, manifest, synced_version=info.version)


def _reusable(plan: _SyncPlan | None, model: nn.Module, signature: tuple[Any, ...]) -> _SyncPlan | None:
    """``plan`` if it still describes ``model``; for adapter/hybrid plans that carried the base, the steady-state
    variant without it (the engine holds that base now), unless the base changed since."""
    if plan is None or plan.signature != signature:
        return None
    payload = plan.payload
    if payload.strategy is Strategy.FULL:
        return plan
    if payload.current_base_key() != payload.base_key:
        return None  # the trainer's base changed in place: plan again (the base travels)
    if not payload.includes_base:
        return plan
    return None  # first sync carried the base; the steady plan is built once, then reused


def sync(
    target: Any,
    model: nn.Module,
    *,
    strategy: str | Strategy = "auto",
    bucket_mb: float | None = None,
    version: int | None = None,
    progress: ProgressFn | None = None,
    lora_name: str | None = None,
    lora_int_id: int | None = None,
) -> SyncReport | None:
    """Make ``target`` serve ``model``'s current weights; return what was sent.

    ``target`` is an in-process ``vllm.LLM`` (colocate) or a handle from :func:`hwsync.connect` (server mode).
    ``model`` is a transformers model, PEFT-wrapped or not, plain or sharded (FSDP2 ``fully_shard`` / DeepSpeed
    ZeRO-3: :mod:`hwsync.gather`). ``strategy`` is ``"auto"``, ``"full"``, ``"adapter"``
    or ``"hybrid"`` (:class:`hwsync.Strategy`); auto asks the engine what it can serve and the report says why.
    ``version`` must increase strictly (default: the engine's version + 1). The engine validates the whole manifest
    before writing anything; see :mod:`hwsync.receiver` for what an interrupted sync leaves behind.
    ``progress(bucket, num_buckets)`` is called before each bucket is handed over (raising aborts the sync).
    ``lora_name``/``lora_int_id`` install the adapter under a framework's own identity (ms-swift: ``swift_lora``/111)
    instead of hwsync's default; the report's ``lora_request`` carries it.

    A sharded model is gathered bucket by bucket, collectively: **every rank** calls ``sync`` at the same point,
    ranks with an engine pass it (several ranks may: colocated engines, one per rank or one tensor-parallel engine
    over the ranks), ranks without one pass ``None`` (they take part in the gathers and return ``None``).
    """
    from hwsync import gather

    request = Strategy.parse(strategy)
    mb = parse_bucket_mb(bucket_mb, "bucket_mb")
    key = f"{model_uuid(model)}:{request.value}:{mb}:{lora_name}:{lora_int_id}"
    kind, signature = _layout(model)
    if kind != "plain":
        return _sync_sharded(target, model, request, mb, key, version, progress, lora_name, lora_int_id,
                             signature)
    if target is None:
        raise OptionError(
            "hwsync.sync(None, model) is for the ranks without an engine of a sharded (FSDP2 / ZeRO-3) trainer, "
            "which take part in the gathers; this model is not sharded, so this rank has nothing to do: call "
            "hwsync.sync only where an engine is")
    engine = as_engine(target)
    t0 = time.perf_counter()
    for attempt in range(2):
        plan, planned, manifest = _prepare(engine, model, key, request, mb, version, lora_name, lora_int_id, attempt,
                                           signature)
        try:
            result = engine.send(manifest, plan.payload.produce, progress)
        except PlanChangedError:
            engine.plans.pop(key, None)
            if attempt:
                raise
            continue
        except BaseException:
            engine.plans.pop(key, None)  # whatever the engine holds now, the next sync plans from scratch
            raise
        break
    else:  # pragma: no cover - the loop either breaks or raises
        raise SyncError("internal: sync retry loop ended without a result")
    return _finish(engine, model, key, plan, planned, manifest, result, t0, request, mb, lora_name, lora_int_id)


def _prepare(engine: Engine, model: nn.Module, key: str, request: Strategy, mb: float | None, version: int | None,
             lora_name: str | None, lora_int_id: int | None, attempt: int,
             signature: tuple[Any, ...]) -> tuple[_SyncPlan, bool, Manifest]:
    plan = _reusable(engine.plans.get(key), model, signature) if attempt == 0 else None
    planned = plan is None
    if planned:
        engine.plans.pop(key, None)
        plan = _plan(engine, model, request, mb, lora_name, lora_int_id)
    assert plan is not None
    next_version = plan.synced_version + 1 if version is None else int(version)
    # a reused plan is only valid on the engine as this trainer left it; a fresh one was just checked
    manifest = plan.manifest.with_version(next_version, expect_version=None if planned else plan.synced_version)
    return plan, planned, manifest


def _finish(engine: Engine, model: nn.Module, key: str, plan: _SyncPlan, planned: bool, manifest: Manifest,
            result: Any, t0: float, request: Strategy, mb: float | None, lora_name: str | None,
            lora_int_id: int | None, extra: str = "") -> SyncReport:
    report = SyncReport(
        strategy=manifest.strategy.value,
        tensors=len(manifest.specs),
        bytes=manifest.nbytes,
        seconds=time.perf_counter() - t0,
        buckets=len(manifest.buckets),
        version=manifest.version,
        reason=plan.payload.reason + ("" if planned else "; plan reused") + extra,
        mode=engine.mode,
        base_tensors=len(manifest.base_specs),
        lora_tensors=len(manifest.lora_specs),
        path=str((result or {}).get("path", "")),
        lora_request=engine.lora_request if manifest.lora_specs or manifest.strategy is not Strategy.FULL else None,
    )
    plan.synced_version = manifest.version
    if plan.payload.includes_base and plan.payload.strategy is not Strategy.FULL:
        # the engine holds this base now: later syncs of this plan send only what changes
        steady = _plan(engine, model, request, mb, lora_name, lora_int_id)
        plan = replace(steady, synced_version=manifest.version)
    engine.plans[key] = plan
    report.log()
    return report


def _sync_sharded(target: Any, model: nn.Module, request: Strategy, mb: float | None, key: str,
                  version: int | None, progress: ProgressFn | None, lora_name: str | None,
                  lora_int_id: int | None, signature: tuple[Any, ...]) -> SyncReport | None:
    """One sync of a sharded model, run by every rank together (protocol: :mod:`hwsync.gather`)."""
    from hwsync import gather

    multi = gather.collective()
    exchange = gather.exchange if multi else (lambda obj: [obj])
    engine = as_engine(target) if target is not None else None
    t0 = time.perf_counter()
    done: SyncReport | None = None
    for attempt in range(2):
        state: Any = None  # this rank's (plan, planned, manifest) while it still has to sync
        mine: list[list[str]] | None = None
        failure: BaseException | None = None
        if engine is not None and done is None:
            try:
                state = _prepare(engine, model, key, request, mb, version, lora_name, lora_int_id, attempt,
                                 signature)
                mine = state[0].payload.schedule
                if mine is None:
                    raise SyncError("internal: a sharded model's payload has no gather schedule")
            except BaseException as e:  # every rank must hear of it before anyone enters a gather
                failure, state = e, None
        plans = exchange(("error", f"{type(failure).__name__}: {failure}") if failure is not None else
                         ("plan", mine) if mine is not None else None)
        bad = [(r, m[1]) for r, m in enumerate(plans) if m is not None and m[0] == "error"]
        if bad:
            if failure is not None:
                raise failure
            raise SyncError(f"hwsync.sync on rank {bad[0][0]} failed before gathering ({bad[0][1]}); every rank "
                            "stops so none waits in a collective")
        schedules: list[list[list[str]]] = []
        for m in plans:
            if m is not None and m[1] not in schedules:
                schedules.append(m[1])
        outcome: tuple[str, Any] | None = None
        for sched in schedules:
            steps = gather.run_groups(model, sched)
            try:
                if state is not None and outcome is None and sched == mine:
                    plan, planned, manifest = state
                    produce = plan.payload.produce_sharded
                    assert produce is not None
                    try:
                        outcome = ("ok", engine.send(manifest, lambda: produce(steps), progress))  # type: ignore[union-attr]
                    except PlanChangedError as e:
                        engine.plans.pop(key, None)  # type: ignore[union-attr]
                        outcome = ("retry", e)
                    except BaseException as e:
                        engine.plans.pop(key, None)  # type: ignore[union-attr]
                        outcome = ("error", e)
            finally:
                gather.drain(steps)  # the rest of the schedule: every rank gathers every group
        tag = None if outcome is None else (outcome[0], f"{type(outcome[1]).__name__}: {outcome[1]}"
                                            if outcome[0] != "ok" else "")
        results = exchange(tag)
        if outcome is not None and outcome[0] == "error":
            raise outcome[1]
        failed = [(r, t[1]) for r, t in enumerate(results) if t is not None and t[0] == "error"]
        if outcome is not None and outcome[0] == "ok":
            plan, planned, manifest = state
            extra = f"; sharded trainer: {len(mine or [])} gather groups"
            done = _finish(engine, model, key, plan, planned, manifest, outcome[1], t0, request,  # type: ignore[arg-type]
                           mb, lora_name, lora_int_id, extra)
        if failed:
            raise SyncError(f"hwsync.sync failed on rank {failed[0][0]} ({failed[0][1]})"
                            + (f"; this rank's engine is at version {done.version}" if done else ""))
        retry = [r for r, t in enumerate(results) if t is not None and t[0] == "retry"]
        if not retry:
            return done
        if attempt:
            if outcome is not None and outcome[0] == "retry":
                raise outcome[1]
            raise SyncError(f"rank {retry[0]}'s engine changed its plan twice during one sync")
    raise SyncError("internal: sharded sync retry loop ended without a result")  # pragma: no cover


def generate(target: Any, prompts: Any, sampling_params: Any = None, **kwargs: Any) -> Any:
    """``LLM.generate`` through hwsync's handle: waits for a sync in progress, refuses on a stale engine
    (:class:`~hwsync.errors.StaleEngineError`), uses the synced adapter when the engine serves one."""
    return as_engine(target).generate(prompts, sampling_params, **kwargs)


def as_engine(target: Any) -> Engine:
    """The handle for ``target``: an :class:`Engine` as is; an in-process ``vllm.LLM`` (or an object with its
    ``llm_engine`` / ``collective_rpc`` surface) wrapped once, the handle cached on it."""
    if isinstance(target, Engine):
        return target
    if hasattr(target, "llm_engine") and hasattr(target, "collective_rpc"):
        from hwsync.vllm.local import local_engine

        return local_engine(target)
    raise SyncError(
        f"cannot sync into a {type(target).__name__}: pass an in-process vllm.LLM (colocate) or the handle "
        "returned by hwsync.connect(address, token) (server mode)"
    )
