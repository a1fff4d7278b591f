"""ms-swift reward plugin for the arithmetic dataset of ``grpo_tiny_moe.py``: ``--reward_funcs arith``.

The verifiable part is exact: 1.0 when the last integer in the completion equals the ``solution`` column.
A random tiny model almost never earns it, and GRPO learns nothing from a group whose rewards are all equal, so
two small shaping terms follow the prompt's instruction ("answer with a single number"): digits are rewarded,
length is penalised. They keep the advantages non-zero, so every step really updates the LoRA weights.
"""

from __future__ import annotations

import re

from swift.rewards import ORM, orms

_INT = re.compile(r"-?\d+")


class ArithmeticReward(ORM):
    """1 for the right number, plus <= 0.2 for digit density, minus <= 0.2 for length (64 chars and more)."""

    def __call__(self, completions: list[str], solution: list[str], **kwargs: object) -> list[float]:
        rewards = []
        for text, answer in zip(completions, solution):
            numbers = _INT.findall(text)
            score = 1.0 if numbers and numbers[-1] == str(answer).strip() else 0.0
            score += 0.2 * sum(ch.isdigit() for ch in text) / max(len(text), 1)
            score -= 0.2 * min(len(text), 64) / 64
            rewards.append(score)
        return rewards


orms["arith"] = ArithmeticReward
