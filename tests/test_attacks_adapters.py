"""Engine state hwsync does not own: a user's own adapters beside hwsync's, on one real vLLM engine (colocated).

A ``LoRARequest`` vLLM refuses must not break hwsync's later syncs and generation on that engine (vLLM used to leave
the refused request in its scheduler, where every later step ran it again: the
``vllm_offline_failed_requests`` patch); and when hwsync's in-memory adapter is gone from the engine, generating with
the ``lora_request`` a sync reported must say so and that a sync installs it again (vLLM would otherwise try to load
``hwsync-in-memory://...`` from the Hugging Face Hub).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import hwsync
from hwsync.common.errors import SyncError
from hwsync.testing import patched_llm
from hwsync.testing.trainer import lora_trainer, perturb

pytestmark = pytest.mark.vllm

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8], [3, 4, 200, 17, 18, 99]]
ENGINE = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}


@pytest.fixture(scope="module")
def llm(tiny_qwen3_moe_dir: Path) -> Iterator[Any]:
    with patched_llm(tiny_qwen3_moe_dir, **ENGINE) as engine:  # + what VLLM_PLUGINS=hwsync does
        yield engine


def _bounded(call: Any, seconds: float = 300) -> Any:
    """``call()``, failing the test instead of hanging when it does not return (a wedged engine spins forever)."""
    out: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            out.append((True, call()))
        except BaseException as e:  # noqa: BLE001
            out.append((False, e))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert out, f"did not return within {seconds:g} s (the engine is wedged)"
    ok, value = out[0]
    if not ok:
        raise value
    return value


def _user_adapter(path: Path, out: Path, kind: str) -> Any:
    from vllm.lora.request import LoRARequest

    if kind == "rank above max_lora_rank":
        model = lora_trainer(path, ATTN, r=16, lora_alpha=32)
    elif kind == "3-D experts on a 2-D wrapper":  # fused expert LoRA without is_3d_lora_weight (CPU: no expert LoRA)
        model = lora_trainer(path, ATTN, EXPERTS)
    else:  # a valid adapter, but hwsync's pinned one holds the only slot (max_loras=1): "All items are pinned"
        model = lora_trainer(path, ATTN)
    perturb(model, 7)
    model.save_pretrained(out)
    return LoRARequest("user-adapter", 7, str(out))


@pytest.mark.parametrize("kind", ["rank above max_lora_rank", "3-D experts on a 2-D wrapper", "no free slot"])
def test_a_refused_user_adapter_does_not_break_hwsync(
    llm: Any, tiny_qwen3_moe_dir: Path, tmp_path: Path, kind: str
) -> None:
    from vllm import SamplingParams

    lora = lora_trainer(tiny_qwen3_moe_dir, ATTN)
    perturb(lora, 1)
    hwsync.sync(llm, lora, strategy="adapter")
    request = _user_adapter(tiny_qwen3_moe_dir, tmp_path / "user", kind)
    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    with pytest.raises(Exception):  # noqa: B017 - vLLM's own error for the user's adapter
        _bounded(lambda: llm.generate([{"prompt_token_ids": PROMPTS[0]}], greedy, lora_request=request, use_tqdm=False))
    assert llm.llm_engine.get_num_unfinished_requests() == 0  # the refused request was not left behind
    for seed in (2, 3):  # later syncs, hwsync's generation and verification work as before
        perturb(lora, seed)
        report = _bounded(lambda: hwsync.sync(llm, lora, strategy="adapter"))
        assert report.lora_request.lora_name == "hwsync"
        _bounded(lambda: hwsync.verify(llm, lora, PROMPTS))
        assert len(_bounded(lambda: hwsync.generate(llm, [{"prompt_token_ids": PROMPTS[1]}], greedy))) == 1


def test_an_evicted_adapter_says_so_and_a_sync_reinstalls_it(llm: Any, tiny_qwen3_moe_dir: Path) -> None:
    """hwsync's adapter is dropped from the engine behind its back (here ``remove_lora``, as a framework cleaning up
    its adapters does; an LRU eviction or another reload drops it the same way)."""
    from vllm import SamplingParams

    lora = lora_trainer(tiny_qwen3_moe_dir, ATTN)
    perturb(lora, 4)
    report = hwsync.sync(llm, lora, strategy="adapter")
    assert llm.llm_engine.remove_lora(report.lora_request.lora_int_id)
    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    with pytest.raises(SyncError, match="synced by hwsync and is no longer in the engine.*hwsync.sync"):
        _bounded(
            lambda: llm.generate(
                [{"prompt_token_ids": PROMPTS[0]}], greedy, lora_request=report.lora_request, use_tqdm=False
            )
        )
    assert hwsync.as_engine(llm).state()["lora_int_id"] is None  # hwsync knows its adapter is gone
    perturb(lora, 5)
    again = _bounded(lambda: hwsync.sync(llm, lora, strategy="adapter"))
    out = _bounded(
        lambda: llm.generate(
            [{"prompt_token_ids": PROMPTS[0]}], greedy, lora_request=again.lora_request, use_tqdm=False
        )
    )
    assert len(out) == 1
    _bounded(lambda: hwsync.verify(llm, lora, PROMPTS))
