"""LoRA formats: every conversion keeps ΔW = scaling·B·A equal to PEFT's own get_delta_weight (real PEFT, real
tiny Qwen3-MoE), and vLLM's own loader code reads our tensors back to the same per-expert ΔW."""

from __future__ import annotations

import math
import types

import pytest
import torch

from hwsync.common.errors import AdapterFormatError
from hwsync.common.lora_formats import (
    VLLM_LORA_RANKS,
    LoraAdapter,
    LoraKind,
    LoraModule,
    extract_peft_lora,
    from_peft_state_dict,
    from_vllm_lora,
    to_vllm_lora,
    vllm_max_lora_rank,
)
from hwsync.common.trainer_names import strip_peft_name
from hwsync.testing import require_vllm, tiny_moe_config

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict  # noqa: E402
from peft.tuners.lora.layer import LoraLayer  # noqa: E402

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]


def tiny_model(dtype: torch.dtype = torch.float32, **overrides):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    # 2I == H: w13 is square per expert, so only declared layouts (not shapes) can be trusted
    cfg = tiny_moe_config("qwen3_moe", **{"num_experts": 4, "moe_intermediate_size": 32, **overrides})
    return Qwen3MoeForCausalLM(cfg).to(dtype)


def lora(**kw) -> LoraConfig:
    # init_lora_weights=False: random A *and* B, so a wrong ΔW cannot hide behind B == 0
    return LoraConfig(lora_dropout=0.0, init_lora_weights=False, **kw)


CONFIGS = {
    "attention": dict(r=8, lora_alpha=16, target_modules=ATTN),
    "experts": dict(r=4, lora_alpha=8, target_modules=[], target_parameters=EXPERTS),
    "both_patterns": dict(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        target_parameters=EXPERTS,
        rank_pattern={"down_proj": 2, "v_proj": 8},
        alpha_pattern={"gate_up_proj": 3, "q_proj": 5},
    ),
    "rslora": dict(
        r=8,
        lora_alpha=4,
        use_rslora=True,
        target_modules=["o_proj"],
        target_parameters=EXPERTS,
        rank_pattern={"gate_up_proj": 2},
    ),
    # transformers-5 conversion: per-expert target_modules become target_parameters with 2r / 2α on gate_up
    "t5_conversion": dict(r=4, lora_alpha=8, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"]),
}


def peft_deltas(pm) -> dict[str, torch.Tensor]:
    """PEFT's own ΔW per adapted parameter (trainer names)."""
    out = {}
    for path, layer in pm.named_modules():
        if isinstance(layer, LoraLayer) and "default" in layer.lora_A:
            out[f"{strip_peft_name(path)}.{getattr(layer, 'parameter_name', 'weight')}"] = layer.get_delta_weight(
                "default"
            ).float()
    return out


def assert_same_deltas(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].shape == want[k].shape, k
        torch.testing.assert_close(got[k], want[k], rtol=tol, atol=tol, msg=k)


@pytest.fixture(scope="module", params=list(CONFIGS))
def peft_model(request):
    pm = get_peft_model(tiny_model(), lora(**CONFIGS[request.param]))
    return request.param, pm


def test_extract_equals_peft_delta(peft_model) -> None:
    name, pm = peft_model
    ad = extract_peft_lora(pm)
    assert_same_deltas(ad.delta_weights(), peft_deltas(pm), 1e-6)
    kinds = {m.kind for m in ad.modules.values()}
    assert (LoraKind.EXPERTS_GATE_UP in kinds) == (name != "attention")
    if name == "t5_conversion":  # PEFT doubled gate_up's rank and alpha
        gu = next(m for m in ad.modules.values() if m.kind is LoraKind.EXPERTS_GATE_UP)
        assert (gu.rank, gu.alpha, gu.scaling) == (8, 16.0, 2.0)
    if name == "rslora":
        gu = next(m for m in ad.modules.values() if m.kind is LoraKind.EXPERTS_GATE_UP)
        assert gu.rank == 2 and math.isclose(gu.scaling, 4 / math.sqrt(2))


def test_reader_reads_what_extract_reads_and_follows_the_weights(peft_model) -> None:
    """The per-sync reader (resolved once) gives extract_peft_lora's folded tensors, bit for bit, and sees the
    optimizer's in-place updates without a new walk; a module removed since is one clear error."""
    from hwsync.common.errors import SyncError
    from hwsync.common.lora_formats import PeftLoraReader

    _, pm = peft_model
    names = list(extract_peft_lora(pm).modules)
    reader = PeftLoraReader(pm, "default", names)
    kept: list[int] = []  # the buffers' addresses after the previous step
    for step in range(2):
        want = [
            t
            for n in names
            for f in [extract_peft_lora(pm).modules[n].folded(torch.bfloat16)]
            for t in (f.lora_A, f.lora_B)
        ]
        got = list(reader.read(torch.bfloat16))
        assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))
        assert all(g.dtype == w.dtype for g, w in zip(got, want))
        again = list(reader.read(torch.bfloat16))  # from the second read on: into buffers kept between reads
        assert all(torch.equal(g, w) for g, w in zip(again, want))
        if step:
            assert [t.data_ptr() for t in again] == kept
        kept = [t.data_ptr() for t in again]
        for _ in range(2):  # the trainer's own fp32: B scaled in fp32, A the parameter itself
            unscaled = reader.read(None)
            fp32 = [
                t for n in names for f in [extract_peft_lora(pm).modules[n].folded(None)] for t in (f.lora_A, f.lora_B)
            ]
            assert all(torch.equal(g, w) and g.dtype == w.dtype for g, w in zip(unscaled, fp32))
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_" in n:
                    p.add_(0.01 * (step + 1))
    from hwsync.testing.faults import fold_fp32

    # another fold (a verify fault's): the reader folds through it, not through its kept buffers
    other = reader.read(torch.bfloat16, fold_fp32)
    want = [
        t
        for n in names
        for f in [extract_peft_lora(pm).modules[n].folded(torch.bfloat16, fold_fp32)]
        for t in (f.lora_A, f.lora_B)
    ]
    assert all(torch.equal(g, w) for g, w in zip(other, want))
    layer = next(m for m in pm.modules() if isinstance(m, LoraLayer) and "default" in m.lora_A)
    saved = layer.lora_A.pop("default")
    try:
        with pytest.raises(SyncError, match="lost module"):
            reader.read(None)
    finally:
        layer.lora_A["default"] = saved
    with pytest.raises(AdapterFormatError, match="no LoRA module"):
        PeftLoraReader(pm, "default", [*names, "model.layers.9.self_attn.q_proj.weight"])


def test_reader_folds_with_another_fold_one_module_at_a_time(peft_model) -> None:
    """verify folds with vLLM's own rounding (another fold): each module is folded as it is consumed, so a reader
    that batches holds no folded copy of the whole adapter (48 layers of r32 did not fit one H200 that way)."""
    from hwsync.common.lora_formats import PeftLoraReader, fold_scaling

    _, pm = peft_model
    names = list(extract_peft_lora(pm).modules)
    reader = PeftLoraReader(pm, "default", names)
    folds: list[int] = []

    def fold(b: torch.Tensor, scaling: float, dtype: torch.dtype) -> torch.Tensor:
        folds.append(1)
        return fold_scaling(b, scaling, dtype)

    it = iter(reader.read(torch.bfloat16, fold))
    next(it), next(it)  # module 0's A and B
    assert len(folds) == 1
    rest = list(it)
    assert len(folds) == len(names) and len(rest) == 2 * len(names) - 2


def _vllm_scaled_b(b: torch.Tensor, scaling: float, dtype: torch.dtype) -> torch.Tensor:
    """B as vLLM's own loading of a saved adapter holds it: ``from_lora_tensors`` casts each factor to the LoRA
    dtype, then ``LoRALayerWeights.optimize`` multiplies the scaling into it in that dtype."""
    require_vllm()
    from vllm.lora.lora_weights import LoRALayerWeights

    w = LoRALayerWeights("m", b.shape[-1], 1, None, b.to(dtype=dtype, copy=True), scaling=scaling)
    return w.optimize().lora_b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_folding_rounds_as_vllms_own_loading(dtype) -> None:
    """folded() gives B the bits vLLM's own loading of the saved adapter gives it (cast to the LoRA dtype, then the
    scaling multiplied in that dtype), from fp32 and from 16-bit factors, for scalings that are and are not powers
    of two -- on every device here. Folding in fp32 and rounding once is a different tensor (issue 29)."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        for src in (torch.float32, dtype):
            b = (torch.randn(64, 96, device=device) * 0.05).to(src)
            for scaling in (2.0, 0.7, 1 / 3, 4 / math.sqrt(2), 6 / math.sqrt(3)):
                m = LoraModule(
                    "x.weight",
                    LoraKind.LINEAR,
                    torch.randn(8, 96, device=device).to(src),
                    b[:, :8],
                    alpha=8.0,
                    scaling=scaling,
                )
                want = _vllm_scaled_b(m.lora_B.cpu(), scaling, dtype)
                assert torch.equal(m.folded(dtype).lora_B.cpu(), want), (device, src, dtype, scaling)
                once = (m.lora_B.float() * scaling).to(dtype).cpu()
                if dtype != torch.float32 and src == torch.float32 and scaling in (0.7, 1 / 3):
                    assert not torch.equal(once, want), "fp32-then-round must differ here, or the test proves nothing"


def test_saved_state_dict_equals_peft_delta(peft_model) -> None:
    _, pm = peft_model
    ad = from_peft_state_dict(get_peft_model_state_dict(pm), pm.peft_config["default"])
    assert_same_deltas(ad.delta_weights(), peft_deltas(pm), 1e-6)


@pytest.mark.parametrize("moe_format", ["2d", "3d"])
def test_vllm_round_trip_equals_peft_delta(peft_model, moe_format: str) -> None:
    _, pm = peft_model
    tensors, config = to_vllm_lora(extract_peft_lora(pm), layout=moe_format)
    assert all(k.startswith("base_model.model.") and k.endswith((".lora_A.weight", ".lora_B.weight")) for k in tensors)
    assert len({t.data_ptr() for t in tensors.values()}) == len(tensors)  # safetensors-safe: no shared storage
    assert config["lora_alpha"] == config["r"] and config["rank_pattern"] == config["alpha_pattern"]
    back = from_vllm_lora(tensors, config)
    assert all(m.scaling == 1.0 for m in back.modules.values())
    assert_same_deltas(back.delta_weights(), peft_deltas(pm), 2e-6)


def test_moe_key_names_match_vllm_conventions() -> None:
    model = tiny_model()
    e, h, i = model.config.num_experts, model.config.hidden_size, model.config.moe_intermediate_size
    pm = get_peft_model(model, lora(**CONFIGS["both_patterns"]))
    ad = extract_peft_lora(pm)
    t2, _ = to_vllm_lora(ad, layout="2d")
    t3, c3 = to_vllm_lora(ad, layout="3d")
    p = "base_model.model.model.layers.1.mlp.experts"
    assert t2[f"{p}.3.gate_proj.lora_A.weight"].shape == (4, h)
    assert t2[f"{p}.3.up_proj.lora_B.weight"].shape == (i, 4)
    assert t2[f"{p}.0.down_proj.lora_A.weight"].shape == (2, i)
    assert t2[f"{p}.0.down_proj.lora_B.weight"].shape == (h, 2)
    assert t3[f"{p}.base_layer.lora_A.weight"].shape == (4 * e, h)
    assert t3[f"{p}.base_layer.lora_B.weight"].shape == (2 * i, 4 * e)
    assert t3[f"{p}.lora_A.weight"].shape == (2 * e, i)
    assert t3[f"{p}.lora_B.weight"].shape == (h, 2 * e)
    # the 3-D keys are PEFT's own saved keys, B rank-major (column k·E + e): identical up to the folded scale
    sd = get_peft_model_state_dict(pm)
    gu = next(m for m in ad.modules.values() if m.name == "model.layers.1.mlp.experts.gate_up_proj")
    assert torch.equal(t3[f"{p}.base_layer.lora_A.weight"], sd[f"{p}.base_layer.lora_A.weight"])
    torch.testing.assert_close(t3[f"{p}.base_layer.lora_B.weight"], sd[f"{p}.base_layer.lora_B.weight"] * gu.scaling)
    assert c3["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]


def test_bf16_conversions_fold_scale_once() -> None:
    pm = get_peft_model(tiny_model(torch.bfloat16), lora(**CONFIGS["both_patterns"]), autocast_adapter_dtype=False)
    ad = extract_peft_lora(pm)
    assert ad.modules["model.layers.0.mlp.experts.down_proj"].lora_B.dtype == torch.bfloat16
    want = {k: v.float() for k, v in ad.delta_weights().items()}  # exact ΔW of the bf16 factors
    for fmt in ("2d", "3d"):
        tensors, config = to_vllm_lora(ad, layout=fmt)
        assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
        # folded B = bf16(scale · B): one rounding, so ΔW agrees to bf16 resolution
        assert_same_deltas(from_vllm_lora(tensors, config).delta_weights(), want, 2e-2)
    t32, c32 = to_vllm_lora(ad, layout="3d", dtype=torch.float32)
    assert_same_deltas(from_vllm_lora(t32, c32).delta_weights(), want, 1e-6)


def _random_per_expert_adapter(e: int = 3, h: int = 16, i: int = 8) -> LoraAdapter:
    """A transformers-4 style adapter: independent 2-D LoRAs per expert, ranks/scalings differing per projection."""
    g = torch.Generator().manual_seed(5)
    mods = {}
    for x in range(e):
        for proj, (out, inp, r, s) in {
            "gate_proj": (i, h, 2, 0.5),
            "up_proj": (i, h, 3, 2.0),
            "down_proj": (h, i, 4, 1.5),
        }.items():
            n = f"model.layers.0.mlp.experts.{x}.{proj}.weight"
            mods[n] = LoraModule(
                n, LoraKind.LINEAR, torch.randn(r, inp, generator=g), torch.randn(out, r, generator=g), s * r, s
            )
    return LoraAdapter(mods, r=4, lora_alpha=4.0)


def test_per_expert_2d_adapter_to_3d_is_exact() -> None:
    ad = _random_per_expert_adapter()
    per = {k: v for k, v in ad.delta_weights().items()}
    t3, c3 = to_vllm_lora(ad, layout="3d")
    back = from_vllm_lora(t3, c3)
    gu = back.modules["model.layers.0.mlp.experts.gate_up_proj"]
    assert gu.rank == 5  # block-diagonal [A_gate; A_up]: rank 2 + 3
    dgu, ddn = gu.delta_weight(), back.modules["model.layers.0.mlp.experts.down_proj"].delta_weight()
    for x in range(3):
        p = f"model.layers.0.mlp.experts.{x}."
        torch.testing.assert_close(dgu[x], torch.cat([per[p + "gate_proj.weight"], per[p + "up_proj.weight"]]))
        torch.testing.assert_close(ddn[x], per[p + "down_proj.weight"])
    # 2-D passes per-expert modules through, with their different ranks announced in rank_pattern
    t2, c2 = to_vllm_lora(ad, layout="2d")
    assert c2["r"] == 4 and set(c2["rank_pattern"].values()) == {2, 3}
    assert_same_deltas(from_vllm_lora(t2, c2).delta_weights(), back.delta_weights(), 1e-5)


def test_from_vllm_honours_vllm_scaling_rules() -> None:
    """Adapters not made by hwsync: vLLM's per-module pattern/rsLoRA rules decide the scaling."""
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(2, 16, generator=g), torch.randn(8, 2, generator=g)
    tensors = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a,
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": b,
    }
    cfg = {
        "r": 4,
        "lora_alpha": 8,
        "use_rslora": True,
        "target_modules": ["q_proj"],
        "rank_pattern": {"q_proj": 2},
        "alpha_pattern": {r"layers\.0\.self_attn\.q_proj": 6},
    }
    mod = from_vllm_lora(tensors, cfg).modules["model.layers.0.self_attn.q_proj.weight"]
    assert math.isclose(mod.scaling, 6 / math.sqrt(2))
    torch.testing.assert_close(mod.delta_weight(), b @ a * (6 / math.sqrt(2)))


def test_vllm_max_lora_rank() -> None:
    assert [vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 64, 300, 320, 321, 512)] == [
        1,
        8,
        8,
        16,
        64,
        320,
        320,
        512,
        512,
    ]
    assert VLLM_LORA_RANKS[-1] == 512
    with pytest.raises(AdapterFormatError, match='strategy="full"'):
        vllm_max_lora_rank(513)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(r=4, target_modules=["q_proj"], use_dora=True), "DoRA"),
        (dict(r=4, target_modules=["q_proj"], lora_bias=True), "bias"),
        (dict(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]), "modules_to_save"),
    ],
)
def test_non_plain_lora_is_refused(kw, match) -> None:
    pm = get_peft_model(tiny_model(), lora(**kw))
    with pytest.raises(AdapterFormatError, match=match) as err:
        extract_peft_lora(pm)
    assert 'strategy="full"' in str(err.value)
    with pytest.raises(AdapterFormatError, match='strategy="full"'):
        from_peft_state_dict(get_peft_model_state_dict(pm), pm.peft_config["default"])


def test_ia3_and_prefix_tuning_are_refused() -> None:
    from peft import IA3Config, PrefixTuningConfig

    ia3 = get_peft_model(tiny_model(), IA3Config(target_modules=["q_proj", "o_proj"], feedforward_modules=["o_proj"]))
    with pytest.raises(AdapterFormatError, match='IA3.*strategy="full"'):
        extract_peft_lora(ia3)
    prefix = get_peft_model(tiny_model(), PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(AdapterFormatError, match="PREFIX_TUNING"):
        extract_peft_lora(prefix)


def test_bad_inputs_are_refused() -> None:
    pm = get_peft_model(tiny_model(), lora(**CONFIGS["attention"]))
    with pytest.raises(AdapterFormatError, match="no adapter 'other'"):
        extract_peft_lora(pm, "other")
    tensors, cfg = to_vllm_lora(extract_peft_lora(pm))
    with pytest.raises(AdapterFormatError, match="lora_A and lora_B"):
        from_vllm_lora({k: v for k, v in tensors.items() if "q_proj.lora_B" not in k}, cfg)
    with pytest.raises(AdapterFormatError, match="packed module 'qkv_proj'"):
        bad = extract_peft_lora(pm)
        renamed = {
            n.replace("q_proj", "qkv_proj"): LoraModule(
                n.replace("q_proj", "qkv_proj"), m.kind, m.lora_A, m.lora_B, m.alpha, m.scaling
            )
            for n, m in bad.modules.items()
        }
        to_vllm_lora(LoraAdapter(renamed, 8, 16.0), packed_modules_mapping={"qkv_proj": ["q_proj", "k_proj", "v_proj"]})
    with pytest.raises(AdapterFormatError, match="moe_format"):
        to_vllm_lora(extract_peft_lora(pm), layout="4d")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------------------
# vLLM's own loader code as the oracle (LoRAModel.from_lora_tensors, PEFTHelper, pack_moe, 3-D -> 2-D conversion)
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm_lora():
    require_vllm()
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import PackedLoRALayerWeights
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.peft_helper import PEFTHelper

    return types.SimpleNamespace(
        LoRAModel=LoRAModel, Packed=PackedLoRALayerWeights, Manager=LoRAModelManager, Helper=PEFTHelper
    )


def _vllm_model(v, tensors, config):
    helper = v.Helper.from_dict(dict(config))
    helper.validate_legal(
        types.SimpleNamespace(max_lora_rank=vllm_max_lora_rank(max([config["r"], *config["rank_pattern"].values()])))
    )
    return v.LoRAModel.from_lora_tensors(1, dict(tensors), helper, device="cpu")


@pytest.mark.vllm
@pytest.mark.parametrize("cfg_name", ["both_patterns", "rslora", "t5_conversion"])
def test_vllm_reads_2d_keys_to_peft_delta(vllm_lora, cfg_name: str) -> None:
    v = vllm_lora
    pm = get_peft_model(tiny_model(), lora(**CONFIGS[cfg_name]))
    want = peft_deltas(pm)
    tensors, config = to_vllm_lora(extract_peft_lora(pm), layout="2d")
    lm = _vllm_model(v, tensors, config)
    for layer in range(2):
        owner = f"model.layers.{layer}.mlp.experts"
        # the order vLLM's packed_modules_mapping["experts"] gives pack_moe: per expert w1 (gate), w2 (down), w3 (up)
        subs = [lm.get_lora(f"{owner}.{e}.{p}") for e in range(4) for p in ("gate_proj", "down_proj", "up_proj")]
        packed = v.Packed.pack_moe(subs, owner)
        packed.optimize()
        (a1, a2, a3), (b1, b2, b3) = packed.lora_a, packed.lora_b
        gate_up = torch.cat([b1 @ a1, b3 @ a3], dim=1)
        torch.testing.assert_close(gate_up, want[f"{owner}.gate_up_proj"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b2 @ a2, want[f"{owner}.down_proj"], rtol=1e-5, atol=1e-6)
    for name, d in want.items():
        if ".experts." not in name:
            w = lm.get_lora(name[: -len(".weight")])
            torch.testing.assert_close(w.scaling * (w.lora_b @ w.lora_a), d, rtol=1e-5, atol=1e-6)


@pytest.mark.vllm
@pytest.mark.parametrize("ep_rank", [0, 1])
def test_vllm_reads_3d_keys_to_peft_delta(vllm_lora, ep_rank: int) -> None:
    """vLLM's `_convert_3d_to_2d_moe_lora` (mixed format, EP-sliced) on our 3-D tensors gives PEFT's ΔW."""
    v = vllm_lora
    pm = get_peft_model(tiny_model(), lora(**CONFIGS["both_patterns"]))
    want = peft_deltas(pm)
    tensors, config = to_vllm_lora(extract_peft_lora(pm), layout="3d")
    lm = _vllm_model(v, tensors, config)
    for w in lm.loras.values():
        w.optimize()  # as _create_merged_loras_inplace does before the MoE conversions
    manager = types.SimpleNamespace(
        _get_lora_layer_weights=lambda model, name: model.get_lora(name),
        model=types.SimpleNamespace(config=types.SimpleNamespace(architectures=["Qwen3MoeForCausalLM"])),
    )
    local = range(2 * ep_rank, 2 * ep_rank + 2)  # ep_size 2, 4 experts
    for layer in range(2):
        owner = f"model.layers.{layer}.mlp.experts"
        module = types.SimpleNamespace(local_num_experts=2, global_num_experts=4, ep_rank=ep_rank)
        v.Manager._convert_3d_to_2d_moe_lora(manager, lm, module, owner)
        w = lm.get_lora(owner)
        (a1, a2, a3), (b1, b2, b3) = w.lora_a, w.lora_b
        torch.testing.assert_close(torch.cat([b1 @ a1, b3 @ a3], dim=1), want[f"{owner}.gate_up_proj"][list(local)])
        torch.testing.assert_close(b2 @ a2, want[f"{owner}.down_proj"][list(local)])


@pytest.mark.parametrize("experts", [False, True])
def test_folded_b_is_vllms_and_contiguous(experts: bool) -> None:
    """The scaling fold gives vLLM's bits (cast, then scaled in the LoRA dtype) and makes PEFT's permuted expert
    layout contiguous on the way."""
    from hwsync.common.lora_formats import LoraKind, LoraModule

    gen = torch.Generator().manual_seed(0)
    for src, dt, scaling in [
        (torch.float32, torch.bfloat16, 0.37),
        (torch.float32, torch.bfloat16, 1.0),
        (torch.bfloat16, torch.bfloat16, 2.0),
        (torch.float32, torch.float16, 0.5),
        (torch.float32, torch.float32, 0.37),
    ]:
        if experts:  # PEFT's ParamWrapper B: [out, r * E] read as [E, out, r] (a permuted view)
            a = torch.randn(4, 8, 16, generator=gen).to(src)
            b = torch.randn(32, 8, 4, generator=gen).to(src).permute(2, 0, 1)
            kind = LoraKind.EXPERTS_DOWN
        else:
            a, b, kind = (
                torch.randn(8, 16, generator=gen).to(src),
                torch.randn(32, 8, generator=gen).to(src),
                LoraKind.LINEAR,
            )
        f = LoraModule("m", kind, a, b, 8.0, scaling, False).folded(dt)
        assert torch.equal(f.lora_B, _vllm_scaled_b(b, scaling, dt)), (src, dt, scaling)
        assert f.lora_B.is_contiguous() and f.scaling == 1.0
