"""PEFT on transformers >= 5: keep a regex ``target_modules`` intact when MoE experts become fused parameters.

transformers 5 fuses Qwen2/3-MoE experts into ``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj``
[E, H, I] and replaces the router ``nn.Linear`` by a custom module. PEFT converts a v4-style LoRA config in
``peft.utils.transformers_weight_conversion.convert_peft_config_for_transformers`` (looked up from
``BaseTuner.inject_adapter`` at call time): targets become ``target_parameters`` and the fused gate/up gets
rank 2r / alpha 2α. For a *regex* ``target_modules`` PEFT 0.20 reduces the regex to the leaf names it happens to
match, which

* widens it: ``model\\.layers\\.0\\.self_attn\\.q_proj`` becomes ``{"q_proj"}`` = every layer's q_proj;
* drops experts: the old per-expert names (``...experts.{e}.gate_proj``) are probed without the expert index,
  so ``.*\\.experts\\.\\d+\\.(gate|up|down)_proj`` matches nothing -- silently when the regex also names attention
  modules, with "Target modules ... not found" when it names only experts.

The replacement keeps the regex as it is for real modules and matches it (compiled once) against the old
per-expert names ``<experts>.{e}.{gate,up,down}_proj`` and the old router ``nn.Linear`` to decide which fused
parameters to add, layer by layer; a router the regex names is added as ``gate.weight`` and excluded by name
(``exclude_modules``) since PEFT cannot wrap the v5 module. Which projections are fused is read from
transformers' own weight-conversion mapping, so families PEFT's converter does not know are covered too: for
Qwen3.5-MoE (``qwen3_5_moe_text``) PEFT 0.20 converts nothing, and even ``["gate_proj", "up_proj", "down_proj"]``
silently adapts only the shared expert -- there lists and ``all-linear`` take the same path. Elsewhere
``all-linear``, lists and regexes that do not compile go to PEFT's original converter. Whichever converter ran,
every fused target and its (doubled) rank / alpha is recorded on the config under :data:`MARKER` -- read it with
:func:`fused_moe_targets` -- so the sync engine never has to guess that a gate_up LoRA of rank 2r is two rank-r
branches.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from hwsync.common import foreign
from hwsync.common.errors import AdapterFormatError

from ._base import APPLIES, NOT_NEEDED, Patch, ProbeResult, register

__all__ = ["MARKER", "FusedMoeTarget", "PeftMoeRegexPatch", "fused_moe_targets"]

MARKER = "fused moe targets"
"""The name of the record in hwsync's state about the PEFT config (:func:`hwsync.common.foreign.state_of`)."""
INCLUDE_LINEAR_LAYERS_SHORTHAND = "all-linear"  # PEFT's spelling
_PROBE_REGEX = r"model\.layers\.0\.self_attn\.q_proj|.*\.experts\.\d+\.(gate_proj|up_proj|down_proj)"


@dataclass(frozen=True)
class FusedMoeTarget:
    """One fused MoE parameter that a LoRA config targets after the v4 -> v5 conversion.

    ``pattern`` is the key used in ``rank_pattern`` / ``alpha_pattern`` (a regex, PEFT's convention);
    ``parameter`` the fused parameter (a leaf name like ``gate_up_proj`` when every layer is targeted, else a
    full path); ``fused_from`` the v4 projections folded into it, in order. ``rank`` / ``alpha`` are the fused
    values: each branch has rank ``rank // len(fused_from)`` and the scale ``alpha / rank`` is unchanged.
    """

    pattern: str
    parameter: str
    fused_from: tuple[str, ...]
    rank: int
    alpha: float

    @property
    def factor(self) -> int:
        return len(self.fused_from)


def fused_moe_targets(peft_config: Any) -> list[FusedMoeTarget]:
    """The fused MoE targets recorded on ``peft_config`` by this patch (empty when none / not converted)."""
    recorded = foreign.held(peft_config, MARKER, ())
    return [FusedMoeTarget(**{**m, "fused_from": tuple(m["fused_from"])}) for m in recorded]


def _record(peft_config: Any, targets: list[FusedMoeTarget]) -> None:
    if targets:
        foreign.state_of(peft_config)[MARKER] = [asdict(t) for t in targets]


# ---------------------------------------------------------------------------------------------------------------------
# the conversion
# ---------------------------------------------------------------------------------------------------------------------
_EXPERT_SOURCE = re.compile(r"experts\.\*\.(\w+)\.weight$")  # transformers' pattern for a per-expert v4 weight
_EXPERT_TARGET = re.compile(r"experts\.(\w+)$")  # ... and for the fused v5 parameter
_ROUTER = "gate"  # the v4 router nn.Linear leaf; on v5 a custom module whose `weight` PEFT targets as a parameter


@dataclass(frozen=True)
class _Tables:
    new_to_old: dict[str, tuple[str, ...]]  # fused expert parameter -> the v4 projections, in fusion order
    peft_converts: bool  # PEFT's own converter knows this model family


def _tables(peft_config: Any, model: Any) -> _Tables | None:
    """Which v4 expert projections transformers fuses for this model (read from transformers' own weight
    conversion mapping), or None when nothing is fused (the original converter does nothing either)."""
    from peft import PeftType
    from peft.utils import transformers_weight_conversion as twc

    if getattr(peft_config, "peft_type", None) != PeftType.LORA:
        return None
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    conversions = twc.get_checkpoint_conversion_mapping(model_type) if model_type else None
    if not conversions:
        return None
    new_to_old: dict[str, tuple[str, ...]] = {}
    for conversion in conversions:
        sources = list(getattr(conversion, "source_patterns", None) or ())
        targets = list(getattr(conversion, "target_patterns", None) or ())
        olds = [m.group(1) for m in map(_EXPERT_SOURCE.search, sources) if m]
        news = [m.group(1) for m in map(_EXPERT_TARGET.search, targets) if m]
        if olds and len(olds) == len(sources) and len(news) == 1:
            new_to_old[news[0]] = tuple(olds)
    if not new_to_old:
        return None
    base = getattr(twc, "_MODEL_TO_CONVERSION_PATTERN", {}).get(model_type)
    return _Tables(new_to_old, bool(getattr(twc, "_MOE_TARGET_MODULE_MAPPING", {}).get(base)))


def _regex_hit(peft_config: Any, pattern: re.Pattern[str]) -> Callable[[str], bool]:
    """PEFT's semantics for a regex ``target_modules`` (fullmatch, minus ``exclude_modules``), compiled once."""
    spec = getattr(peft_config, "exclude_modules", None)
    if not spec:
        excluded: Callable[[str], bool] = lambda key: False  # noqa: E731
    elif isinstance(spec, str):
        ex = re.compile(spec)
        excluded = lambda key: ex.fullmatch(key) is not None  # noqa: E731
    else:
        names = tuple(spec)
        excluded = lambda key: key in names or any(key.endswith(f".{n}") for n in names)  # noqa: E731
    return lambda key: pattern.fullmatch(key) is not None and not excluded(key)


def _list_hit(peft_config: Any) -> Callable[[str], bool]:
    """PEFT's own semantics for a list ``target_modules`` (suffixes, layers_to_transform, exclusions)."""
    from peft.tuners.tuners_utils import check_target_module_exists

    return lambda key: bool(check_target_module_exists(peft_config, key))


def _pattern_lookup(patterns: Mapping[str, Any] | None, default: Any) -> Callable[[str], Any]:
    """PEFT's ``get_pattern_key`` semantics (first key matching ``(.*\\.)?(key)$``), compiled once."""
    compiled = [(re.compile(rf"(.*\.)?({key})$"), value) for key, value in (patterns or {}).items()]

    def lookup(name: str) -> Any:
        for rx, value in compiled:
            if rx.match(name):
                return value
        return default

    return lookup


def _convert(peft_config: Any, model: Any, tables: _Tables, hit: Callable[[str], bool], what: str) -> None:
    """Add the fused parameters whose v4 per-expert names ``hit`` matches; leave ``target_modules`` as it is."""
    from torch import nn

    rank_of = _pattern_lookup(peft_config.rank_pattern, peft_config.r)
    alpha_of = _pattern_lookup(peft_config.alpha_pattern, peft_config.lora_alpha)
    # fused name -> {full parameter path: (rank, alpha)}, and every such parameter of the model
    chosen: dict[str, dict[str, tuple[int, float]]] = {}
    present: dict[str, set[str]] = {}
    origins: dict[str, tuple[str, ...]] = dict(tables.new_to_old)
    routers: list[str] = []  # router modules the targets name: no longer LoRA-able modules on v5

    for mname, module in model.named_modules():
        direct = {k: p for k, p in module._parameters.items() if p is not None}
        for new in tables.new_to_old.keys() & direct.keys():
            param = direct[new]
            if param.dim() != 3:
                continue
            path = f"{mname}.{new}"
            present.setdefault(new, set()).add(path)
            olds = tables.new_to_old[new]
            experts = range(param.shape[0])
            hits = {old: [e for e in experts if hit(f"{mname}.{e}.{old}")] for old in olds}
            if not any(hits.values()):
                continue
            partial = {old: h for old, h in hits.items() if len(h) != len(experts)}
            if partial:
                detail = ", ".join(f"{old}: experts {h}" for old, h in partial.items())
                raise AdapterFormatError(
                    f"target_modules {what} match only some of {mname}'s {len(experts)} experts ({detail}); "
                    f"transformers >= 5 fuses {' and '.join(olds)} of all experts into {path}, which takes one LoRA. "
                    "Target every expert of those projections or none."
                )
            keys = [f"{mname}.{e}.{old}" for old in olds for e in experts]
            ranks, alphas = {rank_of(k) for k in keys}, {alpha_of(k) for k in keys}
            if len(ranks) > 1 or len(alphas) > 1:
                raise AdapterFormatError(
                    f"rank_pattern/alpha_pattern give {mname}'s experts different ranks {sorted(ranks)} / alphas "
                    f"{sorted(alphas)}; the fused {path} takes one rank and one alpha: make them uniform"
                )
            chosen.setdefault(new, {})[path] = (ranks.pop() * len(olds), alphas.pop() * len(olds))
        if (mname == _ROUTER or mname.endswith(f".{_ROUTER}")) and not isinstance(module, nn.Linear):
            weight = direct.get("weight")
            if weight is None or weight.dim() != 2:
                continue
            new = f"{_ROUTER}.weight"
            origins[new] = (_ROUTER,)
            present.setdefault(new, set()).add(f"{mname}.weight")
            if hit(mname):
                chosen.setdefault(new, {})[f"{mname}.weight"] = (rank_of(mname), alpha_of(mname))
                routers.append(mname)

    targets: list[FusedMoeTarget] = []
    for new, paths in chosen.items():
        values = set(paths.values())
        if paths.keys() == present[new] and len(values) == 1:
            rank, alpha = values.pop()  # every layer alike: the compact form PEFT itself writes
            targets.append(FusedMoeTarget(rf".*\.{re.escape(new)}", new, origins[new], rank, alpha))
        else:
            targets += [
                FusedMoeTarget(re.escape(path), path, origins[new], rank, alpha)
                for path, (rank, alpha) in paths.items()
            ]
    if not targets:
        return  # nothing fused is named: on v5 the targets apply to real modules exactly as written

    peft_config.target_parameters = sorted(set(peft_config.target_parameters or ()) | {t.parameter for t in targets})
    ours_r = {t.pattern: t.rank for t in targets if t.rank != peft_config.r or t.factor > 1}
    ours_a = {t.pattern: t.alpha for t in targets if t.alpha != peft_config.lora_alpha or t.factor > 1}
    # ours first: PEFT takes the first matching key, and a user key such as ".*" must not undo the fusion
    peft_config.rank_pattern = {
        **ours_r,
        **{k: v for k, v in (peft_config.rank_pattern or {}).items() if k not in ours_r},
    }
    peft_config.alpha_pattern = {
        **ours_a,
        **{k: v for k, v in (peft_config.alpha_pattern or {}).items() if k not in ours_a},
    }
    if routers:
        # the targets still name the router modules, which PEFT cannot wrap on v5: exclude exactly those
        ex = peft_config.exclude_modules
        if isinstance(ex, str):
            alts = "|".join(re.escape(r) for r in routers)
            peft_config.exclude_modules = f"(?:{ex})|(?:{alts})"
        else:
            peft_config.exclude_modules = sorted(set(ex or ()) | set(routers))
    _record(peft_config, targets)


def _record_original(peft_config: Any, tables: _Tables | None) -> None:
    """After PEFT's own converter: record the fused targets (and the doubled rank/alpha) it created."""
    if tables is None:
        return
    rank_of = _pattern_lookup(peft_config.rank_pattern, peft_config.r)
    alpha_of = _pattern_lookup(peft_config.alpha_pattern, peft_config.lora_alpha)
    params = set(getattr(peft_config, "target_parameters", None) or ())
    origins = {**tables.new_to_old, f"{_ROUTER}.weight": (_ROUTER,)}
    targets = [
        FusedMoeTarget(rf".*\.{re.escape(new)}", new, olds, int(rank_of(f"_.{new}")), alpha_of(f"_.{new}"))
        for new, olds in origins.items()
        if new in params
    ]
    _record(peft_config, targets)


class PeftMoeRegexPatch(Patch):
    name = "peft_moe_regex"
    targets = ("peft.utils.transformers_weight_conversion:convert_peft_config_for_transformers",)
    upstream = "https://github.com/huggingface/peft/blob/v0.20.0/src/peft/utils/transformers_weight_conversion.py"
    seen_in = ("peft 0.20.0 + transformers 5.19",)
    remove_when = (
        "PEFT keeps a regex target_modules as written and matches it against per-expert v4 names, "
        "and records fused rank doubling"
    )

    def check(self) -> ProbeResult:
        import torch
        from peft import LoraConfig
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        small: dict[str, Any] = dict(
            vocab_size=32,
            hidden_size=32,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=1,
            num_key_value_heads=1,
            head_dim=32,
            num_experts=2,
            num_experts_per_tok=1,
        )
        with torch.device("meta"):
            model: Any = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=32, **small))
        config = LoraConfig(r=2, lora_alpha=4, target_modules=_PROBE_REGEX)
        problems = []
        try:
            self.original()(config, model=model, conversions=None)
        except ValueError as e:
            problems.append(f"raises on a per-expert regex ({e})")
        else:
            tm = config.target_modules
            if not isinstance(tm, str) or re.fullmatch(tm, "model.layers.1.self_attn.q_proj") is not None:
                problems.append(f"widens a layer-scoped regex to every layer (target_modules -> {tm!r})")
            if not {"gate_up_proj", "down_proj"} <= {p.rsplit(".", 1)[-1] for p in config.target_parameters or ()}:
                problems.append("drops the experts a regex names")
        try:
            from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
        except ImportError:  # transformers < 5.2: no Qwen3.5
            pass
        else:
            with torch.device("meta"):
                model = Qwen3_5MoeForCausalLM(
                    Qwen3_5MoeTextConfig(
                        shared_expert_intermediate_size=32, layer_types=["full_attention"] * 2, **small
                    )
                )
            config = LoraConfig(r=2, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"])
            self.original()(config, model=model, conversions=None)
            if "gate_up_proj" not in (config.target_parameters or ()):
                problems.append("converts nothing for qwen3_5_moe_text (its experts get no LoRA)")
        if problems:
            return ProbeResult(APPLIES, "the converter " + "; ".join(problems))
        return ProbeResult(NOT_NEEDED, "the converter keeps regexes, adds fused expert parameters, knows Qwen3.5-MoE")

    def replacement(self, original: Any, target: str) -> Any:
        @functools.wraps(original)
        def convert_peft_config_for_transformers(peft_config: Any, model: Any, conversions: Any = None) -> None:
            tables = _tables(peft_config, model)
            tm = getattr(peft_config, "target_modules", None)
            if tables is not None:
                if isinstance(tm, str) and tm.lower() != INCLUDE_LINEAR_LAYERS_SHORTHAND:
                    try:
                        pattern = re.compile(tm)
                    except re.error:
                        pattern = None
                    if pattern is not None:
                        return _convert(peft_config, model, tables, _regex_hit(peft_config, pattern), "regex")
                elif not tables.peft_converts and tm:
                    # a family PEFT does not convert at all (e.g. qwen3_5_moe_text): lists and all-linear too
                    hit = (lambda key: True) if isinstance(tm, str) else _list_hit(peft_config)
                    return _convert(peft_config, model, tables, hit, repr(tm))
            result = original(peft_config, model=model, conversions=conversions)
            _record_original(peft_config, tables)
            return result

        return convert_peft_config_for_transformers


register(PeftMoeRegexPatch())
