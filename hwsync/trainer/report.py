"""What one sync did: one object for callers, one log line for humans."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SyncReport", "logger"]

logger = logging.getLogger("hwsync.sync")


@dataclass(frozen=True)
class SyncReport:
    """Result of :func:`hwsync.sync`.

    ``bytes`` counts the payload as it travelled (the engine's dtype for base weights, the LoRA dtype for
    adapter tensors), so ``bytes / seconds`` is the sync's real throughput, not a trainer-side size.
    """

    strategy: str
    """``"full"``, ``"adapter"`` or ``"hybrid"`` (never ``"auto"``: auto resolves to one of them)."""
    tensors: int
    bytes: int
    seconds: float
    buckets: int
    version: int
    reason: str
    """Why this strategy (and, for adapter/hybrid, why base weights were or were not sent)."""
    mode: str = "colocate"
    """``"colocate"`` (in-process, no serialization) or ``"server"`` (torch.distributed)."""
    base_tensors: int = 0
    lora_tensors: int = 0
    path: str = ""
    """How the engine wrote it (in place / through vLLM's reload; adapter rewritten in place / built by vLLM)."""
    lora_request: Any = field(default=None, compare=False)
    """The ``vllm.lora.request.LoRARequest`` to generate with (``None`` when the engine serves merged weights)."""

    @property
    def megabytes(self) -> float:
        return self.bytes / 1e6

    @property
    def gbps(self) -> float:
        """Payload gigabytes per second (0 for an empty sync)."""
        return self.bytes / 1e9 / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        """The one log line every sync emits."""
        return (
            f"hwsync sync v{self.version}: strategy={self.strategy} tensors={self.tensors} "
            f"MB={self.megabytes:.3f} seconds={self.seconds:.3f} GB/s={self.gbps:.3f} "
            f"buckets={self.buckets} mode={self.mode} ({self.reason})" + (f" [{self.path}]" if self.path else "")
        )

    def log(self) -> None:
        logger.info(self.line())
