"""hwsync.engine.names on hand-built and vLLM-layer namespaces: wrappers, packing, experts, TP slicing, bad input.

The hand-built receiver below is deliberately *not* a known family: Mixtral-style ``block_sparse_moe.experts``
with checkpoint names ``w1/w2/w3``, a Qwen3.5-style GDN projection packed from fewer trainer tensors than it has
shards, and no vLLM mapper at all: everything resolves from ``packed_modules_mapping``, the expert group and
transformers' own (reversed) Mixtral renames. TP slicing is checked against vLLM's real ``weight_loader`` methods.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from hwsync.common.errors import ResolutionError
from hwsync.common.layouts import ExpertLayout, ExpertSharding, w2_from_fused, w13_from_fused
from hwsync.engine.names import (
    ExpertGroup,
    NameMapCache,
    Namespace,
    ParamSpec,
    Shard,
    Target,
    manifest_of,
    manifest_signature,
    namespace_from_vllm_model,
    normalize_trainer_name,
    resolve,
)
from hwsync.engine.names.namespace import _trainer_renames

H, INTER, E, V = 8, 4, 4, 20
QKV = (("q", 8), ("k", 4), ("v", 4))
QKVZ = (4, 4, 6, 6)  # q, k, v, z heads of a GDN layer
EXPERTS = "model.layers.0.block_sparse_moe.experts"
# transformers >= 5 renames Mixtral's block_sparse_moe to mlp at runtime (its conversion mapping, reversed by the
# resolver); older transformers keep the checkpoint name, so the trainer spells it like the receiver
MOE = "mlp" if _trainer_renames("mixtral") else "block_sparse_moe"


def _packed(name: str, sizes, cols: int) -> ParamSpec:
    shards, off = [], 0
    for sid, size in sizes:
        shards.append(Shard(sid, size, off, 0, size))
        off += size
    return ParamSpec(name, (off, cols), torch.float32, 0, tuple(shards))


def toy_namespace(sharding: ExpertSharding | None = None, layout=ExpertLayout.PREPROCESSED) -> Namespace:
    sh = sharding or ExpertSharding(E)
    lp = "model.layers.0."
    specs = [
        ParamSpec("model.embed_tokens.weight", (V, H), torch.float32),
        _packed(lp + "self_attn.qkv_proj.weight", QKV, H),
        ParamSpec(lp + "self_attn.o_proj.weight", (H, 8), torch.float32),
        _packed(lp + "linear_attn.in_proj_qkvz.weight", list(enumerate(QKVZ)), H),
        _packed(lp + "linear_attn.in_proj_ba.weight", [(0, 2), (1, 2)], H),
        ParamSpec(lp + "block_sparse_moe.gate.weight", (E, H), torch.float32),
        ParamSpec("model.norm.weight", (H,), torch.float32),
        ParamSpec("lm_head.weight", (V, H), torch.float32),
    ]
    w13 = f"{EXPERTS}.routed_experts.w13_weight"
    w2 = f"{EXPERTS}.routed_experts.w2_weight"
    from hwsync.common.layouts import w2_shape, w13_shape

    s13, s2 = w13_shape(sh, INTER, H, layout), w2_shape(sh, INTER, H, layout)
    specs += [ParamSpec(w13, s13, torch.float32), ParamSpec(w2, s2, torch.float32)]
    group = ExpertGroup(
        prefix=EXPERTS,
        w13=w13,
        w2=w2,
        gate="w1",
        up="w3",
        down="w2",
        num_experts=E,
        hidden=H,
        intermediate=INTER,
        dtype=torch.float32,
        layout=layout,
        sharding=sh,
    )
    return Namespace(
        params={s.name: s for s in specs},
        expert_groups={EXPERTS: group},
        packed_modules={
            "qkv_proj": ("q_proj", "k_proj", "v_proj"),
            "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
            "in_proj_ba": ("in_proj_b", "in_proj_a"),
        },
        trainer_renames=_trainer_renames("mixtral"),  # transformers' own: runtime ".mlp." -> ".block_sparse_moe."
        num_hidden_layers=1,
        architecture="ToyMoeForCausalLM",
        live={s.name: torch.zeros(s.shape) for s in specs},
    )


def trainer_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """What a transformers-5 trainer of the toy model would send (runtime names, fused experts)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    lp = "model.layers.0."
    return {
        "model.embed_tokens.weight": r(V, H),
        lp + "self_attn.q_proj.weight": r(8, H),
        lp + "self_attn.k_proj.weight": r(4, H),
        lp + "self_attn.v_proj.weight": r(4, H),
        lp + "self_attn.o_proj.weight": r(H, 8),
        lp + "linear_attn.in_proj_qkv.weight": r(14, H),
        lp + "linear_attn.in_proj_z.weight": r(6, H),
        lp + "linear_attn.in_proj_b.weight": r(2, H),
        lp + "linear_attn.in_proj_a.weight": r(2, H),
        lp + f"{MOE}.gate.weight": r(E, H),
        lp + f"{MOE}.experts.gate_up_proj": r(E, 2 * INTER, H),
        lp + f"{MOE}.experts.down_proj": r(E, H, INTER),
        "model.norm.weight": r(H),
        "lm_head.weight": r(V, H),
    }


def expected_params(t: dict[str, torch.Tensor], sh: ExpertSharding | None = None, layout=ExpertLayout.PREPROCESSED):
    lp = "model.layers.0."
    sh = sh or ExpertSharding(E)
    return {
        "model.embed_tokens.weight": t["model.embed_tokens.weight"],
        lp + "self_attn.qkv_proj.weight": torch.cat([t[lp + f"self_attn.{x}_proj.weight"] for x in "qkv"]),
        lp + "self_attn.o_proj.weight": t[lp + "self_attn.o_proj.weight"],
        lp + "linear_attn.in_proj_qkvz.weight": torch.cat(
            [t[lp + "linear_attn.in_proj_qkv.weight"], t[lp + "linear_attn.in_proj_z.weight"]]
        ),
        lp + "linear_attn.in_proj_ba.weight": torch.cat(
            [t[lp + "linear_attn.in_proj_b.weight"], t[lp + "linear_attn.in_proj_a.weight"]]
        ),
        lp + "block_sparse_moe.gate.weight": t[lp + f"{MOE}.gate.weight"],
        f"{EXPERTS}.routed_experts.w13_weight": w13_from_fused(t[lp + f"{MOE}.experts.gate_up_proj"], sh, layout),
        f"{EXPERTS}.routed_experts.w2_weight": w2_from_fused(t[lp + f"{MOE}.experts.down_proj"], sh, layout),
        "model.norm.weight": t["model.norm.weight"],
        "lm_head.weight": t["lm_head.weight"],
    }


def assert_params(ns: Namespace, want: dict[str, torch.Tensor]) -> None:
    for name, value in want.items():
        assert torch.equal(ns.live[name], value), name


# -------------------------------------------------------------------------------------------------------------
# trainer wrappers
# -------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "raw, clean, category",
    [
        ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight", None),
        (
            "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight",
            "model.layers.0.self_attn.q_proj.weight",
            None,
        ),
        (
            "base_model.model.model.layers.0.mlp.experts.base_layer.base_layer.gate_up_proj",
            "model.layers.0.mlp.experts.gate_up_proj",
            None,
        ),
        ("base_model.model.lm_head.modules_to_save.default.weight", "lm_head.weight", None),
        ("base_model.model.lm_head.modules_to_save.my_adapter.weight", "lm_head.weight", None),
        ("base_model.model.lm_head.original_module.weight", "lm_head.weight", "peft_original"),
        ("model.layers.3._checkpoint_wrapped_module.mlp.gate.weight", "model.layers.3.mlp.gate.weight", None),
        ("_orig_mod.model.norm.weight", "model.norm.weight", None),
        (
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
            "model.layers.0.self_attn.q_proj.lora_A.default.weight",
            "adapter",
        ),
        (
            "base_model.model.model.layers.0.mlp.experts.lora_B.default.weight",
            "model.layers.0.mlp.experts.lora_B.default.weight",
            "adapter",
        ),
    ],
)
def test_normalize_trainer_name(raw, clean, category):
    assert normalize_trainer_name(raw) == (clean, category)


# -------------------------------------------------------------------------------------------------------------
# an untested family resolves from its mappings
# -------------------------------------------------------------------------------------------------------------
def test_renamed_family_resolves_from_mappings_and_applies():
    ns = toy_namespace()
    t = trainer_tensors()
    plan = resolve(manifest_of(t), ns)
    lp = "model.layers.0."
    assert plan.entries[lp + f"{MOE}.experts.gate_up_proj"] == (
        Target(f"{EXPERTS}.routed_experts.w13_weight", "experts", "w13"),
    )
    assert plan.entries[lp + "self_attn.k_proj.weight"] == (Target(lp + "self_attn.qkv_proj.weight", "packed", "k"),)
    # fewer trainer tensors than shards: the span comes from the siblings' row counts
    assert plan.entries[lp + "linear_attn.in_proj_qkv.weight"][0].shard_id == (0, 1, 2)
    assert plan.entries[lp + "linear_attn.in_proj_z.weight"][0].shard_id == 3
    assert plan.unwritten() == []
    before = {n: id(p) for n, p in ns.live.items()}
    assert plan.apply(t) == len(t)
    assert {n: id(p) for n, p in ns.live.items()} == before  # in place
    assert_params(ns, expected_params(t))


def test_checkpoint_per_expert_names_and_vllm_checkpoint_names():
    ns = toy_namespace()
    t = trainer_tensors()
    lp = "model.layers.0."
    gate, up = t.pop(lp + f"{MOE}.experts.gate_up_proj").chunk(2, dim=1)
    down = t.pop(lp + f"{MOE}.experts.down_proj")
    for e in range(E):  # HF checkpoint spelling: block_sparse_moe, w1/w3/w2
        t[f"{EXPERTS}.{e}.w1.weight"], t[f"{EXPERTS}.{e}.w3.weight"] = gate[e], up[e]
        t[f"{EXPERTS}.{e}.w2.weight"] = down[e]
    plan = resolve(manifest_of(t), ns)
    assert plan.entries[f"{EXPERTS}.2.w3.weight"] == (
        Target(f"{EXPERTS}.routed_experts.w13_weight", "expert", "w3", (2,)),
    )
    plan.apply(t)
    assert torch.equal(ns.live[f"{EXPERTS}.routed_experts.w13_weight"], torch.cat([gate, up], dim=1))
    assert torch.equal(ns.live[f"{EXPERTS}.routed_experts.w2_weight"], down)

    # a receiver whose loader takes no fused tensors gets per-expert checkpoint names with slicing transforms
    fused = trainer_tensors()
    plan = resolve(manifest_of(fused), ns)
    names = plan.vllm_checkpoint_names(lp + f"{MOE}.experts.gate_up_proj")
    assert [n for n, _ in names][:3] == [f"{EXPERTS}.0.w1.weight", f"{EXPERTS}.0.w3.weight", f"{EXPERTS}.1.w1.weight"]
    g2, u2 = fused[lp + f"{MOE}.experts.gate_up_proj"].chunk(2, dim=1)
    got = dict(plan.vllm_weights({lp + f"{MOE}.experts.gate_up_proj": fused[lp + f"{MOE}.experts.gate_up_proj"]}))
    assert torch.equal(got[f"{EXPERTS}.3.w1.weight"], g2[3]) and torch.equal(got[f"{EXPERTS}.3.w3.weight"], u2[3])
    assert plan.vllm_checkpoint_names(lp + f"{MOE}.gate.weight") == [(lp + "block_sparse_moe.gate.weight", None)]
    assert pickle.loads(pickle.dumps(names))[5][1](fused[lp + f"{MOE}.experts.gate_up_proj"]).shape == (INTER, H)


@pytest.mark.parametrize("tp_size, tp_rank, ep_size, ep_rank", [(2, 1, 1, 0), (1, 0, 2, 1), (2, 0, 2, 1)])
@pytest.mark.parametrize("layout", list(ExpertLayout))
def test_sharded_experts_go_through_the_layout_writers(tp_size, tp_rank, ep_size, ep_rank, layout):
    sh = ExpertSharding(E, tp_size, tp_rank, ep_size, ep_rank)
    ns = toy_namespace(sh, layout)
    t = trainer_tensors()
    resolve(manifest_of(t), ns).apply(t)
    assert_params(ns, expected_params(t, sh, layout))


# -------------------------------------------------------------------------------------------------------------
# MTP, tied weights, adapters, PEFT duplicates
# -------------------------------------------------------------------------------------------------------------
def test_mtp_is_an_explicit_skip():
    ns = toy_namespace()
    t = trainer_tensors()
    t["mtp.layers.0.self_attn.q_proj.weight"] = torch.zeros(8, H)
    t["model.layers.1.self_attn.q_proj.weight"] = torch.zeros(8, H)  # DeepSeek-style MTP: beyond the last layer
    with pytest.raises(ResolutionError) as e:
        resolve(manifest_of(t), ns)
    assert len(e.value.problems) == 2
    assert "receiver has no MTP" in str(e.value)
    assert "allow_skip_prefixes=('mtp.',)" in str(e.value)
    assert "allow_skip_prefixes=('model.layers.1.',)" in str(e.value)
    plan = resolve(manifest_of(t), ns, allow_skip_prefixes=("mtp.", "model.layers.1."))
    assert set(plan.skipped) == {"mtp.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"}
    assert plan.vllm_checkpoint_names("mtp.layers.0.self_attn.q_proj.weight") == []
    assert plan.apply(t) == len(t) - 2


def test_tied_embedding_alias():
    toy = toy_namespace()
    ns = dataclasses.replace(  # vLLM's tie_weights: lm_head *is* embed_tokens, listed once by named_parameters()
        toy,
        params={n: s for n, s in toy.params.items() if n != "lm_head.weight"},
        live={n: t for n, t in toy.live.items() if n != "lm_head.weight"},
        aliases={"lm_head.weight": "model.embed_tokens.weight"},
    )
    t = trainer_tensors()
    plan = resolve(manifest_of(t), ns)
    assert "tied to model.embed_tokens.weight" in plan.skipped["lm_head.weight"]
    only_head = {"lm_head.weight": t["lm_head.weight"]}
    plan = resolve(manifest_of(only_head), ns)
    assert plan.entries["lm_head.weight"] == (Target("model.embed_tokens.weight", "param"),)


def test_peft_wrapped_names_adapters_and_modules_to_save():
    ns = toy_namespace()
    t = trainer_tensors()
    lp = "model.layers.0."
    peft = {"base_model.model." + n.replace("_proj.weight", "_proj.base_layer.weight"): v for n, v in t.items()}
    peft["base_model.model." + lp + "self_attn.q_proj.lora_A.default.weight"] = torch.zeros(2, H)
    head = peft.pop("base_model.model.lm_head.weight")
    peft["base_model.model.lm_head.modules_to_save.default.weight"] = head
    peft["base_model.model.lm_head.original_module.weight"] = torch.zeros_like(head)
    with pytest.raises(ResolutionError, match="LoRA adapter tensor"):
        resolve(manifest_of(peft), ns)
    plan = resolve(manifest_of(peft), ns, skip_adapter_tensors=True)
    assert "frozen PEFT original" in plan.skipped["base_model.model.lm_head.original_module.weight"]
    assert plan.vllm_checkpoint_names("base_model.model." + lp + "self_attn.v_proj.base_layer.weight") == [
        (lp + "self_attn.v_proj.weight", None)
    ]
    plan.apply(peft)
    assert_params(ns, expected_params(t))


# -------------------------------------------------------------------------------------------------------------
# bad input: one error, nothing written
# -------------------------------------------------------------------------------------------------------------
def test_bad_manifest_is_one_error_and_nothing_is_written():
    ns = toy_namespace()
    t = trainer_tensors()
    lp = "model.layers.0."
    t[lp + "self_attn.qq_proj.weight"] = t.pop(lp + "self_attn.q_proj.weight")  # typo
    t[lp + "self_attn.o_proj.weight"] = torch.zeros(H, 9)  # wrong shape
    t["model.norm.weight"] = t["model.norm.weight"].to(torch.bfloat16)  # wrong dtype
    t[f"{EXPERTS}.1.w1.weight"] = torch.zeros(INTER, H)  # writes rows the fused gate_up_proj also writes
    with pytest.raises(ResolutionError) as e:
        resolve(manifest_of(t), ns)
    msg = str(e.value)
    assert len(e.value.problems) == 4, msg
    assert "nothing was written" in msg
    assert "nearest receiver names: model.layers.0.self_attn.q_proj.weight" in msg
    assert "expected [8, 8], got [8, 9]" in msg
    assert "receiver holds float32, got bfloat16 (pass cast=True" in msg
    assert "ambiguous" in msg and "expert 1 w1" in msg
    assert all(not p.any() for p in ns.live.values())


def test_a_name_that_fits_two_receiver_parameters_is_ambiguous():
    # a receiver with two language-model roots (thinker/talker style): a text-only "lm_head.weight" fits both
    specs = [
        ParamSpec(f"{root}.{n}", (V, H), torch.float32)
        for root in ("thinker", "talker")
        for n in ("lm_head.weight", "model.embed_tokens.weight")
    ]
    ns = Namespace(params={s.name: s for s in specs}, live={s.name: torch.zeros(s.shape) for s in specs})
    t = {"lm_head.weight": torch.ones(V, H), "thinker.model.embed_tokens.weight": torch.ones(V, H)}
    with pytest.raises(ResolutionError) as e:
        resolve(manifest_of(t), ns)
    (problem,) = e.value.problems
    assert problem.startswith("'lm_head.weight' [20, 8] float32: ambiguous")
    assert "thinker.lm_head.weight" in problem and "talker.lm_head.weight" in problem
    assert all(not p.any() for p in ns.live.values())
    plan = resolve(manifest_of({"thinker.lm_head.weight": t["lm_head.weight"]}), ns)
    assert plan.entries["thinker.lm_head.weight"] == (Target("thinker.lm_head.weight", "param"),)


def test_apply_validates_the_whole_batch_before_writing():
    ns = toy_namespace()
    t = trainer_tensors()
    plan = resolve(manifest_of(t), ns)
    batch = dict(t)
    batch["model.norm.weight"] = torch.zeros(H + 1)
    with pytest.raises(ResolutionError, match="plan was made for"):
        plan.apply(batch)
    with pytest.raises(ResolutionError, match="not in the plan"):
        plan.apply({"model.unknown.weight": torch.zeros(1)})
    with pytest.raises(ResolutionError, match="nothing was handed to vLLM"):
        plan.vllm_weights(batch)
    assert all(not p.any() for p in ns.live.values())
    repacked = dict(ns.live)
    repacked["model.layers.0.self_attn.qkv_proj.weight"] = torch.empty(0)  # what vLLM-CPU leaves after repacking
    with pytest.raises(ResolutionError, match="repacked it after loading"):
        plan.apply(t, repacked)
    assert all(not p.any() for p in ns.live.values())


def test_cast_and_require_complete():
    ns = toy_namespace()
    t = {n: v.to(torch.bfloat16) for n, v in trainer_tensors().items()}
    resolve(manifest_of(t), ns, cast=True).apply(t)
    assert_params(ns, {n: v.float() for n, v in expected_params({k: v.float() for k, v in t.items()}).items()})
    partial = dict(t)
    del partial[f"model.layers.0.{MOE}.experts.down_proj"], partial["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(ResolutionError) as e:
        resolve(manifest_of(partial), ns, cast=True, require_complete=True)
    assert sorted(e.value.problems) == sorted(
        [
            f"receiver parameter {EXPERTS}.routed_experts.w2_weight is not (fully) written by any trainer name",
            "receiver parameter model.layers.0.self_attn.qkv_proj.weight is not (fully) written by any trainer name",
        ]
    )


# -------------------------------------------------------------------------------------------------------------
# plans are computed once
# -------------------------------------------------------------------------------------------------------------
def test_plan_cache_and_signatures():
    ns = toy_namespace()
    specs = manifest_of(trainer_tensors())
    cache = NameMapCache()
    p1 = cache.get(specs, ns)
    assert cache.get(dict(reversed(list(specs.items()))), ns) is p1  # order does not matter
    assert len(cache) == 1
    other = toy_namespace()  # an identical receiver (e.g. rebuilt after a restart): same plan, new tensors
    p2 = cache.get(specs, other)
    assert p2.entries is p1.entries and p2.namespace is other
    p2.apply(trainer_tensors())
    assert other.live["model.norm.weight"].any() and not ns.live["model.norm.weight"].any()
    restored = pickle.loads(pickle.dumps(ns))
    assert restored.signature == ns.signature and restored.live == {}
    assert manifest_signature(specs) != manifest_signature({**specs, "x": ((1,), torch.float32)})
    assert cache.get(specs, toy_namespace(ExpertSharding(E, 2, 0))) is not p1


# -------------------------------------------------------------------------------------------------------------
# TP slicing checked against vLLM's own weight_loader methods
# -------------------------------------------------------------------------------------------------------------
def _vllm_layers(tp_size: int, tp_rank: int):
    """vLLM linear/embedding layers as rank ``tp_rank`` of ``tp_size`` holds them, without a process group:
    the real classes (their ``weight_loader`` is the oracle), attributes set as their __init__ would."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        VocabParallelEmbedding,
        pad_vocab_size,
    )

    def make(cls, shape, **attrs):
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer.__dict__.update(tp_size=tp_size, tp_rank=tp_rank, **attrs)
        w = torch.nn.Parameter(torch.zeros(shape), requires_grad=False)
        w.output_dim, w.input_dim = 0, 1
        layer.register_parameter("weight", w)
        return layer

    heads, kv_heads, hs, hidden, inter = 8, 2, 4, 16, 24
    q_local = heads // tp_size
    kv_local, replicas = (1, tp_size // kv_heads) if tp_size >= kv_heads else (kv_heads // tp_size, 1)
    vocab = 50
    padded = pad_vocab_size(vocab, 16 * tp_size)
    m = torch.nn.Module()
    m.qkv_proj = make(
        QKVParallelLinear,
        ((q_local + 2 * kv_local) * hs, hidden),
        head_size=hs,
        v_head_size=hs,
        total_num_heads=heads,
        total_num_kv_heads=kv_heads,
        num_heads=q_local,
        num_kv_heads=kv_local,
        num_kv_head_replicas=replicas,
        output_sizes=[heads * hs, kv_local * hs * tp_size, kv_local * hs * tp_size],
    )
    m.gate_up_proj = make(MergedColumnParallelLinear, (2 * inter // tp_size, hidden), output_sizes=[inter, inter])
    m.o_proj = make(RowParallelLinear, (hidden, heads * hs // tp_size), input_is_parallel=True)
    m.up_only = make(ColumnParallelLinear, (inter // tp_size, hidden))
    m.router = make(ReplicatedLinear, (4, hidden))
    m.embed = make(
        VocabParallelEmbedding,
        (padded // tp_size, hidden),
        org_vocab_size=vocab,
        shard_indices=VocabParallelEmbedding._get_indices(padded, padded, vocab, vocab, tp_rank, tp_size),
    )
    m.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    full = {
        "q_proj.weight": torch.randn(heads * hs, hidden),
        "k_proj.weight": torch.randn(kv_heads * hs, hidden),
        "v_proj.weight": torch.randn(kv_heads * hs, hidden),
        "gate_proj.weight": torch.randn(inter, hidden),
        "up_proj.weight": torch.randn(inter, hidden),
        "o_proj.weight": torch.randn(hidden, heads * hs),
        "up_only.weight": torch.randn(inter, hidden),
        "router.weight": torch.randn(4, hidden),
        "embed.weight": torch.randn(vocab, hidden),
    }
    via_vllm = {
        "qkv_proj": [("q_proj.weight", "q"), ("k_proj.weight", "k"), ("v_proj.weight", "v")],
        "gate_up_proj": [("gate_proj.weight", 0), ("up_proj.weight", 1)],
        "o_proj": [("o_proj.weight", None)],
        "up_only": [("up_only.weight", None)],
        "router": [("router.weight", None)],
        "embed": [("embed.weight", None)],
    }
    return m, full, via_vllm


@pytest.mark.vllm
@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_tp_slices_match_vllm_weight_loaders(tp_size):
    pytest.importorskip("vllm")
    torch.manual_seed(0)
    for tp_rank in range(tp_size):
        m, full, via_vllm = _vllm_layers(tp_size, tp_rank)
        ns = namespace_from_vllm_model(m)
        plan = resolve(manifest_of(full), ns)
        ours = {n: torch.zeros_like(p) for n, p in m.named_parameters()}
        plan.apply(full, ours)
        for layer_name, loads in via_vllm.items():
            layer = getattr(m, layer_name)
            for name, shard in loads:
                args = (layer.weight, full[name]) + ((shard,) if shard is not None else ())
                type(layer).weight_loader(layer, *args)
            assert torch.equal(ours[f"{layer_name}.weight"], layer.weight), (tp_size, tp_rank, layer_name)


@pytest.mark.vllm
def test_tp_split_by_a_parameter_own_loader_is_not_guessed():
    pytest.importorskip("vllm")
    m, full, _ = _vllm_layers(2, 1)
    # GDN's conv1d is a ColumnParallelLinear whose weight carries its own (q/k/v-aware) loader: not a plain split
    m.up_only.weight.weight_loader = lambda param, loaded: None
    ns = namespace_from_vllm_model(m)
    assert not ns.spec_of("up_only.weight").sharding_known
    assert ns.spec_of("o_proj.weight").sharding_known
    plan = resolve(manifest_of(full), ns)  # names still resolve (for vLLM's own loader) ...
    assert plan.vllm_checkpoint_names("up_only.weight") == [("up_only.weight", None)]
    ours = {n: torch.zeros_like(p) for n, p in m.named_parameters()}
    with pytest.raises(ResolutionError, match="custom loader"):  # ... but hwsync does not slice it itself
        plan.apply(full, ours)
    assert all(not p.any() for p in ours.values())
