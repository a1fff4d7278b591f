"""A MoE router's LoRA reaches the router logits the MoE runner computes, also when the experts are LoRA-wrapped.

vLLM 0.32 (0.31 too) builds its LoRA layers in ``LoRAModelManager._create_lora_modules``, walking
``model.named_modules(remove_duplicate=False)`` and replacing each target with its LoRA wrapper as it goes. A MoE
block holds its router twice: as ``mlp.gate`` and inside the MoE runner, ``mlp.experts.gate``, which computes the
router logits (``FusedMoE(gate=...)``). The router is wrapped under ``mlp.gate``; at the alias the manager re-points
``get_submodule("mlp.experts").gate`` to that wrapper. But where the engine serves expert LoRA (CUDA), ``mlp.experts``
was replaced a step earlier by its own wrapper (``FusedMoEWithLoRA``): the name now resolves to that wrapper, the
attribute lands there, and the runner -- now the wrapper's ``base_layer`` -- keeps the raw router. The router's LoRA
is built, activated and ignored: an adapter with LoRA on the router and the experts (``target_modules="all-linear"``
on transformers 5) is served as if the router had none, by vLLM's own loading as by hwsync's sync (seen on an H200:
the LoRA-configuration matrix's all-linear cell equalled vLLM's own loading and sat 3.15 mean |Δ logprob| from the
trainer; the router alone, experts unwrapped, was exact). On vLLM's CPU build the experts are never wrapped
(``vllm_cpu_moe_lora``), so the rewire works there.

Fix: after the original, every module that holds a layer some LoRA wrapper wraps -- other than that wrapper -- holds
the wrapper instead (:func:`rewire_aliases`): after LoRA wrapping the only legitimate holder of a raw base layer is
its wrapper. Where the original rewired correctly nothing changes. Probe (source): the original re-points an alias
through ``get_submodule`` of its parent's *name*, which an earlier replacement on that path redirects.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import Any

from ._base import APPLIES, NOT_NEEDED, Patch, ProbeResult, register

__all__ = ["VllmMoeRouterLoraAliasPatch", "rewire_aliases"]

logger = logging.getLogger("hwsync.patches")

_TARGET = "vllm.lora.model_manager:LoRAModelManager._create_lora_modules"


def rewire_aliases(model: Any, wrappers: Iterable[Any]) -> list[str]:
    """Point every other holder of a wrapped base layer at its wrapper; returns the rewired paths. ``lm_head`` is left
    as it is, as upstream leaves it (tied to the embeddings it is the same module, which is no alias of a LoRA
    layer's input: the logits wrapper holds it itself)."""
    by_base = {id(w.base_layer): w for w in wrappers if getattr(w, "base_layer", None) is not None}
    fixed: list[str] = []
    for name, holder in model.named_modules():
        for key, child in list(holder._modules.items()):
            wrapper = by_base.get(id(child))
            if wrapper is not None and wrapper is not holder and "lm_head" not in f"{name}.{key}":
                holder._modules[key] = wrapper  # the same registration nn.Module.__setattr__ makes for a Module
                fixed.append(f"{name}.{key}" if name else key)
    return fixed


class VllmMoeRouterLoraAliasPatch(Patch):
    name = "vllm_moe_router_lora_alias"
    targets = (_TARGET,)
    upstream = "https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/lora/model_manager.py"
    seen_in = ("vllm 0.32.0 CUDA (H200: all-linear LoRA on Qwen3-MoE, router + experts)",)
    remove_when = (
        "_create_lora_modules re-points router aliases to the wrapper object, not through the parent's "
        "name (probe: no get_submodule(_parent_module(...)) rewire)"
    )

    def check(self) -> ProbeResult:
        source = self.original_source()
        if source is None:
            return ProbeResult(NOT_NEEDED, "cannot read _create_lora_modules' source; left unpatched")
        if "existing_wrapper" in source and "get_submodule(_parent_module(" in source:
            return ProbeResult(
                APPLIES,
                "aliases of a wrapped layer are re-pointed through their parent's name, which "
                "a wrapped MoE runner redirects: its router keeps no LoRA",
            )
        return ProbeResult(NOT_NEEDED, "_create_lora_modules does not re-point aliases by their parent's name")

    def replacement(self, original: Any, target: str) -> Any:
        if not callable(original):
            raise TypeError(f"{target} is {type(original).__name__}, expected a function")

        @functools.wraps(original)
        def _create_lora_modules(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(self, *args, **kwargs)
            fixed = rewire_aliases(self.model, self.modules.values())
            if fixed:
                logger.info(
                    "hwsync: %d module(s) held a layer outside its LoRA wrapper (e.g. %s): re-pointed to "
                    "the wrapper (patch vllm_moe_router_lora_alias)",
                    len(fixed),
                    fixed[0],
                )
            return out

        return _create_lora_modules


register(VllmMoeRouterLoraAliasPatch())
