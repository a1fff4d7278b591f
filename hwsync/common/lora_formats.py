"""PEFT LoRA adapters <-> the tensors + ``adapter_config`` vLLM's LoRA manager loads.

One in-memory form, :class:`LoraAdapter`, sits between the formats. Each :class:`LoraModule` holds the LoRA of one
trainer parameter (named like :func:`hwsync.engine.names.strip_peft_name` names it) with the scaling PEFT applies::

    linear            A [r, in]      B [out, r]      ΔW = scaling · B @ A               (param ``<module>.weight``)
    experts_gate_up   A [E, r, H]    B [E, 2I, r]    ΔW[e] = scaling · B[e] @ A[e]      (param
    ``<experts>.gate_up_proj``) experts_down      A [E, r, I]    B [E, H, r]     ΔW[e] = scaling · B[e] @ A[e]
    (param ``<experts>.down_proj``)

PEFT's ``ParamWrapper`` (``target_parameters``) keeps experts as ``lora_A`` [r·E, in] (expert-major rows) and
``lora_B`` [out, r·E] (rank-major columns: column k·E + e), i.e. ``einsum("o r e, e r i -> e o i")``; the stacked
form above is ``A.reshape(E, r, in)`` and ``B.reshape(out, r, E).permute(2, 0, 1)``.

vLLM formats (read from vllm 0.32: ``lora/model_manager.py`` ``_stack_moe_lora_weights`` /
``_convert_3d_to_2d_moe_lora``, ``lora/lora_model.py`` ``from_lora_tensors``, ``lora/utils.py``
``parse_fine_tuned_lora_name``, ``lora/peft_helper.py`` ``get_rank_and_scaling``):

* dense / attention LoRA: PEFT's own keys ``base_model.model.<module>.lora_{A,B}.weight``; vLLM packs q/k/v into
  ``qkv_proj`` (and dense gate/up into ``gate_up_proj``) itself from the model's ``packed_modules_mapping``;
* 2-D MoE (``FusedMoEWithLoRA``): per expert ``<experts>.{e}.{gate,up,down}_proj.lora_{A,B}.weight``,
  A [r, in], B [out, r]; gate and up of one 3-D LoRA share A;
* 3-D MoE (``FusedMoE3DWithLoRA``): PEFT's ParamWrapper keys, ``<experts>.base_layer.lora_{A,B}.weight`` for
  gate_up and ``<experts>.lora_{A,B}.weight`` for down, with PEFT's [r·E, in] / [out, r·E] layout.

Scaling is **folded into B** exactly as vLLM's own loader folds it (:func:`fold_scaling`: B cast to the LoRA dtype
first, ``from_lora_tensors``; then ``lora_b *= scaling`` in that dtype, ``LoRALayerWeights.optimize``), and the
emitted config says ``lora_alpha == r`` with ``rank_pattern == alpha_pattern`` for modules of other ranks, so every
module's scaling is exactly 1 for any vLLM version, with or without per-module pattern support: vLLM only moves what
hwsync hands it (its ``optimize`` is a no-op, the in-memory tensors are never mutated) and holds the bits its own
loading of the trainer's saved adapter holds. (Folding in fp32 and rounding once is not the same: with a scaling
that is not a power of two -- rsLoRA, ``alpha_pattern`` -- and a 16-bit LoRA dtype about a quarter of B's elements
differ in the last bit, which moved served logprobs by up to 0.5 on bf16 GPU engines; issue 29.)
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from hwsync.common import foreign
from hwsync.common.errors import AdapterFormatError, SyncError
from hwsync.common.gather import read
from hwsync.common.lora_layout import LoraLayout
from hwsync.common.trainer_names import strip_peft_name

__all__ = [
    "LoraKind",
    "LoraModule",
    "LoraAdapter",
    "extract_peft_lora",
    "PeftLoraReader",
    "FoldBuffers",
    "from_peft_state_dict",
    "to_vllm_lora",
    "from_vllm_lora",
    "lora_paths",
    "vllm_max_lora_rank",
    "VLLM_LORA_RANKS",
    "NON_GATED_EXPERTS",
    "FoldFn",
    "fold_scaling",
    "base_init",
    "not_lora_reason",
    "peft_type",
    "trained_biases",
    "experts_stored_in_out",
]

#: ``LoRAConfig.max_lora_rank`` values vLLM accepts (vllm/config/lora.py ``MaxLoRARanks``).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

_FULL_HINT = 'sync merged full weights instead (strategy="full")'
_PREFIX = "base_model.model."
_EXPERT_PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_PER_EXPERT = re.compile(r"^(?P<m>.+\.experts)\.(?P<e>\d+)\.(?P<p>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")


class LoraKind(str, enum.Enum):
    LINEAR = "linear"
    EXPERTS_GATE_UP = "experts_gate_up"
    EXPERTS_DOWN = "experts_down"
    EXPERTS_OTHER = "experts_other"
    """LoRA on a stacked expert parameter vLLM's MoE LoRA has no layout for (non-gated experts' ``up_proj``,
    Nemotron-H): it can be merged into the base weights (``hybrid``, ``full``), never served as LoRA."""


NON_GATED_EXPERTS = (
    "vLLM's MoE LoRA only knows gate_up_proj/down_proj (gated experts): LoRA on non-gated experts "
    "(up_proj) has no vLLM layout"
)
"""Why LoRA on a stacked expert parameter other than gate_up/down (:attr:`LoraKind.EXPERTS_OTHER`) is not served as
LoRA: the one wording of the refusal (``adapter``) and of the reason ``hybrid`` merges such experts."""


def experts_unservable_reason(name: str, param_name: str) -> str:
    return f"{name}: LoRA on stacked expert parameter {param_name!r}; {NON_GATED_EXPERTS}"


@dataclass(frozen=True)
class LoraModule:
    """LoRA of one trainer parameter; ``scaling`` is what PEFT multiplies ``B @ A`` with (the truth, even if a live
    layer's scale was changed after creation); ``alpha``/``use_rslora`` are informational."""

    name: str
    kind: LoraKind
    lora_A: Tensor
    lora_B: Tensor
    alpha: float
    scaling: float
    use_rslora: bool = False
    transposed: bool = False  # experts parameter stored [E, in, out] (A/B are in linear terms all the same)
    interleaved: bool = False
    """gate_up rows alternate gate/up (transformers' ``is_concatenated=False``: GPT-OSS), else ``[gate; up]``."""
    sources: tuple[str, ...] = field(default=(), compare=False, repr=False)
    """Names (in the live model's ``named_parameters()``) of the A and B parameters read (sharded trainers gather
    these); empty when not read from a live model."""

    def __post_init__(self) -> None:
        a, b = self.lora_A, self.lora_B
        want = 2 if self.kind is LoraKind.LINEAR else 3
        ok = a.dim() == want and b.dim() == want and a.shape[-2] == b.shape[-1]
        if want == 3:
            ok = ok and a.shape[0] == b.shape[0]
        if not ok:
            raise AdapterFormatError(
                f"{self.name}: {self.kind.value} LoRA needs A {'[E, r, in]' if want == 3 else '[r, in]'} and "
                f"B {'[E, out, r]' if want == 3 else '[out, r]'} of equal r; got A {tuple(a.shape)}, B {tuple(b.shape)}"
            )

    @property
    def rank(self) -> int:
        return int(self.lora_A.shape[-2])

    @property
    def num_experts(self) -> int:
        return 1 if self.kind is LoraKind.LINEAR else int(self.lora_A.shape[0])

    @property
    def module(self) -> str:
        """The module the LoRA wraps (``...q_proj`` or ``...mlp.experts``)."""
        return self.name.rsplit(".", 1)[0]

    def delta_weight(self) -> Tensor:
        """ΔW in fp32 in the parameter's own layout ([out, in]; experts [E, out, in], or [E, in, out] if transposed)."""
        d = torch.matmul(self.lora_B.float(), self.lora_A.float()) * self.scaling
        return d.transpose(-1, -2) if self.transposed else d

    def folded(self, dtype: torch.dtype | None = None, fold: FoldFn | None = None) -> LoraModule:
        """Same ΔW with scaling 1: A cast to ``dtype``, B scaled in vLLM's rounding order (:func:`fold_scaling`, or
        ``fold``: what :mod:`hwsync.verify` computes its expectation with)."""
        dt = dtype or self.lora_B.dtype
        b = (fold or fold_scaling)(self.lora_B, self.scaling, dt)
        return LoraModule(
            self.name, self.kind, self.lora_A.to(dt), b, float(self.rank), 1.0, False, self.transposed, self.interleaved
        )


FoldFn = Callable[[Tensor, float, torch.dtype], Tensor]
"""``(B, scaling, dtype) -> B · scaling`` in ``dtype``: how a module's scaling is folded into its B."""


def fold_scaling(b: Tensor, scaling: float, dtype: torch.dtype) -> Tensor:
    """``b · scaling`` in ``dtype``, rounded as vLLM's own adapter loading rounds it (vllm 0.32
    ``lora/lora_model.py`` ``from_lora_tensors``: ``lora_b = tensor.to(device, dtype)``; ``lora/lora_weights.py``
    ``LoRALayerWeights.optimize``: ``lora_b *= scaling``): cast to ``dtype`` first, then multiplied in ``dtype`` (torch
    multiplies 16-bit floats in fp32 and rounds once, on every device). Written contiguous (PEFT's expert B is a
    permuted view); ``b`` itself when there is nothing to do."""
    if scaling == 1 and b.dtype == dtype:
        return b
    out = torch.empty(b.shape, dtype=dtype, device=b.device)
    out.copy_(b)
    if scaling != 1:
        out.mul_(scaling)
    return out


@dataclass
class LoraAdapter:
    """A LoRA adapter keyed by the trainer parameter each module adapts."""

    modules: dict[str, LoraModule]
    r: int
    lora_alpha: float
    use_rslora: bool = False
    name: str = "default"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules.values())

    def delta_weights(self) -> dict[str, Tensor]:
        """``{param name: ΔW}`` in fp32 (what a merged sync adds to the base weights)."""
        return {n: m.delta_weight() for n, m in self.modules.items()}


def vllm_max_lora_rank(r: int) -> int:
    """Smallest ``max_lora_rank`` vLLM accepts that holds rank ``r``."""
    for v in VLLM_LORA_RANKS:
        if v >= r:
            return v
    raise AdapterFormatError(f"LoRA rank {r} exceeds vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}; {_FULL_HINT}")


# ---------------------------------------------------------------------------------------------------------------
# PEFT config semantics
# ---------------------------------------------------------------------------------------------------------------
def _cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def pattern_value(pattern: Mapping[str, Any] | None, name: str) -> Any:
    """PEFT's ``get_pattern_key`` rule (also vLLM's): a key matches a dotted suffix of ``name``; first match wins."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return None


def _scaling(rank: int, alpha: float, rslora: bool) -> float:
    return alpha / math.sqrt(rank) if rslora else alpha / rank


BASE_INITS = ("pissa", "olora", "corda", "loftq")
"""``init_lora_weights`` families that rewrite the base weights when the adapter is created (the base becomes the
residual ``W - scaling·B0·A0``): served as LoRA only over that residual base, which hwsync sends from a live model."""


def base_init(cfg: Any) -> str | None:
    """The ``init_lora_weights`` value of ``cfg`` when it rewrote the base weights (:data:`BASE_INITS`), else None."""
    init = _cfg_get(cfg, "init_lora_weights", True)
    if isinstance(init, str) and init.lower().split("_")[0] in BASE_INITS:
        return init
    return None


def trained_biases(model: nn.Module, cfg: Any) -> list[str]:
    """The bias parameters PEFT's ``bias`` option trains on ``model`` (``"all"``: every parameter whose name holds
    ``bias``; ``"lora_only"``: the biases of LoRA-adapted layers), LoRA's own tensors left out. Empty when the model
    has none: then the option trains nothing and the adapter is plain LoRA."""
    from peft.tuners.lora.layer import LoraLayer

    mode = _cfg_get(cfg, "bias", "none") or "none"
    if mode == "none":
        return []
    if mode == "all":
        names = [n for n, _ in model.named_parameters() if "bias" in n and ".lora_" not in n]
    else:
        names = [
            f"{path}.bias"
            for path, layer in model.named_modules()
            if isinstance(layer, LoraLayer) and isinstance(getattr(layer.get_base_layer(), "bias", None), Tensor)
        ]
    return list(dict.fromkeys(strip_peft_name(n) for n in names))


PROMPT_LEARNING = ("PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING", "MULTITASK_PROMPT_TUNING", "ADAPTION_PROMPT", "CPT")
"""PEFT types that add learned virtual tokens / prefixes instead of changing weights."""


def peft_type(cfg: Any) -> str:
    """``cfg``'s PEFT type, upper case (``"LORA"``, ``"IA3"``, ``"PROMPT_TUNING"``, ...)."""
    ptype = _cfg_get(cfg, "peft_type", "LORA")
    return str(getattr(ptype, "value", ptype)).upper()


def not_lora_reason(adapter: str, ptype: str) -> str:
    """The one refusal of a PEFT adapter that is not LoRA, naming what the user can do instead."""
    if ptype in PROMPT_LEARNING:
        return (
            f"adapter {adapter!r} is peft_type={ptype}: it prepends learned virtual tokens to every input, which "
            "no weight sync can express and vLLM's LoRA does not serve, so hwsync cannot sync it with any "
            "strategy (train LoRA instead)"
        )
    return (
        f"adapter {adapter!r} is peft_type={ptype}, not LoRA: vLLM serves only LoRA adapters and hwsync's merged "
        f"view adds LoRA deltas only. Merge it on a copy with PEFT (copy.merge_and_unload()) and sync that model "
        f'with strategy="full", or train LoRA'
    )


def _check_config(cfg: Any, adapter: str, model: nn.Module | None = None) -> None:
    """Refuse what vLLM's LoRA cannot serve, naming the option. ``model``: the live PEFT model the adapter is read
    from (hwsync then sends its base weights itself, so an init that rewrote them is served exactly; ``bias`` is
    judged by the biases it actually trains). Without it (a saved adapter) both are refused as configured."""
    ptype = peft_type(cfg)
    if ptype != "LORA":
        raise AdapterFormatError(not_lora_reason(adapter, ptype))
    problems = []
    if _cfg_get(cfg, "use_dora", False):
        problems.append("use_dora=True (vLLM serves no DoRA)")
    if _cfg_get(cfg, "lora_bias", False):
        problems.append("lora_bias=True (vLLM's LoRA has no bias term)")
    mode = _cfg_get(cfg, "bias", "none")
    if mode not in ("none", None):
        biases = trained_biases(model, cfg) if model is not None else ["?"]
        if biases:
            what = f"{len(biases)} bias tensor(s), e.g. {biases[0]}" if model is not None else "the model's biases"
            problems.append(f"bias={mode!r} trains {what} (base weights: vLLM's LoRA has no bias)")
    if _cfg_get(cfg, "fan_in_fan_out", False):
        problems.append("fan_in_fan_out=True")
    if _cfg_get(cfg, "modules_to_save", None):
        problems.append(
            f"modules_to_save={list(_cfg_get(cfg, 'modules_to_save'))} trains full copies of those "
            "modules (vLLM serves LoRA factors only)"
        )
    if _cfg_get(cfg, "trainable_token_indices", None):
        problems.append("trainable_token_indices trains token embeddings")
    if _cfg_get(cfg, "layer_replication", None):
        problems.append("layer_replication is set")
    init = base_init(cfg)
    if init is not None and model is None:
        problems.append(f"init_lora_weights={init!r} rewrote the base weights (a saved adapter carries no base)")
    if problems:
        raise AdapterFormatError(
            f"adapter {adapter!r} cannot be served as a vLLM LoRA: {'; '.join(problems)}; {_FULL_HINT}"
        )


# ---------------------------------------------------------------------------------------------------------------
# from a live PEFT model
# ---------------------------------------------------------------------------------------------------------------
def _experts_kind(name: str, param_name: str) -> LoraKind:
    """The kind of a ParamWrapper LoRA on stacked experts; anything but gate_up/down (non-gated experts' ``up_proj``)
    is :attr:`LoraKind.EXPERTS_OTHER`: readable and mergeable, refused where it would have to be served as LoRA
    (:func:`to_vllm_lora`)."""
    if param_name == "gate_up_proj":
        return LoraKind.EXPERTS_GATE_UP
    if param_name == "down_proj":
        return LoraKind.EXPERTS_DOWN
    return LoraKind.EXPERTS_OTHER


def experts_stored_in_out(experts: nn.Module) -> bool | None:
    """Whether a gated experts module stores its weights ``[E, in, out]`` (``True``) or ``[E, out, in]``
    (``False``), told from the shapes of its ``gate_up_proj`` and ``down_proj`` alone (``[E, 2I, H]`` + ``[E, H, I]``
    against ``[E, H, 2I]`` + ``[E, I, H]``; both cannot fit); ``None`` without such a pair."""
    gu, dn = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gu, Tensor) and isinstance(dn, Tensor) and gu.dim() == 3 and dn.dim() == 3):
        return None
    g, d = gu.shape, dn.shape
    if g[-1] == d[-2] and g[-2] == 2 * d[-1]:
        return False
    if g[-2] == d[-1] and g[-1] == 2 * d[-2]:
        return True
    return None


def _stack_param_wrapper(a: Tensor, b: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """PEFT ParamWrapper [r·E, in] / [out, r·E] -> stacked [E, r, in] / [E, out, r] (views)."""
    if a.shape[0] % num_experts or b.shape[1] != a.shape[0]:
        raise AdapterFormatError(
            f"expert LoRA shapes A {tuple(a.shape)} / B {tuple(b.shape)} do not hold {num_experts} experts"
        )
    return a.reshape(num_experts, -1, a.shape[-1]), b.reshape(b.shape[0], -1, num_experts).permute(2, 0, 1)


def _peft_layers(model: nn.Module, adapter_name: str) -> list[tuple[str, Any]]:
    """The LoRA layers of ``adapter_name`` (module path, layer), checked to be plain LoRA: one walk of the model."""
    from peft.tuners.lora.layer import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer

    configs = getattr(model, "peft_config", None)
    cfg = configs.get(adapter_name) if isinstance(configs, dict) else None
    if isinstance(configs, dict) and cfg is None:
        raise AdapterFormatError(f"model has no adapter {adapter_name!r}; it has {sorted(configs)}")
    if cfg is not None:
        _check_config(cfg, adapter_name, model)
    layers = []
    for path, layer in model.named_modules():
        if not isinstance(layer, BaseTunerLayer):
            continue
        if not isinstance(layer, LoraLayer):
            raise AdapterFormatError(f"{path} is a {type(layer).__name__}, not LoRA; {_FULL_HINT}")
        if adapter_name in getattr(layer, "lora_embedding_A", {}):
            raise AdapterFormatError(f"{path}: embedding LoRA is not supported by the adapter sync; {_FULL_HINT}")
        if adapter_name not in layer.lora_A:
            continue
        if adapter_name in getattr(layer, "lora_variant", {}):
            raise AdapterFormatError(
                f"{path}: {type(layer.lora_variant[adapter_name]).__name__} (e.g. DoRA) is not plain LoRA; {_FULL_HINT}"
            )
        if layer.lora_bias.get(adapter_name, False) or getattr(layer, "fan_in_fan_out", False):
            raise AdapterFormatError(f"{path}: lora_bias / fan_in_fan_out adapters are not plain LoRA; {_FULL_HINT}")
        if not isinstance(layer.lora_A[adapter_name], nn.Linear):
            raise AdapterFormatError(
                f"{path}: {type(layer.lora_A[adapter_name]).__name__} LoRA (e.g. conv) is not supported; {_FULL_HINT}"
            )
        layers.append((path, layer))
    if not layers:
        raise AdapterFormatError(f"model has no LoRA layers for adapter {adapter_name!r}")
    return layers


def _layer_module(path: str, layer: Any, adapter_name: str, sources: tuple[str, str] = ("", "")) -> LoraModule:
    """The :class:`LoraModule` of one PEFT LoRA layer, its tensors read now (views of the weights)."""
    from peft.tuners.lora.layer import ParamWrapper

    a, b = read(layer.lora_A[adapter_name].weight), read(layer.lora_B[adapter_name].weight)
    common: dict[str, Any] = dict(
        alpha=float(layer.lora_alpha[adapter_name]),
        scaling=float(layer.scaling[adapter_name]),
        use_rslora=bool(layer.use_rslora.get(adapter_name, False)),
        sources=sources,
    )
    owner = strip_peft_name(path)
    if isinstance(layer, ParamWrapper):
        pname = layer.parameter_name
        name = f"{owner}.{pname}"
        if layer.num_experts > 1:
            sa, sb = _stack_param_wrapper(a, b, layer.num_experts)
            transposed = not layer._did_swap_in_out_features
            experts = layer.get_base_layer()
            stored = experts_stored_in_out(experts)
            if stored is not None and stored != transposed:
                # PEFT took the parameter for the other orientation (transformers' Llama 4 stores [E, in, out] and
                # declares no ``is_transposed``): its B A is the parameter's ΔW all the same, but A's columns are
                # the outputs. In linear terms ΔW = (B A)ᵀ = Aᵀ Bᵀ: A' = Bᵀ, B' = Aᵀ.
                sa, sb = sb.transpose(-1, -2).contiguous(), sa.transpose(-1, -2).contiguous()
                transposed = stored
            return LoraModule(
                name,
                _experts_kind(name, pname),
                sa,
                sb,
                transposed=transposed,
                interleaved=getattr(experts, "is_concatenated", True) is False,
                **common,
            )
        return LoraModule(name, LoraKind.LINEAR, a, b, **common)
    return LoraModule(f"{owner}.weight", LoraKind.LINEAR, a, b, **common)


def extract_peft_lora(model: nn.Module, adapter_name: str = "default") -> LoraAdapter:
    """Read adapter ``adapter_name`` from a live PEFT model (no copy: tensors are detached views of its weights).

    Per-module rank/alpha/scaling come from the layers themselves, so ``rank_pattern``/``alpha_pattern``, rsLoRA
    and the transformers-5 conversion (2r, 2α for fused experts) are already resolved. Clone the tensors if the
    trainer keeps stepping while you hold them.
    """
    param_names = {id(p): n for n, p in model.named_parameters()}
    modules: dict[str, LoraModule] = {}
    for path, layer in _peft_layers(model, adapter_name):
        sources = tuple(param_names.get(id(getattr(layer, f)[adapter_name].weight), "") for f in ("lora_A", "lora_B"))
        m = _layer_module(path, layer, adapter_name, sources)  # type: ignore[arg-type]
        modules[m.name] = m
    cfg = (getattr(model, "peft_config", None) or {}).get(adapter_name)
    return LoraAdapter(
        modules,
        r=int(_cfg_get(cfg, "r", max(m.rank for m in modules.values()))),
        lora_alpha=float(_cfg_get(cfg, "lora_alpha", 0.0) or 0.0),
        use_rslora=bool(_cfg_get(cfg, "use_rslora", False)),
        name=adapter_name,
    )


class PeftLoraReader:
    """The current A/B of chosen LoRA modules of a live PEFT model, without walking the model at every sync.

    Resolved once (the same walk and checks as :func:`extract_peft_lora`); a read then touches only the layers it
    holds. It is only valid while the model keeps these layers: hwsync re-plans (and builds a new reader) when the
    model's parameter set or active adapter changes."""

    def __init__(self, model: nn.Module, adapter_name: str, modules: Sequence[str]) -> None:
        layers = {}
        for path, layer in _peft_layers(model, adapter_name):
            m = _layer_module(path, layer, adapter_name)
            layers[m.name] = (path, layer)
        missing = [m for m in modules if m not in layers]
        if missing:
            raise AdapterFormatError(f"the trainer's adapter {adapter_name!r} has no LoRA module {missing[0]}")
        self.adapter_name = adapter_name
        self._layers = [(m, *layers[m]) for m in modules]
        self._folds: dict[torch.dtype | None, FoldBuffers] = {}

    def read(self, dtype: torch.dtype | None, fold: FoldFn | None = None) -> Iterable[Tensor]:
        """A and B (scaling folded, :meth:`LoraModule.folded`, in ``dtype``) of every module, in order: the kept fold
        buffers' views, or (another ``fold``) each module folded as it is consumed, so a reader that batches (the
        verify's comparison) never holds a folded copy of the whole adapter."""
        for name, _path, layer in self._layers:
            if self.adapter_name not in layer.lora_A:
                raise SyncError(f"the trainer's adapter lost module {name} since this sync was planned; sync again")
        mods = self._modules()
        plain = getattr(self, "_views", None) is mods
        if fold in (None, fold_scaling) and plain:  # plain parameters, vLLM's rounding order:
            folds = self._folds.get(dtype)  # buffers kept between reads
            if folds is None:
                folds = self._folds[dtype] = FoldBuffers(mods, dtype)
            return folds.read()
        return _each_folded(mods, dtype, fold or fold_scaling)  # the fold of now, whenever it is consumed

    def _modules(self) -> list[LoraModule]:
        """The modules as views of the trainer's LoRA parameters: read once where the parameters are plain tensors
        (an optimizer updates them in place, so the views stay current), at every read where they are sharded (the
        views are of the gathered tensors of this read)."""
        cached = getattr(self, "_views", None)
        if cached is not None:
            return cached
        mods = [_layer_module(path, layer, self.adapter_name) for _, path, layer in self._layers]
        from hwsync.common.gather import Sharding, param_kind

        if all(
            param_kind(layer.lora_A[self.adapter_name].weight) == Sharding.PLAIN
            and param_kind(layer.lora_B[self.adapter_name].weight) == Sharding.PLAIN
            for _, _, layer in self._layers
        ):
            self._views = mods
        return mods


def kept_buffer(t: Tensor) -> bool:
    """Whether ``t`` is one of the kept buffers of a :class:`FoldBuffers` in this process: rewritten in place with the
    adapter's folded values at every read of its plan and never used for anything else, so an engine colocated in
    this process may hold views of it instead of copies
    (:meth:`hwsync.engine.vllm.lora_slots.SlotWriter.materialize`): the adapter is then held once, not twice."""
    return foreign.held(t, "kept fold buffer") is True


class FoldBuffers:
    """:meth:`LoraModule.folded` of every module, the same bits as :func:`fold_scaling` (cast, then multiplied in the
    cast dtype): the casts in one batched copy instead of an allocation and a launch each. A factor already in
    ``dtype`` with nothing to fold is the parameter itself, as in :meth:`LoraModule.folded`. The buffers are kept from
    the first read on (one copy of the folded factors, held between syncs instead of allocated at each: the first
    sync needs that copy anyway), so their addresses hold still and the folds are recorded once as one graph where
    the device records graphs (:class:`hwsync.common.replay.Replay`), already launched as one by the second sync."""

    def __init__(self, modules: Sequence[LoraModule], dtype: torch.dtype | None) -> None:
        from hwsync.common.replay import Replay, common_device

        self._layout: list[Tensor | int] = []  # the parameter itself, or the index of its buffer
        self._srcs: list[Tensor] = []
        self._dtypes: list[torch.dtype] = []
        self._scaled: list[tuple[int, float]] = []
        for m in modules:
            dt = dtype or m.lora_B.dtype
            for t, scale in ((m.lora_A, 1.0), (m.lora_B, float(m.scaling))):
                if scale == 1 and t.dtype == dt:
                    self._layout.append(t)
                    continue
                if scale != 1:
                    self._scaled.append((len(self._srcs), scale))
                self._layout.append(len(self._srcs))
                self._srcs.append(t)
                self._dtypes.append(dt)
        self._device = common_device(self._srcs)
        self._kept: list[Tensor] | None = None
        self._key: tuple[Any, ...] = ()
        self._replay = Replay("the LoRA folds")

    def _fold(self, bufs: list[Tensor]) -> None:
        from hwsync.common.replay import copy_all

        copy_all(bufs, self._srcs)
        for i, scale in self._scaled:  # not _foreach_mul_: on CPU it rounds the scale to bf16 first
            bufs[i].mul_(scale)

    def read(self) -> list[Tensor]:
        """A, B of every module, as of now (kept buffers are rewritten: read them before the next read)."""
        from hwsync.common.replay import addresses

        bufs = self._kept
        if bufs is None:
            bufs = [torch.empty(s.shape, dtype=dt, device=s.device) for s, dt in zip(self._srcs, self._dtypes)]
            for b in bufs:
                foreign.state_of(b)["kept fold buffer"] = True  # views and detached aliases do not carry it
            self._kept, self._key = bufs, addresses(self._srcs + bufs)
        if bufs:
            with torch.no_grad():
                self._replay.run(self._key, self._device, lambda: self._fold(bufs))
        return [t if isinstance(t, Tensor) else bufs[t] for t in self._layout]


# ---------------------------------------------------------------------------------------------------------------
# from a saved PEFT state dict
# ---------------------------------------------------------------------------------------------------------------
_LORA_KEY = re.compile(r"^(?P<m>.+)\.(?P<ab>lora_A|lora_B)(?:\.(?P<adapter>[^.]+))?\.weight$")


def _split_lora_keys(state_dict: Mapping[str, Tensor], what: str) -> dict[str, dict[str, Tensor]]:
    pairs: dict[str, dict[str, Tensor]] = {}
    for key, t in state_dict.items():
        k = key[len(_PREFIX) :] if key.startswith(_PREFIX) else key
        m = _LORA_KEY.match(k)
        if m is None:
            hint = (
                "DoRA magnitude"
                if "lora_magnitude_vector" in k
                else "embedding LoRA"
                if "lora_embedding" in k
                else "non-LoRA"
            )
            raise AdapterFormatError(f"{what} key {key!r} is a {hint} tensor; {_FULL_HINT}")
        pairs.setdefault(m["m"], {})[m["ab"]] = t
    for mod, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise AdapterFormatError(f"{what}: module {mod!r} has {sorted(ab)} but needs both lora_A and lora_B")
    return pairs


def _unwrap(path: str) -> tuple[str, int]:
    depth = 0
    while path.endswith(".base_layer"):
        path, depth = path[: -len(".base_layer")], depth + 1
    return path, depth


def _assign_gate_up_down(levels: dict[int, dict[str, Tensor]], owner: str) -> dict[int, str]:
    """Which nesting level of a ParamWrapper pair is gate_up and which is down, from shapes alone.

    gate_up: A [·, H], B [2I, ·]; down: A [·, I], B [H, ·]. With two levels at most one assignment fits (both
    would need I == 2I), so no naming convention has to be trusted.
    """
    (d0, x), (d1, y) = sorted(levels.items())

    def fits(gu: dict[str, Tensor], dn: dict[str, Tensor]) -> bool:
        return gu["lora_A"].shape[1] == dn["lora_B"].shape[0] and gu["lora_B"].shape[0] == 2 * dn["lora_A"].shape[1]

    a, b = fits(y, x), fits(x, y)
    if a == b:
        raise AdapterFormatError(f"{owner}: cannot tell gate_up_proj from down_proj LoRA by shape")
    return {d1: "gate_up_proj", d0: "down_proj"} if a else {d0: "gate_up_proj", d1: "down_proj"}


def from_peft_state_dict(
    state_dict: Mapping[str, Tensor], peft_config: Any, *, adapter_name: str = "default"
) -> LoraAdapter:
    """Read a saved PEFT LoRA (``adapter_model.safetensors`` tensors + ``LoraConfig`` or its dict).

    Nested ParamWrappers are told apart by shape, so the gate_up/down nesting order needs no convention. Ranks and
    scalings follow PEFT's ``rank_pattern``/``alpha_pattern`` matching; experts are assumed stored [E, out, in].
    """
    _check_config(peft_config, adapter_name)
    r0 = int(_cfg_get(peft_config, "r", 8))
    alpha0 = float(_cfg_get(peft_config, "lora_alpha", 8))
    rslora = bool(_cfg_get(peft_config, "use_rslora", False))
    rp, ap = _cfg_get(peft_config, "rank_pattern", {}) or {}, _cfg_get(peft_config, "alpha_pattern", {}) or {}
    targets = list(_cfg_get(peft_config, "target_parameters", None) or [])

    def rank_alpha(key: str) -> tuple[int, float]:
        r = pattern_value(rp, key)
        a = pattern_value(ap, key)
        return int(r if r is not None else r0), float(a if a is not None else alpha0)

    def wrapped_leafs(owner: str) -> set[str]:
        # PEFT's target_parameters rule: "<module>.<param>" equals a target or ends with ".<target>"
        out = set()
        for t in targets:
            key = f"{owner}.{t.rpartition('.')[2]}"
            if key == t or key.endswith("." + t):
                out.add(t.rpartition(".")[2])
        return out

    tm = _cfg_get(peft_config, "target_modules", None)

    def is_target_module(key: str) -> bool:
        # PEFT's check_target_module_exists: a string is a full-match regex, a list matches dotted suffixes
        if isinstance(tm, str):
            return re.fullmatch(tm, key) is not None
        return any(key == t or key.endswith("." + t) for t in tm or ())

    pairs = _split_lora_keys(state_dict, "PEFT state dict")
    wrapped: dict[str, dict[int, dict[str, Tensor]]] = {}
    modules: dict[str, LoraModule] = {}
    for path, ab in pairs.items():
        owner, depth = _unwrap(path)
        if wrapped_leafs(owner) and (depth > 0 or not is_target_module(owner)):
            wrapped.setdefault(owner, {})[depth] = ab
            continue
        r, alpha = rank_alpha(owner)
        name = f"{owner}.weight"
        modules[name] = LoraModule(
            name, LoraKind.LINEAR, ab["lora_A"], ab["lora_B"], alpha, _scaling(r, alpha, rslora), rslora
        )

    for owner, levels in wrapped.items():
        leafs = sorted(wrapped_leafs(owner))
        if len(levels) == 2:
            assign = _assign_gate_up_down(levels, owner)
        elif len(levels) == 1 and len(leafs) == 1:
            assign = {next(iter(levels)): leafs[0]}
        else:
            raise AdapterFormatError(
                f"{owner}: {len(levels)} nested LoRA levels for target parameters {leafs}; cannot map them"
            )
        for depth, ab in levels.items():
            pname = assign[depth]
            name = f"{owner}.{pname}"
            r, alpha = rank_alpha(name)
            if ab["lora_A"].shape[0] % r:
                raise AdapterFormatError(f"{name}: lora_A rows {ab['lora_A'].shape[0]} are not a multiple of r={r}")
            sa, sb = _stack_param_wrapper(ab["lora_A"], ab["lora_B"], ab["lora_A"].shape[0] // r)
            modules[name] = LoraModule(
                name, _experts_kind(name, pname), sa, sb, alpha, _scaling(r, alpha, rslora), rslora
            )
    return LoraAdapter(modules, r=r0, lora_alpha=alpha0, use_rslora=rslora, name=adapter_name)


# ---------------------------------------------------------------------------------------------------------------
# per-expert 2-D LoRAs <-> stacked experts
# ---------------------------------------------------------------------------------------------------------------
def _group_experts(modules: dict[str, LoraModule]) -> dict[str, LoraModule]:
    """Fold per-expert 2-D LoRAs (``experts.{e}.{gate,up,down}_proj``) into stacked experts modules.

    gate and up become one gate_up LoRA: with a shared A (as 3-D adapters have) it is kept at rank r; otherwise
    ``A = [A_gate; A_up]`` and ``B = [[B_gate, 0], [0, B_up]]`` (rank r_gate + r_up), which has exactly the same
    ΔW. Differing scalings are folded into B as ratios to the gate's.
    """
    groups: dict[str, dict[str, dict[int, LoraModule]]] = {}
    out: dict[str, LoraModule] = {}
    for name, mod in modules.items():
        m = _PER_EXPERT.match(name) if mod.kind is LoraKind.LINEAR else None
        if m is None:
            out[name] = mod
            continue
        groups.setdefault(m["m"], {}).setdefault(_EXPERT_PROJ[m["p"]], {})[int(m["e"])] = mod
    for owner, projs in groups.items():
        n = 1 + max(max(d) for d in projs.values())
        for proj, per in projs.items():
            if sorted(per) != list(range(n)):
                missing = sorted(set(range(n)) - set(per))
                raise AdapterFormatError(f"{owner}: {proj} LoRA missing for experts {missing[:8]}")
            if len({x.rank for x in per.values()}) != 1:
                raise AdapterFormatError(f"{owner}: experts have different {proj} LoRA ranks")

        def stacked(proj: str) -> tuple[Tensor, Tensor, float, float, bool] | None:  # called in this iteration only
            per = projs.get(proj)  # noqa: B023
            if per is None:
                return None
            mods = [per[e] for e in range(n)]  # noqa: B023
            s = mods[0].scaling
            bs = [x.lora_B if x.scaling == s else (x.lora_B.float() * (x.scaling / s)).to(x.lora_B.dtype) for x in mods]
            return torch.stack([x.lora_A for x in mods]), torch.stack(bs), mods[0].alpha, s, mods[0].use_rslora

        dn = stacked("down")
        if dn is not None:
            name = f"{owner}.down_proj"
            out[name] = LoraModule(name, LoraKind.EXPERTS_DOWN, dn[0], dn[1], dn[2], dn[3], dn[4])
        g, u = stacked("gate"), stacked("up")
        if g is None and u is None:
            continue
        name = f"{owner}.gate_up_proj"
        if g is None or u is None:
            have = g if g is not None else u
            assert have is not None
            e, i, r = have[1].shape
            zeros = have[1].new_zeros(e, i, r)
            b = torch.cat([have[1], zeros] if g is not None else [zeros, have[1]], dim=1)
            out[name] = LoraModule(name, LoraKind.EXPERTS_GATE_UP, have[0], b, have[2], have[3], have[4])
            continue
        ga, gb, galpha, gs, grs = g
        ua, ub, _, us, _ = u
        if us != gs:
            ub = (ub.float() * (us / gs)).to(ub.dtype)
        if ga.shape == ua.shape and not ga.is_meta and torch.equal(ga, ua):  # shared A (3-D adapters): rank r
            out[name] = LoraModule(name, LoraKind.EXPERTS_GATE_UP, ga, torch.cat([gb, ub], dim=1), galpha, gs, grs)
            continue
        e, i, rg = gb.shape
        ru = ub.shape[2]
        b = gb.new_zeros(e, 2 * i, rg + ru)
        b[:, :i, :rg] = gb
        b[:, i:, rg:] = ub
        r = rg + ru
        alpha = gs * (math.sqrt(r) if grs else r)  # keep scaling == alpha/r (or alpha/sqrt r) at the new rank
        out[name] = LoraModule(name, LoraKind.EXPERTS_GATE_UP, torch.cat([ga, ua], dim=1), b, alpha, gs, grs)
    return out


# ---------------------------------------------------------------------------------------------------------------
# to / from vLLM
# ---------------------------------------------------------------------------------------------------------------
def _rank_patterns(ranks: Mapping[str, int], r: int) -> dict[str, int]:
    """Compact ``rank_pattern`` for modules whose rank differs from ``r`` (layer/expert indices generalised)."""
    generic: dict[str, set[int]] = {}
    members: dict[str, list[str]] = {}
    for name, rank in ranks.items():
        if rank == r:
            continue
        g = re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(name))
        generic.setdefault(g, set()).add(rank)
        members.setdefault(g, []).append(name)
    # a generalised key is safe only if it matches no module of a different rank
    out: dict[str, int] = {}
    for g, rs in generic.items():
        clash = any(rank != next(iter(rs)) and re.match(rf"(.*\.)?({g})$", n) for n, rank in ranks.items())
        if len(rs) == 1 and not clash:
            out[g] = next(iter(rs))
        else:
            out.update({re.escape(n): ranks[n] for n in members[g]})
    return out


def to_vllm_lora(
    adapter: LoraAdapter,
    *,
    layout: LoraLayout | str | None = None,
    packed_modules_mapping: Mapping[str, Sequence[str]] | None = None,
    dtype: torch.dtype | None = None,
    copy: bool = True,
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Tensors with the keys vLLM's ``LoRAModel.from_lora_tensors`` / ``from_local_checkpoint`` expect + config.

    ``layout`` (:class:`hwsync.common.lora_layout.LoraLayout`, or its expert format ``"2d"`` / ``"3d"``; default
    per expert) is how the engine holds LoRA: ``"2d"`` writes per-expert keys (``FusedMoEWithLoRA``, e.g.
    Qwen3-MoE) named by its ``expert_names``; ``"3d"`` writes PEFT's ParamWrapper keys (``FusedMoE3DWithLoRA``; a
    2-D model loads them only with ``enable_mixed_moe_lora_format`` and ``is_3d_lora_weight=True``); its row orders
    reorder the B of the modules the engine's loader reorders. ``packed_modules_mapping`` (the vLLM model's) rejects
    LoRA on a packed owner (e.g. ``qkv_proj``), which vLLM would not split. With ``copy`` every tensor is a new
    contiguous buffer (``safetensors``-safe); without, tensors are views where the layout allows (in-memory
    hand-over: per-expert slices cost nothing).
    """
    layout = LoraLayout.of(layout)
    owners = set(packed_modules_mapping or {})
    mods = _group_experts(adapter.modules) if layout.stacked else adapter.modules
    tensors: dict[str, Tensor] = {}
    ranks: dict[str, int] = {}
    leaves: set[str] = set()
    targets: set[str] = set()
    gate_n, up_n, down_n = layout.expert_names

    def put(module: str, a: Tensor, b: Tensor, pattern_name: str | None = None, rank: int | None = None) -> None:
        rows = layout.rows_of(module)
        if rows is not None and not b.is_meta:  # a new tensor already: no clone needed
            b = b.index_select(0, rows.to(b.device))
        elif copy:
            b = b.clone(memory_format=torch.contiguous_format)
        tensors[f"{_PREFIX}{module}.lora_A.weight"] = a.clone(memory_format=torch.contiguous_format) if copy else a
        tensors[f"{_PREFIX}{module}.lora_B.weight"] = b
        ranks[pattern_name or module] = int(a.shape[0]) if rank is None else rank

    for name, mod in mods.items():
        if mod.kind is LoraKind.EXPERTS_OTHER:
            raise AdapterFormatError(
                f"{experts_unservable_reason(name, name.rsplit('.', 1)[-1])}. {_FULL_HINT} "
                '(or strategy="hybrid": those experts travel merged)'
            )
        f = mod.folded(dtype)
        if f.kind is LoraKind.LINEAR:
            if not name.endswith(".weight"):
                raise AdapterFormatError(f"{name}: LoRA on a non-weight parameter cannot be expressed for vLLM")
            module = name[: -len(".weight")]
            leaf = module.rsplit(".", 1)[-1]
            if leaf in owners:
                raise AdapterFormatError(
                    f"{module}: LoRA on packed module {leaf!r}; vLLM expects LoRA on its parts "
                    f"{list(packed_modules_mapping[leaf])}"  # type: ignore[index]
                )
            put(module, f.lora_A, f.lora_B)
            leaves.add(leaf)
            continue
        why = layout.refusal(name, f.interleaved)
        if why is not None:
            raise AdapterFormatError(why)
        owner = f.module
        e = f.num_experts
        if layout.stacked:
            a = f.lora_A.reshape(e * f.rank, -1)  # expert-major rows
            b = f.lora_B.permute(1, 2, 0).reshape(f.lora_B.shape[1], f.rank * e)  # column k·E + e
            if f.kind is LoraKind.EXPERTS_GATE_UP:
                put(f"{owner}.base_layer", a, b, f"{owner}.gate_up_proj", f.rank)
            else:
                put(owner, a, b, f"{owner}.down_proj", f.rank)
            targets.add(".".join(name.split(".")[-3:]))
            continue
        if f.kind is LoraKind.EXPERTS_DOWN:
            for x in range(e):
                put(f"{owner}.{x}.{down_n}", f.lora_A[x], f.lora_B[x])
            leaves.add(down_n)
            continue
        i = f.lora_B.shape[1] // 2
        for x in range(e):
            put(f"{owner}.{x}.{gate_n}", f.lora_A[x], f.lora_B[x, :i])
            put(f"{owner}.{x}.{up_n}", f.lora_A[x], f.lora_B[x, i:])
        leaves.update((gate_n, up_n))

    r = max(ranks.values())
    patterns = _rank_patterns(ranks, r)
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": r,
        "use_rslora": False,
        "use_dora": False,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "target_modules": sorted(leaves),
        "rank_pattern": dict(patterns),
        "alpha_pattern": {k: float(v) for k, v in patterns.items()},
    }
    if targets:
        config["target_parameters"] = sorted(targets)
    return tensors, config


def lora_paths(tensors: Mapping[str, Tensor]) -> list[str]:
    """The LoRA module paths (``base_model.model.`` kept) of adapter tensors in vLLM's format (:func:`to_vllm_lora`):
    what the trainer asks the engine about and what the engine checks it serves."""
    return sorted({k[: -len(".lora_A.weight")] for k in tensors if k.endswith(".lora_A.weight")})


def from_vllm_lora(
    tensors: Mapping[str, Tensor], config: Mapping[str, Any] | Any, *, num_experts: int | None = None
) -> LoraAdapter:
    """Inverse of :func:`to_vllm_lora` for any adapter vLLM can load (2-D or 3-D MoE keys, dense keys).

    Scalings follow vLLM's ``PEFTHelper.get_rank_and_scaling`` (patterns matched on names without
    ``base_model.model.``; 3-D experts matched as ``experts.gate_up_proj`` / ``experts.down_proj``). Per-expert keys
    are regrouped into stacked experts modules. ``num_experts`` is needed for 3-D keys only when the config's rank
    does not say it.
    """
    _check_config(config, "vllm")
    r0 = int(_cfg_get(config, "r"))
    alpha0 = float(_cfg_get(config, "lora_alpha"))
    rslora = bool(_cfg_get(config, "use_rslora", False))
    rp, ap = _cfg_get(config, "rank_pattern", {}) or {}, _cfg_get(config, "alpha_pattern", {}) or {}

    def rank_scale(key: str) -> tuple[int, float, float]:
        r = pattern_value(rp, key)
        a = pattern_value(ap, key)
        r = int(r if r is not None else r0)
        a = float(a if a is not None else alpha0)
        return r, a, _scaling(r, a, rslora)

    modules: dict[str, LoraModule] = {}
    for path, ab in _split_lora_keys(tensors, "vLLM LoRA").items():
        a, b = ab["lora_A"], ab["lora_B"]
        if path.endswith(".experts.base_layer") or path.endswith(".experts"):
            owner = path[: -len(".base_layer")] if path.endswith(".base_layer") else path
            pname = "gate_up_proj" if path.endswith(".base_layer") else "down_proj"
            name = f"{owner}.{pname}"
            r, alpha, s = rank_scale(name)
            e = num_experts if num_experts is not None else a.shape[0] // r
            if e * r != a.shape[0] and num_experts is None:
                raise AdapterFormatError(f"{name}: lora_A rows {a.shape[0]} not a multiple of r={r}; pass num_experts")
            sa, sb = _stack_param_wrapper(a, b, e)
            modules[name] = LoraModule(name, _experts_kind(name, pname), sa, sb, alpha, s, rslora)
            continue
        _, alpha, s = rank_scale(path)
        name = f"{path}.weight"
        modules[name] = LoraModule(name, LoraKind.LINEAR, a, b, alpha, s, rslora)
    return LoraAdapter(_group_experts(modules), r=r0, lora_alpha=alpha0, use_rslora=rslora, name="vllm")


# ---------------------------------------------------------------------------------------------------------------
# over the wire: the trainer's modules as they are, converted to vLLM's keys by the receiver
# ---------------------------------------------------------------------------------------------------------------
WIRE_FORMAT = "hwsync-lora/1"


def wire_name(module: str, factor: str) -> str:
    """The manifest name of one factor (``"A"``/``"B"``) of a trainer LoRA module."""
    return f"{module}#{factor}"


def to_wire(
    adapter: LoraAdapter, dtype: torch.dtype | None = None, values: bool = True
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The adapter as one A and one B tensor per trainer module (experts stay stacked: a few tensors per layer,
    not thousands), scaling folded into B; plus the metadata :func:`from_wire` needs. The receiver converts to the
    format its engine serves (:func:`to_vllm_lora`), so the trainer does not depend on the engine's MoE format.
    ``values=False``: the same tensors on ``meta`` (shapes and dtypes only: a plan describes what travels without
    holding a folded copy of the adapter; the values are read at every sync)."""
    tensors: dict[str, Tensor] = {}
    modules: dict[str, list[Any]] = {}
    for name, mod in adapter.modules.items():
        if values:
            f = mod.folded(dtype)
            a, b = f.lora_A, f.lora_B
        else:
            f, dt = mod, dtype or mod.lora_B.dtype
            a, b = (torch.empty(t.shape, dtype=dt, device="meta") for t in (mod.lora_A, mod.lora_B))
        tensors[wire_name(name, "A")] = a
        tensors[wire_name(name, "B")] = b
        modules[name] = [f.kind.value, bool(f.transposed), bool(f.interleaved)]
    return tensors, {"format": WIRE_FORMAT, "name": adapter.name, "r": adapter.r, "modules": modules}


def from_wire(tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> LoraAdapter:
    """Inverse of :func:`to_wire` (tensors as they arrived; scaling 1, since :func:`to_wire` folded it)."""
    if meta.get("format") != WIRE_FORMAT or not isinstance(meta.get("modules"), Mapping):
        raise AdapterFormatError(f"adapter metadata is not {WIRE_FORMAT}; sender and receiver hwsync differ?")
    modules: dict[str, LoraModule] = {}
    for name, spec in meta["modules"].items():
        try:
            kind, transposed, interleaved = LoraKind(spec[0]), bool(spec[1]), bool(spec[2]) if len(spec) > 2 else False
            a, b = tensors[wire_name(name, "A")], tensors[wire_name(name, "B")]
        except (KeyError, ValueError, TypeError, IndexError) as e:
            raise AdapterFormatError(f"adapter module {name!r} is incomplete or malformed ({e})") from None
        rank = int(a.shape[-2]) if a.dim() >= 2 else 0
        modules[name] = LoraModule(name, kind, a, b, float(rank), 1.0, False, transposed, interleaved)
    if not modules:
        raise AdapterFormatError("adapter carries no LoRA modules")
    r = max(m.rank for m in modules.values())
    return LoraAdapter(modules, r=r, lora_alpha=float(r), use_rslora=False, name=str(meta.get("name", "default")))


def _each_folded(mods: Sequence[LoraModule], dtype: torch.dtype | None, fold: FoldFn) -> Iterator[Tensor]:
    for m in mods:
        f = m.folded(dtype, fold)
        yield f.lora_A
        yield f.lora_B
