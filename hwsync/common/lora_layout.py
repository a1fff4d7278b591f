"""How an engine holds LoRA: one value, computed by the engine and taken by everything that lays LoRA out for it.

vLLM holds a MoE layer's expert LoRA in one of two ways, and a model's loader may reorder the rows of a base weight
that vLLM then serves the LoRA of untransformed. Each of those facts used to be read where it was needed; they are
now one :class:`LoraLayout`:

* the engine computes it -- the expert format from vLLM's LoRA manager once per worker (:meth:`LoraLayout.of_vllm`,
  the one read of vLLM's flag), the row orders as its first base validation learns them
  (:class:`hwsync.engine.vllm.applier.VllmApplier`, ``lora_layout``);
* its description carries it (``EngineInfo.lora_layout``, what travels: :meth:`LoraLayout.to_wire`), so the
  trainer plans the paths the engine will serve (:mod:`hwsync.trainer.payload`);
* the converter takes it (:func:`hwsync.common.lora_formats.to_vllm_lora`: keys, stacking, the gate/up split, the
  row orders), and the slot writer, the fingerprints and verify read the converter's output through the engine's
  applier, never their own idea of the layout.

A trainer-side fact stays with the trainer's module: whether its fused gate/up rows are interleaved (GPT-OSS,
``LoraModule.interleaved``). The layout says which of those it can hold (:meth:`LoraLayout.refusal`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from hwsync.common.errors import AdapterFormatError

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["LoraLayout", "PER_EXPERT", "STACKED"]

ExpertFormat = Literal["2d", "3d"]


@dataclass(frozen=True)
class LoraLayout:
    """How one engine holds LoRA (see the module docstring for who computes and who takes it)."""

    experts: ExpertFormat = "2d"
    """``"2d"``: per expert, ``<experts>.{e}.{gate,up,down}`` A [r, in] / B [out, r] (vLLM's ``FusedMoEWithLoRA``,
    e.g. Qwen3-MoE); ``"3d"``: stacked, PEFT's ParamWrapper keys A [E·r, in] / B [out, r·E]
    (``FusedMoE3DWithLoRA``)."""
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """The per-expert projection names of the 2-D keys (gate, up, down; Mixtral's checkpoint: w1, w3, w2)."""
    row_orders: Mapping[str, Tensor] = field(default_factory=dict, compare=False, repr=False)
    """LoRA module (trainer path, no ``.weight``) -> the row order the engine's loader gives its base weight (Llama 4
    permutes q/k rows for its rotary layout), applied to that module's B. Learned by the engine at its first base
    validation; engine-side only (shapes do not change, so the trainer's plan does not need them)."""

    def __post_init__(self) -> None:
        if self.experts not in ("2d", "3d"):
            raise AdapterFormatError(f"expert LoRA layout (moe_format) must be '2d' or '3d', got {self.experts!r}")

    @classmethod
    def of(cls, value: LoraLayout | str | Mapping[str, Any] | None) -> LoraLayout:
        """A layout from itself, its expert format (``"2d"`` / ``"3d"``) or its wire form; ``None``: the default."""
        if value is None:
            return PER_EXPERT
        if isinstance(value, LoraLayout):
            return value
        if isinstance(value, str):
            return cls(experts=value)  # type: ignore[arg-type]
        if isinstance(value, Mapping):
            names = tuple(str(n) for n in value.get("expert_names", PER_EXPERT.expert_names))
            if len(names) != 3:
                raise AdapterFormatError(f"expert LoRA layout: expert_names must name gate, up, down, got {names}")
            return cls(experts=value.get("experts", "2d"), expert_names=names)
        raise AdapterFormatError(f"expert LoRA layout: expected a LoraLayout, '2d' / '3d' or a mapping, got {value!r}")

    @classmethod
    def of_vllm(cls, manager: Any) -> LoraLayout:
        """How vLLM's LoRA model manager ``manager`` holds expert LoRA: stacked where vLLM built the model's experts
        for PEFT's fused format (``_is_3d_moe_model``, vLLM 0.30-0.33), else per expert. The one read of that flag."""
        return STACKED if getattr(manager, "_is_3d_moe_model", False) else PER_EXPERT

    @property
    def stacked(self) -> bool:
        return self.experts == "3d"

    def to_wire(self) -> dict[str, Any]:
        """What the engine's description carries (row orders stay with the engine)."""
        return {"experts": self.experts, "expert_names": list(self.expert_names)}

    def with_row_orders(self, orders: Mapping[str, Tensor]) -> LoraLayout:
        """This layout with more learned row orders (a new value: a layout is never changed in place)."""
        return replace(self, row_orders={**self.row_orders, **orders})

    def rows_of(self, module: str) -> Tensor | None:
        """The row order for ``module``'s B (``None``: as given)."""
        return self.row_orders.get(module)

    def refusal(self, module: str, interleaved: bool) -> str | None:
        """Why this layout cannot hold expert LoRA ``module`` (``None``: it can). Per-expert keys split the fused
        gate/up rows in two halves; interleaved rows (GPT-OSS) are only held stacked."""
        if interleaved and not self.stacked:
            return (
                f"{module}: experts with interleaved gate/up rows (GPT-OSS) are served only by an engine that holds "
                'expert LoRA stacked (3-D); this one holds it per expert: sync merged weights (strategy="full")'
            )
        return None


PER_EXPERT = LoraLayout("2d")
STACKED = LoraLayout("3d")
