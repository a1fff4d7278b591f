"""Per-sync and per-step records of a training run (ms-swift, TRL), as JSON lines, plus the human summary table.

Records (one JSON object per line, ``event`` tells which):

* ``sync``  -- after every weight sync: ``step`` (optimizer steps done when the sync ran, so it serves the
  rollouts of step ``step + 1``), ``strategy``, ``reason``, ``mode``, ``version``, ``tensors``,
  ``base_tensors``, ``lora_tensors``, ``bytes``, ``mb``, ``seconds``, ``buckets``, ``verify_max_abs_dlogp``
  (``null`` when the check did not run), ``verify_tokens``, ``verify_seconds`` and ``policy_shift`` (max |Δ logprob| of
  the trainer on the check prompts since the first sync: evidence that the policy the engine now matches has moved).
* ``step``  -- after every logged optimizer step: ``step``, ``reward``, ``reward_std``, ``loss``,
  ``rollout_max_abs_dlogp`` (engine vs trainer on the tokens the engine actually sampled this step, from the
  trainer's rollout logprobs), ``rollout_tokens``.
* ``summary`` -- at the end of training: ``text``, the table :func:`format_summary` printed.

The file is appended to, so a run resumed into the same file keeps its history.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["MetricsLog", "read_metrics", "format_summary"]


class MetricsLog:
    """Appends records to a JSONL file (flushed per record, so a crashed run keeps what it measured)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, **fields}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=_jsonable) + "\n")
        return record


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of a metrics file, in order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def format_summary(records: Iterable[Mapping[str, Any]]) -> str:
    """One row per optimizer step: reward, and the sync that served that step's rollouts."""
    records = list(records)
    syncs = {r["step"]: r for r in records if r.get("event") == "sync"}
    steps = [r for r in records if r.get("event") == "step"]
    header = ("step", "reward", "strategy", "MB", "sync ms", "max|Δlogp| verify", "max|Δlogp| rollout", "policy shift")
    rows = []
    for rec in steps:
        # rollouts of step s were generated right after the sync made at step s - 1; a step without one trains on a
        # rollout batch generated earlier (--steps_per_generation / --num_iterations > 1)
        sync = syncs.get(rec["step"] - 1, {})
        rows.append(
            (
                str(rec["step"]),
                _fmt(rec.get("reward"), ".3f"),
                str(sync.get("strategy", "(no sync)")),
                _fmt(sync.get("mb"), ".3f"),
                _fmt(None if sync.get("seconds") is None else 1000 * sync["seconds"], ".0f"),
                _fmt(sync.get("verify_max_abs_dlogp"), ".1e"),
                _fmt(rec.get("rollout_max_abs_dlogp"), ".1e"),
                _fmt(sync.get("policy_shift"), ".1e"),
            )
        )
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    if syncs:
        first = syncs[min(syncs)]
        lines.append(f"strategy: {first.get('strategy')} ({first.get('reason', '')})")
    return "\n".join(lines)


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return str(value)
