"""Consistency under faults, monotonic versions, and bad input refused before anything is written.

One real vLLM engine (tiny Qwen3-MoE; ``hwsync.testing.engine_args``: fp32 and LoRA on attention on the CPU build,
bf16 on GPUs), started *without* the worker extension: hwsync then calls the same receiver through ``collective_rpc``
with a callable. "The engine serves these weights" is ``hwsync.testing.assert_serves``: engine == trainer within 1e-4
on the CPU build, engine == vLLM's own loading of the same weights within 1e-6 elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hwsync
from hwsync.common.errors import AdapterFormatError, ResolutionError, StaleEngineError, SyncError, VersionError
from hwsync.testing import EngineReference, assert_serves, make_tiny_moe, patched_llm
from hwsync.testing.trainer import lora_trainer, perturb

pytestmark = pytest.mark.vllm

PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8], [3, 4, 200, 17, 18, 99]]
ATOL = 1e-4
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# LoRA served on attention only, on every platform: then `hybrid` sends the experts merged (base bytes), which the
# interrupted-sync test needs (an engine serving expert LoRA, as vLLM does on GPUs by default, gets LoRA only)
ENGINE = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1, "lora_target_modules": ["qkv_proj", "o_proj"]}


@pytest.fixture(scope="module")
def llm(tiny_qwen3_moe_dir: Path) -> Iterator[Any]:
    with patched_llm(tiny_qwen3_moe_dir, **ENGINE) as engine:  # + what VLLM_PLUGINS=hwsync does
        yield engine


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineReference]:
    with EngineReference(tmp_path_factory.mktemp("reference"), **ENGINE) as ref:
        yield ref


def _fail_at(k: int) -> Any:
    def progress(index: int, total: int) -> None:
        if index == k:
            raise RuntimeError(f"trainer crashed at bucket {index} of {total}")

    return progress


def _state(llm: Any) -> dict[str, Any]:
    return hwsync.as_engine(llm).state()


def test_adapter_sync_interrupted_keeps_the_previous_adapter(
    llm: Any, reference: EngineReference, tiny_qwen3_moe_dir: Path
) -> None:
    model = lora_trainer(tiny_qwen3_moe_dir, ATTN)
    perturb(model, 1)
    hwsync.sync(llm, model, strategy="adapter")
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    served = _state(llm)
    perturb(model, 2)
    with pytest.raises(
        SyncError, match=r"aborted after bucket 3 of \d+ .*nothing was applied; the engine still serves"
    ):
        hwsync.sync(llm, model, strategy="adapter", bucket_mb=0.002, progress=_fail_at(3))
    after = _state(llm)
    assert after["version"] == served["version"] and not after["stale"]
    # the engine still computes the previous adapter, exactly
    with torch.no_grad():
        current = {n: p.detach().clone() for n, p in model.named_parameters() if n in before}
        for n, p in model.named_parameters():
            if n in before:
                p.copy_(before[n])
    assert assert_serves(llm, model, PROMPTS, atol=ATOL, reference=reference) <= ATOL
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in current:
                p.copy_(current[n])
    r = hwsync.sync(llm, model, strategy="adapter", bucket_mb=0.002)
    assert r.buckets > 3 and r.base_tensors == 0
    assert assert_serves(llm, model, PROMPTS, atol=ATOL, reference=reference) <= ATOL


@pytest.mark.parametrize("strategy", ["full", "hybrid"])
def test_interrupted_base_sync_marks_stale_until_a_complete_sync(
    llm: Any, reference: EngineReference, tiny_qwen3_moe_dir: Path, strategy: str
) -> None:
    from vllm import SamplingParams

    model = lora_trainer(tiny_qwen3_moe_dir, ATTN, EXPERTS)
    perturb(model, 3, base=strategy == "full")
    hwsync.sync(llm, model, strategy=strategy)
    perturb(model, 4, base=strategy == "full")
    with pytest.raises(SyncError, match=r"aborted after bucket 2 of \d+ .*engine is stale"):
        hwsync.sync(llm, model, strategy=strategy, bucket_mb=0.2, progress=_fail_at(2))
    assert _state(llm)["stale"]
    with pytest.raises(StaleEngineError, match="complete hwsync.sync"):
        hwsync.generate(llm, [{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=2))
    with pytest.raises(StaleEngineError):
        hwsync.verify(llm, model, PROMPTS)
    r = hwsync.sync(llm, model, strategy=strategy, bucket_mb=0.2)
    if strategy == "hybrid":
        assert "base weights sent (engine is stale)" in r.reason  # the whole base comes back, not just experts
    assert not _state(llm)["stale"]
    assert assert_serves(llm, model, PROMPTS, atol=ATOL, reference=reference) <= ATOL


def test_versions_only_increase(llm: Any, reference: EngineReference, tiny_qwen3_moe_dir: Path) -> None:
    model = lora_trainer(tiny_qwen3_moe_dir)
    current = _state(llm)["version"]
    r = hwsync.sync(llm, model, version=current + 100)
    assert r.version == current + 100
    perturb(model, 5, base=True)
    for older in (current + 100, current + 7):
        with pytest.raises(VersionError, match="not newer"):
            hwsync.sync(llm, model, version=older)
    assert _state(llm)["version"] == current + 100
    with torch.no_grad():  # the refused syncs wrote nothing: the engine still serves the unperturbed weights
        model.load_state_dict(lora_trainer(tiny_qwen3_moe_dir).state_dict())
    assert assert_serves(llm, model, PROMPTS, atol=ATOL, reference=reference) <= ATOL
    assert hwsync.sync(llm, model).version == current + 101  # default: the engine's version + 1


def _unknown_name(path: Path, tmp: Path) -> Any:
    model = lora_trainer(path)
    model.model.extra_scale = torch.nn.Parameter(torch.ones(3))
    return model


def _wrong_shape(path: Path, tmp: Path) -> Any:
    other = make_tiny_moe(tmp / "wider", moe_intermediate_size=64)
    return lora_trainer(other)


def _dora(path: Path, tmp: Path) -> Any:
    return lora_trainer(path, ATTN, use_dora=True)


def _dropout_on_experts(path: Path, tmp: Path) -> Any:
    model = lora_trainer(path, ATTN, EXPERTS)
    model.peft_config["default"].lora_dropout = 0.1  # what an ms-swift default (0.05..0.1) config says
    return model


@pytest.mark.parametrize(
    ("make", "strategy", "error", "match"),
    [
        (_unknown_name, "full", ResolutionError, "model.extra_scale.*no receiver parameter"),
        (_wrong_shape, "full", ResolutionError, "model.layers.0.mlp.experts"),
        (_dora, "adapter", AdapterFormatError, "DoRA.*full"),
        (_dropout_on_experts, "adapter", AdapterFormatError, "lora_dropout=0.1.*experts"),
    ],
    ids=["unknown-name", "wrong-shape", "dora-adapter", "dropout-experts"],
)
def test_bad_input_one_clear_error_engine_untouched(
    llm: Any,
    reference: EngineReference,
    tiny_qwen3_moe_dir: Path,
    tmp_path: Path,
    make: Any,
    strategy: str,
    error: type,
    match: str,
) -> None:
    good = lora_trainer(tiny_qwen3_moe_dir, ATTN)
    perturb(good, 6)
    hwsync.sync(llm, good)
    served = _state(llm)
    bad = make(tiny_qwen3_moe_dir, tmp_path)
    with pytest.raises(error, match=match) as err:
        hwsync.sync(llm, bad, strategy=strategy)
    assert "\n" not in str(err.value).strip() or isinstance(err.value, ResolutionError)  # one error, one story
    assert _state(llm) == served  # same version, not stale, same adapter
    assert assert_serves(llm, good, PROMPTS, atol=ATOL, reference=reference) <= ATOL


def test_adapter_identity_per_call(llm: Any, reference: EngineReference, tiny_qwen3_moe_dir: Path) -> None:
    """Frameworks attach their own LoRARequest to rollouts (ms-swift: swift_lora / 111): install under theirs."""
    model = lora_trainer(tiny_qwen3_moe_dir, ATTN)
    perturb(model, 8)
    r = hwsync.sync(llm, model, strategy="adapter", lora_name="swift_lora", lora_int_id=111)
    assert (r.lora_request.lora_name, r.lora_request.lora_int_id) == ("swift_lora", 111)
    assert assert_serves(llm, model, PROMPTS, atol=ATOL, reference=reference) <= ATOL
    with pytest.raises(AdapterFormatError, match="positive"):
        hwsync.sync(llm, model, strategy="adapter", lora_int_id=0)
    r = hwsync.sync(llm, model, strategy="adapter")  # back to hwsync's identity: the old one is dropped
    assert r.lora_request.lora_int_id != 111
    worker = llm.llm_engine.model_executor.driver_worker
    assert 111 not in worker.model_runner.lora_manager.list_adapters()
    assert assert_serves(llm, model, PROMPTS, atol=ATOL, reference=reference) <= ATOL


def test_prefix_cache_is_reset_while_a_request_holds_kv(llm: Any, tiny_qwen3_moe_dir: Path) -> None:
    """A request left in the engine (e.g. by a generate that raised) holds KV blocks, and vLLM then declines to reset
    its prefix cache: without the reset, a prompt cached under the old weights is served from that KV after the
    sync. The sync preempts such requests so the reset happens."""
    from vllm import SamplingParams

    greedy = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, detokenize=False)
    prompt = {"prompt_token_ids": [(7 * i) % 199 + 1 for i in range(300)]}  # > 2 KV blocks on every platform

    def served() -> list[float]:
        out = llm.generate([prompt], greedy, lora_request=hwsync.as_engine(llm).lora_request, use_tqdm=False)
        return [next(iter(lp.values())).logprob for lp in out[0].outputs[0].logprobs]

    model = lora_trainer(tiny_qwen3_moe_dir)
    perturb(model, 11, base=True)
    hwsync.sync(llm, model, strategy="full")
    served()  # the prompt's blocks are cached under these weights
    engine = llm.llm_engine
    engine.add_request("hwsync-left-over", {"prompt_token_ids": [3, 4, 5] * 50}, SamplingParams(max_tokens=500))
    engine.step()  # scheduled: it holds KV blocks now
    try:
        assert not llm.reset_prefix_cache()  # what vLLM does on its own while a request holds blocks
        perturb(model, 12, base=True)
        hwsync.sync(llm, model, strategy="full")
    finally:
        engine.abort_request(["hwsync-left-over"])
    after_sync = served()
    assert llm.reset_prefix_cache()
    assert max(abs(a - b) for a, b in zip(after_sync, served())) <= ATOL  # no KV of the old weights was reused
