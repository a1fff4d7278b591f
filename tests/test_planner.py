"""The trainer-side planner (:mod:`hwsync.trainer.api`): one :class:`~hwsync.trainer.api.SyncPlan` per (engine, model,
options), made from one description of the engine. A first adapter sync and the steady syncs after it come from that
description (the engine's state after a successful sync is known, not asked again), and the steady plan equals what
describing the engine again would give. The engine is a recorder (an :class:`hwsync.common.target.Engine` that keeps
what it receives and counts the describe round trips): CPU-only, no vLLM; the same planner against real engines runs in
test_sync_strategies / test_sync_server / test_gather."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest
import torch

import hwsync
from hwsync.common.target import Engine
from hwsync.common.wire import EngineInfo, Manifest, Strategy
from hwsync.trainer.api import SyncPlan, SyncRequest, last_plan


class Recorder(Engine):
    """An engine that serves LoRA everywhere (3-D MoE-LoRA), keeps what a sync sends and counts describes."""

    def __init__(self) -> None:
        super().__init__()
        self.version = 0
        self.base_key: str | None = None
        self.describes = 0
        self.manifests: list[Manifest] = []
        self.refill: str | None = None  # what vLLM discarded (a level-2 sleep): the next sync must carry the base

    def forget(self, reason: str) -> None:
        """What :meth:`hwsync.engine.receiver.Receiver.forget` does when vLLM discarded the weights."""
        self.refill, self.base_key = reason, None

    def describe(self, lora_paths: Sequence[str] = (), base: Mapping[str, Sequence[int]] | None = None) -> EngineInfo:
        self.describes += 1
        return EngineInfo(
            engine="recorder",
            dtype="float32",
            lora_enabled=True,
            lora_dtype="float32",
            max_lora_rank=16,
            moe_lora=True,
            lora_layout="3d",
            version=self.version,
            base_key=self.base_key,
            stale=self.refill is not None,
            refill=self.refill,
        )

    def state(self) -> dict[str, Any]:
        return {"version": self.version, "stale": False, "lora_int_id": None}

    def send(self, manifest: Manifest, produce: Callable[[], Iterator[torch.Tensor]], progress: Any) -> dict[str, Any]:
        from hwsync.common.errors import PlanChangedError
        from hwsync.common.transport.buckets import bucket_lists

        if manifest.expect_version is not None and (manifest.expect_version != self.version or self.refill):
            raise PlanChangedError(f"engine at v{self.version}, plan expects v{manifest.expect_version}")
        if self.refill and not manifest.base_specs:
            raise PlanChangedError("the engine needs its base again")
        self.refill = None
        for _ in bucket_lists(manifest, produce, progress):
            pass
        self.manifests.append(manifest)
        self.version, self.base_key = manifest.version, manifest.base_key
        return {}

    def logprobs(self, prompts: Any, max_tokens: int) -> Any:  # pragma: no cover - not used here
        raise NotImplementedError


def tiny_model(lora: bool) -> Any:
    from transformers import Qwen3MoeForCausalLM

    from hwsync.testing import tiny_moe_config

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(tiny_moe_config("qwen3_moe", num_experts=4, moe_intermediate_size=32))
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        init_lora_weights=False,
        target_modules=["q_proj", "v_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    return get_peft_model(model, cfg)


def step(model: Any) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.mul_(1.01)


@pytest.fixture(scope="module")
def lora_model() -> Any:
    return tiny_model(lora=True)


def test_a_first_adapter_sync_describes_the_engine_once_and_steady_syncs_never(lora_model: Any) -> None:
    engine = Recorder()
    first = hwsync.sync(engine, lora_model, strategy="adapter")
    assert first is not None and first.base_tensors > 0 and "first sync" in first.reason
    # one description = 2 round trips for a PEFT model (where its modules land in vLLM's LoRA format depends on the
    # engine's answer to the first); before one planner it was 4: a hidden second plan after the first sync
    assert engine.describes == 2
    for k in range(3):
        step(lora_model)
        report = hwsync.sync(engine, lora_model, strategy="adapter")
        assert report is not None and report.base_tensors == 0 and report.lora_tensors == first.lora_tensors
        assert "plan reused" in report.reason and report.version == k + 2
    assert engine.describes == 2  # steady syncs: no round trip at all
    assert [m.expect_version for m in engine.manifests] == [None, 1, 2, 3]


def test_the_steady_plan_is_what_describing_the_engine_again_gives(lora_model: Any) -> None:
    """The state a successful sync leaves is known: the steady plan made from the first description equals a plan
    made from a new description of the engine after that sync."""
    engine = Recorder()
    hwsync.sync(engine, lora_model, strategy="adapter")
    steady = last_plan(engine, lora_model)
    assert steady is not None and not steady.payload.includes_base
    asked = SyncPlan.make(engine, lora_model, SyncRequest(Strategy.ADAPTER))
    assert steady.manifest.digest == asked.manifest.digest
    assert steady.payload.reason == asked.payload.reason
    assert steady.synced().version == engine.version


def test_a_model_without_adapter_is_one_round_trip() -> None:
    engine = Recorder()
    model = tiny_model(lora=False)
    report = hwsync.sync(engine, model)
    assert report is not None and report.strategy == "full"
    assert engine.describes == 1
    hwsync.sync(engine, model)
    assert engine.describes == 1


def test_options_key_the_plans_and_a_changed_engine_replans(lora_model: Any) -> None:
    engine = Recorder()
    hwsync.sync(engine, lora_model, strategy="adapter")
    assert engine.describes == 2
    hwsync.sync(engine, lora_model, strategy="full")  # other options: a plan of their own
    assert engine.describes == 4
    # the adapter plan expects the engine at v1; it is at v2: the engine refuses before writing, the trainer plans
    # again once (one description) and the base travels again (the full sync replaced it)
    report = hwsync.sync(engine, lora_model, strategy="adapter")
    assert report is not None and report.version == 3 and report.base_tensors > 0
    assert engine.describes == 6
    plan = last_plan(engine, lora_model)
    assert plan is not None and plan.options == SyncRequest(Strategy.ADAPTER) and plan.synced_version == 3


def test_a_refill_resends_the_plan_that_carried_the_base_without_planning(lora_model: Any) -> None:
    """After vLLM discarded the weights (level-2 sleep) the engine refuses the steady plan; the trainer asks for its
    state alone and re-sends the plan that carried the base, then goes on with the same steady plan. An engine that
    moved on meanwhile (another version) is planned for anew, from that same state answer."""
    engine = Recorder()
    hwsync.sync(engine, lora_model, strategy="adapter")
    steady = hwsync.sync(engine, lora_model, strategy="adapter")
    assert steady is not None and steady.base_tensors == 0
    planned = last_plan(engine, lora_model)
    described = engine.describes

    engine.forget("vLLM's level-2 sleep discarded the engine's weights")
    refill = hwsync.sync(engine, lora_model, strategy="adapter")
    assert refill is not None and refill.base_tensors > 0 and refill.lora_tensors > 0
    assert "full refill (base + adapter): vLLM's level-2 sleep" in refill.reason, refill.reason
    assert engine.describes == described + 1  # the state, nothing planned anew
    assert last_plan(engine, lora_model) is planned
    after = hwsync.sync(engine, lora_model, strategy="adapter")
    assert after is not None and after.base_tensors == 0 and after.version == refill.version + 1

    engine.forget("vLLM's level-2 sleep discarded the engine's weights")
    engine.version += 5  # someone else synced meanwhile: the kept plan does not describe this engine
    described = engine.describes
    again = hwsync.sync(engine, lora_model, strategy="adapter")
    assert again is not None and again.base_tensors > 0 and again.version == engine.version
    assert engine.describes == described + 2  # the state (reused as the plan's first description) and the paths
    assert last_plan(engine, lora_model) is not planned
