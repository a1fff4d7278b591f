"""Every strategy, 20 consecutive syncs into one real vLLM engine (tiny Qwen3-MoE; settings per platform from
``hwsync.testing.engine_args``: fp32 on vLLM's CPU build, bf16 on GPUs).

After each sync the engine must compute what the trainer computes: on the CPU build ``hwsync.verify`` <= 1e-4 over
prompt and generated tokens, and the greedy tokens are the trainer's argmax; on GPUs (TF32 fused MoE, bf16 LoRA: no
engine equals transformers there) the engine must equal vLLM's own loading of the same weights within 1e-6
(``hwsync.testing.assert_serves``). The schedule includes a sync of unchanged weights and a switch back to an older
weight set. Without hwsync's reload fix the same check fails (the test proves it detects vLLM's skipped CPU MoE
prepack).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hwsync
from hwsync.common.errors import AdapterFormatError, VerifyError
from hwsync.testing import EngineReference, assert_serves, patched_llm
from hwsync.testing.trainer import lora_trainer, perturb

pytestmark = pytest.mark.vllm

PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8], [3, 4, 200, 17, 18, 99], [11, 400, 23]]
ATOL = 1e-4
STEPS = 20
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
PREPACK_FIX = "vllm_cpu_moe_prepack"
# on the CPU build engine_args adds lora_target_modules=[qkv_proj, o_proj] (vLLM 0.32 CPU: a LoRA-wrapped lm_head
# breaks prompt_logprobs, which verify needs; attention LoRA is what the CPU build serves for a MoE model anyway)
ENGINE = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}


@pytest.fixture(scope="module")
def llm(tiny_qwen3_moe_dir: Path) -> Iterator[Any]:
    """One LoRA-enabled engine for the whole module (on the CPU build LoRA on attention: what it can serve)."""
    with patched_llm(
        tiny_qwen3_moe_dir, worker_extension_cls="hwsync.vllm.HwsyncWorkerExtension", **ENGINE
    ) as engine:  # + what VLLM_PLUGINS=hwsync does
        yield engine


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineReference]:
    """vLLM's own loading of the synced weights (started only off the CPU build; see assert_serves)."""
    with EngineReference(tmp_path_factory.mktemp("reference"), **ENGINE) as ref:
        yield ref


def _element_size(dtype_name: str) -> int:
    from hwsync.common.wire import dtype_from_name

    return torch.empty(0, dtype=dtype_from_name(dtype_name)).element_size()


def _snapshot(model: Any, *, base: bool) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if base or "lora_" in n}


def _restore(model: Any, snap: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in snap:
                p.copy_(snap[n])


def _run_schedule(
    llm: Any, reference: EngineReference, model: Any, strategy: str, *, base: bool, expect_lora: bool
) -> list[Any]:
    """20 syncs: changing weights, one repeat of unchanged weights, one switch back to an older set."""
    gen = torch.Generator().manual_seed(1234)
    reports = []
    worst = 0.0
    snap: dict[str, torch.Tensor] | None = None
    for step in range(STEPS):
        if step == 13:
            assert snap is not None
            _restore(model, snap)  # switch back to the weights of step 4
        elif step != 8:  # step 8 syncs the same weights as step 7
            perturb(model, gen, base=base)
        report = hwsync.sync(llm, model, strategy=strategy)
        reports.append(report)
        assert report.strategy == strategy
        assert (report.lora_request is not None) == expect_lora
        # logprobs of prompt + 4 greedy tokens within ATOL, and every greedy token is the trainer's argmax
        # (off the CPU build: the same as vLLM's own loading of these weights, within 1e-6)
        worst = max(worst, assert_serves(llm, model, PROMPTS, atol=ATOL, max_tokens=4, reference=reference))
        if step == 4:
            snap = _snapshot(model, base=base)
    versions = [r.version for r in reports]
    assert versions == list(range(versions[0], versions[0] + STEPS))
    print(
        f"{strategy}: max |Δ logprob| over {STEPS} syncs = {worst:.2e}; bytes/sync first={reports[0].bytes} "
        f"steady={reports[-1].bytes}; seconds/sync median={sorted(r.seconds for r in reports)[STEPS // 2]:.3f}"
    )
    return reports


def test_full_20_syncs_lora_and_base_changes(llm: Any, reference: EngineReference, tiny_qwen3_moe_dir: Path) -> None:
    model = lora_trainer(tiny_qwen3_moe_dir, ATTN, EXPERTS)
    reports = _run_schedule(llm, reference, model, "full", base=True, expect_lora=False)
    n_params = len(list(hwsync.trainer.merged.merged_named_weights(model)))
    assert all(r.tensors == n_params and r.lora_tensors == 0 for r in reports)


def test_hybrid_20_syncs_sends_only_merged_experts_after_the_first(
    llm: Any, reference: EngineReference, tiny_qwen3_moe_dir: Path
) -> None:
    info = hwsync.as_engine(llm).describe()
    model = lora_trainer(tiny_qwen3_moe_dir, ATTN, EXPERTS)
    reports = _run_schedule(llm, reference, model, "hybrid", base=False, expect_lora=True)
    first, rest = reports[0], reports[1:]
    assert "base weights sent" in first.reason
    steady = {r.bytes for r in rest}
    assert len(steady) == 1 and steady.pop() < first.bytes
    base_size, lora_size = _element_size(info.dtype), _element_size(info.lora_dtype or info.dtype)
    experts = sum(p.numel() * base_size for n, p in model.named_parameters() if ".experts." in n and "lora_" not in n)
    attn_lora = sum(p.numel() * lora_size for n, p in model.named_parameters() if "lora_" in n and ".experts" not in n)
    if info.moe_lora:  # GPUs: the engine serves expert LoRA too, so nothing needs to travel merged
        all_lora = sum(p.numel() * lora_size for n, p in model.named_parameters() if "lora_" in n)
        assert rest[0].bytes == all_lora, "hybrid on an engine serving every module = the LoRA tensors only"
    else:
        assert rest[0].bytes == experts + attn_lora, "hybrid steady state = merged experts + attention LoRA only"
    # a base weight changed in place (e.g. a user edit): the next sync resends the base, and stays correct
    with torch.no_grad():
        model.base_model.model.model.norm.weight.mul_(1.5)
    r = hwsync.sync(llm, model, strategy="hybrid")
    assert "base weights sent (trainer base changed)" in r.reason and r.bytes == first.bytes
    assert_serves(llm, model, PROMPTS, atol=ATOL, reference=reference)


def test_adapter_20_syncs(llm: Any, reference: EngineReference, tiny_qwen3_moe_dir: Path) -> None:
    info = hwsync.as_engine(llm).describe()
    # experts get LoRA too where the engine has MoE-LoRA kernels (GPU); vLLM's CPU build has none
    model = lora_trainer(tiny_qwen3_moe_dir, ATTN, EXPERTS if info.moe_lora else None)
    reports = _run_schedule(llm, reference, model, "adapter", base=False, expect_lora=True)
    assert reports[0].base_tensors > 0 and all(r.base_tensors == 0 for r in reports[1:])
    lora_size = _element_size(info.lora_dtype or info.dtype)
    lora_bytes = sum(p.numel() * lora_size for n, p in model.named_parameters() if "lora_" in n)
    assert all(r.bytes == lora_bytes for r in reports[1:]), "adapter steady state = the LoRA tensors only"


def test_auto_asks_the_engine_and_says_why(llm: Any, reference: EngineReference, tiny_qwen3_moe_dir: Path) -> None:
    info = hwsync.as_engine(llm).describe()
    plain = lora_trainer(tiny_qwen3_moe_dir, None)
    r = hwsync.sync(llm, plain)
    assert (r.strategy, r.reason) == ("full", "model has no LoRA adapter")
    attn_only = lora_trainer(tiny_qwen3_moe_dir, ATTN)
    r = hwsync.sync(llm, attn_only)
    assert r.strategy == "adapter" and "serves LoRA on every adapted module" in r.reason
    assert_serves(llm, attn_only, PROMPTS, atol=ATOL, reference=reference)
    with_experts = lora_trainer(tiny_qwen3_moe_dir, ATTN, EXPERTS)
    r = hwsync.sync(llm, with_experts)
    if info.moe_lora:
        assert r.strategy == "adapter"
    else:
        assert r.strategy == "hybrid" and "no MoE-LoRA kernels" in r.reason and "experts" in r.reason
        with pytest.raises(AdapterFormatError, match='strategy="hybrid"'):
            hwsync.sync(llm, with_experts, strategy="adapter")
    assert_serves(llm, with_experts, PROMPTS, atol=ATOL, reference=reference)


@pytest.mark.parametrize("strategy", ["full", "hybrid", "adapter"])
def test_without_the_reload_fix_the_check_fails(
    llm: Any, tiny_qwen3_moe_dir: Path, strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same sync + verify, with hwsync's prepack fix switched off, must detect vLLM's stale CPU prepack."""
    from vllm.platforms import current_platform

    import hwsync.patches as patches
    from hwsync.patches import vllm_cpu_moe_prepack  # noqa: F401 - registers the patch

    if patches.get(PREPACK_FIX).probe().state != patches.APPLIES:
        pytest.skip(f"{PREPACK_FIX} does not apply on {type(current_platform).__name__}: nothing to prove here")
    model = lora_trainer(tiny_qwen3_moe_dir, ATTN, EXPERTS if strategy != "adapter" else None)
    gen = torch.Generator().manual_seed(7)
    perturb(model, gen, base=strategy == "full")
    monkeypatch.setenv("HWSYNC_DISABLE_PATCHES", PREPACK_FIX)
    r = hwsync.sync(llm, model, strategy=strategy)
    assert r.base_tensors > 0  # the adapter's first sync carries W0 through the same reload
    with pytest.raises(VerifyError) as err:
        hwsync.verify(llm, model, PROMPTS, atol=ATOL)
    worst = float(str(err.value).split("= ")[1].split(" ")[0])
    assert worst > 1e-3 and math.isfinite(worst)
    print(f"{strategy} without {PREPACK_FIX}: max |Δ logprob| = {worst:.3g} (detected)")
    monkeypatch.delenv("HWSYNC_DISABLE_PATCHES")
    model2 = lora_trainer(tiny_qwen3_moe_dir, ATTN, EXPERTS if strategy != "adapter" else None)  # new base identity
    perturb(model2, gen, base=strategy == "full")
    hwsync.sync(llm, model2, strategy=strategy)
    assert hwsync.verify(llm, model2, PROMPTS, atol=ATOL) <= ATOL
