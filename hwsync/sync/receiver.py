"""Engine side, engine-agnostic: versions, staleness, buckets -> loads, LoRA accumulated until ``is_last``.

The :class:`Receiver` owns the consistency rules; an :class:`Applier` (``hwsync.vllm_ext.VllmApplier`` for vLLM)
owns how tensors reach a particular engine.

Consistency rules
-----------------
* A manifest is validated (version, names, shapes, layer completeness, adapter config) before anything is written.
  A refused manifest leaves the engine exactly as it was.
* Versions strictly increase; an older or equal version is refused with :class:`~hwsync.errors.VersionError`.
* LoRA tensors are accumulated across buckets and handed to the engine once, after the last bucket: a sync that
  dies earlier leaves the previous adapter serving (verl #5599 semantics).
* Base weights stream into the engine as they arrive (memory stays bounded by a bucket, not the model). From the
  first base write until the sync completes, the receiver is **stale**: generation through hwsync refuses with
  :class:`~hwsync.errors.StaleEngineError` until a complete sync lands.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

from hwsync.errors import HwsyncError, StaleEngineError, SyncError, VersionError
from hwsync.sync.manifest import Manifest

__all__ = ["Applier", "Receiver", "ReceiverState"]


class Applier(Protocol):
    """How one engine takes weights. Every method may raise an :class:`HwsyncError` naming the fix."""

    def describe(self, lora_paths: Sequence[str]) -> dict[str, Any]:
        """Static facts for :class:`hwsync.sync.payload.EngineInfo` (dtype, LoRA support, unservable paths)."""

    def validate(self, manifest: Manifest) -> Any:
        """Resolve and check the whole manifest against the live engine; return a plan. Must not write."""

    def load_base(self, plan: Any, weights: Iterator[tuple[str, Tensor]]) -> None:
        """Load base tensors (checkpoint layout) through the engine's reload path, post-processing each touched
        layer exactly once. On error, leave the engine structurally usable (values may be partial)."""

    def load_lora(self, tensors: Mapping[str, Tensor], config: Mapping[str, Any], name: str | None,
                  lora_int_id: int | None, replaces: int | None) -> tuple[str, int]:
        """Install (or replace in place) the adapter from memory under ``name``/``lora_int_id`` (``None``: the
        engine's default identity), removing the adapter ``replaces`` once the new one is validated; return the
        identity used."""

    def drop_lora(self, lora_int_id: int) -> None:
        """Forget the adapter (the engine now serves merged weights)."""

    def has_lora(self, lora_int_id: int) -> bool:
        """Whether the engine still holds the adapter (someone else may have reloaded weights meanwhile)."""

    def after_sync(self) -> None:
        """Invalidate caches derived from old weights (prefix cache, ...)."""


@dataclass
class ReceiverState:
    version: int = 0
    stale: bool = False
    strategy: str | None = None
    base_key: str | None = None
    lora_name: str | None = None
    lora_int_id: int | None = None
    last_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Receiver:
    """The state machine around an :class:`Applier`; thread-safe (one sync or one generation at a time)."""

    def __init__(self, applier: Applier) -> None:
        self.applier = applier
        self.state = ReceiverState()
        self.lock = threading.RLock()

    # -- queries --------------------------------------------------------------------------------------------------
    def refresh(self) -> ReceiverState:
        """The state, corrected for changes made behind hwsync's back: a ``reload_weights`` by someone else drops
        the adapter (vLLM resets LoRA state) and replaces the base, so neither may be assumed any more."""
        with self.lock:
            lid = self.state.lora_int_id
            if lid is not None and not self.applier.has_lora(lid):
                self.state.lora_name = self.state.lora_int_id = None
                self.state.base_key = None
            return self.state

    def describe(self, lora_paths: Sequence[str] = ()) -> dict[str, Any]:
        with self.lock:
            self.refresh()
            info = dict(self.applier.describe(lora_paths))
            info.update(version=self.state.version, stale=self.state.stale, base_key=self.state.base_key,
                        lora_int_id=self.state.lora_int_id, lora_name=self.state.lora_name)
            return info

    def check_servable(self) -> None:
        """Raise :class:`StaleEngineError` while a partially applied weight set is loaded."""
        if self.state.stale:
            raise StaleEngineError(
                f"engine is stale: a sync after v{self.state.version} was interrupted "
                f"({self.state.last_error or 'unknown cause'}) and left part of the weights written. Run a complete "
                "hwsync.sync(...) before generating (adapter/hybrid resend the base automatically)"
            )

    # -- the sync -------------------------------------------------------------------------------------------------
    def prepare(self, manifest: Manifest) -> Any:
        """Validate ``manifest`` completely; nothing is written. Returns the plan for :meth:`receive`."""
        with self.lock:
            if manifest.version <= self.state.version:
                raise VersionError(
                    f"sync version {manifest.version} is not newer than the engine's v{self.state.version}: versions "
                    f"must strictly increase (pass version={self.state.version + 1} or more, or let hwsync number them)"
                )
            if manifest.lora_specs and not manifest.lora_config:
                raise SyncError("manifest carries LoRA tensors without an adapter config")
            return self.applier.validate(manifest)

    def receive(self, manifest: Manifest, plan: Any, buckets: Iterable[Sequence[Tensor]]) -> dict[str, Any]:
        """Consume ``buckets`` (one tensor list per manifest bucket, in ``bucket.entries`` order) and apply them.

        Contract with the transport: a tensor it yields stays valid for as long as anyone references it (the engine's
        layer-wise reload holds a layer's tensors until the layer is complete; LoRA tensors are held until the end).
        :func:`hwsync.sync.remote.receive_buckets` reuses its flat buffer only when no view of it is left.
        """
        with self.lock:
            t0 = time.perf_counter()
            specs = manifest.specs
            base_idx = [i for i, s in enumerate(specs) if s.kind == "base"]
            lora: dict[str, Tensor] = {}
            received = [0]

            def stream() -> Iterator[tuple[str, Tensor]]:
                it = iter(buckets)
                for bucket in manifest.buckets:
                    try:
                        tensors = next(it)
                    except StopIteration:
                        raise SyncError(f"sender stopped after bucket {bucket.index} of {len(manifest.buckets)}") from None
                    if len(tensors) != len(bucket.entries):
                        raise SyncError(f"bucket {bucket.index} carries {len(tensors)} tensors, manifest says "
                                        f"{len(bucket.entries)}")
                    for i, t in zip(bucket.entries, tensors):
                        spec = specs[i]
                        if tuple(t.shape) != spec.shape:
                            raise SyncError(f"{spec.name}: sent shape {tuple(t.shape)} differs from its manifest "
                                            f"entry {spec.shape}")
                        if spec.kind == "lora":
                            lora[spec.name] = t
                            continue
                        yield spec.name, t
                    received[0] += 1

            try:
                if base_idx:
                    self.state.stale = True  # from the first base write until the sync completes
                    self.state.last_error = f"sync v{manifest.version} in progress"
                    weights = stream()
                    self.applier.load_base(plan, weights)
                    for _ in weights:  # a loader that stopped early must not leave buckets unread
                        raise SyncError("engine loader stopped before the last base tensor")
                else:
                    for _ in stream():
                        raise SyncError("internal: base tensor in a LoRA-only sync")
                old = self.state.lora_int_id
                if lora:
                    name, lid = self.applier.load_lora(lora, manifest.lora_config or {}, manifest.lora_name,
                                                       manifest.lora_int_id, old)
                    self.state.lora_name, self.state.lora_int_id = name, lid
                elif base_idx and old is not None:
                    self.applier.drop_lora(old)  # the base was replaced; an old adapter on it would be wrong
                    self.state.lora_name = self.state.lora_int_id = None
                self.applier.after_sync()
            except BaseException as e:
                where = f"after bucket {received[0]} of {len(manifest.buckets)}"
                if base_idx:
                    self.state.last_error = f"sync v{manifest.version} failed {where}: {type(e).__name__}: {e}"
                    consequence = ("engine is stale (part of the base weights were written) and refuses to generate "
                                   "through hwsync until a complete sync lands")
                else:
                    consequence = f"nothing was applied; the engine still serves v{self.state.version}"
                if not isinstance(e, Exception) or (isinstance(e, HwsyncError) and not isinstance(e, SyncError)):
                    raise
                raise SyncError(f"sync v{manifest.version} aborted {where} ({type(e).__name__}: {e}); "
                                f"{consequence}") from e
            self.state.version = manifest.version
            self.state.strategy = manifest.strategy
            if base_idx:
                self.state.base_key = manifest.base_key if manifest.strategy != "full" else "merged"
            self.state.stale = False
            self.state.last_error = None
            return {"version": manifest.version, "seconds": time.perf_counter() - t0, "lora": len(lora),
                    "base": len(base_idx)}
