"""Which strategy a sync uses: ordered rules, first match wins.

Each rule looks at the requested :class:`~hwsync.common.wire.Strategy`, the trainer's LoRA (as the engine would serve
it) and the engine's :class:`~hwsync.common.wire.EngineInfo`, and either decides (a :class:`Choice` with the reason the
report prints), refuses an explicit request that cannot work (an error naming the fix), or passes. ``auto`` never
refuses: it falls back to ``full``, which every engine serves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hwsync.common.errors import AdapterFormatError
from hwsync.common.wire import EngineInfo, Strategy

__all__ = ["Choice", "LoraFacts", "choose", "RULES"]


class LoraFacts(Protocol):
    """What the rules read of the trainer's adapter (`hwsync.trainer.payload.TrainerLora` has it)."""

    @property
    def max_rank(self) -> int: ...

    @property
    def by_module(self) -> Mapping[str, list[str]]:
        """Trainer LoRA parameter name -> the vLLM LoRA module paths it becomes."""

    @property
    def not_lora(self) -> Mapping[str, str]:
        """Trainer LoRA modules no vLLM engine serves as LoRA (-> why)."""


@dataclass(frozen=True)
class Choice:
    strategy: Strategy
    reason: str
    unservable: tuple[str, ...] = field(default=())
    """Trainer LoRA modules the engine cannot serve as LoRA (``hybrid`` sends them merged)."""


Rule = Callable[[Strategy, "LoraFacts | AdapterFormatError | None", EngineInfo], "Choice | None"]


def _full_requested(req: Strategy, lora: LoraFacts | AdapterFormatError | None, info: EngineInfo) -> Choice | None:
    return Choice(Strategy.FULL, "requested") if req is Strategy.FULL else None


def _no_adapter(req: Strategy, lora: LoraFacts | AdapterFormatError | None, info: EngineInfo) -> Choice | None:
    if lora is not None:
        return None
    if req is not Strategy.AUTO:
        raise AdapterFormatError(
            f'strategy="{req.value}" needs a PEFT LoRA model; this model has no adapter. Use strategy="full"'
        )
    return Choice(Strategy.FULL, "model has no LoRA adapter")


def _not_servable_as_lora(
    req: Strategy, lora: LoraFacts | AdapterFormatError | None, info: EngineInfo
) -> Choice | None:
    if not isinstance(lora, AdapterFormatError):
        return None
    if req is not Strategy.AUTO:
        raise lora
    return Choice(Strategy.FULL, f"adapter cannot be served as LoRA ({lora})")


def _engine_without_lora(req: Strategy, lora: LoraFacts | AdapterFormatError | None, info: EngineInfo) -> Choice | None:
    if info.lora_enabled:
        return None
    why = info.lora_reason or "the engine was started without enable_lora"
    if req is not Strategy.AUTO:
        rank = getattr(lora, "max_rank", "r")
        raise AdapterFormatError(
            f'strategy="{req.value}": {why}. Start vLLM with enable_lora=True '
            f'(max_lora_rank>={rank}) or use strategy="full"'
        )
    return Choice(Strategy.FULL, why)


def _rank_too_large(req: Strategy, lora: LoraFacts | AdapterFormatError | None, info: EngineInfo) -> Choice | None:
    assert lora is not None and not isinstance(lora, AdapterFormatError)
    if info.max_lora_rank is None or lora.max_rank <= info.max_lora_rank:
        return None
    why = f"adapter rank {lora.max_rank} > engine max_lora_rank {info.max_lora_rank}"
    if req is not Strategy.AUTO:
        raise AdapterFormatError(f'{why}: restart vLLM with a larger max_lora_rank or use strategy="full"')
    return Choice(Strategy.FULL, why)


def _unservable(lora: LoraFacts, info: EngineInfo) -> tuple[list[str], str]:
    """Trainer LoRA modules not served as LoRA (the engine says so for their vLLM paths, or no vLLM serves them:
    :attr:`LoraFacts.not_lora`) and why."""
    not_lora = lora.not_lora
    modules = [m for m, paths in lora.by_module.items() if m in not_lora or any(p in info.unservable for p in paths)]
    reasons = {info.unservable[p] for m in modules for p in lora.by_module[m] if p in info.unservable}
    reasons.update(not_lora[m] for m in modules if m in not_lora)
    return modules, "; ".join(sorted(reasons))


def _all_servable(req: Strategy, lora: LoraFacts | AdapterFormatError | None, info: EngineInfo) -> Choice | None:
    assert lora is not None and not isinstance(lora, AdapterFormatError)
    if _unservable(lora, info)[0]:
        return None
    if req is Strategy.HYBRID:
        return Choice(
            Strategy.HYBRID, "requested (the engine serves LoRA on every adapted module: same bytes as adapter)"
        )
    return Choice(
        Strategy.ADAPTER, "engine serves LoRA on every adapted module" if req is Strategy.AUTO else "requested"
    )


def _some_unservable(req: Strategy, lora: LoraFacts | AdapterFormatError | None, info: EngineInfo) -> Choice | None:
    assert lora is not None and not isinstance(lora, AdapterFormatError)
    modules, why_not = _unservable(lora, info)
    if req is Strategy.ADAPTER:
        raise AdapterFormatError(
            f"the engine serves no LoRA on {len(modules)} adapted module(s), e.g. {modules[0]} ({why_not}); "
            'use strategy="hybrid" (LoRA where served, merged weights for the rest) or "full"'
        )
    if len(modules) == len(lora.by_module):
        if req is Strategy.HYBRID:
            return Choice(Strategy.HYBRID, f"requested; no adapted module is LoRA-servable ({why_not})", tuple(modules))
        return Choice(Strategy.FULL, f"engine serves LoRA on none of the adapted modules ({why_not})")
    kinds = sorted({"experts" if ".experts" in m else m.rsplit(".", 2)[-2] for m in modules})
    why = f"engine serves no LoRA on {', '.join(kinds)} ({why_not}): those travel merged"
    return Choice(Strategy.HYBRID, why if req is Strategy.AUTO else f"requested; {why}", tuple(modules))


RULES: Sequence[Rule] = (
    _full_requested,
    _no_adapter,
    _not_servable_as_lora,
    _engine_without_lora,
    _rank_too_large,
    _all_servable,
    _some_unservable,
)
"""In order; the last rule always decides."""


def choose(requested: Strategy | str, lora: LoraFacts | AdapterFormatError | None, info: EngineInfo) -> Choice:
    """The strategy for this sync and why; refuses an explicit request the engine or the model cannot serve."""
    req = Strategy.parse(requested)
    for rule in RULES:
        choice = rule(req, lora, info)
        if choice is not None:
            return choice
    raise AssertionError("the last strategy rule always decides")  # pragma: no cover
