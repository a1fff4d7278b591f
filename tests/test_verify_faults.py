"""``hwsync.verify`` tells a broken sync from numerics: every injected fault caught, no false alarm on healthy syncs.

One real vLLM engine for the module (tiny Qwen3-MoE, ``hwsync.testing.engine_args``: fp32 on vLLM's CPU build, LoRA
on attention). Per strategy (full, adapter, hybrid): 20 healthy syncs (changing weights, a repeat, a switch back),
each checked -- zero false alarms -- then every fault of :mod:`hwsync.testing.faults` written into the engine's real
state (vLLM's reload with wrong tensors, the worker's LoRA manager changed, a real sync of older weights), each of
which must be caught by the check that names it, and the engine must pass again once repaired.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import hwsync
from hwsync.common.errors import OptionError, VerifyError
from hwsync.testing import on_cpu, patched_llm
from hwsync.testing.faults import FAULTS, FaultInjector, applicable, campaign
from hwsync.testing.trainer import lora_trainer

pytestmark = pytest.mark.vllm

PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8], [3, 4, 200, 17, 18, 99], [11, 400, 23]]
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ENGINE = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
STEPS = 20
# the exact check that must name each fault (the logprob gate may fire too: on CPU fp32 it usually does)
CAUGHT_BY = {
    "adapter not installed": "state",
    "stale adapter id": "state",
    "LoRA scaling 2x": "adapter content",
    "LoRA slot not written": "adapter slots",
    "scaling folded in another order": "adapter content",
    "post-load skipped": "base content",
    "layer experts not written": "base content",
    "experts transposed": "base content",
    "gate/up swapped": "base content",
}


@pytest.fixture(scope="module")
def llm(tiny_qwen3_moe_dir: Path) -> Iterator[Any]:
    with patched_llm(tiny_qwen3_moe_dir, **ENGINE) as engine:  # + what VLLM_PLUGINS=hwsync does
        yield engine


def _trainer(path: Path, experts: bool) -> Any:
    # o_proj's scaling 6/4 is not a power of two: folding it in another order than vLLM's changes last bits of B in
    # a 16-bit LoRA dtype (the fault "scaling folded in another order"); the other modules keep alpha/r = 2
    return lora_trainer(path, ATTN, EXPERTS if experts else None, alpha_pattern={"o_proj": 6})


@pytest.mark.parametrize("strategy", ["full", "adapter", "hybrid"])
def test_no_false_alarm_and_every_fault_caught(llm: Any, tiny_qwen3_moe_dir: Path, strategy: str) -> None:
    assert_campaign(llm, tiny_qwen3_moe_dir, strategy)


def assert_campaign(llm: Any, tiny_qwen3_moe_dir: Path, strategy: str) -> None:
    """20 healthy syncs without a false alarm, then every applicable fault caught by its check and repaired."""
    info = hwsync.as_engine(llm).describe()
    model = _trainer(tiny_qwen3_moe_dir, experts=strategy != "adapter" or info.moe_lora)
    result = campaign(llm, model, strategy, PROMPTS, steps=STEPS, log=print)
    false_alarms = [h["message"] for h in result["healthy"] if h["failed"]]
    assert not false_alarms, f"{len(false_alarms)} false alarm(s) over {STEPS} healthy syncs: {false_alarms[0]}"
    assert len(result["healthy"]) == STEPS
    # the exact checks: healthy fingerprints within a thousandth of their allowance (float64 summation order)
    assert max(h.get("base content", 0.0) for h in result["healthy"]) < 1e-3
    assert max(h.get("adapter content", 0.0) for h in result["healthy"]) < 1e-3
    expected = [f for f in FAULTS if applicable(f, strategy)]
    not_here = result.get("not_applicable", {})
    if on_cpu() and info.dtype == "float32":  # the CPU prepack is real there; fp32 LoRA folds alike in both orders
        assert set(not_here) <= {"scaling folded in another order"}, (
            f"every other fault changes a CPU fp32 engine: {not_here}"
        )
    if strategy != "full" and info.lora_dtype in ("bfloat16", "float16"):
        assert "scaling folded in another order" in result["faults"], "a 16-bit LoRA dtype must see the other order"
    assert sorted(result["faults"]) == sorted(f for f in expected if f not in not_here)
    for fault, got in result["faults"].items():
        assert got["failed"], f"{strategy}: {fault} was not caught: {got['message']}"
        want = CAUGHT_BY.get(fault) or ("adapter content" if strategy == "adapter" else "base content")
        assert want in got["failed"], f"{strategy}: {fault} caught by {got['failed']}, not by {want!r}"
        assert result["repaired"][fault], f"{strategy}: the engine did not pass again after repairing {fault}"


def test_verify_raises_naming_the_check_and_the_fix(llm: Any, tiny_qwen3_moe_dir: Path) -> None:
    model = _trainer(tiny_qwen3_moe_dir, experts=True)
    hwsync.sync(llm, model, strategy="hybrid")
    hwsync.verify(llm, model, PROMPTS)  # the default call: content checks + this platform's gate
    injector = FaultInjector(llm, model)
    injector.inject("stale adapter id")
    with pytest.raises(VerifyError, match=r"state: .*stale adapter id.*Fix: run hwsync.sync"):
        hwsync.verify(llm, model, PROMPTS)
    injector.repair()
    injector.inject("gate/up swapped")
    with pytest.raises(VerifyError, match=r"base content: 1 of \d+ tensor\(s\) differ.*gate_up_proj"):
        hwsync.verify(llm, model, PROMPTS)
    if on_cpu() and hwsync.as_engine(llm).describe().dtype == "float32":
        # the logprob gate alone (content=False) sees it too where the engine computes like the trainer
        with pytest.raises(VerifyError, match="logprobs: mean"):
            hwsync.verify(llm, model, PROMPTS, content=False)
    injector.repair()
    hwsync.verify(llm, model, PROMPTS)


def test_gate_override_and_bad_value(llm: Any, tiny_qwen3_moe_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hwsync.trainer.verify import GATES, Gate, check, gate_for

    assert gate_for("cuda", "bfloat16") == GATES[("cuda", "bfloat16")]
    assert gate_for("cpu", "float32").max_abs is not None
    model = _trainer(tiny_qwen3_moe_dir, experts=False)
    hwsync.sync(llm, model, strategy="adapter")
    tight = Gate(mean_abs=1e-12, p90_abs=1e-12, mean_prob=1e-12)
    r = check(llm, model, PROMPTS, gate=tight)
    assert [c.name for c in r.failed] == ["logprobs"]  # content exact, numerics above an absurd gate
    monkeypatch.setenv("HWSYNC_VERIFY_GATE", "1e-12,1e-12,1e-12")
    assert [c.name for c in check(llm, model, PROMPTS).failed] == ["logprobs"]
    monkeypatch.setenv("HWSYNC_VERIFY_GATE", "0.1,abc")
    with pytest.raises(OptionError, match="HWSYNC_VERIFY_GATE"):
        check(llm, model, PROMPTS)
