"""The tiny checkpoints are what the other tests assume: deterministic, loadable by transformers, ms-swift and
vLLM like real Qwen checkpoints, and served by vLLM with exactly the logprobs transformers computes (on vLLM's CPU
build; on GPUs, where TF32 fused-MoE matmuls keep any engine 1e-2..1e0 from transformers, served exactly as vLLM
serves the checkpoint transformers writes back)."""

from __future__ import annotations

import gc
import importlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hwsync.common.errors import HwsyncError
from hwsync.testing import (
    FAMILIES,
    FixtureConfigError,
    close_llm,
    make_llm,
    make_tiny_moe,
    on_cpu,
    require_vllm,
    tiny_moe_config,
)
from hwsync.testing.tokenizer import VOCAB_SIZE
from hwsync.trainer.verify import engine_logprobs, token_logprobs

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
HF_CLASS = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}
CHAT_PROMPT = "<|im_start|>user\nWhat is 3+4?<|im_end|>\n<|im_start|>assistant\n"
RAW_PROMPT = "12+30=42. 7*6="


def fixture_dir(request: pytest.FixtureRequest, family: str) -> Path:
    return request.getfixturevalue(f"tiny_{family}_dir")


# --------------------------------------------------------------------------------------------- determinism
@pytest.mark.parametrize("family", FAMILIES)
def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path, family: str) -> None:
    rng_before = torch.get_rng_state()
    a = make_tiny_moe(tmp_path / "a", family, seed=3)
    b = make_tiny_moe(tmp_path / "b", family, seed=3)
    c = make_tiny_moe(tmp_path / "c", family, seed=4)
    assert torch.equal(torch.get_rng_state(), rng_before), "make_tiny_moe must not consume the global RNG"

    assert sorted(p.name for p in a.iterdir()) == sorted(FILES)
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    wa, wc = load_file(a / "model.safetensors"), load_file(c / "model.safetensors")
    assert wa.keys() == wc.keys()
    random_tensors = [k for k, v in wa.items() if v.dim() >= 2 or k.endswith("norm.weight")]
    assert random_tensors and all(not torch.equal(wa[k], wc[k]) for k in random_tensors)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (c / name).read_bytes(), f"{name} must not depend on the seed"


def test_bytes_do_not_depend_on_the_process(tmp_path: Path, tiny_qwen3_5_moe_dir: Path) -> None:
    """Another interpreter (other hash seed, fresh RNG and allocator state) writes the same files."""
    code = "import sys; from hwsync.testing import make_tiny_moe; make_tiny_moe(sys.argv[1], 'qwen3_5_moe')"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, env=env, capture_output=True)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (tiny_qwen3_5_moe_dir / name).read_bytes(), name


def test_dtype_and_overrides(tmp_path: Path) -> None:
    d = make_tiny_moe(tmp_path / "bf16", dtype="bfloat16", moe_intermediate_size=64, num_experts=4)
    weights = load_file(d / "model.safetensors")
    assert {v.dtype for v in weights.values()} == {torch.bfloat16}
    assert weights["model.layers.0.mlp.experts.3.down_proj.weight"].shape == (64, 64)  # the square case
    assert "model.layers.0.mlp.experts.4.down_proj.weight" not in weights
    config = json.loads((d / "config.json").read_text())
    assert (config["dtype"], config["moe_intermediate_size"], config["num_experts"]) == ("bfloat16", 64, 4)


def test_sizes_vllm_cpu_cannot_run_are_refused_before_writing(tmp_path: Path) -> None:
    with pytest.raises(FixtureConfigError, match="head_dim=16"):
        make_tiny_moe(tmp_path / "x", head_dim=16)
    with pytest.raises(FixtureConfigError, match="moe_intermediate_size=48"):
        tiny_moe_config("qwen3_5_moe", moe_intermediate_size=48)
    with pytest.raises(FixtureConfigError, match="unknown tiny MoE family"):
        tiny_moe_config("llama")
    with pytest.raises(FixtureConfigError, match="floating torch dtype"):
        make_tiny_moe(tmp_path / "x", dtype="int8")
    assert not (tmp_path / "x").exists()
    assert issubclass(FixtureConfigError, HwsyncError)


def test_default_expert_tensors_are_not_square() -> None:
    """A transposed or mis-fused expert tensor must fail a shape check on the default fixture."""
    for family in FAMILIES:
        c = tiny_moe_config(family)
        h, i = c.hidden_size, c.moe_intermediate_size
        assert len({h, i, 2 * i}) == 3 and c.head_dim >= 32 and h % 32 == 0 and i % 32 == 0


# ------------------------------------------------------------------------------------------ transformers
@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_it_like_a_hub_checkpoint(request: pytest.FixtureRequest, family: str) -> None:
    from transformers import AutoModelForCausalLM

    d = fixture_dir(request, family)
    model, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert type(model).__name__ == HF_CLASS[family]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]

    keys = load_file(d / "model.safetensors").keys()
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in keys  # per-expert names, as on the Hub
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in keys)
    if family == "qwen3_5_moe":
        c = model.config
        assert set(c.layer_types) == {"linear_attention", "full_attention"} and c.mtp_num_hidden_layers == 1
        assert "mtp.fc.weight" in keys and "mtp.layers.0.mlp.experts.0.up_proj.weight" in keys

    # Same names and values as save_pretrained writes (MTP weights aside: transformers drops them).
    out = request.getfixturevalue("tmp_path")
    model.save_pretrained(out)
    ours = {k: v for k, v in load_file(d / "model.safetensors").items() if not k.startswith("mtp.")}
    theirs = load_file(out / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("family", FAMILIES)
def test_next_token_distribution_is_far_from_uniform(request: pytest.FixtureRequest, family: str) -> None:
    """Wrong weights must move logprobs visibly: the fixture is not a near-flat random model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = fixture_dir(request, family)
    model = AutoModelForCausalLM.from_pretrained(d).eval()
    ids = AutoTokenizer.from_pretrained(d)(CHAT_PROMPT + "The answer is 7.").input_ids
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    assert entropy.max() < 0.8 * math.log(VOCAB_SIZE), entropy
    # ... and every block matters: dropping the experts' down projections changes the next-token logprobs
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.experts.down_proj.zero_()
        logp2 = torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)
    assert (logp2 - logp).abs().max() > 0.05


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_is_qwen_like(request: pytest.FixtureRequest, family: str) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoTokenizer

    d = fixture_dir(request, family)
    tok = AutoTokenizer.from_pretrained(d)
    raw = Tokenizer.from_file(str(d / "tokenizer.json"))
    config = AutoConfig.from_pretrained(d)
    assert len(tok) == VOCAB_SIZE == config.vocab_size
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    assert tok.convert_tokens_to_ids("<|im_end|>") == config.eos_token_id
    gen = json.loads((d / "generation_config.json").read_text())
    assert set(gen["eos_token_id"]) == {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}

    for text in (CHAT_PROMPT, "What is 123+4567? The answer is 4690.", "naïve café x\u0301 \t\n\n end", "ünï😀"):
        ids = tok(text, add_special_tokens=False).input_ids
        assert ids == raw.encode(text, add_special_tokens=False).ids, text  # transformers == tokenizer.json
        assert tok.decode(ids) == text
    assert len(tok("1234567890", add_special_tokens=False).input_ids) == 10  # one token per digit, as Qwen
    ids = tok("<think>\nx\n</think>\n\nA<|im_end|>", add_special_tokens=False).input_ids
    assert tok.decode(ids, skip_special_tokens=True) == "<think>\nx\n</think>\n\nA"  # think tags survive


def test_chat_template_renders_qwen3_layout(tiny_qwen3_moe_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3_moe_dir)

    def render(messages: list[dict], **kw: object) -> str:
        return tok.apply_chat_template(messages, tokenize=False, **kw)

    user = {"role": "user", "content": "What is 3+4?"}
    assert render([user], add_generation_prompt=True) == CHAT_PROMPT
    assert render([user], add_generation_prompt=True, enable_thinking=False) == CHAT_PROMPT + "<think>\n\n</think>\n\n"
    system = {"role": "system", "content": "Be brief."}
    assert (
        render([system, user])
        == "<|im_start|>system\nBe brief.<|im_end|>\n" + CHAT_PROMPT[: -len("<|im_start|>assistant\n")]
    )
    # reasoning of earlier turns is dropped, the last turn keeps it (Qwen3's rule)
    turns = [
        user,
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n7"},
        {"role": "user", "content": "And 5+5?"},
    ]
    assert render(turns, add_generation_prompt=True) == (
        CHAT_PROMPT + "7<|im_end|>\n<|im_start|>user\nAnd 5+5?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render(turns[:2]) == CHAT_PROMPT + "<think>\nadd\n</think>\n\n7<|im_end|>\n"
    # tools: schema in the system turn, calls and responses as Qwen3 writes them
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 3, "b": 4}}}],
    }
    text = render([user, call, {"role": "tool", "content": "7"}], tools=[tool], add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n") and '<tools>\n{"type": "function"' in text
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>\n' in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.swift
def test_ms_swift_qwen3_template_matches_chat_template(tiny_qwen3_moe_dir: Path) -> None:
    """`--template qwen3` (what the GRPO job uses) produces the token ids the Jinja template renders."""
    from swift.model import get_processor
    from swift.template import get_template

    processor = get_processor(str(tiny_qwen3_moe_dir), model_type="qwen3_moe")
    messages = [{"role": "user", "content": "What is 3+4?"}]
    encoded = get_template(processor, template_type="qwen3").encode({"messages": messages})
    # ms-swift's qwen3 template adds the non-thinking prefix by default, i.e. enable_thinking=False
    text = processor.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False, tokenize=False)
    assert encoded["input_ids"] == processor(text, add_special_tokens=False).input_ids


# -------------------------------------------------------------------------------------------------- vLLM
def test_require_vllm_skips_naming_the_missing_piece_but_fails_on_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # what an environment without vLLM looks like to `import`
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="vLLM is not importable.*vllm-cpu>=0.30,<0.33"):
        require_vllm()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true but the vLLM tests cannot run"):
        require_vllm()


@pytest.mark.vllm
def test_gpu_engines_of_gated_deltanet_models_take_vllms_triton_prefill(
    monkeypatch: pytest.MonkeyPatch, tiny_qwen3_moe_dir: Path, tiny_qwen3_5_moe_dir: Path
) -> None:
    """On a GPU, a Qwen3.5 engine asks vLLM for its Triton/FLA GDN prefill kernel (vLLM's default on Hopper imports
    FlashInfer, which the GPU kit leaves out), through the engine argument this vLLM declares; other models and every
    CPU engine are left alone, and a caller's own choice wins."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    import hwsync.testing.engine as engine

    require_vllm()
    assert "gdn_prefill_backend" in {f.name for f in dataclasses.fields(EngineArgs)}
    if on_cpu():
        assert engine.portable_kernel_args(tiny_qwen3_5_moe_dir) == {}
    monkeypatch.setattr(engine, "on_cpu", lambda: False)
    assert engine.engine_args(tiny_qwen3_5_moe_dir)["gdn_prefill_backend"] == "triton"
    assert "gdn_prefill_backend" not in engine.engine_args(tiny_qwen3_moe_dir)
    assert (
        engine.engine_args(tiny_qwen3_5_moe_dir, gdn_prefill_backend="flashinfer")["gdn_prefill_backend"]
        == "flashinfer"
    )


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.fixture(scope="module")
def qwen3_engine(tiny_qwen3_moe_dir: Path):
    require_vllm()
    from vllm import LLM  # noqa: F401  (importing vLLM's engine, ~5-15 s, is not engine start)

    rss, t0 = _rss_mib(), time.perf_counter()
    llm = make_llm(tiny_qwen3_moe_dir)
    start_s, rss_mib = time.perf_counter() - t0, _rss_mib() - rss
    print(f"\nvLLM engine start (tiny qwen3_moe, fp32, CPU): {start_s:.1f} s, RSS +{rss_mib:.0f} MiB")
    yield llm
    del llm
    gc.collect()


def _hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


def _served_as_transformers_writes_it(outs, hf, tmp_path: Path, **engine_kwargs) -> float:
    """GPUs: the engine's greedy answers equal a fresh engine's on the checkpoint ``hf.save_pretrained`` writes (the
    engine-own reference of ``hwsync.testing.reference``); returns the max |Δ logprob| (1e-6 at most)."""
    from hwsync.testing import EXACT_ATOL, EngineReference
    from hwsync.testing.reference import compare_logprobs

    got = [engine_logprobs(out) for out in outs]
    prompts = [list(out.prompt_token_ids) for out in outs]
    max_tokens = max(len(out.outputs[0].token_ids) for out in outs)  # greedy: an EOS stops both engines alike
    with EngineReference(tmp_path, **engine_kwargs) as reference:
        want = reference.logprobs(hf, "full", prompts, max_tokens=max_tokens)
    diff = compare_logprobs(got, want, "engine on the fixture vs engine on transformers' re-save")
    print(f"max |vLLM(fixture) - vLLM(transformers' re-save)| logprob: {diff:.1e}")
    assert diff <= EXACT_ATOL
    return diff


@pytest.mark.vllm
def test_vllm_serves_the_checkpoint_with_token_logprobs(qwen3_engine, tiny_qwen3_moe_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe_dir, dtype=torch.float32).eval()
    greedy = SamplingParams(temperature=0, max_tokens=12, logprobs=0, prompt_logprobs=0)
    sampled = SamplingParams(temperature=1.0, max_tokens=12, logprobs=0, prompt_logprobs=0, seed=7)
    outs = qwen3_engine.generate([CHAT_PROMPT, RAW_PROMPT], greedy, use_tqdm=False)
    if not on_cpu():
        _served_as_transformers_writes_it(outs, hf, tmp_path)
        return
    outs += qwen3_engine.generate([CHAT_PROMPT], sampled, use_tqdm=False)
    for out in outs[:2]:
        completion = list(out.outputs[0].token_ids)
        assert completion == _hf_greedy(hf, out.prompt_token_ids, len(completion))
    for out in outs:
        ids, served = engine_logprobs(out)
        diff = (torch.tensor(served) - token_logprobs(hf, ids)).abs().max().item()
        print(f"max |vLLM - HF| logprob over {len(served)} tokens: {diff:.1e}")
        assert diff <= 1e-4, f"vLLM and transformers disagree by {diff:.2e} on {out.prompt!r}"


@pytest.mark.vllm
def test_vllm_chat_uses_the_chat_template(qwen3_engine, tiny_qwen3_moe_dir: Path) -> None:
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    tok = AutoTokenizer.from_pretrained(tiny_qwen3_moe_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3+4?"}]
    one = SamplingParams(max_tokens=1)
    for kwargs in ({}, {"enable_thinking": False}):
        out = qwen3_engine.chat(messages, one, chat_template_kwargs=kwargs, use_tqdm=False)[0]
        expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        assert out.prompt_token_ids == tok(expected, add_special_tokens=False).input_ids


@pytest.mark.vllm
def test_vllm_namespace_of_the_fixture(qwen3_engine) -> None:
    """The live names/shapes the resolver targets (vLLM 0.32: packed qkv, RoutedExperts w13/w2)."""
    params = dict(qwen3_engine.apply_model(lambda m: [(n, tuple(p.shape)) for n, p in m.named_parameters()])[0])
    c = tiny_moe_config("qwen3_moe")
    e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
    assert params["model.layers.0.mlp.experts.routed_experts.w13_weight"] == (e, 2 * i, h)
    assert params["model.layers.0.mlp.experts.routed_experts.w2_weight"] == (e, h, i)
    assert "model.layers.0.self_attn.qkv_proj.weight" in params and "lm_head.weight" in params
    assert not any(".q_proj." in n or ".experts.0." in n for n in params)
    print("\n" + "\n".join(f"{n} {s}" for n, s in params.items()))


def _torchvision_error() -> BaseException | None:
    try:
        importlib.import_module("torchvision")
    except Exception as e:  # noqa: BLE001  (missing, or a CUDA build that cannot load its ops on CPU torch)
        return e
    return None


@pytest.mark.vllm
def test_vllm_serves_qwen3_5_moe(request: pytest.FixtureRequest, tiny_qwen3_5_moe_dir: Path) -> None:
    """vLLM's Qwen3.5 module imports its VL module, which imports transformers' Qwen2-VL image processor,
    which needs torchvision: without it (our CPU env drops the CUDA-built wheel) the text model cannot even be
    inspected. Where it can run, the CPU GDN kernel needs bf16 (make_llm picks it) and key/value head dim 128; on a
    GPU make_llm picks vLLM's Triton/FLA GDN prefill kernel (its default on Hopper imports FlashInfer, which the GPU
    kit leaves out: ``hwsync.testing.portable_kernel_args``)."""
    require_vllm()
    if (err := _torchvision_error()) is not None:
        request.applymarker(
            pytest.mark.xfail(
                strict=True,
                raises=type(err),
                reason=f"vLLM 0.32 cannot load Qwen3.5 without torchvision: {type(err).__name__}: {err}",
            )
        )
    importlib.import_module("vllm.model_executor.models.qwen3_5")  # raises the root cause, not vLLM's summary

    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    llm = make_llm(tiny_qwen3_5_moe_dir)
    try:
        outs = llm.generate(
            [CHAT_PROMPT, RAW_PROMPT],
            SamplingParams(temperature=0, max_tokens=8, logprobs=0, prompt_logprobs=0),
            use_tqdm=False,
        )
        dtype = llm.llm_engine.model_config.dtype
    finally:
        close_llm(llm)
    hf32 = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5_moe_dir, dtype=torch.float32).eval()
    if not on_cpu():
        _served_as_transformers_writes_it(outs, hf32, request.getfixturevalue("tmp_path"))
        return
    hf_lo = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5_moe_dir, dtype=dtype).eval()
    for out in outs:
        ids, served = engine_logprobs(out)
        ref = token_logprobs(hf32, ids)
        engine_err = (torch.tensor(served) - ref).abs().mean().item()
        # vLLM must be as close to fp32 transformers as transformers itself is at the engine's precision
        own_err = (token_logprobs(hf_lo, ids) - ref).abs().mean().item()
        print(f"{dtype}: mean |vLLM - HF fp32| = {engine_err:.1e}, mean |HF {dtype} - HF fp32| = {own_err:.1e}")
        assert engine_err <= 2 * own_err + 1e-4, (engine_err, own_err, dtype)
