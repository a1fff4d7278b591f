"""Does it learn the same? TRL GRPO on a toy task a tiny MoE learns in minutes on CPU, with TRL's own weight sync and
with hwsync's (with and without its check after every sync), from the same seed: reward curves and per-step wall time, as a PNG and a markdown table.

    python benchmarks/trl_learning.py                       # both runs, then docs/trl-learning.png + the table
    python benchmarks/trl_learning.py --steps 40 --png out.png --json runs.json
    python benchmarks/trl_learning.py --plot runs.json      # redraw from saved runs (needs only matplotlib)

The task: the arithmetic prompts of the main job, and a reward for emitting a token pattern -- the fraction of
completion tokens that are digits (a random tiny model emits few; GRPO with LoRA on attention and experts raises
it within tens of steps). Both runs are identical but for the sync: same model, seed, data order, engine settings
(the engine in bfloat16: on vLLM's CPU build TRL's own sync cannot write into an fp32 engine, see
``bench_trl_sync.py``), hwsync with its defaults (``auto``, verify after every sync). Recorded per step: the mean
reward of the step's rollouts, the wall time of the step (rollout, sync and checks, scoring, update), the time of the sync inside it, and
the largest gap between the logprobs the engine sampled with and the trainer's (TRL's
``sampling/sampling_logp_difference/max``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

DIGITS: frozenset[int] = frozenset()  # token ids of "0".."9", filled in by the run from the tokenizer


def digit_reward(completions: list[Any], completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """Fraction of completion tokens that are digits."""
    return [sum(t in DIGITS for t in ids) / max(len(ids), 1) for ids in completion_ids]


RUNS = {"trl": "TRL's own sync", "hwsync": "hwsync (verify every sync)", "hwsync-noverify": "hwsync (no verify)"}


def run(sync: str, steps: int, seed: int, workdir: Path) -> list[dict[str, Any]]:
    """One training run (in this process); per-step records."""
    global DIGITS
    import trl_grpo_tiny_moe as job

    if not job.has_gpu():
        for key, value in {**job.CPU_ENV, "CUDA_VISIBLE_DEVICES": ""}.items():
            os.environ.setdefault(key, value)
    os.environ["HWSYNC_METRICS"] = str(workdir / f"{sync}-hwsync.jsonl")
    os.environ["HWSYNC_VERIFY_EVERY"] = "0" if sync == "hwsync-noverify" else "1"
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback

    model_dir, data = job.prepare(workdir, seed=0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    DIGITS = frozenset(tok(str(d), add_special_tokens=False)["input_ids"][0] for d in range(10))
    args = job.config(workdir / f"out-{sync}", steps=steps, gspo=False, server_port=None, seed=seed,
                      learning_rate=5e-3, num_generations=8, per_device_train_batch_size=16, max_completion_length=12)
    engine = {**job.engine_kwargs(), "dtype": "bfloat16"}
    common = dict(model=str(model_dir), reward_funcs=digit_reward, args=args, train_dataset=job.dataset(data),
                  peft_config=LoraConfig(**job.LORA))
    times: list[float] = []
    if sync.startswith("hwsync"):
        from hwsync.trl import GRPOTrainer

        trainer = GRPOTrainer(**common, engine_kwargs=engine)
    else:
        trainer = job.stock_trainer(common, engine)
        backend = trainer.vllm_generation
        own = backend.sync_weights

        def timed() -> None:  # the benchmark's stopwatch on TRL's own sync
            t0 = time.perf_counter()
            own()
            times.append(time.perf_counter() - t0)

        backend.sync_weights = timed
    walls: list[float] = []

    class Stopwatch(TrainerCallback):  # wall time of each optimizer step: rollout, sync, scoring, update
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            walls.append(-time.perf_counter())

        def on_step_end(self, *a: Any, **k: Any) -> None:
            walls[-1] += time.perf_counter()

    trainer.add_callback(Stopwatch())
    t_start = time.perf_counter()
    trainer.train()
    rows = []
    logs = [h for h in trainer.state.log_history if "loss" in h]
    for i, h in enumerate(logs):
        sync_s = h["hwsync/sync_ms"] / 1000 if sync.startswith("hwsync") else times[i]
        rows.append({"step": h["step"], "reward": h.get("reward"), "step_s": walls[i], "sync_s": sync_s,
                     "verify_s": h.get("hwsync/verify_ms", 0.0) / 1000,
                     "rollout_max_abs_dlogp": h.get("sampling/sampling_logp_difference/max")})
    rows.append({"total_s": time.perf_counter() - t_start})
    return rows


def table(runs: dict[str, list[dict[str, Any]]]) -> str:
    def stats(rows: list[dict[str, Any]]) -> dict[str, float]:
        steps = [r for r in rows if "step" in r]
        k = max(1, len(steps) // 4)
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        return {"first": mean([r["reward"] for r in steps[:k]]), "last": mean([r["reward"] for r in steps[-k:]]),
                "step_s": mean([r["step_s"] for r in steps[1:]]), "sync_s": mean([r["sync_s"] for r in steps[1:]]),
                "verify_s": mean([r["verify_s"] for r in steps[1:]]),
                "gap": max(r["rollout_max_abs_dlogp"] or 0.0 for r in steps), "k": k, "n": len(steps)}

    lines = ["| sync | reward, first quarter | reward, last quarter | s / step | of which sync | of which verify | "
             "max rollout \\|Δ logprob\\| |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, rows in runs.items():
        s = stats(rows)
        lines.append(f"| {name} | {s['first']:.3f} | {s['last']:.3f} | {s['step_s']:.2f} | {s['sync_s']:.3f} | "
                     f"{s['verify_s']:.2f} | {s['gap']:.1e} |")
    return "\n".join(lines)


def plot(runs: dict[str, list[dict[str, Any]]], png: Path) -> None:
    plot_curves(runs, png, reward="mean reward (fraction of digit tokens)", time_key="step_s",
                time_axis=("seconds", "wall time per step"),
                title="TRL GRPO, tiny Qwen3-MoE, LoRA on attention + experts, same seed: TRL's own sync vs hwsync")


def plot_curves(runs: dict[str, list[dict[str, Any]]], png: Path, *, reward: str, time_key: str,
                time_axis: tuple[str, str], title: str) -> None:
    """Reward (left) and ``time_key`` (right, labelled ``time_axis``: y label, title) per optimizer step of each run
    (records without a ``step`` are skipped); also ``swift_learning.py``'s plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in runs.items():
        steps = [r for r in rows if "step" in r]
        ax1.plot([r["step"] for r in steps], [r["reward"] for r in steps], label=name, marker=".")
        ax2.plot([r["step"] for r in steps], [r[time_key] for r in steps], label=name, marker=".")
    ax1.set(xlabel="optimizer step", ylabel=reward, title="reward")
    ax2.set(xlabel="optimizer step", ylabel=time_axis[0], title=time_axis[1])
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--png", type=Path, default=ROOT / "docs" / "trl-learning.png")
    parser.add_argument("--json", type=Path, default=None, help="save both runs' records here")
    parser.add_argument("--plot", type=Path, default=None, help="only redraw from a saved --json")
    parser.add_argument("--sync", choices=sorted(RUNS), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sync is not None:  # a child: one run, records as the last line
        print("RESULT " + json.dumps(run(args.sync, args.steps, args.seed, args.workdir)), flush=True)
        return 0
    if args.plot is not None:
        runs = json.loads(args.plot.read_text())
    else:
        runs = {}
        with tempfile.TemporaryDirectory(prefix="hwsync-trl-learning-") as tmp:
            for sync, name in RUNS.items():
                cmd = [sys.executable, __file__, "--sync", sync, "--steps", str(args.steps), "--seed",
                       str(args.seed), "--workdir", tmp]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if proc.returncode != 0 or not lines:
                    print(proc.stdout[-3000:] + proc.stderr[-5000:], file=sys.stderr)
                    raise SystemExit(f"the {sync} run failed (exit {proc.returncode})")
                runs[name] = json.loads(lines[-1][len("RESULT "):])
                print(f"{name}: {runs[name][-1]['total_s']:.0f} s", flush=True)
        if args.json:
            args.json.write_text(json.dumps(runs, indent=1))
    print(table(runs))
    plot(runs, args.png)
    print(f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
