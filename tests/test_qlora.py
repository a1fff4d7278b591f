"""QLoRA: a bitsandbytes 4-bit (nf4) base with LoRA, synced into vLLM exactly.

* The merged view of a QLoRA model is the dequantized base plus the LoRA delta -- for every 4-bit layer, adapted or
  not -- computed the way bitsandbytes and PEFT compute them (no engine).
* ``full``: that merged view into an unquantized engine (bf16 on GPUs, as served; fp32 on vLLM's CPU build) equals a
  fresh engine started from a checkpoint of the same merged view ("the same weights": dequant(W0) + ΔW, saved in the
  engine's dtype), every sync.
* ``adapter``: the dequantized base once, then LoRA only, equal to a fresh engine started from the dequantized base
  with PEFT's saved adapter as a ``LoRARequest`` (vLLM 0.32 serves no bitsandbytes checkpoint).

Needs bitsandbytes (the `test` extra installs it: CI runs these on its CPU backend; the GPU kit carries the CUDA 13
build). The 4-bit trainer runs on the GPU where there is one, else on bitsandbytes' CPU backend.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hwsync
from hwsync.testing import EXACT_ATOL, EngineReference, close_llm, engine_patches, make_llm, on_cpu, require_vllm
from hwsync.testing.reference import compare_logprobs
from hwsync.testing.trainer import perturb

try:
    import bitsandbytes as bnb
except Exception as e:  # noqa: BLE001  (missing, or a build without a library for this machine)
    bnb, _BNB_ERROR = None, f"{type(e).__name__}: {e}"
pytestmark = pytest.mark.skipif(
    bnb is None, reason=f"QLoRA tests need bitsandbytes (pip install bitsandbytes): {_BNB_ERROR if bnb is None else ''}"
)

PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8], [3, 4, 200, 17, 18, 99], [11, 400, 23]]
SYNCS = 4
# LoRA on q/v only: k_proj and o_proj stay 4-bit without an adapter, and must still arrive dequantized
ATTN = ["q_proj", "v_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _quantized(path: Path) -> Any:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    compute = torch.bfloat16 if _device() == "cuda" else torch.float32
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute)
    return AutoModelForCausalLM.from_pretrained(
        path, quantization_config=q, device_map={"": _device()}, dtype=torch.float32
    )


def _qlora(model: Any, targets: list[str], parameters: list[str] | None) -> Any:
    from peft import LoraConfig, get_peft_model

    # alpha/r = 2 (a power of two: scaling rounds alike on both loading paths in bf16)
    return get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, target_parameters=parameters)
    ).eval()


def test_merged_view_is_bnb_dequant_plus_peft_delta(tiny_qwen3_moe_dir: Path) -> None:
    from bitsandbytes.functional import dequantize_4bit

    from hwsync.trainer.merged import merged_named_weights

    model = _qlora(_quantized(tiny_qwen3_moe_dir), ATTN, EXPERTS)
    perturb(model, torch.Generator().manual_seed(0))
    merged = dict(merged_named_weights(model))
    checked = {"adapted": 0, "plain": 0}
    for name, module in model.named_modules():
        if not isinstance(module, bnb.nn.Linear4bit):  # the 4-bit layers themselves, not PEFT's wrappers of them
            continue
        clean = name.removeprefix("base_model.model.").replace(".base_layer", "")
        w = module.weight
        want = dequantize_4bit(w.data, w.quant_state).float()
        owner = model.get_submodule(name.rpartition(".")[0] if name.endswith(".base_layer") else name)
        if owner is not module:  # a LoRA layer wraps it: + scaling * B @ A, as PEFT's get_delta_weight
            want = want + owner.get_delta_weight("default").float()
            checked["adapted"] += 1
        else:
            checked["plain"] += 1
        torch.testing.assert_close(merged[f"{clean}.weight"].float(), want, rtol=1e-6, atol=1e-6, msg=clean)
    assert checked["adapted"] > 0 and checked["plain"] > 0, checked  # both kinds exist in this model
    assert all(t.is_floating_point() for t in merged.values()), "a packed 4-bit tensor left the merged view"


@pytest.fixture(scope="module")
def full_engine(
    tiny_qwen3_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Any, EngineReference]]:
    require_vllm()
    dtype = "bfloat16" if not on_cpu() else "float32"  # QLoRA users serve bf16; vLLM's CPU build tests run fp32
    llm = make_llm(tiny_qwen3_moe_dir, dtype=dtype, worker_extension_cls="hwsync.vllm.HwsyncWorkerExtension")
    reference = EngineReference(
        tmp_path_factory.mktemp("qlora-full"), dtype=dtype, checkpoint_dtype=getattr(torch, dtype)
    )
    try:
        yield llm, reference
    finally:
        reference.close()
        close_llm(llm)


@pytest.mark.vllm
def test_full_sync_of_a_4bit_base_is_exact(full_engine: tuple[Any, EngineReference], tiny_qwen3_moe_dir: Path) -> None:
    from hwsync.trainer.api import as_engine

    llm, reference = full_engine
    model = _qlora(_quantized(tiny_qwen3_moe_dir), ATTN, EXPERTS)
    gen = torch.Generator().manual_seed(1)
    worst, previous, moved = 0.0, None, 0.0
    for step in range(SYNCS):
        perturb(model, gen)
        r = hwsync.sync(llm, model, strategy="full")
        assert r.strategy == "full" and r.lora_tensors == 0
        got = as_engine(llm).logprobs(PROMPTS, 4)
        diff = compare_logprobs(got, reference.logprobs(model, "full", PROMPTS, 4), f"QLoRA full sync {step + 1}")
        assert diff <= EXACT_ATOL, diff
        worst = max(worst, diff)
        if previous is not None:
            moved = max(
                moved,
                max(
                    abs(a - b)
                    for (_, x), (_, y), p in zip(got, previous, PROMPTS)
                    for a, b in zip(x[: len(p) - 1], y[: len(p) - 1])
                ),
            )
        previous = got
    assert moved > 1e-3, "the adapter changed every sync but the served logprobs did not"
    print(f"QLoRA full: {SYNCS} syncs, max |Δ logprob| vs vLLM's own loading of the merged view = {worst:.1e}")


@pytest.mark.vllm
def test_adapter_sync_of_a_4bit_base_is_exact(tiny_qwen3_moe_dir: Path, tmp_path: Path) -> None:
    """``adapter`` with a 4-bit trainer base: the base once, dequantized, then LoRA only, equal to a fresh engine
    started from a checkpoint of the dequantized base with PEFT's saved adapter as a ``LoRARequest``.

    vLLM 0.32 has no bitsandbytes quantization any more (``quantization="bitsandbytes"`` is refused: "Unknown
    quantization method", measured on an H100), so the engine of a QLoRA trainer serves the base in floating point;
    an engine on the 4-bit checkpoint itself would take the adapter alone (hwsync then sends no base) on a vLLM that
    still serves bitsandbytes."""
    require_vllm()
    from hwsync.trainer.api import as_engine

    dtype = "bfloat16" if not on_cpu() else "float32"
    engine = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1, "lora_target_modules": ["qkv_proj", "o_proj"]}
    model = _qlora(_quantized(tiny_qwen3_moe_dir), ["q_proj", "k_proj", "v_proj", "o_proj"], None)
    with engine_patches(threads=None):  # what VLLM_PLUGINS=hwsync does in a vLLM process (LoRA on the CPU build)
        llm = make_llm(
            tiny_qwen3_moe_dir, dtype=dtype, worker_extension_cls="hwsync.vllm.HwsyncWorkerExtension", **engine
        )
        try:
            with EngineReference(tmp_path / "reference", dtype=dtype, **engine) as reference:
                gen = torch.Generator().manual_seed(2)
                reports = []
                for step in range(SYNCS):
                    perturb(model, gen)
                    reports.append(hwsync.sync(llm, model, strategy="adapter"))
                    got = as_engine(llm).logprobs(PROMPTS, 4)
                    diff = compare_logprobs(
                        got, reference.logprobs(model, "adapter", PROMPTS, 4), f"QLoRA adapter sync {step + 1}"
                    )
                    assert diff <= EXACT_ATOL, diff
        finally:
            close_llm(llm)
    assert reports[0].base_tensors > 0 and all(r.base_tensors == 0 and r.lora_tensors > 0 for r in reports[1:]), [
        r.reason for r in reports
    ]


def test_checking_a_4bit_trainer_leaves_it_as_it_was(tiny_qwen3_moe_dir: Path) -> None:
    """bitsandbytes (0.50) repacks a 4-bit layer in place for its bf16 CPU kernel at the first eval-mode forward
    without grad on a CPU with AVX512-BF16: hwsync.verify's trainer forward must not do that (it would switch the
    trainer to bf16 and make its weights undequantizable); a trainer repacked by its own eval is judged by the bf16
    gate, and its repacked weights are refused, not sent wrong."""
    from bitsandbytes.functional import has_avx512bf16

    from hwsync.common.errors import UnsupportedSetupError
    from hwsync.trainer.merged import four_bit_matmul_dtype, plain_weight, repacked_for_cpu
    from hwsync.trainer.verify import GATES, token_logprobs, trainer_gate

    if _device() != "cpu" or not has_avx512bf16():
        pytest.skip("bitsandbytes repacks 4-bit weights only on a CPU with AVX512-BF16")
    model = _quantized(tiny_qwen3_moe_dir).eval()
    layers = {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    before = {n: m.weight.data.clone() for n, m in layers.items()}
    token_logprobs(model, [1, 5, 9, 22, 7])  # what hwsync.verify runs on the trainer
    assert not any(repacked_for_cpu(m.weight) for m in layers.values())
    assert all(torch.equal(layers[n].weight.data, w) for n, w in before.items())
    assert not model.training and four_bit_matmul_dtype(model) is None
    assert trainer_gate("cpu", "float32", model) == GATES[("cpu", "float32")]
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 5, 9, 22, 7]]))  # the trainer's own eval: bitsandbytes repacks
    name, layer = next(iter(layers.items()))
    assert repacked_for_cpu(layer.weight) and four_bit_matmul_dtype(model) == "bfloat16"
    assert trainer_gate("cpu", "float32", model) == GATES[("cpu", "bfloat16")]
    with pytest.raises(UnsupportedSetupError, match="repacked the 4-bit weight"):
        plain_weight(model, f"{name}.weight", layer.weight)
