"""A GRPO step at the real size, with hwsync's guard in it: where the step's time goes, and whether the guard ever
stops a healthy run.

    python benchmarks/bench_step.py                                             # CPU: tiny MoE (what .ci/run runs)
    python benchmarks/bench_step.py --shapes qwen3-30b-a3b --layers 48 --runs adapter:8,adapter:32,full --steps 20
    python benchmarks/bench_step.py --shapes qwen3.5-moe --layers 24 --runs adapter:32

Each run builds one engine and one trainer (trainer and engine on the same device, as a colocated GRPO job) and
loops the way a user's own PyTorch loop or a trainer integration calls hwsync, per step:

* **sync**: ``hwsync.sync`` through :class:`hwsync.integrations.trainer_sync.TrainerSync`, the integrations' own path;
* **guard**: that class's check after the sync (content checks of what can have changed; the check prompts'
  logprobs and the model's numerics spread at the first check and every ``HWSYNC_VERIFY_LOGPROBS_EVERY``-th) plus
  the rollout check (the engine's sampling logprobs against the trainer's on the sampled tokens, which the
  policy-gradient step computes anyway);
* **generate**: ``--prompts`` prompts x ``--samples`` samples x ``--tokens`` tokens, temperature 1, with logprobs;
* **train**: one policy-gradient step (group-normalized random rewards, ``-A * logp``), ``backward()`` and AdamW
  on the trainable parameters (LoRA; for ``full`` the attention projections on a GPU -- Adam state for 60 GB of
  experts does not fit beside the engine -- every weight on CPU), gradient checkpointing on GPUs. ``--optimizer
  sgd`` and ``--lora-dtype bfloat16`` shrink the trainer's state (what the guard's cost does not depend on): AdamW's
  fp32 state of LoRA r32 on 48 layers does not fit one H200 beside the resident engine;
* **sleep** (``--sleep 1,2``, CUDA): the engine sleeps at that vLLM level for the training step and wakes after it
  (level 1: weights to host memory and back; level 2: discarded, the next sync refills them); one row per level,
  the training phase's device memory beside it.

The table gives per-phase medians over the steps after the first (the first sync carries the base), the guard's
share of the step (the target: <= 2%), peak device memory, and the guard's verdicts: **false alarms** (the guard
stopped a healthy step; the run goes on to count them) and weak evidence (logged, not stopping). The baseline of
the guard's cost is the step measured in the same run. The script asserts no time; it exits non-zero on a false
alarm only with ``--strict``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_sync as bs  # noqa: E402 - the model shapes, checkpoint, engine and trainer of the sync bench

PHASES = ("sync", "guard", "generate", "train", "sleep")


def _peak(before: int = 0) -> float:
    """Peak allocated GB: the larger of ``before`` (bytes, recorded ahead of a reset of torch's peak) and torch's
    peak since; NaN on CPU."""
    return max(before, torch.cuda.max_memory_allocated()) / 1e9 if bs._on_gpu() else float("nan")


def _parse_runs(text: str) -> list[tuple[str, int]]:
    runs = []
    for part in text.split(","):
        strategy, _, rank = part.strip().partition(":")
        if strategy not in ("adapter", "full", "hybrid"):
            raise SystemExit(f"--runs: {part!r}: expected adapter:R, hybrid:R or full")
        runs.append((strategy, int(rank or 8)))
    return runs


def _trainable(model: Any, strategy: str) -> list[torch.nn.Parameter]:
    """LoRA factors; for ``full`` every weight on CPU, the attention projections on a GPU (see the module doc)."""
    if strategy != "full":
        return [p for n, p in model.named_parameters() if "lora_" in n]
    params = []
    for n, p in model.named_parameters():
        keep = not bs._on_gpu() or any(f"{a}." in n for a in bs.ATTN)
        p.requires_grad_(keep)
        if keep:
            params.append(p)
    return params


def _rollouts(llm: Any, prompts: list[list[int]], samples: int, tokens: int, seed: int) -> list[Any]:
    import hwsync
    from vllm import SamplingParams

    params = SamplingParams(n=samples, max_tokens=tokens, temperature=1.0, logprobs=0, seed=seed, detokenize=False,
                            ignore_eos=True)
    return hwsync.generate(llm, [{"prompt_token_ids": p} for p in prompts], params)


def _batch(outs: list[Any], device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask, completion mask, the engine's sampling logprobs), right-padded; position t of the
    masks/logprobs is the token at t+1 (aligned with the trainer's next-token logprobs)."""
    rows, engine = [], []
    for out in outs:
        for c in out.outputs:
            ids = list(out.prompt_token_ids) + list(c.token_ids)
            lp = [float("nan")] * (len(out.prompt_token_ids) - 1) + [
                float(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs)]
            rows.append((ids, len(out.prompt_token_ids)))
            engine.append(lp)
    width = max(len(r) for r, _ in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros(len(rows), width, dtype=torch.long)
    comp = torch.zeros(len(rows), width - 1, dtype=torch.bool)
    elp = torch.full((len(rows), width - 1), float("nan"))
    for i, ((r, n_prompt), lp) in enumerate(zip(rows, engine)):
        ids[i, :len(r)] = torch.tensor(r)
        attn[i, :len(r)] = 1
        comp[i, n_prompt - 1:len(r) - 1] = True
        elp[i, :len(lp)] = torch.tensor(lp)
    return ids.to(device), attn.to(device), comp.to(device), elp.to(device)


def _train(model: Any, opt: Any, ids: torch.Tensor, attn: torch.Tensor, comp: torch.Tensor, samples: int,
           seed: int) -> torch.Tensor:
    """One policy-gradient step; returns the trainer's logprobs of the sampled tokens (before the update)."""
    model.train()
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(ids.shape[0] // samples, samples, generator=g)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).reshape(-1)
    adv = adv.to(logp.device)
    mask = comp.float()
    loss = -((logp * mask).sum(1) / mask.sum(1).clamp(min=1) * adv).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()
    return logp.detach()


def _profiler() -> Any:
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
    return profile


def _print_profile(profile: Any, what: str, top: int = 30) -> None:
    """Where the host's time went (cumulative), device work waited for inside the profile."""
    import io
    import pstats

    bs._sync_device()
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(top)
    print(f"--- cProfile of {what} ---\n{out.getvalue()}", flush=True)


def _in_use() -> float:
    """Device memory in use, GB (vLLM's sleeping pool is unmapped behind torch's allocator: only the device says)."""
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 1e9


def run(llm: Any, path: Path, strategy: str, rank: int, args: argparse.Namespace, dtype: torch.dtype,
        level: int = 0) -> dict[str, Any]:
    import gc

    from hwsync.common.errors import VerifyError
    from hwsync.integrations.options import SyncOptions
    from hwsync.integrations.trainer_sync import TrainerSync, first_prompts

    model = bs._trainer(path, strategy, rank, dtype, lora_in_fp32=args.lora_dtype == "float32")
    if bs._on_gpu():
        model.gradient_checkpointing_enable()
        if hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()
    params = _trainable(model, strategy)
    opt = torch.optim.AdamW(params, lr=args.lr) if args.optimizer == "adamw" else torch.optim.SGD(params, lr=args.lr)
    train_gb: list[float] = []
    peak = 0
    device = "cuda" if bs._on_gpu() else "cpu"
    vocab = model.config.vocab_size if hasattr(model.config, "vocab_size") else model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    options = SyncOptions(strategy=strategy, verify_every=1)
    lines: list[str] = []
    kept: list[str] = []  # the first step's lines and every later weak verdict, for the JSON row
    guard = TrainerSync(options, log=lines.append)
    guard.probe = first_prompts(prompts, options.verify_prompts)
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    alarms: list[str] = []
    verify_ms: list[float] = []
    rollout_s: list[float] = []  # the guard's rollout-check part (the rest is the check after the sync)
    if bs._on_gpu():
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.steps):
        t: dict[str, float] = {}
        bs._sync_device()
        t0 = time.perf_counter()
        profile = _profiler() if step == args.profile_step else None
        try:
            # the guard's check runs inside TrainerSync.sync: timed apart from the sync itself below
            _, numbers = guard.sync(llm, model, step)
            alarm = None
        except VerifyError as e:
            numbers, alarm = {}, str(e)
        finally:
            if profile is not None:
                _print_profile(profile, f"step {step}'s sync and check")
        bs._sync_device()
        t_sync_guard = time.perf_counter() - t0
        t["guard"] = numbers.get("hwsync/verify_ms", 0.0) / 1e3
        t["sync"] = t_sync_guard - t["guard"]
        if alarm is not None:
            alarms.append(f"step {step} sync check: {alarm}")
        t0 = time.perf_counter()
        outs = _rollouts(llm, prompts, args.samples, args.tokens, seed=step)
        t["generate"] = time.perf_counter() - t0
        ids, attn, comp, elp = _batch(outs, device)
        bs._sync_device()
        t0 = time.perf_counter()
        if level:
            llm.sleep(level=level)
        t["sleep"] = time.perf_counter() - t0
        if bs._on_gpu():
            torch.cuda.synchronize()
            before, allocated = _in_use(), torch.cuda.memory_allocated()
            peak = max(peak, torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        trainer_logp = _train(model, opt, ids, attn, comp, args.samples, seed=step)
        bs._sync_device()
        t["train"] = time.perf_counter() - t0
        if bs._on_gpu():  # in use when training began + what training added at its peak (an upper bound)
            total = torch.cuda.mem_get_info()[1] / 1e9
            train_gb.append(min(total, before + (torch.cuda.max_memory_allocated() - allocated) / 1e9))
        t0 = time.perf_counter()
        if level:
            llm.wake_up()
        bs._sync_device()
        t["sleep"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            guard.rollout_check(trainer_logp, elp.nan_to_num(0.0), comp & ~elp.isnan(), step=step,
                                exact_sampling=True)
        except VerifyError as e:
            alarms.append(f"step {step} rollout check: {e}")
        rollout_s.append(time.perf_counter() - t0)
        t["guard"] += rollout_s[-1]
        guard.step_done(step)
        for p in PHASES:
            times[p].append(t[p])
        verify_ms.append(t["guard"] * 1e3)
        print(f"[{strategy}:{rank}] step {step}: " + ", ".join(f"{p} {t[p]:.3f}s" for p in PHASES)
              + (f"\n  ALARM: {alarms[-1]}" if alarms and alarms[-1].startswith(f"step {step} ") else ""), flush=True)
        if step == 0 or level == 2:  # the first sync's report, and every refill's path after a level-2 wake
            print("\n".join(f"  {line}" for line in lines if step == 0 or "hwsync sync v" in line), flush=True)
        kept += lines if step == 0 else [line for line in lines if "weak" in line or "ALARM" in line]
        lines.clear()
    steady = {p: statistics.median(v[1:] or v) for p, v in times.items()}
    step_s = sum(steady.values())
    spread = guard.spread
    row = dict(run=f"{strategy}" + (f" r{rank}" if strategy != "full" else "") + (f", sleep {level}" if level else ""),
               layers=args.layers, sleep=level, train_gb=max(train_gb, default=float("nan")),
               shapes=args.shapes, steps=args.steps, **{f"{p}_s": steady[p] for p in PHASES}, step_s=step_s,
               guard_share=steady["guard"] / step_s if step_s else float("nan"),
               guard_check_s=statistics.median(g - r for g, r in zip(times["guard"][1:] or times["guard"],
                                                                      rollout_s[1:] or rollout_s)),
               guard_rollout_s=statistics.median(rollout_s[1:] or rollout_s),
               first_guard_s=times["guard"][0], peak_gb=_peak(peak), false_alarms=len(alarms), weak=guard.weak,
               spread_mean=spread.mean_abs if spread is not None else None, alarms=alarms[:5],
               log=[line for line in kept if "verify after" in line or "weak" in line][:6])
    import hwsync

    handle = hwsync.as_engine(llm)  # the next run's trainer replaces this one: nothing may keep it alive
    handle.plans.clear()
    for kept in ("_hwsync_references", "_hwsync_verified_base"):
        handle.__dict__.pop(kept, None)
    del model, opt, guard
    gc.collect()
    if bs._on_gpu():
        torch.cuda.empty_cache()
    return row


def _print(rows: list[dict[str, Any]]) -> None:
    head = ("| run | layers | sync s | guard s (check + rollout) | generate s | train s | sleep + wake s | step s | "
            "guard share | first guard s | peak GB | training GB | false alarms | weak | numerics spread |")
    print(head)
    print("|" + "|".join("---" for _ in range(15)) + "|")
    for r in rows:
        spread = "-" if r["spread_mean"] is None else f"{r['spread_mean']:.3g}"
        print(f"| {r['run']} | {r['layers']} | {r['sync_s']:.4f} | {r['guard_s']:.4f} ({r['guard_check_s']:.4f} + "
              f"{r['guard_rollout_s']:.4f}) | {r['generate_s']:.3f} | "
              f"{r['train_s']:.3f} | {r['sleep_s']:.3f} | {r['step_s']:.3f} | {100 * r['guard_share']:.2f}% | "
              f"{r['first_guard_s']:.3f} | {r['peak_gb']:.1f} | {r['train_gb']:.1f} | {r['false_alarms']} of "
              f"{r['steps']} | {r['weak']} | {spread} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="tiny", choices=sorted(bs.SHAPES))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--runs", default=None, help="comma-separated adapter:R / hybrid:R / full (default: the platform's)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on GPUs, float32 on CPU")
    ap.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    ap.add_argument("--lora-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the trainer's LoRA parameters (PEFT's default: float32)")
    ap.add_argument("--sleep", default="0", help="comma-separated vLLM sleep levels, a row each (CUDA; 0: no sleep)")
    ap.add_argument("--profile-step", type=int, default=None,
                    help="print a cProfile of this step's sync and check (of every run), e.g. a refill after a wake")
    ap.add_argument("--json", default=None)
    ap.add_argument("--strict", action="store_true", help="exit 1 on a false alarm")
    args = ap.parse_args(argv)
    gpu = bs._on_gpu()
    levels = [int(v) for v in args.sleep.split(",")]
    if any(levels) and not gpu:
        raise SystemExit("--sleep: vLLM's CPU build has no sleep mode (tests/test_sleep_refill.py tests the refill)")
    runs = _parse_runs(args.runs or ("adapter:8,adapter:32,full" if gpu else "adapter:8,full"))
    args.steps = args.steps or (20 if gpu else 4)
    if not gpu:  # the CPU job: a short loop on the tiny model
        args.prompts, args.samples, args.tokens = min(args.prompts, 4), min(args.samples, 2), min(args.tokens, 8)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if gpu else torch.float32)
    bs.environment()
    os.environ.setdefault("BENCH_MAX_SEQS", str(args.prompts * args.samples))  # one wave of rollouts
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = bs._checkpoint(Path(tmp), args.shapes, args.layers)
        extra = {"enable_sleep_mode": True} if any(levels) else {}
        llm = bs._engine(path, dtype, max(r for _, r in runs), **extra)  # one engine for every run, as a job keeps
        for strategy, rank in runs:
            for level in levels:
                rows.append(run(llm, path, strategy, rank, args, dtype, level))
            if args.json:  # run by run: a later run that fails keeps what was measured
                Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    print(f"\nGRPO step, {args.shapes} x {args.layers} layers, {dtype}, {'GPU' if gpu else 'CPU'}: "
          f"{args.prompts} prompts x {args.samples} samples x {args.tokens} tokens, medians of steps 2..{args.steps}")
    _print(rows)
    for r in rows:
        for a in r["alarms"]:
            print(f"  {r['run']}: {a}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 1 if args.strict and any(r["false_alarms"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
