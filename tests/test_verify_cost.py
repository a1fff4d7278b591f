"""``hwsync.verify`` at any depth: reads only what can have changed, and reads a logprob gap against the model's own
numerics.

On a real vLLM CPU engine (tiny Qwen3-MoE): the base is read whole after every base write and in turns otherwise,
with the stated guarantee (every tensor within :data:`hwsync.verify.BASE_ROUNDS` checks) -- a tensor changed behind
hwsync's back is caught within that many checks, one written by a sync at the next; the model's numerics spread
grows with the rounding unit; and the logprob verdict is decisive only beyond both the gate and the spread.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hwsync
from hwsync.testing import patched_llm
from hwsync.testing.faults import FaultInjector
from hwsync.testing.trainer import lora_trainer
from hwsync.trainer import verify as V

pytestmark = pytest.mark.vllm

PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8], [3, 4, 200, 17, 18, 99]]
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def llm(tiny_qwen3_moe_dir: Path) -> Iterator[Any]:
    with patched_llm(tiny_qwen3_moe_dir, enable_lora=True, max_lora_rank=8, max_loras=1) as engine:
        yield engine


def _step_lora_b(model: Any) -> None:
    """A training step's worth of change to every LoRA B (PEFT starts them at zero)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(0.01)


def _base_read(report: Any) -> str:
    return next(c.detail for c in report.checks if c.name == "base content")


def test_base_read_whole_after_a_write_and_in_turns_otherwise(
    llm: Any, tiny_qwen3_moe_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(V, "BASE_SAMPLE_BYTES", 1)  # the tiny base would fit the byte floor: force the turns
    model = lora_trainer(tiny_qwen3_moe_dir, ATTN, None)
    hwsync.sync(llm, model, strategy="adapter")
    first = V.check(llm, model, PROMPTS, logprobs=False)
    assert first.ok, first.message()
    assert "whole (written since it was last checked)" in _base_read(first)
    total = int(_base_read(first).split(" of ")[1].split()[0])
    rounds = -(-total // -(-total // V.BASE_ROUNDS))
    # adapter syncs leave the base alone: it is read in turns, every tensor within BASE_ROUNDS checks
    seen = 0
    for _ in range(rounds):
        _step_lora_b(model)
        hwsync.sync(llm, model, strategy="adapter")
        r = V.check(llm, model, PROMPTS, logprobs=False)
        assert r.ok, r.message()
        assert "in turn" in _base_read(r), _base_read(r)
        seen += int(_base_read(r).split("base tensors read")[0].split(";")[-1].split(" of ")[0])
    assert seen >= total
    # a base tensor changed behind hwsync's back (no sync counted the write): caught within BASE_ROUNDS checks
    from hwsync.engine.vllm.worker import receiver_of

    receiver = receiver_of(llm.llm_engine.model_executor.driver_worker)
    before = receiver.state.base_writes
    injector = FaultInjector(llm, model)
    injector.inject("gate/up swapped")
    receiver.state.base_writes = before  # the injector counts its write as a sync would: this writer is unseen
    caught_at = next((i for i in range(rounds + 1) if not V.check(llm, model, PROMPTS, logprobs=False).ok), None)
    assert caught_at is not None and caught_at <= rounds, "a base tensor changed behind hwsync's back went unseen"
    injector.repair()
    # a fault written as a sync writes (the base counted as written): caught at the very next check
    injector.inject("gate/up swapped")
    r = V.check(llm, model, PROMPTS, logprobs=False)
    assert not r.ok and "whole" in _base_read(r) and "gate_up_proj" in _base_read(r), r.message()
    injector.repair()
    assert V.check(llm, model, PROMPTS, logprobs=False).ok


def test_numerics_spread_grows_with_the_rounding_unit(llm: Any, tiny_qwen3_moe_dir: Path) -> None:
    model = lora_trainer(tiny_qwen3_moe_dir, ATTN, None)
    hwsync.sync(llm, model, strategy="adapter")
    a = V.agreement(llm, model, PROMPTS, max_tokens=4)
    assert len(V.decoder_layers(model)) == model.config.num_hidden_layers
    fine = V.numerics_spread(model, a.sequences, 1e-7)
    coarse = V.numerics_spread(model, a.sequences, 1e-2)
    assert fine is not None and coarse is not None
    assert 0 < fine.mean_abs < coarse.mean_abs, (fine, coarse)
    assert coarse.max_abs >= coarse.p90_abs >= 0
    # the perturbation is gone afterwards: the trainer computes exactly as before
    again = V.token_logprobs(model, a.sequences[0][0])
    assert torch.equal(again, a.sequences[0][1])


def _agreement(mean: float, p90: float, prob: float = 0.0) -> V.Agreement:
    return V.Agreement(
        max_abs_diff=p90,
        where="",
        tokens=10,
        greedy_mismatches=(),
        mean_abs_diff=mean,
        p90_abs_diff=p90,
        mean_prob_diff=prob,
    )


def test_logprob_verdict_is_decisive_only_beyond_gate_and_spread() -> None:
    gate = V.Gate(mean_abs=0.5, p90_abs=2.0, mean_prob=0.05)
    spread = V.Spread(mean_abs=5.0, p90_abs=10.0, mean_prob=0.01, max_abs=20.0, unit=2**-7)
    within_gate, weak, _ = V._logprob_check(_agreement(0.3, 1.0), gate, spread, "")
    assert within_gate.ok and not weak
    # 48 layers of a random model: far beyond the gate, within 4x the spread -> weak evidence, logged, not failing
    deep, weak, _ = V._logprob_check(_agreement(8.0, 14.0, prob=0.16), gate, spread, "")
    assert deep.ok and weak and "within 4x" in weak[0]
    # beyond both: decisive
    broken, weak, _ = V._logprob_check(_agreement(25.0, 45.0), gate, spread, "")
    assert not broken.ok and not weak
    # no spread (an explicit gate): the gate alone decides
    alone, weak, _ = V._logprob_check(_agreement(8.0, 14.0), gate, None, "")
    assert not alone.ok and not weak
    # NaN is never weak
    nan, _, _ = V._logprob_check(_agreement(float("nan"), float("nan")), gate, spread, "")
    assert not nan.ok


def _slots(report: Any) -> str:
    return next(c.detail for c in report.checks if c.name == "adapter slots")


def test_traced_layout_is_proven_once_and_slots_are_still_checked(llm: Any, tiny_qwen3_moe_dir: Path) -> None:
    """vLLM's own ``set_lora`` re-derives every module of hwsync's traced slot layout once (the layout is fixed per
    writer; re-running it at every check was the adapter guard's largest part at 48 layers); later checks re-derive
    none and still catch a slot written behind hwsync's back, through the traced blocks."""
    import re

    model = lora_trainer(tiny_qwen3_moe_dir, ATTN, None)
    _step_lora_b(model)  # a trained adapter: PEFT starts B at zero, where a zeroed slot changes nothing
    hwsync.sync(llm, model, strategy="adapter")
    first = V.check(llm, model, PROMPTS, logprobs=False)
    assert first.ok, first.message()
    found = re.search(
        r"layout of (\d+) of (\d+) modules proven by vLLM's own set_lora \((\d+) in this check\)", _slots(first)
    )
    assert found, _slots(first)
    proven, modules, _ = map(int, found.groups())
    assert proven == modules > 0, _slots(first)
    second = V.check(llm, model, PROMPTS, logprobs=False)
    assert second.ok and "(0 in this check)" in _slots(second), _slots(second)
    injector = FaultInjector(llm, model)
    injector.inject("LoRA slot not written")
    caught = V.check(llm, model, PROMPTS, logprobs=False)
    assert not caught.ok and any(c.name == "adapter slots" and not c.ok for c in caught.checks), caught.message()
    injector.repair()
    assert V.check(llm, model, PROMPTS, logprobs=False).ok


def test_adapter_compared_in_batches_holds_one_batch_and_still_catches(
    llm: Any, tiny_qwen3_moe_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer's folded LoRA tensors (copies made for the check) go to the engine in batches of
    LORA_BATCH_BYTES, not all at once: with one tensor per batch the verdicts are the same -- a healthy sync
    passes with every tensor compared, a doubled scaling and a zeroed slot are caught."""
    model = lora_trainer(tiny_qwen3_moe_dir, ATTN, None)
    _step_lora_b(model)
    hwsync.sync(llm, model, strategy="adapter")
    whole = V.check(llm, model, PROMPTS, logprobs=False)
    assert whole.ok, whole.message()
    monkeypatch.setattr(V, "LORA_BATCH_BYTES", 1)
    calls: list[int] = []
    engine = hwsync.as_engine(llm)
    real = engine.compare

    def counted(request: dict[str, Any]) -> Any:
        if request.get("lora") is not None:
            calls.append(len(request["lora"]["tensors"]))
        return real(request)

    monkeypatch.setattr(engine, "compare", counted)
    batched = V.check(llm, model, PROMPTS, logprobs=False)
    assert batched.ok, batched.message()
    assert len(calls) > 1 and max(calls) == 1, calls
    content = lambda r: next(c.detail for c in r.checks if c.name == "adapter content")  # noqa: E731
    assert content(batched) == content(whole)
    for fault, check in (("LoRA scaling 2x", "adapter content"), ("LoRA slot not written", "adapter slots")):
        injector = FaultInjector(llm, model)
        injector.inject(fault)
        caught = V.check(llm, model, PROMPTS, logprobs=False)
        assert not caught.ok and any(c.name == check and not c.ok for c in caught.checks), (fault, caught.message())
        injector.repair()
    assert V.check(llm, model, PROMPTS, logprobs=False).ok
