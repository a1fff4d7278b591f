"""Trainer names: strip training-time wrappers (PEFT, FSDP, checkpointing, compile) from parameter names.

The one normaliser every trainer-side and receiver-side module uses, so a name means the same thing everywhere.
"""

from __future__ import annotations

# ---------------------------------------------------------------------------------------------------------------
# trainer-side wrappers
# ---------------------------------------------------------------------------------------------------------------
_PEFT_ROOT = "base_model.model."
# Module wrappers that add a path segment without changing the weight: activation checkpointing, torch.compile,
# FSDP1, PEFT/vLLM-LoRA base layers.
_WRAPPER_SEGMENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module", "base_layer"})
_ADAPTER_SEGMENTS = frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"})
ADAPTER = "adapter"
PEFT_ORIGINAL = "peft_original"


def normalize_trainer_name(name: str) -> tuple[str, str | None]:
    """Strip training-time wrappers from a trainer name; say when it is not a base weight at all.

    Returns ``(clean_name, category)``; ``category`` is ``None`` for a base weight, ``"adapter"`` for LoRA
    tensors (``lora_A``/``lora_B``/...), ``"peft_original"`` for the frozen ``original_module`` copy that PEFT
    keeps beside a trained ``modules_to_save`` copy. ``.base_layer`` is dropped wherever it occurs: PEFT nests it
    before the leaf (``q_proj.base_layer.weight``) and, for ``target_parameters``, before the module
    (``experts.base_layer.base_layer.gate_up_proj``).
    """
    parts = name.split(".")
    if name.startswith(_PEFT_ROOT):
        parts = parts[2:]
    out: list[str] = []
    category: str | None = None
    i = 0
    while i < len(parts):
        p = parts[i]
        if p in _WRAPPER_SEGMENTS:
            i += 1
            continue
        if p == "modules_to_save" and i + 1 < len(parts):  # modules_to_save.<adapter>.
            i += 2
            continue
        if p == "original_module":
            category = category or PEFT_ORIGINAL
            i += 1
            continue
        if p in _ADAPTER_SEGMENTS:
            category = ADAPTER
        out.append(p)
        i += 1
    return ".".join(out), category


def strip_peft_name(name: str) -> str:
    """The trainer runtime name of a (possibly PEFT-/FSDP-/compile-wrapped) parameter or module name."""
    return normalize_trainer_name(name)[0]
