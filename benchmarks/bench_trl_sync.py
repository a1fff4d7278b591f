"""TRL's own weight sync against hwsync's, on the same model, adapter and engine settings, through TRL's own backend.

    python benchmarks/bench_trl_sync.py                                    # CPU: tiny MoE (in the TRL venv)
    python benchmarks/bench_trl_sync.py --shapes qwen3-30b-a3b --layers 4  # GPU: Qwen3-30B-A3B layer shapes

Each side runs in a process of its own (one colocated engine per process, as in a TRL run): TRL 1.16's
``VLLMGeneration`` -- the object ``GRPOTrainer`` holds -- built on the model's checkpoint (weights ``dummy``: the
first sync writes them all), with a PEFT LoRA of rank ``--rank`` on attention and experts. After ``--warmup`` syncs,
``--syncs`` times: one "optimizer step" (every LoRA factor moves), then the sync, timed:

* **TRL**: ``VLLMGeneration.sync_weights()`` -- merge the adapter into the weights, push every parameter through the
  model's ``load_weights`` one by one, unmerge, reset the prefix cache (its engine has no LoRA: TRL never serves it);
* **hwsync**: ``hwsync.sync(engine, model)`` on the same ``VLLMGeneration``'s engine, built with LoRA serving by
  ``hwsync.trl`` (strategy ``auto``: adapter-only where the engine serves expert LoRA, else hybrid).

After every sync the engine's logprobs (prompt + 4 greedy tokens, with the synced adapter where there is one) are
compared with the trainer's on the same tokens: the gap TRL's importance-sampling correction then has to absorb. On
vLLM's CPU build in fp32 a correct sync leaves ~1e-6; on a GPU bf16 kernels alone leave 1e-2..1 (compare the two
rows). The table: median seconds per sync, MB moved, the gap (max and mean |Δ logprob| over all syncs), peak device
memory. Nothing is asserted; the JSON (``--out``) holds every sync.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sync import ATTN, EXPERTS, PROMPTS, SHAPES, _checkpoint, _on_gpu, _step, _sync_device  # noqa: E402

CPU_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_PLUGINS": "hwsync", "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""}


def _trainer(path: Path, rank: int, dtype: torch.dtype) -> Any:
    """The checkpoint's model (seeded: both sides hold the same weights) with LoRA on attention and experts."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("cuda" if _on_gpu() else "cpu"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config._name_or_path = str(path)  # what TRL's backend builds its engine from
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=ATTN, target_parameters=EXPERTS)
    model = get_peft_model(model, cfg).eval()
    _step(model, 0)  # B starts at zero in PEFT: make the adapter matter from the first sync
    return model


def _generation(model: Any, path: Path, dtype: torch.dtype, rank: int, hwsync_side: bool) -> Any:
    """TRL's ``VLLMGeneration`` (colocate) for ``model``; its engine built with hwsync's settings on hwsync's side."""
    from accelerate import Accelerator
    from transformers import AutoTokenizer
    from trl.generation.vllm_generation import VLLMGeneration

    import hwsync.patches as patches
    from hwsync.integrations.options import SyncOptions
    from hwsync.patches.trl_vllm_generation import engine_settings
    from hwsync.integrations.trl._trainer import engine_settings_for

    engine: dict[str, Any] = {"load_format": "dummy", "dtype": str(dtype).removeprefix("torch."),
                              "enforce_eager": True, "seed": 0}
    if _on_gpu():
        engine["kv_cache_memory_bytes"] = int(os.environ.get("BENCH_KV_BYTES", 1 << 30))
    else:
        engine["num_gpu_blocks_override"] = 32
    settings = engine_settings_for(model, None, None, SyncOptions(), engine) if hwsync_side else engine
    with engine_settings(settings), patches.get("trl_vllm_generation").scoped():
        return VLLMGeneration(model, Accelerator(cpu=not _on_gpu()), AutoTokenizer.from_pretrained(path),
                              mode="colocate", max_model_length=512, max_num_seqs=8,
                              gpu_memory_utilization=float(os.environ.get("BENCH_GPU_MEM", "0.35")))


def _gap(llm: Any, model: Any) -> tuple[float, float]:
    """Max and mean |Δ logprob| of the engine (greedy, its synced adapter if any) against the trainer."""
    from hwsync.trainer.api import as_engine
    from hwsync.trainer.verify import token_logprobs

    diffs = []
    for ids, values in as_engine(llm).logprobs(PROMPTS, 4):
        diffs.append((torch.tensor(values) - token_logprobs(model, ids)).abs())
    every = torch.cat(diffs)
    return float(every.max()), float(every.mean())


def run_side(side: str, args: argparse.Namespace) -> dict[str, Any]:
    """One side's syncs (in this process); a side whose sync fails reports the error instead."""
    try:
        return _run_side(side, args)
    except Exception as e:  # noqa: BLE001 - reported in the table: TRL's own sync fails on some engines
        return {"side": side, "error": f"{type(e).__name__}: {e}".splitlines()[0][:200], "shapes": args.shapes,
                "layers": args.layers, "rank": args.rank, "dtype": args.dtype,
                "device": torch.cuda.get_device_name() if _on_gpu() else "cpu"}


def _run_side(side: str, args: argparse.Namespace) -> dict[str, Any]:
    import hwsync

    dtype = getattr(torch, args.dtype)
    path = _checkpoint(Path(args.workdir), args.shapes, args.layers)
    model = _trainer(path, args.rank, dtype)
    gen = _generation(model, path, dtype, args.rank, side == "hwsync")
    llm = gen.llm
    nbytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" not in n)
    rows = []
    for i in range(args.warmup + args.syncs):
        _step(model, 100 + i)
        _sync_device()
        t0 = time.perf_counter()
        if side == "trl":
            gen.sync_weights()
            moved, strategy = nbytes, "TRL merge + load_weights"
        else:
            report = hwsync.sync(llm, model)
            moved, strategy = report.bytes, f"hwsync {report.strategy}"
        _sync_device()
        seconds = time.perf_counter() - t0
        worst, mean = _gap(llm, model)
        rows.append({"sync": i, "seconds": seconds, "bytes": moved, "strategy": strategy, "max_abs_dlogp": worst,
                     "mean_abs_dlogp": mean})
        print(f"{side} sync {i}: {seconds:.3f} s, {moved / 1e6:.1f} MB, max |Δ logprob| {worst:.2e}", flush=True)
    steady = rows[args.warmup:]
    return {"side": side, "strategy": steady[-1]["strategy"], "shapes": args.shapes, "layers": args.layers,
            "rank": args.rank, "dtype": args.dtype, "device": torch.cuda.get_device_name() if _on_gpu() else "cpu",
            "seconds": statistics.median(r["seconds"] for r in steady),
            "mb": statistics.median(r["bytes"] for r in steady) / 1e6,
            "max_abs_dlogp": max(r["max_abs_dlogp"] for r in rows),
            "mean_abs_dlogp": statistics.mean(r["mean_abs_dlogp"] for r in rows),
            "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if _on_gpu() else None, "syncs": rows}


def table(results: list[dict[str, Any]]) -> str:
    """Markdown rows (one per side and engine dtype); times relative to TRL's in the same dtype."""
    base = {r["dtype"]: r["seconds"] for r in results if r["side"] == "trl" and "error" not in r}
    lines = ["| sync | engine | what moves | MB / sync | s / sync | vs TRL | max \\|Δ logprob\\| engine vs trainer "
             "| mean \\|Δ logprob\\| | peak GB |", "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['side']} | {r['dtype']} | fails: {r['error']} | | | | | | |")
            continue
        peak = f"{r['peak_gb']:.1f}" if r["peak_gb"] is not None else "-"
        ratio = f"{base[r['dtype']] / r['seconds']:.1f}x" if r["dtype"] in base else "-"
        lines.append(f"| {r['side']} | {r['dtype']} | {r['strategy']} | {r['mb']:.1f} | {r['seconds']:.3f} | {ratio} | "
                     f"{r['max_abs_dlogp']:.1e} | {r['mean_abs_dlogp']:.1e} | {peak} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--dtype", nargs="+", default=None,
                        help="engine and trainer dtypes to run (default: bfloat16 on a GPU; float32 and bfloat16 on "
                             "CPU, where TRL's own sync cannot write into an fp32 engine)")
    parser.add_argument("--out", type=Path, default=None, help="JSON with every sync of both sides")
    parser.add_argument("--side", choices=("trl", "hwsync"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not _on_gpu():
        for key, value in CPU_ENV.items():
            os.environ.setdefault(key, value)
    dtypes = args.dtype or (["bfloat16"] if _on_gpu() else ["float32", "bfloat16"])
    if args.side is not None:  # a child: one side, result as the last line
        args.dtype = dtypes[0]
        print("RESULT " + json.dumps(run_side(args.side, args)), flush=True)
        return 0
    results = []
    with tempfile.TemporaryDirectory(prefix="hwsync-bench-trl-") as tmp:
        for dtype, side in [(d, s) for d in dtypes for s in ("trl", "hwsync")]:
            cmd = [sys.executable, __file__, "--side", side, "--workdir", tmp, "--shapes", args.shapes, "--layers",
                   str(args.layers), "--rank", str(args.rank), "--warmup", str(args.warmup), "--syncs",
                   str(args.syncs), "--dtype", dtype]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                print(proc.stdout[-3000:] + proc.stderr[-5000:], file=sys.stderr)
                raise SystemExit(f"the {side} side failed (exit {proc.returncode})")
            results.append(json.loads(lines[-1][len("RESULT "):]))
    print(f"TRL's sync vs hwsync's: {args.shapes} shapes, {args.layers} layers, LoRA r={args.rank} on attention and "
          f"experts, {args.syncs} syncs after {args.warmup} warm-up, on {results[0]['device']}")
    print(table(results))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
