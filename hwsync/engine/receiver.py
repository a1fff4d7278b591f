"""Engine side, engine-agnostic: versions, staleness, validated plans, buckets -> loads, LoRA applied once.

The :class:`Receiver` owns the consistency rules; an :class:`Applier` (``hwsync.engine.vllm.applier.VllmApplier`` for
vLLM) owns how tensors reach one particular engine worker.

Consistency rules
-----------------
* A manifest is validated (version, names, shapes, dtypes, layer completeness, adapter config) before anything is
  written; a refused manifest leaves the engine exactly as it was. The validated plan is kept per manifest digest
  (everything but the version), so a trainer that syncs the same tensors every step pays for validation once.
* Versions strictly increase, by at most :data:`MAX_VERSION_STEP` per sync; anything else is refused with
  :class:`~hwsync.common.errors.VersionError`. A manifest planned against another engine version (``expect_version``) is
  refused with :class:`~hwsync.common.errors.PlanChangedError` before anything is written: the sender re-plans.
* LoRA tensors are accumulated across buckets and installed once, after the last bucket: a sync that dies earlier
  leaves the previous adapter serving. If installing itself fails, the engine is marked stale (it must not serve a
  half-installed adapter, nor silently the base model).
* Base weights stream into the engine as they arrive (memory stays bounded by a bucket, not the model). From the
  first base write until the sync completes the receiver is **stale**: generation through hwsync refuses with
  :class:`~hwsync.common.errors.StaleEngineError` until a complete sync lands.
* A sync carrying NaN or infinite values never completes (:mod:`hwsync.common.finite`: checked in the copy that writes
  it, or one device reduction per bucket; read once after the last): base weights leave the engine stale, an adapter is
  refused before it is installed.

The contract with an :class:`Applier` is explicit: a load returns :class:`Loaded` (how it wrote, and the adapter
identity it installed), or raises. An error wrapped in :class:`NothingWritten` says the engine is exactly as before
the call (an adapter built and validated aside); any other error counts as *partly written*. Whether a failed sync
leaves the engine stale is :func:`leaves_stale` of what the receiver saw and that one answer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

from hwsync.common.errors import HwsyncError, PlanChangedError, StaleEngineError, SyncError, VersionError
from hwsync.common.finite import FiniteFlags
from hwsync.common.progress import phase
from hwsync.common.wire import Manifest, ReceiverState, Strategy

__all__ = ["Applier", "Loaded", "NothingWritten", "Receiver", "leaves_stale"]

logger = logging.getLogger("hwsync.receiver")

_PLANS_KEPT = 8
MAX_VERSION_STEP = 1 << 32
"""Largest step from the engine's version to a sync's: ~2^31 syncs before the 64-bit range runs out, not one."""


@dataclass(frozen=True)
class Loaded:
    """What an :class:`Applier` load did: ``how`` (one line for the sync report) and, for an adapter, the identity it
    now serves under."""

    how: str
    lora_name: str | None = None
    lora_int_id: int | None = None


class NothingWritten(Exception):  # noqa: N818 - a statement about the engine, raised around the real error
    """Raised by an :class:`Applier` load that failed before changing anything the engine serves; ``cause`` is the
    error the caller gets. Any other error out of a load means the engine may be partly written."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


def leaves_stale(*, base_reached: bool, adapter_lost: bool, adapter_stage: bool, nothing_written: bool) -> bool:
    """The atomicity rule: a failed sync leaves the engine stale (it refuses to generate through hwsync until a
    complete sync lands) when a base tensor reached the engine's loader, when the adapter it served is gone, or when
    the adapter load failed without saying it wrote nothing. Otherwise the engine serves the previous sync exactly."""
    return base_reached or adapter_lost or (adapter_stage and not nothing_written)


class Applier(Protocol):
    """How one engine worker takes weights. Every method may raise an :class:`HwsyncError` naming the fix."""

    def describe(self, lora_paths: Sequence[str], base: Mapping[str, Sequence[int]] | None = None) -> dict[str, Any]:
        """Static facts for :class:`hwsync.common.wire.EngineInfo` (dtype, LoRA support, unservable paths, kept dtypes
        of the trainer's ``base`` tensors)."""

    def validate(self, manifest: Manifest) -> Any:
        """Resolve and check the whole manifest against the live engine; return a plan. Must not write."""

    def load_base(self, plan: Any, weights: Iterator[tuple[str, Tensor]]) -> Loaded:
        """Write base tensors (checkpoint layout); return how. On error leave the engine structurally usable (values
        may be partial: once a tensor was taken, the receiver marks the engine stale)."""

    def load_lora(
        self,
        plan: Any,
        tensors: Mapping[str, Tensor],
        config: Mapping[str, Any],
        name: str | None,
        lora_int_id: int | None,
        replaces: int | None,
    ) -> Loaded:
        """Install the adapter (or update the installed one in place) under ``name``/``lora_int_id`` (``None``: the
        engine's default identity), then drop ``replaces`` if it is another id; return how, with the identity used.
        Either the new adapter serves afterwards or the call raises (:class:`NothingWritten` when the previous
        adapter still serves untouched)."""

    def drop_lora(self, lora_int_id: int) -> None:
        """Forget the adapter (the engine now serves merged weights)."""

    def has_lora(self, lora_int_id: int) -> bool:
        """Whether the engine still holds the adapter (someone else may have reloaded weights meanwhile)."""


class Receiver:
    """The state machine around an :class:`Applier`; thread-safe (its lock serializes syncs on this worker)."""

    def __init__(self, applier: Applier) -> None:
        self.applier = applier
        self.state = ReceiverState()
        self.lock = threading.RLock()
        self._plans: OrderedDict[str, Any] = OrderedDict()

    # -- queries --------------------------------------------------------------------------------------------------
    def refresh(self) -> ReceiverState:
        """The state, corrected for changes made behind hwsync's back: a ``reload_weights`` by someone else drops
        the adapter (vLLM resets LoRA state) and replaces the base, so neither may be assumed any more."""
        with self.lock:
            lid = self.state.lora_int_id
            if lid is not None and not self.applier.has_lora(lid):
                self.state.lora_name = self.state.lora_int_id = None
                self.state.base_key = None
                self.state.base_writes += 1  # someone reloaded the weights: the base is not known to be ours
            return self.state

    def describe(
        self, lora_paths: Sequence[str] = (), base: Mapping[str, Sequence[int]] | None = None
    ) -> dict[str, Any]:
        with self.lock:
            self.refresh()
            info = dict(self.applier.describe(lora_paths, base))
            info.update(
                version=self.state.version,
                stale=self.state.stale,
                base_key=self.state.base_key,
                lora_int_id=self.state.lora_int_id,
                lora_name=self.state.lora_name,
                refill=self.state.refill,
            )
            return info

    def mark_stale(self, reason: str) -> None:
        """Refuse to generate until a complete sync lands (the weights are written but something after the receive,
        e.g. vLLM's prefix-cache reset, did not happen)."""
        with self.lock:
            self.state.stale = True
            self.state.last_error = reason

    def forget(self, reason: str, *, plans: bool = False) -> None:
        """The engine lost the weights hwsync wrote (vLLM discarded them: level-2 sleep): stale, and the next sync must
        carry the base (adapter/hybrid too) until one lands. ``plans``: the validated plans hold tensors that moved."""
        with self.lock:
            self.state.stale, self.state.last_error = True, reason
            self.state.base_key, self.state.refill = None, reason
            if plans:
                self._plans.clear()

    def check_servable(self) -> None:
        """Raise :class:`StaleEngineError` while a partially applied weight set is loaded."""
        if self.state.stale:
            raise StaleEngineError(
                f"engine is stale: {self.state.last_error or 'an interrupted sync left part of the weights written'} "
                f"(last complete sync: v{self.state.version}). Run a complete hwsync.sync(...) before generating "
                "(adapter/hybrid resend the base automatically)"
            )

    # -- the sync -------------------------------------------------------------------------------------------------
    def prepare(self, manifest: Manifest) -> Any:
        """Validate ``manifest`` completely (nothing is written); the plan for :meth:`receive`, cached by digest."""
        with self.lock:
            self.refresh()
            if manifest.expect_version is not None and (
                manifest.expect_version != self.state.version or self.state.stale
            ):
                raise PlanChangedError(
                    f"the engine is at v{self.state.version}{' (stale)' if self.state.stale else ''}, the sync was "
                    f"planned against v{manifest.expect_version}: re-plan (hwsync.sync does this by itself)"
                )
            if manifest.version <= self.state.version:
                raise VersionError(
                    f"sync version {manifest.version} is not newer than the engine's v{self.state.version}: versions "
                    f"must strictly increase (pass version={self.state.version + 1} or more, or let hwsync number them)"
                )
            if manifest.version - self.state.version > MAX_VERSION_STEP:
                raise VersionError(
                    f"sync version {manifest.version} jumps more than 2^32 past the engine's v{self.state.version}: "
                    "one sync may not use up the version range (later syncs could never be newer); pass a version at "
                    f"most {self.state.version + MAX_VERSION_STEP}, e.g. the training step, or let hwsync number them"
                )
            if (
                manifest.strategy is not Strategy.FULL
                and not manifest.base_specs
                and manifest.base_key is not None
                and self.state.base_key != manifest.base_key
            ):
                raise PlanChangedError(
                    "the engine does not hold the base weights this LoRA-only sync was planned on (another sync or "
                    "a reload replaced them): re-plan with the base included (hwsync.sync does this by itself)"
                )
            plan = self._plans.get(manifest.digest)
            if plan is None:
                plan = self.applier.validate(manifest)
                self._plans[manifest.digest] = plan
                while len(self._plans) > _PLANS_KEPT:
                    self._plans.popitem(last=False)
            else:
                self._plans.move_to_end(manifest.digest)
            return plan

    def receive(self, manifest: Manifest, buckets: Iterable[Sequence[Tensor]]) -> dict[str, Any]:
        """Validate (or reuse the validated plan), then consume ``buckets`` (one tensor list per manifest bucket,
        in ``bucket.entries`` order) and apply them.

        Contract with the transport: a tensor it yields stays valid for as long as anyone references it (the engine's
        layer-wise reload holds a layer's tensors until the layer is complete; LoRA tensors are held until the end).
        """
        with self.lock:
            plan = self.prepare(manifest)
            t0 = time.perf_counter()
            specs = manifest.specs
            has_base = bool(manifest.base_specs)
            lora: dict[str, Tensor] = {}
            received = [0]
            wrote = [False]
            was_stale, last_error = self.state.stale, self.state.last_error
            in_progress = f"sync v{manifest.version} in progress"
            finite = FiniteFlags()

            def stream() -> Iterator[tuple[str, Tensor]]:
                it = iter(buckets)
                for bucket in manifest.buckets:
                    try:
                        tensors = next(it)
                    except StopIteration:
                        raise SyncError(
                            f"sender stopped after bucket {bucket.index} of {len(manifest.buckets)}"
                        ) from None
                    if len(tensors) != len(bucket.entries):
                        raise SyncError(
                            f"bucket {bucket.index} carries {len(tensors)} tensors, manifest says {len(bucket.entries)}"
                        )
                    finite.open(bucket.index, tensors, [specs[i].name for i in bucket.entries])
                    for i, t in zip(bucket.entries, tensors):
                        spec = specs[i]
                        if tuple(t.shape) != spec.shape:
                            raise SyncError(
                                f"{spec.name}: sent shape {tuple(t.shape)} differs from its manifest entry {spec.shape}"
                            )
                        if spec.kind == "lora":
                            lora[spec.name] = t
                            continue
                        if not self.state.stale or self.state.last_error != in_progress:
                            # stale from the moment a loader gets the first base tensor until the sync completes;
                            # a bucket refused before that (forged, out of step) leaves the engine serving
                            self.state.stale = True
                            self.state.last_error = in_progress
                            self.state.base_writes += 1
                        wrote[0] = True
                        yield spec.name, t
                    received[0] += 1
                    finite.close()  # its queued checked copies land before the transport may reuse its memory

            stage = "base weights"
            paths: list[str] = []
            try:
                if has_base:
                    weights = stream()
                    with phase("base weights received and loaded"), finite.writing():
                        paths.append(self.applier.load_base(plan, weights).how)
                    for _ in weights:  # a loader that stopped early must not leave buckets unread
                        raise SyncError("engine loader stopped before the last base tensor")
                else:
                    for _ in stream():
                        raise SyncError("internal: base tensor in a LoRA-only sync")
                bad = finite.non_finite()  # one host read per sync: before the adapter, before "complete"
                if bad:
                    raise SyncError(
                        f"sync v{manifest.version} carries NaN or infinite values in {finite.describe(bad)}"
                        " (a diverged training step?): they are never served; sync finite weights"
                    )
                stage = "adapter"
                old = self.state.lora_int_id
                if lora:
                    with phase("adapter applied"):
                        loaded = self.applier.load_lora(
                            plan, lora, manifest.lora_meta or {}, manifest.lora_name, manifest.lora_int_id, old
                        )
                    self.state.lora_name, self.state.lora_int_id = loaded.lora_name, loaded.lora_int_id
                    paths.append(loaded.how)
                elif has_base and old is not None:
                    self.applier.drop_lora(old)  # the base was replaced; an old adapter on it would be wrong
                    self.state.lora_name = self.state.lora_int_id = None
            except BaseException as raised:
                e = raised.cause if isinstance(raised, NothingWritten) else raised
                error = self._aborted(
                    manifest,
                    e,
                    e is not raised,
                    f"after bucket {received[0]} of {len(manifest.buckets)}",
                    stage,
                    wrote[0],
                    (was_stale, last_error),
                )
                if error is None:
                    if e is raised:
                        raise
                    raise e from e.__cause__  # what the applier wrapped in NothingWritten, as it was
                raise error from e
            self.state.version = manifest.version
            self.state.strategy = manifest.strategy.value
            if has_base:
                self.state.base_key = manifest.base_key if manifest.strategy is not Strategy.FULL else "merged"
                self.state.refill = None
            self.state.stale = False
            self.state.last_error = None
            return {
                "version": manifest.version,
                "seconds": time.perf_counter() - t0,
                "lora": len(lora),
                "base": len(manifest.base_specs),
                "path": "; ".join(p for p in paths if p),
            }

    def _aborted(
        self,
        manifest: Manifest,
        e: BaseException,
        nothing_written: bool,
        where: str,
        stage: str,
        base_reached: bool,
        before: tuple[bool, str | None],
    ) -> SyncError | None:
        """After a failed receive (``e``: the error, unwrapped from :class:`NothingWritten`): stale or not
        (:func:`leaves_stale`), logged; the :class:`SyncError` to raise, or ``None`` to re-raise ``e`` itself (an
        interrupt, or an :class:`HwsyncError` that names its own fix)."""
        lid = self.state.lora_int_id
        if leaves_stale(
            base_reached=base_reached,
            adapter_stage=stage == "adapter",
            adapter_lost=lid is not None and not self.applier.has_lora(lid),
            nothing_written=nothing_written,
        ):
            self.state.stale = True
            self.state.last_error = f"sync v{manifest.version} failed {where} ({stage}): {type(e).__name__}: {e}"
            consequence = (
                f"engine is stale ({stage} partly written) and refuses to generate through hwsync "
                "until a complete sync lands"
            )
        else:
            self.state.stale, self.state.last_error = before
            consequence = f"nothing was applied; the engine still serves v{self.state.version}" + (
                " (and stays stale from before)" if before[0] else ""
            )
        origin = "" if isinstance(e, HwsyncError) else _origin(e)  # a bare `assert` in vLLM says nothing
        logger.warning(
            "hwsync: sync v%d aborted %s: %s: %s%s; %s",
            manifest.version,
            where,
            type(e).__name__,
            e,
            origin,
            consequence,
        )
        logger.debug("hwsync: sync v%d: the error's traceback", manifest.version, exc_info=e)
        if not isinstance(e, Exception) or (isinstance(e, HwsyncError) and not isinstance(e, SyncError)):
            return None
        return SyncError(f"sync v{manifest.version} aborted {where} ({type(e).__name__}: {e}{origin}); {consequence}")


def _origin(e: BaseException) -> str:
    """`` (raised at <file>:<line> in <function>)`` of the innermost frame: where an unexpected error came from."""
    tb = e.__traceback__
    if tb is None:
        return ""
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    where = "/".join(code.co_filename.split("/")[-3:])  # e.g. model_loader/reload/meta.py
    return f" (raised at {where}:{tb.tb_lineno} in {code.co_name})"
