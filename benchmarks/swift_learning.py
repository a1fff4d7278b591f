"""Does ms-swift learn the same with hwsync as with its own weight sync? The README's main job (``swift rlhf
--rlhf_type grpo``, tiny Qwen3-MoE, LoRA on attention and experts, vLLM colocated, reward ``arith``: the exact answer
plus digit density minus length) run from the same seed with ms-swift 4.6's own sync -- both of its ways: the adapter
as a vLLM LoRA (``--vllm_enable_lora true``, as the main job) and merged weights (``false``: merge, push every
weight, unmerge) -- and with hwsync's plugin (``auto``, verify after every sync): reward per step and wall time, as
a PNG and a markdown table.

    python benchmarks/swift_learning.py --steps 40 --json runs.json       # every run, then the plot and the table
    python benchmarks/swift_learning.py --plot runs.json --png out.png    # redraw from saved runs (matplotlib only)

A run that fails is reported with its error and left out of the plot. Measured on an H200 (docs/performance.md):
ms-swift's LoRA sync refuses the fused MoE experts' adapter at the first sync (vLLM's 2-D MoE LoRA wrapper); on
vLLM's CPU build ms-swift's own sync fails (``tests/test_swift_upstream.py``: its ``load_weights`` meets the
CPU build's repacked linears; past that, the experts' prepack is not redone). Per step: the mean reward of the step's
rollouts and the wall time since training began (ms-swift's ``logging.jsonl``, whole seconds), for hwsync also the
sync and its check (``HWSYNC_METRICS``).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

SIDES = {"swift": "ms-swift's own sync (LoRA to vLLM)", "swift-merged": "ms-swift's own sync (merged weights)",
         "hwsync": "hwsync (verify every sync)"}
_TIME = re.compile(r"(?:(\d+)d )?(?:(\d+)h )?(?:(\d+)m )?(\d+)s")


def seconds(text: str) -> float:
    """ms-swift's ``format_time`` back to seconds (``1h 2m 3s``, ``4m 5s``, ``6s``)."""
    m = _TIME.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"not an ms-swift elapsed time: {text!r}")
    d, h, mi, s = (int(g) if g else 0 for g in m.groups())
    return float(((d * 24 + h) * 60 + mi) * 60 + s)


def steps_of(output_dir: Path) -> list[dict[str, Any]]:
    """Per optimizer step from ms-swift's ``logging.jsonl``: step, mean reward, wall seconds since training began."""
    rows = []
    for path in sorted(output_dir.glob("v*/logging.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line) if line.strip() else {}
            if "reward" not in rec or "global_step/max_steps" not in rec:
                continue
            rows.append({"step": int(str(rec["global_step/max_steps"]).split("/")[0]), "reward": float(rec["reward"]),
                         "elapsed_s": seconds(str(rec.get("elapsed_time", "0s")))})
    return rows


def run(side: str, steps: int, workdir: Path) -> dict[str, Any]:
    """One ``swift rlhf`` run (a child process); its steps, or its error."""
    import grpo_tiny_moe as job

    model, data = job.prepare(workdir / "job", seed=0)
    out = workdir / f"out-{side}"
    args = job.swift_args(model, data, out, steps=steps, plugin=side == "hwsync")
    if side == "swift-merged":  # ms-swift without vLLM LoRA: it merges the adapter and pushes every weight
        args[args.index("--vllm_enable_lora") + 1] = "false"
    result = job.run_job(args, out)
    syncs = result.syncs
    run_info: dict[str, Any] = {"side": SIDES[side], "returncode": result.returncode, "wall_s": result.wall_s,
                                "steps": steps_of(out)}
    if syncs:
        run_info["sync_s"] = sum(s.get("seconds") or 0.0 for s in syncs) / len(syncs)
        run_info["verify_s"] = sum(s.get("verify_seconds") or 0.0 for s in syncs) / len(syncs)
    if result.returncode != 0:
        errors = [ln for ln in result.log_tail(400).splitlines() if "Error" in ln or "error:" in ln]
        run_info["error"] = (errors[-1] if errors else result.log_tail(3)).strip()[:300]
    return run_info


def table(runs: list[dict[str, Any]]) -> str:
    lines = ["| sync | steps | reward, first quarter | reward, last quarter | s / step | of which sync | of which verify |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in runs:
        steps = r["steps"]
        if r.get("error") and not steps:
            lines.append(f"| {r['side']} | fails: {r['error']} | | | | | |")
            continue
        k = max(1, len(steps) // 4)
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
        per_step = (steps[-1]["elapsed_s"] - steps[0]["elapsed_s"]) / max(len(steps) - 1, 1) if steps else float("nan")
        sync = f"{r['sync_s']:.3f}" if "sync_s" in r else "--"
        verify = f"{r['verify_s']:.2f}" if "verify_s" in r else "--"
        lines.append(f"| {r['side']} | {len(steps)} | {mean([s['reward'] for s in steps[:k]]):.3f} | "
                     f"{mean([s['reward'] for s in steps[-k:]]):.3f} | {per_step:.2f} | {sync} | {verify} |")
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], png: Path) -> None:
    from trl_learning import plot_curves

    plot_curves({r["side"]: r["steps"] for r in runs if r["steps"]}, png,
                reward="mean reward (arith: answer + digits - length)", time_key="elapsed_s",
                time_axis=("seconds since training began", "wall time"),
                title="ms-swift GRPO, tiny Qwen3-MoE, LoRA on attention + experts, same seed: ms-swift's own sync vs "
                      "hwsync")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--png", type=Path, default=ROOT / "docs" / "swift-learning.png")
    parser.add_argument("--json", type=Path, default=None, help="save both runs here")
    parser.add_argument("--plot", type=Path, default=None, help="only redraw from a saved --json")
    parser.add_argument("--sides", default="swift,swift-merged,hwsync",
                        help="which runs (comma-separated: swift, swift-merged, hwsync)")
    args = parser.parse_args(argv)
    if args.plot is not None:
        runs = json.loads(args.plot.read_text())
    else:
        runs = []
        with tempfile.TemporaryDirectory(prefix="hwsync-swift-learning-") as tmp:
            for side in [s.strip() for s in args.sides.split(",") if s.strip()]:
                if side not in SIDES:
                    parser.error(f"--sides: {side!r} is not one of {sorted(SIDES)}")
                runs.append(run(side, args.steps, Path(tmp)))
                print(f"{runs[-1]['side']}: exit {runs[-1]['returncode']}, {len(runs[-1]['steps'])} steps, "
                      f"{runs[-1]['wall_s']:.0f} s" + (f" ({runs[-1]['error']})" if runs[-1].get("error") else ""),
                      flush=True)
        if args.json:
            args.json.write_text(json.dumps(runs, indent=1))
    print(table(runs))
    if any(r["steps"] for r in runs):
        plot(runs, args.png)
        print(f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
