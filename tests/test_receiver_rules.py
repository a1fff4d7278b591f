"""The receiver's consistency rules against a fake applier: every branch of "never serve a half-written engine".

The real-engine tests (test_sync_faults, test_attacks) show the rules hold with vLLM; these pin each rule on its own,
through the :class:`hwsync.engine.receiver.Applier` contract only: a load returns
:class:`~hwsync.engine.receiver.Loaded` or raises, and an error wrapped in
:class:`~hwsync.engine.receiver.NothingWritten` says the engine is as before the call.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
import torch
from torch import Tensor

from hwsync.common.errors import AdapterFormatError, PlanChangedError, StaleEngineError, SyncError, VersionError
from hwsync.common.wire import Manifest, TensorSpec, plan_buckets
from hwsync.engine.receiver import Loaded, NothingWritten, Receiver, leaves_stale

BASE = [TensorSpec(f"layers.{i}.w", (4,), torch.float32) for i in range(3)]
LORA = [TensorSpec(f"layers.{i}.lora_{ab}", (2, 4), torch.float32, "lora") for i in range(2) for ab in "AB"]


class FakeApplier:
    """An engine of a dict: ``base`` and ``adapters`` (id -> tensors); each failure point is a switch."""

    def __init__(self) -> None:
        self.base: dict[str, Tensor] = {}
        self.adapters: dict[int, dict[str, Tensor]] = {}
        self.validations = 0
        self.fail_validate: Exception | None = None
        self.base_fails_after: int | None = None  # raise after taking this many tensors
        self.base_stops_after: int | None = None  # return early (a loader that stopped) after this many
        self.lora_error: BaseException | None = None
        self.lora_error_aside = False  # the adapter error came before anything was changed
        self.drop_previous_before_failing = False

    def describe(self, lora_paths: Sequence[str], base: Mapping[str, Sequence[int]] | None = None) -> dict[str, Any]:
        return {"engine": "fake"}

    def validate(self, manifest: Manifest) -> Any:
        self.validations += 1
        if self.fail_validate is not None:
            raise self.fail_validate
        return object()

    def load_base(self, plan: Any, weights: Iterator[tuple[str, Tensor]]) -> Loaded:
        for n, (name, t) in enumerate(weights):
            if self.base_fails_after is not None and n == self.base_fails_after:
                raise RuntimeError("loader failed")
            self.base[name] = t.clone()
            if self.base_stops_after is not None and n + 1 == self.base_stops_after:
                return Loaded("base: stopped early")
        return Loaded("base: all")

    def load_lora(
        self,
        plan: Any,
        tensors: Mapping[str, Tensor],
        config: Mapping[str, Any],
        name: str | None,
        lora_int_id: int | None,
        replaces: int | None,
    ) -> Loaded:
        lid = lora_int_id or 1
        if self.lora_error is not None:
            if self.lora_error_aside:
                raise NothingWritten(self.lora_error)
            if self.drop_previous_before_failing and replaces is not None:
                self.adapters.pop(replaces, None)
            raise self.lora_error
        if replaces is not None and replaces != lid:
            self.adapters.pop(replaces, None)
        self.adapters[lid] = {k: v.clone() for k, v in tensors.items()}
        return Loaded("adapter: installed", name or "fake", lid)

    def drop_lora(self, lora_int_id: int) -> None:
        self.adapters.pop(lora_int_id, None)

    def has_lora(self, lora_int_id: int) -> bool:
        return lora_int_id in self.adapters


def manifest(version: int, *, base: bool = True, lora: bool = True, strategy: str = "hybrid", **kw: Any) -> Manifest:
    specs = (BASE if base else []) + (LORA if lora else [])
    return Manifest(
        version,
        strategy,
        tuple(specs),
        plan_buckets(specs, 32),  # one or two tensors per bucket
        {"r": 2} if lora else None,
        base_key="k",
        **kw,
    )


def buckets(m: Manifest, value: float = 1.0, stop_after: int | None = None) -> Iterator[list[Tensor]]:
    for b in m.buckets:
        if stop_after is not None and b.index == stop_after:
            return
        yield [torch.full(m.specs[i].shape, value + i) for i in b.entries]


@pytest.fixture
def engine() -> tuple[Receiver, FakeApplier]:
    applier = FakeApplier()
    receiver = Receiver(applier)
    out = receiver.receive(manifest(1), buckets(manifest(1)))  # v1: base + adapter 1 serve
    assert out["path"] == "base: all; adapter: installed" and receiver.state.lora_int_id == 1
    return receiver, applier


def snapshot(applier: FakeApplier) -> tuple[dict[str, Tensor], dict[int, dict[str, Tensor]]]:
    return (
        {k: v.clone() for k, v in applier.base.items()},
        {i: {k: v.clone() for k, v in a.items()} for i, a in applier.adapters.items()},
    )


def unchanged(applier: FakeApplier, before: tuple[dict[str, Tensor], dict[int, dict[str, Tensor]]]) -> bool:
    base, adapters = before
    return (
        applier.base.keys() == base.keys()
        and all(torch.equal(applier.base[k], base[k]) for k in base)
        and applier.adapters.keys() == adapters.keys()
        and all(torch.equal(applier.adapters[i][k], adapters[i][k]) for i in adapters for k in adapters[i])
    )


def test_the_rule_itself() -> None:
    """Stale exactly when a base tensor reached the loader, the served adapter is gone, or an adapter load failed
    without saying it wrote nothing."""
    for base_reached in (False, True):
        for adapter_lost in (False, True):
            for adapter_stage in (False, True):
                for nothing_written in (False, True):
                    expect = base_reached or adapter_lost or (adapter_stage and not nothing_written)
                    assert (
                        leaves_stale(
                            base_reached=base_reached,
                            adapter_lost=adapter_lost,
                            adapter_stage=adapter_stage,
                            nothing_written=nothing_written,
                        )
                        is expect
                    )


def test_a_refused_manifest_writes_nothing(engine: tuple[Receiver, FakeApplier]) -> None:
    receiver, applier = engine
    before = snapshot(applier)
    applier.fail_validate = AdapterFormatError("bad adapter")
    with pytest.raises(AdapterFormatError):
        receiver.receive(manifest(2, lora=True, base=False, strategy="adapter"), iter(()))
    with pytest.raises(VersionError):  # not newer
        receiver.receive(manifest(1), buckets(manifest(1)))
    with pytest.raises(VersionError, match="2\\^32"):
        receiver.receive(manifest(2 + (1 << 32)), buckets(manifest(2)))
    with pytest.raises(PlanChangedError):
        receiver.receive(manifest(2, expect_version=0), buckets(manifest(2)))
    assert unchanged(applier, before) and not receiver.state.stale and receiver.state.version == 1
    receiver.check_servable()


def test_validation_is_kept_per_digest(engine: tuple[Receiver, FakeApplier]) -> None:
    receiver, applier = engine
    n = applier.validations
    receiver.receive(manifest(2), buckets(manifest(2), 2.0))
    receiver.receive(manifest(3), buckets(manifest(3), 3.0))
    assert applier.validations == n  # the same digest as v1's: validated once


def test_a_bucket_refused_before_any_base_tensor_leaves_the_engine_serving(
    engine: tuple[Receiver, FakeApplier],
) -> None:
    receiver, applier = engine
    before = snapshot(applier)
    m = manifest(2)
    bad = iter([[torch.zeros(5)] * len(m.buckets[0].entries)])  # wrong shape in the first bucket
    with pytest.raises(SyncError, match="nothing was applied; the engine still serves v1"):
        receiver.receive(m, bad)
    assert unchanged(applier, before) and not receiver.state.stale
    receiver.check_servable()


def test_a_base_loader_failure_after_a_tensor_leaves_the_engine_stale(engine: tuple[Receiver, FakeApplier]) -> None:
    receiver, applier = engine
    applier.base_fails_after = 1
    with pytest.raises(SyncError, match=r"engine is stale \(base weights partly written\)"):
        receiver.receive(manifest(2), buckets(manifest(2), 2.0))
    assert receiver.state.stale and receiver.state.version == 1
    with pytest.raises(StaleEngineError, match="RuntimeError: loader failed"):
        receiver.check_servable()
    applier.base_fails_after = None  # a complete sync clears it
    receiver.receive(manifest(3), buckets(manifest(3), 3.0))
    assert not receiver.state.stale and receiver.state.version == 3
    receiver.check_servable()


def test_a_loader_that_stops_early_leaves_the_engine_stale(engine: tuple[Receiver, FakeApplier]) -> None:
    receiver, applier = engine
    applier.base_stops_after = 1
    with pytest.raises(SyncError, match="engine loader stopped before the last base tensor"):
        receiver.receive(manifest(2), buckets(manifest(2), 2.0))
    assert receiver.state.stale


@pytest.mark.parametrize("stop_after", [1, 3])
def test_a_sender_that_stops_mid_sync(engine: tuple[Receiver, FakeApplier], stop_after: int) -> None:
    """A stop after base tensors went in leaves the engine stale; the adapter is installed only after the last
    bucket (the previous one is still there, untouched)."""
    receiver, applier = engine
    m = manifest(2)
    assert [m.specs[i].kind for b in m.buckets for i in b.entries] == ["base"] * 3 + ["lora"] * 4
    with pytest.raises(SyncError, match=f"sender stopped after bucket {stop_after}"):
        receiver.receive(m, buckets(m, 2.0, stop_after=stop_after))
    assert receiver.state.stale and torch.equal(applier.adapters[1]["layers.0.lora_A"], torch.full((2, 4), 4.0))


def test_an_adapter_only_sync_interrupted_keeps_the_previous_adapter(engine: tuple[Receiver, FakeApplier]) -> None:
    receiver, applier = engine
    before = snapshot(applier)
    m = manifest(2, base=False, strategy="adapter")
    with pytest.raises(SyncError, match="nothing was applied; the engine still serves v1"):
        receiver.receive(m, buckets(m, 2.0, stop_after=1))
    assert unchanged(applier, before) and not receiver.state.stale


def test_an_adapter_built_aside_that_fails_leaves_the_previous_one_serving(
    engine: tuple[Receiver, FakeApplier],
) -> None:
    receiver, applier = engine
    before = snapshot(applier)
    applier.lora_error, applier.lora_error_aside = AdapterFormatError("vLLM refuses this adapter"), True
    m = manifest(2, base=False, strategy="adapter")
    with pytest.raises(AdapterFormatError, match="vLLM refuses"):  # the applier's own error, unwrapped
        receiver.receive(m, buckets(m, 2.0))
    assert unchanged(applier, before) and not receiver.state.stale and receiver.state.version == 1
    applier.lora_error = RuntimeError("out of memory")  # a plain error is reported as a SyncError, nothing applied
    with pytest.raises(SyncError, match="nothing was applied") as info:
        receiver.receive(m, buckets(m, 2.0))
    assert isinstance(info.value.__cause__, RuntimeError) and not receiver.state.stale


def test_an_adapter_error_without_that_promise_leaves_the_engine_stale(engine: tuple[Receiver, FakeApplier]) -> None:
    receiver, applier = engine
    applier.lora_error = RuntimeError("failed while writing the slots")
    m = manifest(2, base=False, strategy="adapter")
    with pytest.raises(SyncError, match=r"engine is stale \(adapter partly written\)"):
        receiver.receive(m, buckets(m, 2.0))
    assert receiver.state.stale


def test_an_adapter_lost_on_the_way_leaves_the_engine_stale(engine: tuple[Receiver, FakeApplier]) -> None:
    """Even an error that says nothing was written cannot keep the engine serving once the adapter it served is
    gone (removed before the new one failed)."""
    receiver, applier = engine
    applier.lora_error, applier.drop_previous_before_failing = RuntimeError("add_adapter failed"), True
    m = manifest(2, base=False, strategy="adapter", lora_int_id=2)
    with pytest.raises(SyncError, match="engine is stale"):
        receiver.receive(m, buckets(m, 2.0))
    assert receiver.state.stale and not applier.has_lora(1)


def test_an_interrupt_is_raised_as_itself_and_leaves_the_engine_stale(engine: tuple[Receiver, FakeApplier]) -> None:
    receiver, applier = engine
    applier.lora_error = KeyboardInterrupt()
    m = manifest(2)
    with pytest.raises(KeyboardInterrupt):
        receiver.receive(m, buckets(m, 2.0))
    assert receiver.state.stale  # the base went in before the adapter stage


def test_a_failure_that_wrote_nothing_keeps_an_earlier_staleness(engine: tuple[Receiver, FakeApplier]) -> None:
    receiver, applier = engine
    receiver.mark_stale("prefix cache not reset")
    applier.lora_error, applier.lora_error_aside = RuntimeError("refused"), True
    m = manifest(2, base=False, strategy="adapter")
    with pytest.raises(PlanChangedError):  # an adapter-only plan against a stale engine is re-planned first
        receiver.receive(manifest(2, base=False, strategy="adapter", expect_version=1), buckets(m))
    with pytest.raises(SyncError, match="stays stale from before"):
        receiver.receive(m, buckets(m, 2.0))
    assert receiver.state.stale and receiver.state.last_error == "prefix cache not reset"


def test_a_base_sync_drops_the_adapter_it_replaces(engine: tuple[Receiver, FakeApplier]) -> None:
    receiver, applier = engine
    m = manifest(2, lora=False, strategy="full")
    receiver.receive(m, buckets(m, 2.0))
    assert not applier.adapters and receiver.state.lora_int_id is None and receiver.state.base_key == "merged"


def test_someone_elses_reload_is_noticed(engine: tuple[Receiver, FakeApplier]) -> None:
    receiver, applier = engine
    applier.adapters.clear()  # e.g. a reload_weights behind hwsync's back resets vLLM's LoRA state
    state = receiver.refresh()
    assert state.lora_int_id is None and state.base_key is None
    m = manifest(2, base=False, strategy="adapter")
    with pytest.raises(PlanChangedError, match="does not hold the base weights"):
        receiver.receive(m, buckets(m, 2.0))
