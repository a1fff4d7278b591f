"""vLLM's level-2 sleep: the next sync refills what was discarded, exactly, in place or through the first-sync path.

vLLM's CPU build has no sleep mode, so :func:`hwsync.testing.sleep.stand_in_sleep` makes ``llm.sleep(level=2)`` /
``llm.wake_up()`` (vLLM's own dispatch down to the worker) overwrite the engine's weights, LoRA slots and derived
tensors with NaN and restore what vLLM restores (buffers, ``sleep_preserve_parameter_names``); ``remap=True`` also
gives every parameter new storage on wake, where an in-place write through an old address would be wrong.
Reference: the same engine's output and LoRA slots before the sleep (same weights), and vLLM's own activation.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hwsync
from hwsync.common.errors import EngineAsleepError, StaleEngineError, SyncError
from hwsync.testing import close_llm, make_llm, require_vllm
from hwsync.testing.sleep import stand_in_sleep, worker_of
from hwsync.testing.trainer import fail_at, lora_trainer, perturb
from hwsync.trainer.api import _plans, as_engine
from hwsync.trainer.verify import KV_ASLEEP, check

pytestmark = pytest.mark.vllm

PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8], [3, 4, 200, 17, 18, 99]]
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _engine(path: Path, remap: bool) -> tuple[Any, Any]:
    require_vllm()
    from hwsync.engine import vllm_plugin

    vllm_plugin.register()
    llm = make_llm(path, enable_lora=True, max_lora_rank=8, max_loras=2, lora_target_modules=["qkv_proj", "o_proj"])
    return llm, stand_in_sleep(llm, remap=remap)  # before hwsync touches it: it stands where vLLM's methods are


@pytest.fixture(scope="module")
def engine(tiny_qwen3_moe_dir: Path) -> Iterator[tuple[Any, Any]]:
    llm, stand_in = _engine(tiny_qwen3_moe_dir, remap=False)
    yield llm, stand_in
    close_llm(llm)


def _logprobs(llm: Any) -> list[list[float]]:
    from vllm import SamplingParams

    from hwsync.trainer.verify import engine_logprobs

    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, prompt_logprobs=0, detokenize=False)
    return [engine_logprobs(o)[1] for o in hwsync.generate(llm, [{"prompt_token_ids": p} for p in PROMPTS], params)]


def _slots(llm: Any) -> dict[str, torch.Tensor]:
    """Every LoRA slot tensor of hwsync's adapter's slot (cloned)."""

    wm = worker_of(llm).model_runner.lora_manager._adapter_manager
    slot = wm.lora_index_to_id.index(as_engine(llm).lora_request.lora_int_id)
    return {
        f"{name}.{attr}[{i}]": t[slot].clone()
        for name, module in wm.modules.items()
        for attr in ("lora_a_stacked", "lora_b_stacked")
        for i, t in enumerate(getattr(module, attr))
    }


def _params(llm: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in worker_of(llm).model_runner.get_model().named_parameters()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys() and a
    return [k for k in a if not torch.equal(a[k], b[k])]


def test_adapter_refill_after_level2_wake_is_exact(engine: tuple[Any, Any], tiny_qwen3_moe_dir: Path) -> None:
    """Adapter strategy: a level-2 wake makes the next sync a full refill (base + adapter, the report says why); the
    engine then serves exactly what it served before the sleep, parameters and slots bit-equal; a sync while asleep
    and generation before the refill are refused; later syncs are steady (adapter only) again."""
    llm, stand_in = engine
    model = lora_trainer(tiny_qwen3_moe_dir, ATTN, lora_dropout=0.0)
    perturb(model, 1)
    hwsync.sync(llm, model)
    perturb(model, 2)
    steady = hwsync.sync(llm, model)
    assert steady.strategy == "adapter" and steady.base_tensors == 0, steady.line()
    out, params, slots = _logprobs(llm), _params(llm), _slots(llm)
    (planned,) = _plans(as_engine(llm), model).values()

    llm.sleep(level=2)
    assert stand_in.discards == 1
    assert all(torch.isnan(p).all() for p in _params(llm).values() if p.numel())  # the stand-in did discard
    with pytest.raises(EngineAsleepError, match="asleep"):
        hwsync.sync(llm, model)
    llm.wake_up()
    with pytest.raises(StaleEngineError, match="level-2 sleep"):
        _logprobs(llm)
    refill = hwsync.sync(llm, model)
    print(refill.line())
    assert refill.strategy == "adapter" and refill.base_tensors > 0 and refill.lora_tensors > 0, refill.line()
    assert "full refill (base + adapter)" in refill.reason and "level-2 sleep" in refill.reason, refill.reason
    assert "every address kept" in refill.path, refill.path
    assert not _equal(params, _params(llm)), "parameters differ from before the sleep"
    assert not _equal(slots, _slots(llm)), "LoRA slots differ from before the sleep"
    assert _logprobs(llm) == out
    # the refill re-sent the first sync's plan and went back to the steady one: nothing planned anew (describing a
    # 48-layer MoE's LoRA paths and reading its adapter again cost ~2 s of a refill on an H200)
    assert _plans(as_engine(llm), model)[planned.options] is planned

    perturb(model, 3)
    after = hwsync.sync(llm, model)
    assert after.base_tensors == 0 and "rewritten in place" in after.path, after.line()


def test_full_refill_interrupted_stays_stale(engine: tuple[Any, Any], tiny_qwen3_moe_dir: Path) -> None:
    """Full strategy: a refill that dies half-way leaves the engine stale (never serving the discarded garbage); a
    complete one serves exactly as before the sleep. A level-1 sleep discards nothing: the plan stays steady."""
    llm, _ = engine
    model = lora_trainer(tiny_qwen3_moe_dir)
    perturb(model, 4, base=True)
    hwsync.sync(llm, model, strategy="full")
    out, params = _logprobs(llm), _params(llm)
    llm.sleep(level=1)
    llm.wake_up()
    again = hwsync.sync(llm, model, strategy="full")
    assert "refill" not in again.reason and _logprobs(llm) == out

    llm.sleep(level=2)
    llm.wake_up()
    with pytest.raises(SyncError):
        hwsync.sync(llm, model, strategy="full", progress=fail_at(2), bucket_mb=0.25)
    with pytest.raises(StaleEngineError):
        _logprobs(llm)
    refill = hwsync.sync(llm, model, strategy="full")
    assert "full refill (base)" in refill.reason, refill.reason
    assert not _equal(params, _params(llm))
    assert _logprobs(llm) == out


def test_trls_reload_after_wake_is_hwsyncs_refill(engine: tuple[Any, Any], tiny_qwen3_moe_dir: Path) -> None:
    """TRL's sleep mode calls ``collective_rpc("reload_weights")`` after waking (vllm#29341), which would reload the
    checkpoint from disk over the trainer's weights: through hwsync's ``ServedLLM`` it is the refill where vLLM
    discarded the weights, and nothing where it did not."""
    from hwsync.integrations.trl._generation import ServedLLM

    llm, _ = engine
    model = lora_trainer(tiny_qwen3_moe_dir, ATTN, lora_dropout=0.0)
    perturb(model, 7)
    hwsync.sync(llm, model)
    out, params = _logprobs(llm), _params(llm)
    reports: list[Any] = []
    served = ServedLLM(llm, refill=lambda: reports.append(hwsync.sync(llm, model)))
    served.collective_rpc("reload_weights")
    assert reports == [] and not _equal(params, _params(llm))
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    served.collective_rpc("reload_weights")
    llm.wake_up(tags=["kv_cache"])
    assert len(reports) == 1 and "full refill" in reports[0].reason, reports
    assert _logprobs(llm) == out


def test_every_entry_point_is_watched(engine: tuple[Any, Any], tiny_qwen3_moe_dir: Path) -> None:
    """A level-2 sleep (or a discard of the weights) is seen whichever way vLLM is asked for it: ``LLM.sleep`` (the
    ``/sleep`` route's path from ``EngineCore.sleep`` down), ``collective_rpc("sleep")`` and the executor's
    ``discard``. Each is refused for syncs while asleep, stale after the wake, and refilled by the next sync; an
    unseen one would leave the engine serving the discarded garbage."""
    from hwsync.patches.vllm_sleep_watch import observer_of

    llm, stand_in = engine
    model = lora_trainer(tiny_qwen3_moe_dir, ATTN, lora_dropout=0.0)
    perturb(model, 8)
    hwsync.sync(llm, model)
    watch = observer_of(worker_of(llm))
    assert watch.observed  # the stand-in sits on the instance, where vLLM's dispatch finds it; the watch around it
    executor = llm.llm_engine.model_executor
    entries = {
        "LLM.sleep": (lambda: llm.sleep(level=2), llm.wake_up),
        "collective_rpc": (
            lambda: llm.collective_rpc("sleep", kwargs={"level": 2}),
            lambda: llm.collective_rpc("wake_up", kwargs={"tags": None}),
        ),
        "discard": (lambda: executor.discard(("weights",)), lambda: executor.wake_up(["weights"])),
    }
    for name, (sleep, wake) in entries.items():
        discards = stand_in.discards
        sleep()
        assert stand_in.discards == discards + 1, name
        assert watch.asleep is not None and watch.discarded is not None and not watch.discarded.woke, name
        with pytest.raises(EngineAsleepError):
            hwsync.sync(llm, model)
        wake()
        assert watch.asleep is None and watch.discarded.woke, name
        with pytest.raises(StaleEngineError):
            _logprobs(llm)
        refill = hwsync.sync(llm, model)
        assert "full refill" in refill.reason and watch.discarded is None, (name, refill.reason)


def test_refill_takes_first_sync_path_where_addresses_moved(tiny_qwen3_moe_dir: Path) -> None:
    """A wake that gives parameters new storage: detected, every in-place plan dropped, the refill goes through
    vLLM's reload and adapter activation, and the engine serves exactly as before; in-place writes through the
    addresses learnt before the sleep would have landed in storage no kernel reads. Closed, the engine leaves no
    worker behind, so the sleep watch's hold on vLLM's dispatch (patch ``vllm_sleep_watch``) goes with it."""
    import weakref

    from hwsync.engine.vllm.worker import receiver_of

    llm, stand_in = _engine(tiny_qwen3_moe_dir, remap=True)
    worker = weakref.ref(worker_of(llm))
    try:
        model = lora_trainer(tiny_qwen3_moe_dir, ATTN, lora_dropout=0.0)
        perturb(model, 5)
        hwsync.sync(llm, model)
        perturb(model, 6)
        hwsync.sync(llm, model)
        out, params = _logprobs(llm), _params(llm)
        applier = receiver_of(worker_of(llm)).applier
        llm.sleep(level=2)
        llm.wake_up()
        assert stand_in.remapped > 0
        assert applier._refill is not None and applier._refill.moved  # detected, before any sync
        refill = hwsync.sync(llm, model)
        assert "at new addresses: in-place plans dropped, first-sync path" in refill.path, refill.path
        assert " 0 in place" in refill.path and "adapter: built" in refill.path, refill.path
        assert not _equal(params, _params(llm))
        assert _logprobs(llm) == out
    finally:
        close_llm(llm)
    del llm, stand_in, applier
    gc.collect()
    assert worker() is None, "the closed engine's worker is still alive"


def test_a_refill_says_which_derived_tensors_send_layers_through_vllms_reload() -> None:
    """A layer holding a tensor its post-load step derived is refilled through vLLM's reload (which rebuilds it); the
    sync report names how many tensors that sent there and one such tensor, so a slow refill says why."""
    from types import SimpleNamespace

    from hwsync.engine.vllm.applier import VllmApplier
    from hwsync.engine.vllm.direct import DirectWriter
    from hwsync.engine.vllm.sleep import Discarded

    names = SimpleNamespace(unwritten=lambda: [])
    groups = {"l0.w13": "model.layers.0.mlp.experts", "l0.w2": "model.layers.0.mlp.experts", "l1.q": "model.layers.1.q"}
    plan = SimpleNamespace(names=names, groups=groups)
    refill = Discarded("vLLM's level-2 sleep", frozenset(), frozenset({"model.layers.0.mlp.experts.packed[0]"}))
    applier = SimpleNamespace(_live=lambda plan: {})
    direct = DirectWriter(names, frozenset(groups), {})
    kept, note = VllmApplier._refill_direct(applier, plan, refill, direct)  # type: ignore[arg-type]
    assert kept is not None and kept.names == {"l1.q"}
    assert note == (
        "; 2 tensors through vLLM's reload for 1 tensors their layers' post-load step derived "
        "(e.g. model.layers.0.mlp.experts.packed[0])"
    )
    untouched = Discarded("vLLM's level-2 sleep", frozenset(), frozenset({"model.layers.9.mlp.experts.packed[0]"}))
    assert VllmApplier._refill_direct(applier, plan, untouched, direct) == (direct, "")  # type: ignore[arg-type]


def test_a_sleep_before_hwsync_attached_is_adopted(tiny_qwen3_moe_dir: Path) -> None:
    """ms-swift (``--sleep_level 2``) and TRL (sleep mode) put the engine to sleep right after building it, before
    hwsync has seen it: what that sleep discarded is unknown, so the first sync is refused while the weights sleep
    and, once they are woken, carries the base (adapter strategy included) -- the engine then serves the trainer
    exactly instead of the garbage the sleep left."""
    llm, _stand_in = _engine(tiny_qwen3_moe_dir, remap=False)
    try:
        model = lora_trainer(tiny_qwen3_moe_dir, ATTN, lora_dropout=0.0)
        perturb(model, 7)
        llm.sleep(level=2)
        with pytest.raises(EngineAsleepError, match="asleep"):
            hwsync.sync(llm, model, strategy="adapter")
        llm.wake_up(tags=["weights"])
        report = hwsync.sync(llm, model, strategy="adapter")
        assert report.base_tensors > 0 and "refill" in report.path, report.path
        params = _params(llm)
        assert all(torch.isfinite(t).all() for t in params.values() if t.is_floating_point())
        # the KV cache still sleeps, so vLLM's scheduler is paused: a generation would wait forever. hwsync refuses
        # one, and its check runs the exact content checks and leaves the logprobs to the rollout
        with pytest.raises(EngineAsleepError, match="scheduler"):
            _logprobs(llm)
        partial = check(llm, model, PROMPTS)
        assert partial.ok and partial.skipped == (KV_ASLEEP,), partial.message()
        llm.wake_up(tags=["kv_cache"])
        hwsync.verify(llm, model, PROMPTS)  # content exact and logprobs within the gate
    finally:
        close_llm(llm)


def test_trls_own_repush_after_a_level2_sleep_is_hwsyncs_sync() -> None:
    """TRL 1.16's ``generate()`` re-pushes the weights itself while they slept (``self.sync_weights()`` when
    ``_llm_weights_sleeping``, its merge-and-``load_weights``): with hwsync's generation that call is hwsync's sync
    (weights woken first), and TRL's flag is cleared, so the next generate pushes nothing."""
    from hwsync.integrations.trl._generation import HwsyncGeneration

    calls: list[str] = []

    class Engine:  # the colocated vllm.LLM, as far as the wake goes
        def wake_up(self, tags: list[str] | None = None) -> None:
            calls.append(f"wake {tags}")

    class TrlGeneration:  # TRL's VLLMGeneration as its generate() reaches sync_weights
        mode, enable_sleep_mode = "colocate", True

        def __init__(self) -> None:
            self.llm = Engine()
            self._llm_weights_sleeping = True

        def sync_weights(self) -> None:
            calls.append("TRL's own sync")

        def generate(self) -> str:
            if self._llm_weights_sleeping:
                self.sync_weights()
            return "completions"

    inner = TrlGeneration()
    HwsyncGeneration(inner, lambda: calls.append("hwsync sync"))
    assert inner.generate() == "completions"
    assert calls == ["wake ['weights']", "hwsync sync"] and inner._llm_weights_sleeping is False
    assert inner.generate() == "completions" and len(calls) == 2
