"""The trainer side of the tests: a PEFT model on a local checkpoint and its 'optimizer steps'.

One home for what every sync test needs, so each test says only what it varies (targets, strategy, seeds).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["fail_at", "lora_trainer", "perturb"]


def lora_trainer(
    path: str | Path,
    targets: list[str] | None = None,
    parameters: list[str] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    **lora: Any,
) -> Any:
    """``path``'s transformers model in eval mode, PEFT-wrapped with rank 4, alpha 8 LoRA on ``targets`` (modules)
    and ``parameters`` (fused expert parameters); plain when both are None. ``lora``: more ``LoraConfig`` fields
    (every other configuration people train with: :mod:`hwsync.testing.lora_configs`)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    if targets is None and parameters is None:
        return model
    lora = {"r": 4, "lora_alpha": 8, **lora}
    cfg = LoraConfig(target_modules=targets or [], target_parameters=parameters, **lora)
    return get_peft_model(model, cfg).eval()


def fail_at(bucket: int, message: str = "optimizer blew up") -> Any:
    """A sync ``progress`` callback that raises ``RuntimeError(message)`` before bucket ``bucket`` is handed over:
    the sender failing mid-sync (earlier buckets are already applied, so the engine turns stale)."""

    def progress(index: int, total: int) -> None:
        if index == bucket:
            raise RuntimeError(message)

    return progress


def perturb(
    model: Any, gen: torch.Generator | int, *, base: bool = False, lora_scale: float = 0.05, base_scale: float = 0.02
) -> None:
    """One 'optimizer step', in place as an optimizer does: every LoRA factor moves (``+ N(0, lora_scale)``) and,
    with ``base``, every other weight too (``* (1 + N(0, base_scale))``). ``gen``: a generator or a seed."""
    if isinstance(gen, int):
        gen = torch.Generator().manual_seed(gen)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_((torch.randn(p.shape, generator=gen) * lora_scale).to(p.device, p.dtype))
            elif base and p.is_floating_point():
                p.mul_((1 + torch.randn(p.shape, generator=gen) * base_scale).to(p.device, p.dtype))
