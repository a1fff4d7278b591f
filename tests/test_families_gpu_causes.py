"""The causes of the family-matrix failures seen on a GPU (vLLM 0.32 CUDA), reproduced on CPU without an engine.

* Non-gated experts (Nemotron-H: relu2, ``experts.up_proj`` [E, I, H] + ``experts.down_proj``): vLLM's w13 holds up
  alone, and vLLM's own expert mapping feeds the fused ``experts.up_proj`` to shard ``w1``. The resolver expected
  gate and up stacked ([E, 2I, H]) and refused the trainer's tensor.
* ``kept_dtypes`` (the parameters vLLM keeps wider than the model dtype: Mamba2 ``A_log``, fp32 routers) answered
  ``{}`` for the whole model as soon as one unrelated name did not resolve: every kept tensor then travelled in the
  model dtype and the sync was refused for those too (Nemotron-H's ``A_log`` and router), hiding the real problem.
* LoRA on non-gated experts (PEFT ``target_parameters`` on ``experts.up_proj``) was refused outright
  (AdapterFormatError), also for ``hybrid``, which exists to send what vLLM cannot serve as LoRA merged.
* Llama 4's expert LoRA (2026-11-26, ``hybrid`` on the H100: ``set_lora`` size 64 vs 256): transformers stores Llama
  4's experts ``[E, in, out]`` without declaring ``is_transposed``, so PEFT adapts them as ``[E, out, in]``; its
  ``B A`` is still the parameter's ΔW, but A's columns are outputs. hwsync sent those factors to vLLM as if A took
  the hidden state (A ``[r, 2I]`` where vLLM's gate_proj A is ``[r, H]``).
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from hwsync.common.errors import AdapterFormatError, ResolutionError
from hwsync.common.layouts import ExpertLayout
from hwsync.common.wire import EngineInfo, Strategy
from hwsync.engine.names import ExpertGroup, Namespace, ParamSpec, resolve

E, H, I = 4, 8, 6  # noqa: E741 - experts, hidden, intermediate: the [E, I, H] of the docstring
EXPERTS = "model.layers.0.mixer.experts"
W13 = f"{EXPERTS}.routed_experts.w13_weight"
W2 = f"{EXPERTS}.routed_experts.w2_weight"


def _non_gated_namespace(dtype: torch.dtype = torch.float32) -> Namespace:
    specs = [
        ParamSpec(W13, (E, I, H), dtype),
        ParamSpec(W2, (E, H, I), dtype),
        ParamSpec("model.layers.0.mixer.gate.weight", (E, H), torch.float32),  # vLLM keeps the router fp32
        ParamSpec("model.layers.1.mixer.A", (2,), torch.float32),  # Mamba2 A (from A_log), fp32
        ParamSpec("model.norm.weight", (H,), dtype),
    ]
    group = ExpertGroup(
        prefix=EXPERTS,
        w13=W13,
        w2=W2,
        gate="up_proj",
        up="up_proj",
        down="down_proj",
        num_experts=E,
        hidden=H,
        intermediate=I,
        dtype=dtype,
        layout=ExpertLayout.PREPROCESSED,
        sharding=None,
        vllm_fused_gate_up="up_proj",
        vllm_fused_down="down_proj",
        unwritable="non-gated experts",
        gated=False,
    )
    return Namespace(
        params={s.name: s for s in specs},
        expert_groups={EXPERTS: group},
        packed_modules={},
        trainer_renames=(),
        num_hidden_layers=2,
        architecture="ToyNonGatedForCausalLM",
        live={s.name: torch.zeros(s.shape, dtype=s.dtype) for s in specs},
    )


def test_non_gated_fused_and_per_expert_up_proj_resolve_to_w13_alone() -> None:
    ns = _non_gated_namespace()
    up = torch.randn(E, I, H)
    plan = resolve({f"{EXPERTS}.up_proj": (up.shape, up.dtype), f"{EXPERTS}.down_proj": ((E, H, I), torch.float32)}, ns)
    assert [x for x, _ in plan.vllm_checkpoint_names(f"{EXPERTS}.up_proj")] == [f"{EXPERTS}.up_proj"]
    (tg,) = plan.entries[f"{EXPERTS}.up_proj"]
    assert tg.param == W13
    # per-expert checkpoint spelling: one expert's up is w1 (vLLM's mapping for non-gated experts)
    plan = resolve({f"{EXPERTS}.{e}.up_proj.weight": ((I, H), torch.float32) for e in range(E)}, ns)
    assert {t.shard_id for ts in plan.entries.values() for t in ts} == {"w1"}
    # gate and up stacked is what a gated layer takes, not this one
    with pytest.raises(ResolutionError, match="shape does not fit"):
        resolve({f"{EXPERTS}.up_proj": ((E, 2 * I, H), torch.float32)}, ns)


def test_non_gated_experts_are_complete_without_a_gate() -> None:
    ns = _non_gated_namespace()
    names = {
        f"{EXPERTS}.up_proj": ((E, I, H), torch.float32),
        f"{EXPERTS}.down_proj": ((E, H, I), torch.float32),
        "model.layers.0.mixer.gate.weight": ((E, H), torch.float32),
        "model.layers.1.mixer.A": ((2,), torch.float32),
        "model.norm.weight": ((H,), torch.float32),
    }
    resolve(names, ns, require_complete=True)  # w13 has no "w3" part left unwritten


def _applier(ns: Namespace, dtype: torch.dtype) -> object:
    from hwsync.engine.vllm.applier import VllmApplier

    cfg = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=dtype))
    runner = types.SimpleNamespace(vllm_config=cfg, get_model=lambda: None)
    applier = VllmApplier(types.SimpleNamespace(model_runner=runner))
    applier._namespace = ns
    return applier


def test_kept_dtypes_survive_an_unrelated_resolution_problem() -> None:
    ns = _non_gated_namespace(torch.bfloat16)
    applier = _applier(ns, torch.bfloat16)
    base = {
        f"{EXPERTS}.up_proj": (E, I, H),
        f"{EXPERTS}.down_proj": (E, H, I),
        "model.layers.0.mixer.gate.weight": (E, H),
        "model.layers.1.mixer.A": (2,),
        "model.norm.weight": (H,),
    }
    want = {"model.layers.0.mixer.gate.weight": "float32", "model.layers.1.mixer.A": "float32"}
    assert applier.kept_dtypes(base) == want
    # one name the engine refuses (here a shape it does not hold) must not cost the others their kept dtype
    assert applier.kept_dtypes({**base, "model.norm.weight": (H + 1,)}) == want
    assert applier.kept_dtypes({**base, f"{EXPERTS}.up_proj": (E, 2 * I, H)}) == want


def test_kept_dtypes_of_lora_wrapped_parameters() -> None:
    """A LoRA engine wraps the router (``gate.base_layer.weight``, MiniMax-M2): the trainer's ``gate.weight`` keeps
    its fp32."""
    ns = _non_gated_namespace(torch.bfloat16)
    params = dict(ns.params)
    gate = params.pop("model.layers.0.mixer.gate.weight")
    wrapped = dataclasses.replace(gate, name="model.layers.0.mixer.gate.base_layer.weight")
    params[gate.name] = wrapped  # keyed by the canonical name, as namespace_from_vllm_model does
    live = {wrapped.name if n == gate.name else n: t for n, t in ns.live.items()}
    ns = dataclasses.replace(ns, params=params, live=live)
    applier = _applier(ns, torch.bfloat16)
    got = applier.kept_dtypes({"model.layers.0.mixer.gate.weight": (E, H), "model.norm.weight": (H,)})
    assert got == {"model.layers.0.mixer.gate.weight": "float32"}


# -- LoRA on non-gated experts ---------------------------------------------------------------------------------------
class _NonGatedExperts(torch.nn.Module):
    """transformers-5-style stacked non-gated experts (Nemotron-H: ``up_proj`` [E, I, H], ``down_proj`` [E, H, I])."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = E
        self.up_proj = torch.nn.Parameter(torch.randn(E, I, H) * 0.1)
        self.down_proj = torch.nn.Parameter(torch.randn(E, H, I) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(torch.einsum("eih,bh->ebi", self.up_proj, x)) ** 2
        return torch.einsum("ehi,ebi->bh", self.down_proj, h)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = _NonGatedExperts()
        self.o_proj = torch.nn.Linear(H, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.experts(x))


class _Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.model.layers[0].mixer = _Block()
        self.config = types.SimpleNamespace(model_type="toy", tie_word_embeddings=False, to_dict=lambda: {})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.layers[0].mixer(x)


def _peft_toy(attention: bool) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    cfg = LoraConfig(
        r=2,
        lora_alpha=4,
        target_modules=["o_proj"] if attention else [],
        target_parameters=["experts.up_proj", "experts.down_proj"],
    )
    model = get_peft_model(_Toy(), cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.1)
    return model


def _lora_info() -> EngineInfo:
    return EngineInfo.from_dict(
        dict(engine="vllm", dtype="float32", lora_enabled=True, max_lora_rank=8, moe_lora=True, lora_dtype="float32")
    )


@pytest.mark.parametrize("attention", [True, False], ids=["attention+experts", "experts-only"])
def test_hybrid_merges_lora_on_non_gated_experts(attention: bool) -> None:
    from hwsync.trainer.merged import merged_named_weights
    from hwsync.trainer.payload import _base_params, build_payload, read_lora
    from hwsync.trainer.strategy import choose

    model = _peft_toy(attention)
    info = _lora_info()
    lora = read_lora(model, info)
    assert not isinstance(lora, Exception), lora
    up, down = f"{EXPERTS}.up_proj", f"{EXPERTS}.down_proj"
    assert set(lora.not_lora) == {up, down}  # down travels merged with up: the block is merged whole
    assert lora.by_module[up] == lora.by_module[down] == []
    with pytest.raises(AdapterFormatError, match="gated experts"):
        choose("adapter", lora, info)
    choice = choose("hybrid", lora, info)
    assert choice.strategy is Strategy.HYBRID and set(choice.unservable) == {up, down}
    assert "gated experts" in choice.reason
    auto = choose("auto", lora, info)
    assert auto.strategy is (Strategy.HYBRID if attention else Strategy.FULL)
    payload = build_payload(model, choice, lora, info)
    lora_specs = [s.name for s in payload.specs if s.kind == "lora"]
    assert all("o_proj" in n for n in lora_specs) and bool(lora_specs) == attention
    sent = dict(zip([s.name for s in payload.specs], payload.produce()))
    merged = dict(merged_named_weights(model, include=lambda n: n in (up, down)))
    w0 = _base_params(model)
    for n in (up, down):
        assert torch.equal(sent[n], merged[n])
        assert not torch.equal(sent[n], w0[n])  # ΔW applied
    assert "model.layers.0.mixer.o_proj.weight" in sent  # first sync: the frozen base travels too


def test_lora_on_non_gated_experts_is_still_refused_as_vllm_lora() -> None:
    from hwsync.common.lora_formats import LoraKind, extract_peft_lora, to_vllm_lora

    adapter = extract_peft_lora(_peft_toy(False))
    assert adapter.modules[f"{EXPERTS}.up_proj"].kind is LoraKind.EXPERTS_OTHER
    with pytest.raises(AdapterFormatError, match="only knows gate_up_proj/down_proj"):
        to_vllm_lora(adapter, layout="3d")


def test_experts_prefix_of_a_lora_wrapped_moe_built_under_another_prefix() -> None:
    """MiniMax-M2 builds its MoE with prefix '...mlp' but stores it as 'block_sparse_moe'; vLLM's MoE-LoRA wrapper
    then puts the experts under '.base_layer.': the group key must still be the checkpoint-side module path (the H100
    run refused every MiniMax-M2 sync: 'resolves to no receiver parameter ... block_sparse_moe.experts.base_layer')."""
    from hwsync.engine.names.namespace import _experts_prefix

    live = "model.layers.0.block_sparse_moe.experts.base_layer.routed_experts"
    assert _experts_prefix(live, "model.layers.0.mlp.experts") == "model.layers.0.block_sparse_moe.experts"
    # the usual case: an ancestor matches vLLM's layer_name, with or without the wrapper
    assert (
        _experts_prefix("model.layers.3.mlp.experts.routed_experts", "model.layers.3.mlp.experts")
        == "model.layers.3.mlp.experts"
    )
    assert (
        _experts_prefix("model.layers.3.mlp.experts.base_layer.routed_experts", "model.layers.3.mlp.experts.base_layer")
        == "model.layers.3.mlp.experts"
    )


def test_non_gated_experts_are_not_written_in_place() -> None:
    """The in-place writers build gate+up w13 blocks: non-gated experts go through vLLM's reload (on the H100 a
    Nemotron-H sync reached the writer's calibration and stopped at its assert, leaving the engine stale)."""
    from hwsync.engine.vllm.direct import eligible_names

    ns = _non_gated_namespace()
    plan = resolve(
        {f"{EXPERTS}.up_proj": ((E, I, H), torch.float32), f"{EXPERTS}.down_proj": ((E, H, I), torch.float32)}, ns
    )
    eligible, why = eligible_names(torch.nn.Module(), plan)
    assert not eligible and set(why) == {f"{EXPERTS}.up_proj", f"{EXPERTS}.down_proj"}
    assert all("non-gated" in r for r in why.values())


def test_llama4_expert_lora_is_reoriented_for_vllm(tmp_path) -> None:
    """Llama 4 (experts stored [E, in, out], PEFT adapting them as [E, out, in]): the trainer's expert LoRA reads in
    linear terms (A takes the hidden state), its ΔW stays PEFT's, and the 2-D per-expert LoRA hwsync and the test
    reference write both give each expert's linear ΔW = PEFT's ΔW transposed, in vLLM's per-expert shapes."""
    from peft.tuners.lora.layer import ParamWrapper

    from hwsync.common.lora_formats import LoraKind, extract_peft_lora, to_vllm_lora
    from hwsync.testing.families import _trainer, make_family_checkpoint
    from hwsync.testing.reference import write_adapter

    model = _trainer(make_family_checkpoint(tmp_path / "llama4", "llama4_text"), "hybrid")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
    cfg = model.config
    h, i, e = cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts
    peft_delta = {}
    for path, layer in model.named_modules():
        if isinstance(layer, ParamWrapper) and ".layers.0." in path:
            peft_delta[layer.parameter_name] = layer.get_delta_weight("default").float()  # parameter layout
    assert peft_delta["gate_up_proj"].shape == (e, h, 2 * i) and peft_delta["down_proj"].shape == (e, i, h)
    adapter = extract_peft_lora(model)
    owner = "model.layers.0.feed_forward.experts"
    gu, dn = adapter.modules[f"{owner}.gate_up_proj"], adapter.modules[f"{owner}.down_proj"]
    assert gu.kind is LoraKind.EXPERTS_GATE_UP and gu.transposed and not gu.interleaved
    assert gu.lora_A.shape[-1] == h and gu.lora_B.shape[-2] == 2 * i  # A takes the hidden state
    assert dn.lora_A.shape[-1] == i and dn.lora_B.shape[-2] == h
    torch.testing.assert_close(gu.delta_weight(), peft_delta["gate_up_proj"])
    torch.testing.assert_close(dn.delta_weight(), peft_delta["down_proj"])

    def per_expert(tensors: dict[str, torch.Tensor], prefix: str, scale: dict[str, float]) -> dict[str, torch.Tensor]:
        """Each expert projection's linear ΔW [out, in] from 2-D per-expert LoRA keys."""
        return {
            f"{x}.{p}": scale[p]
            * tensors[f"{prefix}.{x}.{p}.lora_B.weight"].float()
            @ tensors[f"{prefix}.{x}.{p}.lora_A.weight"].float()
            for x in range(e)
            for p in ("gate_proj", "up_proj", "down_proj")
        }

    want = {}
    for x in range(e):
        linear_gu = peft_delta["gate_up_proj"][x].T  # [2I, H]
        want[f"{x}.gate_proj"], want[f"{x}.up_proj"] = linear_gu[:i], linear_gu[i:]
        want[f"{x}.down_proj"] = peft_delta["down_proj"][x].T  # [H, I]
    sent, _ = to_vllm_lora(adapter, layout="2d")  # scaling folded into B
    got = per_expert(sent, f"base_model.model.{owner}", dict.fromkeys(("gate_proj", "up_proj", "down_proj"), 1.0))
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
    from safetensors.torch import load_file

    # the reference writes PEFT's own tensors (vLLM scales them by the adapter config's alpha / r per module)
    ref = load_file(str(write_adapter(model, tmp_path / "ref", moe_format="2d") / "adapter_model.safetensors"))
    got = per_expert(
        ref, f"base_model.model.{owner}", {"gate_proj": gu.scaling, "up_proj": gu.scaling, "down_proj": dn.scaling}
    )
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
