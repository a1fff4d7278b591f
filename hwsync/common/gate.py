"""The limits of verify's logprob gate: a device's measured policy, carried by its backend.

A gate bounds how far a healthy engine's logprobs may sit from the trainer's on the same tokens; each device backend
carries the gates measured on its platform per engine dtype (:attr:`hwsync.common.backend.Backend.verify_gates`), so a
new device brings its own (a dtype without one gets :data:`LOOSEST`). :mod:`hwsync.trainer.verify` applies them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Gate", "LOOSEST"]


@dataclass(frozen=True)
class Gate:
    """Limits of the logprob gate (engine vs trainer over prompt + greedy tokens). ``max_abs`` is ``None`` except
    where the platform computes like the trainer (vLLM's CPU build in fp32)."""

    mean_abs: float
    """Mean |Δ logprob|."""
    p90_abs: float
    """90th percentile of |Δ logprob|."""
    mean_prob: float
    """Mean |Δ probability| (verl watches <= 0.01)."""
    max_abs: float | None = None


LOOSEST = Gate(mean_abs=0.5, p90_abs=2.0, mean_prob=0.05)
"""Where a device carries no measured gate for a dtype: the loosest of the measured 16-bit gates."""
