"""``hwsync.sync``: the call a trainer makes after each optimizer step.

A sync is planned once per (engine, model, :class:`SyncRequest`) into a :class:`SyncPlan`, from one description
of the engine (:func:`describe_for`): the strategy chosen (:mod:`hwsync.trainer.strategy`), the payload described
(:mod:`hwsync.trainer.payload`) and the manifest built (:mod:`hwsync.common.wire`). After a successful sync the engine's
state is known (:meth:`SyncPlan.after_sync`: a first adapter/hybrid sync leaves the base, so the steady plan sends only
what changes). Later syncs whose plan still holds -- same parameters, the engine at the version this trainer left it,
the base weights unchanged -- reuse all of that and only stream tensors; the engine in turn reuses its validated
plan for the same manifest digest (:mod:`hwsync.engine.receiver`). Anything that no longer holds re-plans: a changed
model, another writer on the engine (it answers :class:`~hwsync.common.errors.PlanChangedError` before writing), an
error. :func:`last_plan` is how :mod:`hwsync.verify` finds what the trainer last synced.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any

from torch import nn

from hwsync.common.config import raw
from hwsync.common.errors import (
    AdapterFormatError,
    EngineAsleepError,
    HwsyncError,
    OptionError,
    PlanChangedError,
    SyncError,
    UnsupportedSetupError,
)
from hwsync.common.lora_formats import FoldFn
from hwsync.common.progress import phase
from hwsync.common.target import Engine, EngineQueries, Generating, ProgressFn
from hwsync.common.wire import EngineInfo, Manifest, Strategy, plan_buckets
from hwsync.trainer.payload import Payload, TrainerLora, base_shapes, build_payload, has_adapter, model_uuid, read_lora
from hwsync.trainer.report import SyncReport
from hwsync.trainer.strategy import choose

logger = logging.getLogger("hwsync")

__all__ = [
    "sync",
    "generate",
    "as_engine",
    "as_queries",
    "default_bucket_mb",
    "parse_bucket_mb",
    "BUCKET_ENV",
    "SyncRequest",
    "SyncPlan",
    "SyncedPlan",
    "describe_for",
    "last_plan",
]

BUCKET_ENV = "HWSYNC_BUCKET_MB"
# Measured with benchmarks/bench_sync.py (vLLM CPU build, 105 MB fp32 MoE, server mode over gloo/loopback, 2 shared
# cores, two runs): a full sync takes 0.40-0.52 s for any bucket size from 1 to 256 MB -- flat within noise, because


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
    """Bucket size used when ``bucket_mb`` is not given: ``$HWSYNC_BUCKET_MB`` or the device's backend's
    (:attr:`hwsync.common.backend.Backend.bucket_mb`; a device kind no backend drives gets the base class's)."""
    env = parse_bucket_mb(raw(BUCKET_ENV) or None)
    if env is not None:
        return env
    from hwsync.common.backend import Backend, known_backends

    kinds = {b.device_type: b for b in known_backends().values()}
    return float(kinds[device_type].bucket_mb if device_type in kinds else Backend.bucket_mb)


@dataclass(frozen=True)
class SyncRequest:
    """What the caller asked of a sync (checked once, by :meth:`parse`); with the model, it keys the trainer's plans
    on an engine handle. (The integrations' configuration is :class:`hwsync.integrations.options.SyncOptions`.)"""

    strategy: Strategy = Strategy.AUTO
    bucket_mb: float | None = None
    """``None``: :func:`default_bucket_mb` for the engine's device."""
    lora_name: str | None = None
    lora_int_id: int | None = None
    fold: FoldFn | None = None
    """How each LoRA scaling is folded into B; ``None``: vLLM's rounding order
    (:func:`hwsync.common.lora_formats.fold_scaling`), what the engine's own loading of the adapter holds."""

    @classmethod
    def parse(
        cls,
        strategy: str | Strategy = "auto",
        bucket_mb: float | None = None,
        lora_name: str | None = None,
        lora_int_id: int | None = None,
        fold: FoldFn | None = None,
    ) -> SyncRequest:
        if fold is not None and not callable(fold):
            raise OptionError(f"fold must be a function (B, scaling, dtype) -> B * scaling, got {type(fold).__name__}")
        return cls(Strategy.parse(strategy), parse_bucket_mb(bucket_mb, "bucket_mb"), lora_name, lora_int_id, fold)

    def bucket_bytes(self, device_type: str) -> int:
        mb = default_bucket_mb(device_type) if self.bucket_mb is None else self.bucket_mb
        return max(1, int(mb * (1 << 20)))


@dataclass
class SyncPlan:
    """What the trainer resolved for one (engine, model, options), from **one** description of the engine
    (:func:`describe_for`); reused while it holds (:meth:`holds`)."""

    options: SyncRequest
    signature: tuple[Any, ...]
    info: EngineInfo
    """The engine's description the plan was made from (after a sync: with the state that sync left)."""
    lora: TrainerLora | AdapterFormatError | None
    payload: Payload
    manifest: Manifest
    synced_version: int = 0
    """The engine version the last sync of this plan left (the next one expects the engine there)."""
    with_base: SyncPlan | None = dataclasses.field(default=None, repr=False, compare=False)
    """On a steady adapter/hybrid plan: the plan that carried the base before it, which a refill sends again."""
    steady: SyncPlan | None = dataclasses.field(default=None, repr=False, compare=False)
    """On a plan that carries the base: the steady plan made after its first sync, taken again after a refill."""

    @classmethod
    def make(
        cls,
        engine: Engine,
        model: nn.Module,
        options: SyncRequest,
        signature: tuple[Any, ...] | None = None,
        first: EngineInfo | None = None,
    ) -> SyncPlan:
        """Describe the engine once and plan from that (``first``: its plain description, where just asked)."""
        from hwsync.trainer.merged import refuse_non_lora

        refuse_non_lora(model)  # IA3, prompt tuning, ...: no strategy syncs them; said before the engine is asked
        info, lora = describe_for(engine, model, first)
        return cls.from_description(model, options, info, lora, _signature(model) if signature is None else signature)

    @classmethod
    def from_description(
        cls,
        model: nn.Module,
        options: SyncRequest,
        info: EngineInfo,
        lora: TrainerLora | AdapterFormatError | None,
        signature: tuple[Any, ...],
        readers: dict[Any, Any] | None = None,
    ) -> SyncPlan:
        choice = choose(options.strategy, lora, info)
        size = options.bucket_bytes(info.device_type)
        trainer_lora = lora if choice.strategy is not Strategy.FULL and isinstance(lora, TrainerLora) else None
        payload = build_payload(
            model, choice, trainer_lora, info, gather_bytes=size, fold=options.fold, readers=readers
        )
        manifest = Manifest(
            version=info.version + 1,
            strategy=choice.strategy,
            specs=tuple(payload.specs),
            buckets=plan_buckets(payload.specs, size),
            lora_meta=payload.lora_meta,
            lora_base_names=dict(payload.lora_base_names),
            base_key=payload.base_key,
            lora_name=options.lora_name,
            lora_int_id=options.lora_int_id,
        )
        return cls(options, signature, info, lora, payload, manifest, synced_version=info.version)

    def holds(self, signature: tuple[Any, ...]) -> bool:
        """Whether the plan still describes the model: the same parameters, and for adapter/hybrid the base the
        engine holds unchanged (a base changed in place travels again: plan again)."""
        if self.signature != signature:
            return False
        return self.payload.strategy is Strategy.FULL or self.payload.current_base_key() == self.payload.base_key

    def manifest_for(self, version: int | None, *, fresh: bool) -> Manifest:
        """The manifest of the next sync (``version``: default the engine's + 1). A reused plan is only valid on the
        engine as this trainer left it, so it names that version (``expect_version``); a fresh one was just made."""
        number = self.synced_version + 1 if version is None else int(version)
        return self.manifest.with_version(number, expect_version=None if fresh else self.synced_version)

    def after_sync(self, model: nn.Module, version: int) -> SyncPlan:
        """This plan once the engine holds what the sync to ``version`` sent. The engine's state is known, not asked
        again: after a first adapter/hybrid sync that carried the base, the steady plan (only what changes) is made
        from the same description with the base the engine now holds, not stale, at ``version``."""
        if not self.payload.includes_base or self.payload.strategy is Strategy.FULL:
            self.synced_version = version
            return self
        if self.steady is not None:  # a refill: the steady plan (and what verify cached about it) from before
            self.steady.synced_version = version
            return self.steady
        held = dataclasses.replace(self.info, version=version, stale=False, base_key=self.manifest.base_key)
        steady = SyncPlan.from_description(
            model, self.options, held, self.lora, self.signature, readers=self.payload.lora_readers
        )  # the same fold buffers from here on
        steady.synced_version = version
        steady.with_base, self.steady = self, steady
        return steady

    def for_refill(self, engine: Engine) -> tuple[SyncPlan | None, EngineInfo]:
        """The plan that carries the base again, where the engine refused this one only because vLLM discarded the
        weights this plan's syncs wrote (a level-2 sleep) and nothing else changed: the engine at the version this plan
        left, the same engine otherwise. One state round trip instead of a new plan (describing a 48-layer MoE's
        ~18,600 LoRA paths and reading the adapter again cost ~2 s of a refill); with the engine's description it
        was decided on (a new plan starts from it). ``None``: plan anew."""
        now = engine.describe()
        again = self if self.payload.includes_base else self.with_base
        if again is None or not now.refill or now.version != self.synced_version or _layout(now) != _layout(self.info):
            return None, now
        again.info = dataclasses.replace(
            again.info, version=now.version, stale=now.stale, base_key=now.base_key, refill=now.refill
        )
        again.synced_version = now.version
        return again, now

    def synced(self) -> SyncedPlan:
        """What :mod:`hwsync.verify` checks the engine against: this plan's last sync, as plain data."""
        return SyncedPlan(self.synced_version, self.manifest.strategy, self.manifest.lora_int_id, self.info)


@dataclass(frozen=True)
class SyncedPlan:
    """A plan's last sync as plain data (it crosses a sharded trainer's ranks): the version it left, its strategy
    and adapter id, and the engine's description it was planned from."""

    version: int
    strategy: Strategy
    lora_int_id: int | None
    info: EngineInfo

    def reference_payload(
        self, model: nn.Module, fold: FoldFn | None = None, cache: dict[Any, Any] | None = None
    ) -> Payload:
        """Every tensor a from-scratch sync of this strategy would send now (merged view for merged names, W0 for
        frozen ones, folded LoRA A/B), read lazily: what the engine should hold. With ``cache`` (a dict kept by the
        caller), the payload is planned once per model, strategy, engine description and fold, and read anew at
        every call of its ``produce`` (planning a 48-layer MoE's LoRA costs ~1 s; reading it, milliseconds)."""
        if cache is not None:
            key = (model_uuid(model), _signature(model), self.strategy, self.info, fold)
            kept = cache.get("reference")
            if kept is not None and kept[0] == key:
                payload: Payload = kept[1]
                return payload
            cache["reference"] = (key, payload := self.reference_payload(model, fold))
            return payload
        fresh = dataclasses.replace(self.info, base_key=None, stale=False)  # as if nothing were on the engine
        lora = read_lora(model, fresh)
        choice = choose(self.strategy, lora, fresh)
        trainer_lora = lora if self.strategy is not Strategy.FULL and isinstance(lora, TrainerLora) else None
        return build_payload(model, choice, trainer_lora, fresh, fold=fold)


def _plans(engine: Engine, model: nn.Module) -> dict[SyncRequest, SyncPlan]:
    """The trainer's plans for ``model`` on ``engine``'s handle, per options."""
    plans: dict[SyncRequest, SyncPlan] = engine.plans.setdefault(model_uuid(model), {})
    return plans


def last_plan(engine: Engine, model: nn.Module) -> SyncPlan | None:
    """The plan of ``model``'s last sync into ``engine`` (whatever its options); ``None`` before its first."""
    plans = engine.plans.get(model_uuid(model), {})
    return max(plans.values(), key=lambda p: p.synced_version) if plans else None


_REGISTRATIONS = [0]
"""Parameters and modules registered on a module of a model whose signature was taken (torch's global registration
hooks): while it is unchanged, no such model gained, lost or replaced a parameter or a submodule through
``nn.Module``, so its signature still holds. Registrations elsewhere do not count: a colocated engine's reload
registers hundreds of parameters on vLLM's modules during a first sync, which would cost the next sync a walk."""
_WATCHED: set[int] = set()
"""``id`` of every module of those models (a stale id of a collected module costs at most one walk more)."""
_SIGNATURES: weakref.WeakKeyDictionary[nn.Module, tuple[int, Any, tuple[Any, ...]]] = weakref.WeakKeyDictionary()


def _registered(module: nn.Module, *_: Any) -> None:
    if id(module) in _WATCHED:  # a new child of a watched module is attached here too: caught before it holds more
        _REGISTRATIONS[0] += 1


def _count_registrations() -> None:
    if not getattr(_count_registrations, "done", False):
        from torch.nn.modules import module as nn_module

        nn_module.register_module_parameter_registration_hook(_registered)
        nn_module.register_module_module_registration_hook(_registered)
        _count_registrations.done = True  # type: ignore[attr-defined]


def _signature(model: nn.Module) -> tuple[Any, ...]:
    """Cheap identity of the model's parameter set (objects and shapes) and active adapter: a new or reshaped
    parameter, or another adapter made active, re-plans. The walk over every parameter (thousands in a PEFT-wrapped
    MoE: ~10 ms a sync) is skipped while no parameter or module was registered anywhere since the last one."""
    from hwsync.common.gather import parameters

    _count_registrations()
    active = getattr(model, "active_adapter", None)  # PEFT: a str (transformers' own mixin: a method, ignored)
    active = tuple(active) if isinstance(active, (list, tuple)) else active if isinstance(active, str) else None
    known = _SIGNATURES.get(model)
    if known is not None and known[0] == _REGISTRATIONS[0] and known[2][0] == active:
        return known[2]
    generation = _REGISTRATIONS[0]
    _WATCHED.update(id(m) for m in model.modules())
    signature = (active, tuple((id(p), p.shape) for p in parameters(model)))
    _SIGNATURES[model] = (generation, active, signature)
    return signature


_SHARDINGS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[Any, ...], str]] = weakref.WeakKeyDictionary()


def _sharding(model: nn.Module) -> tuple[str, tuple[Any, ...]]:
    """The model's :func:`hwsync.common.gather.sharding` and :func:`_signature`: one walk of the model per sync (the
    sharding is looked at again only when the signature changes, e.g. after ``fully_shard``)."""
    from hwsync.common.gather import sharding

    signature = _signature(model)
    known = _SHARDINGS.get(model)
    if known is None or known[0] != signature:
        known = (signature, sharding(model))
        _SHARDINGS[model] = known
    return known[1], signature


def describe_for(
    engine: Engine, model: nn.Module, first: EngineInfo | None = None
) -> tuple[EngineInfo, TrainerLora | AdapterFormatError | None]:
    """One description of the engine for syncing ``model``, and the trainer's LoRA as it would travel
    (:func:`hwsync.trainer.payload.read_lora`): what the engine serves, whether it serves LoRA on the trainer's modules,
    and which of the trainer's base tensors it keeps in a wider dtype (those travel in it). Two round trips for a PEFT
    model (where its modules land in vLLM's LoRA format depends on the engine; ``first``: the first, where the
    caller just asked), one otherwise."""
    lora: TrainerLora | AdapterFormatError | None = None
    paths: list[str] = []
    if has_adapter(model):
        first = engine.describe() if first is None else first
        lora = read_lora(model, first)
        if isinstance(lora, TrainerLora) and first.lora_enabled:
            paths = lora.vllm_paths
    return engine.describe(paths, base_shapes(model)), lora


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
    fold: FoldFn | None = None,
) -> SyncReport | None:
    """Make ``target`` serve ``model``'s current weights; return what was sent.

    ``target`` is an in-process ``vllm.LLM`` (colocate) or a handle from :func:`hwsync.connect` (server mode).
    ``model`` is a transformers model, PEFT-wrapped or not, plain or sharded (FSDP2 ``fully_shard`` / DeepSpeed
    ZeRO-3: :mod:`hwsync.common.gather`). ``strategy`` is ``"auto"``, ``"full"``, ``"adapter"``
    or ``"hybrid"`` (:class:`hwsync.Strategy`); auto asks the engine what it can serve and the report says why.
    ``version`` must increase strictly (default: the engine's version + 1). The engine validates the whole manifest
    before writing anything; see :mod:`hwsync.engine.receiver` for what an interrupted sync leaves behind.
    ``progress(bucket, num_buckets)`` is called before each bucket is handed over (raising aborts the sync).
    ``lora_name``/``lora_int_id`` install the adapter under a framework's own identity (ms-swift: ``swift_lora``/111)
    instead of hwsync's default; the report's ``lora_request`` carries it. ``fold(B, scaling, dtype)`` folds each LoRA
    scaling into B instead of vLLM's rounding order (:func:`hwsync.common.lora_formats.fold_scaling`; what the
    engine's own loading holds, so :func:`hwsync.verify` tells another fold apart).

    A sharded model is gathered bucket by bucket, collectively: **every rank** calls ``sync`` at the same point,
    ranks with an engine pass it (several ranks may: colocated engines, one per rank or one tensor-parallel engine
    over the ranks), ranks without one pass ``None`` (they take part in the gathers and return ``None``).
    """
    options = SyncRequest.parse(strategy, bucket_mb, lora_name, lora_int_id, fold)
    kind, signature = _sharding(model)
    if kind != "plain":
        return _sync_sharded(target, model, options, version, progress, signature)
    if target is None:
        raise OptionError(
            "hwsync.sync(None, model) is for the ranks without an engine of a sharded (FSDP2 / ZeRO-3) trainer, "
            "which take part in the gathers; this model is not sharded, so this rank has nothing to do: call "
            "hwsync.sync only where an engine is"
        )
    engine = as_engine(target)
    t0 = time.perf_counter()
    refused: SyncPlan | None = None
    for attempt in range(2):
        plan, manifest = _prepare(engine, model, options, version, signature, retry=attempt > 0, previous=refused)
        try:
            result = engine.send(manifest, plan.payload.produce, progress)
        except PlanChangedError:
            refused = _plans(engine, model).pop(options, None)
            if attempt:
                raise
            continue
        except EngineAsleepError:  # refused before anything was read or written: the plan holds
            raise
        except BaseException:
            _plans(engine, model).pop(options, None)  # whatever the engine holds now, the next sync plans anew
            raise
        return _finish(engine, model, plan, manifest, result, t0)
    raise SyncError("internal: sync retry loop ended without a result")  # pragma: no cover


def _prepare(
    engine: Engine,
    model: nn.Module,
    options: SyncRequest,
    version: int | None,
    signature: tuple[Any, ...],
    *,
    retry: bool,
    previous: SyncPlan | None = None,
) -> tuple[SyncPlan, Manifest]:
    """The plan to sync with (the cached one while it holds; on a retry the plan that carries the base where only a
    refill was missing (:meth:`SyncPlan.for_refill`), else a new one) and its next manifest."""
    plans = _plans(engine, model)
    plan = None if retry else plans.get(options)
    first = None
    if retry and previous is not None and previous.holds(signature):
        plan, first = previous.for_refill(engine)
        if plan is not None:
            return plan, plan.manifest_for(version, fresh=True)
    fresh = plan is None or not plan.holds(signature)
    if fresh:
        plans.pop(options, None)
        with phase("sync planned"):
            plan = SyncPlan.make(engine, model, options, signature, first=first)
    assert plan is not None
    return plan, plan.manifest_for(version, fresh=fresh)


_STATE = frozenset({"version", "stale", "base_key", "lora_int_id", "lora_name", "refill", "unservable", "kept_dtypes"})


def _layout(info: EngineInfo) -> tuple[Any, ...]:
    """What an engine's description says about the engine itself (not its sync state, nor the answers about the paths
    and tensors a trainer asked about): equal before and after a sleep of the same engine."""
    return tuple(repr(getattr(info, f.name)) for f in dataclasses.fields(info) if f.name not in _STATE)


def _finish(
    engine: Engine, model: nn.Module, plan: SyncPlan, manifest: Manifest, result: Any, t0: float, extra: str = ""
) -> SyncReport:
    reused = manifest.expect_version is not None
    if plan.info.refill and manifest.base_specs:  # the engine asked for its base again: say why it travelled
        extra = f"; full refill ({'base + adapter' if manifest.lora_specs else 'base'}): {plan.info.refill}" + extra
    report = SyncReport(
        strategy=manifest.strategy.value,
        tensors=len(manifest.specs),
        bytes=manifest.nbytes,
        seconds=time.perf_counter() - t0,
        buckets=len(manifest.buckets),
        version=manifest.version,
        reason=plan.payload.reason + ("; plan reused" if reused else "") + extra,
        mode=engine.mode,
        base_tensors=len(manifest.base_specs),
        lora_tensors=len(manifest.lora_specs),
        path=str((result or {}).get("path", "")),
        lora_request=engine.lora_request if manifest.lora_specs or manifest.strategy is not Strategy.FULL else None,
    )
    after = _plans(engine, model)[plan.options] = plan.after_sync(model, manifest.version)
    if after is not plan:  # the steady plan, made after a sync that carried the base: validated now, not by the next
        try:
            engine.warm(after.manifest_for(None, fresh=False))
        except HwsyncError as e:  # the next sync validates it again and says so
            logger.debug("hwsync: validating the steady plan ahead failed: %s", e)
    report.log()
    return report


def _sync_sharded(
    target: Any,
    model: nn.Module,
    options: SyncRequest,
    version: int | None,
    progress: ProgressFn | None,
    signature: tuple[Any, ...],
) -> SyncReport | None:
    """One sync of a sharded model, run by every rank together (protocol: :mod:`hwsync.common.gather`)."""
    from hwsync.common import gather

    multi = gather.collective()
    exchange = gather.exchange if multi else (lambda obj: [obj])
    engine = as_engine(target) if target is not None else None
    t0 = time.perf_counter()
    done: SyncReport | None = None
    for attempt in range(2):
        state: tuple[SyncPlan, Manifest] | None = None  # this rank's plan and manifest while it still has to sync
        mine: list[list[str]] | None = None
        failure: BaseException | None = None
        if engine is not None and done is None:
            try:
                state = _prepare(engine, model, options, version, signature, retry=attempt > 0)
                mine = state[0].payload.schedule
                if mine is None:
                    raise SyncError("internal: a sharded model's payload has no gather schedule")
            except BaseException as e:  # every rank must hear of it before anyone enters a gather
                failure, state = e, None
        plans = exchange(
            ("error", f"{type(failure).__name__}: {failure}")
            if failure is not None
            else ("plan", mine)
            if mine is not None
            else None
        )
        bad = [(r, m[1]) for r, m in enumerate(plans) if m is not None and m[0] == "error"]
        if bad:
            if failure is not None:
                raise failure
            raise SyncError(
                f"hwsync.sync on rank {bad[0][0]} failed before gathering ({bad[0][1]}); every rank "
                "stops so none waits in a collective"
            )
        schedules: list[list[list[str]]] = []
        for m in plans:
            if m is not None and m[1] not in schedules:
                schedules.append(m[1])
        outcome: tuple[str, Any] | None = None
        for sched in schedules:
            steps = gather.run_groups(model, sched)
            try:
                if state is not None and engine is not None and outcome is None and sched == mine:
                    outcome = _send_sharded(engine, model, options, state, steps, progress)
            finally:
                gather.drain(steps)  # the rest of the schedule: every rank gathers every group
        tag = (
            None
            if outcome is None
            else (outcome[0], f"{type(outcome[1]).__name__}: {outcome[1]}" if outcome[0] != "ok" else "")
        )
        results = exchange(tag)
        if outcome is not None and outcome[0] == "error":
            raise outcome[1]
        failed = [(r, t[1]) for r, t in enumerate(results) if t is not None and t[0] == "error"]
        if outcome is not None and outcome[0] == "ok" and engine is not None and state is not None:
            extra = f"; sharded trainer: {len(mine or [])} gather groups"
            done = _finish(engine, model, state[0], state[1], outcome[1], t0, extra)
        if failed:
            raise SyncError(
                f"hwsync.sync failed on rank {failed[0][0]} ({failed[0][1]})"
                + (f"; this rank's engine is at version {done.version}" if done else "")
            )
        retry = [r for r, t in enumerate(results) if t is not None and t[0] == "retry"]
        if not retry:
            return done
        if attempt:
            if outcome is not None and outcome[0] == "retry":
                raise outcome[1]
            raise SyncError(f"rank {retry[0]}'s engine changed its plan twice during one sync")
    raise SyncError("internal: sharded sync retry loop ended without a result")  # pragma: no cover


def _send_sharded(
    engine: Engine,
    model: nn.Module,
    options: SyncRequest,
    state: tuple[SyncPlan, Manifest],
    steps: Any,
    progress: ProgressFn | None,
) -> tuple[str, Any]:
    """This rank's send inside its schedule's gathers: ``("ok", result)``, ``("retry", PlanChangedError)`` or
    ``("error", exception)`` (every rank hears of it after the gathers)."""
    plan, manifest = state
    produce = plan.payload.produce_sharded
    assert produce is not None
    try:
        return "ok", engine.send(manifest, lambda: produce(steps), progress)
    except PlanChangedError as e:
        _plans(engine, model).pop(options, None)
        return "retry", e
    except BaseException as e:
        _plans(engine, model).pop(options, None)
        return "error", e


def generate(target: Any, prompts: Any, sampling_params: Any = None, **kwargs: Any) -> Any:
    """``LLM.generate`` through hwsync's handle: waits for a sync in progress, refuses on a stale engine
    (:class:`~hwsync.common.errors.StaleEngineError`), uses the synced adapter when the engine serves one. An engine in
    another process (:func:`hwsync.connect`) generates there."""
    engine = as_engine(target)
    if not isinstance(engine, Generating):
        raise UnsupportedSetupError(
            "a remote engine generates in its own process: call server.generate(...) there, or use the serving "
            "framework's API (ms-swift: swift rollout's routes); this handle syncs and verifies"
        )
    return engine.generate(prompts, sampling_params, **kwargs)


def as_queries(target: Any) -> EngineQueries:
    """``target`` as a handle to ask (:func:`hwsync.verify`): any engine handle as it is (one engine of several, rank
    0's engine as every rank sees it, a sync target), anything else as :func:`as_engine` takes it."""
    return target if isinstance(target, EngineQueries) else as_engine(target)


def as_engine(target: Any) -> Engine:
    """The handle for ``target``: an :class:`Engine` as is; an in-process ``vllm.LLM`` (or an object with its
    ``llm_engine`` / ``collective_rpc`` surface) wrapped once, the handle cached on it -- through vLLM's weight-transfer
    protocol where the engine selected hwsync's backend (``weight_transfer_config={"backend": "hwsync"}``)."""
    if isinstance(target, Engine):
        return target
    if hasattr(target, "llm_engine") and hasattr(target, "collective_rpc"):
        from hwsync.engine.vllm.local import local_engine
        from hwsync.trainer.transfer_backend import selects_hwsync, transfer_engine

        if selects_hwsync(target):
            return transfer_engine(target)

        return local_engine(target)
    raise SyncError(
        f"cannot sync into a {type(target).__name__}: pass an in-process vllm.LLM (colocate) or the handle "
        "returned by hwsync.connect(address, token) (server mode)"
    )
