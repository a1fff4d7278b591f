"""Tiny random MoE checkpoints (Qwen3-MoE, Qwen3.5-MoE text) for tests and smoke jobs, built offline.

The directory looks like a real Hub checkpoint (``config.json``, ``generation_config.json``,
``model.safetensors`` with the names ``save_pretrained`` writes, i.e. per-expert ``experts.{e}.*_proj``,
``tokenizer.json``, ``tokenizer_config.json`` with a chat template), so transformers, PEFT, ms-swift and
vLLM load it through their ordinary paths. Sizes respect vLLM's CPU kernels (head_dim >= 32, MoE dims
divisible by 32), and weights are scaled so next-token distributions are far from uniform: a wrong weight
shows up as a visible logprob difference, not as noise.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from hwsync.common.errors import FixtureConfigError
from hwsync.common.quiet import quiet_imports, quiet_progress_bars

from .tokenizer import VOCAB_SIZE, token_id, write_tokenizer

__all__ = ["FAMILIES", "Family", "FixtureConfigError", "make_tiny_moe", "tiny_moe_config"]

Family = Literal["qwen3_moe", "qwen3_5_moe"]
FAMILIES: tuple[str, ...] = ("qwen3_moe", "qwen3_5_moe")

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    # 2*I != H and I != H: every expert tensor is non-square, so a transposed or mis-fused tensor cannot pass
    # a shape check. The square cases are one override away: moe_intermediate_size=32 (w13 [E, 64, 64]),
    # moe_intermediate_size=64 (w2 [E, 64, 64]).
    "moe_intermediate_size": 128,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}


_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "intermediate_size": 128,  # dense MLP, used only by `mlp_only_layers`
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,  # as Qwen3-30B-A3B
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    },
    "qwen3_5_moe": {
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "layer_types": ["linear_attention", "full_attention"],  # one Gated-DeltaNet layer, one attention layer
        "linear_conv_kernel_dim": 4,
        # 128 as in Qwen3.5; vLLM's CPU GDN kernel rejects 32 ("Unexpected head dim size, 32").
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "shared_expert_intermediate_size": 32,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        # Qwen3.5 checkpoints carry one multi-token-prediction layer under `mtp.*` (ignored by transformers'
        # model, dropped by vLLM's loader unless speculative decoding uses it); the fixture writes it too.
        "mtp_num_hidden_layers": 1,
    },
}

# Logit scale: lm_head std = _LOGIT_STD / sqrt(hidden); with the final RMSNorm this gives logits of std
# ~_LOGIT_STD, i.e. a peaked but not degenerate next-token distribution over VOCAB_SIZE tokens.
_LOGIT_STD = 2.5
# Norm weights get N(0, _NORM_NOISE) on top of their neutral value, so a sync that forgets a norm, or gets
# Qwen3.5's zero-centred (1 + w) convention wrong, changes outputs.
_NORM_NOISE = 0.1


def tiny_moe_config(family: Family = "qwen3_moe", **overrides: Any) -> Any:
    """The transformers config of the tiny model (``Qwen3MoeConfig`` / ``Qwen3_5MoeTextConfig``).

    ``overrides`` replace any field, e.g. ``moe_intermediate_size=64`` for the square case
    (moe_intermediate == hidden), ``num_hidden_layers=4`` or ``num_experts=16``.
    """
    cfg_cls = _config_class(family)
    kwargs: dict[str, Any] = {**_COMMON, **_FAMILY_DEFAULTS[family]}
    kwargs["initializer_range"] = kwargs["hidden_size"] ** -0.5  # unit-gain layers: every block matters
    kwargs.update(
        bos_token_id=token_id("<|endoftext|>"),
        eos_token_id=token_id("<|im_end|>"),
        pad_token_id=token_id("<|endoftext|>"),
    )
    kwargs.update(overrides)
    if family == "qwen3_5_moe" and "num_hidden_layers" in overrides and "layer_types" not in overrides:
        n = kwargs["num_hidden_layers"]  # Qwen3.5 pattern: three GDN layers, then one attention layer
        kwargs["layer_types"] = [
            "full_attention" if (i + 1) % 4 == 0 or i == n - 1 else "linear_attention" for i in range(n)
        ]
    _check_sizes(kwargs)
    return cfg_cls(**kwargs)


def make_tiny_moe(
    path: str | os.PathLike[str],
    family: Family = "qwen3_moe",
    *,
    seed: int = 0,
    dtype: str = "float32",
    **overrides: Any,
) -> Path:
    """Write a complete tiny checkpoint of ``family`` into ``path`` (created) and return it as a ``Path``.

    Same arguments -> byte-identical files (the global torch RNG is left untouched). ``dtype`` is the
    stored dtype ("float32", "bfloat16", "float16"); ``overrides`` go to :func:`tiny_moe_config`.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch_dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise FixtureConfigError(f"dtype must name a floating torch dtype such as 'bfloat16', got {dtype!r}")
    config = tiny_moe_config(family, **overrides)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        extra = _mtp_weights(config) if getattr(config, "mtp_num_hidden_layers", 0) else {}
        _shape_init(model, config, extra)
    model.to(torch_dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[token_id("<|im_end|>"), token_id("<|endoftext|>")],
        pad_token_id=config.pad_token_id,
    )
    state = model.state_dict()
    state.update({k: v.to(torch_dtype) for k, v in extra.items()})
    # save_pretrained reverts transformers' runtime fusions (experts.gate_up_proj -> experts.{e}.gate_proj...),
    # so the file carries exactly the names of a Hub checkpoint.
    with quiet_imports(), quiet_progress_bars():  # DeepSpeed's "no GPU" line, a one-shard progress bar
        model.save_pretrained(out, state_dict=state)
    _write_hub_style_config(out / "config.json")
    write_tokenizer(out, family, model_max_length=config.max_position_embeddings)
    return out


def _write_hub_style_config(file: Path) -> None:
    """Spell config.json as the Hub checkpoints do (``num_experts``, top-level ``rope_theta``), not only as the
    installed transformers serialises it, so readers of the raw JSON and older transformers see the same model."""
    config = json.loads(file.read_text())
    if "num_local_experts" in config:  # transformers 5 writes Qwen3-MoE's attribute_map target
        config["num_experts"] = config.pop("num_local_experts")
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
    file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _config_class(family: str) -> Any:
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig
    if family == "qwen3_5_moe":
        try:
            from transformers import Qwen3_5MoeTextConfig
        except ImportError as e:  # transformers < 5.2 has no Qwen3.5
            raise FixtureConfigError(f"family 'qwen3_5_moe' needs transformers >= 5.2 (Qwen3.5-MoE): {e}") from e
        return Qwen3_5MoeTextConfig
    raise FixtureConfigError(f"unknown tiny MoE family {family!r}; choose one of {FAMILIES}")


def _check_sizes(kw: dict[str, Any]) -> None:
    """Refuse sizes vLLM's CPU kernels cannot run, before any file is written."""
    problems = []
    if kw["head_dim"] < 32:
        problems.append(f"head_dim={kw['head_dim']} (vLLM CPU attention needs >= 32)")
    for key in ("hidden_size", "moe_intermediate_size"):
        if kw[key] % 32:
            problems.append(f"{key}={kw[key]} (vLLM CPU MoE needs a multiple of 32)")
    if kw["num_attention_heads"] % kw["num_key_value_heads"]:
        problems.append("num_attention_heads must be a multiple of num_key_value_heads")
    if kw["vocab_size"] < VOCAB_SIZE:
        problems.append(f"vocab_size={kw['vocab_size']} is smaller than the tokenizer ({VOCAB_SIZE})")
    if problems:
        raise FixtureConfigError("tiny MoE config rejected, change the override(s): " + "; ".join(problems))


def _mtp_weights(config: Any) -> dict[str, Any]:
    """Qwen3.5's MTP block (``mtp.*``), laid out as vLLM's Qwen3_5MultiTokenPredictor loads it."""
    import copy

    import torch
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m

    h = config.hidden_size
    weights: dict[str, torch.Tensor] = {"mtp.fc.weight": torch.randn(h, 2 * h) * (2 * h) ** -0.5}
    for name in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        weights[f"mtp.{name}.weight"] = torch.zeros(h)
    layer_cfg = copy.deepcopy(config)
    layer_cfg.layer_types = ["full_attention"] * config.mtp_num_hidden_layers
    for i in range(config.mtp_num_hidden_layers):
        layer = m.Qwen3_5MoeDecoderLayer(layer_cfg, i)
        for k, v in layer.state_dict().items():
            weights[f"mtp.layers.{i}.{k}"] = torch.zeros_like(v) if k.endswith("norm.weight") else v
    for v in weights.values():  # decoder layers are built with torch's default init: redo it at our scale
        if v.dim() >= 2:
            v.normal_(0.0, config.initializer_range)
    return weights


def _shape_init(model: Any, config: Any, extra: dict[str, Any]) -> None:
    """Make outputs informative: peaked logits and slightly non-neutral norms (HF init does the rest)."""
    import torch

    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0.0, _LOGIT_STD * config.hidden_size**-0.5)
        named = list(model.named_parameters()) + list(extra.items())
        for name, p in named:
            if p.dim() == 1 and name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * _NORM_NOISE)
