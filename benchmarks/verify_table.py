"""How far apart are healthy syncs and broken ones, per check of ``hwsync.verify``? (markdown tables, ``--json``)

Per dtype and strategy, one real vLLM engine (settings from ``hwsync.testing.engine.engine_args``; one engine at a
time) on the tiny Qwen3-MoE: ``--steps`` healthy syncs, each checked (``hwsync.verify.check``), then every fault of
``hwsync.testing.faults`` injected into the engine's real state, checked, repaired. Prints

1. per check: the healthy max, the faulty min over the faults that check catches, their ratio (the margin), and which
   faults it catches (the others are another check's: the per-fault table);
2. per fault: which checks fired and the values they measured.

Dtypes: on vLLM's CPU build ``float32`` (+ ``bfloat16`` if the build serves it); on CUDA ``bfloat16`` (LoRA
engines: vLLM's LoRA kernels take only bf16/fp16) for every strategy plus ``float32`` for ``full`` (an engine
without LoRA). ``--dtypes`` picks others.

    python benchmarks/verify_table.py --json verify.json            # CPU or CUDA
    python benchmarks/verify_table.py --shapes qwen3-30b-a3b --layers 48 --strategies adapter --steps 5   # GPU

``--shapes``/``--layers`` run the campaign on the sync bench's model instead (``benchmarks/bench_sync.py``: the
real layer shapes, random bf16 weights, an engine loaded with ``load_format="dummy"`` that hwsync fills, LoRA rank
``--rank`` on attention and experts): the checks at the users' depth.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8], [3, 4, 200, 17, 18, 99], [11, 400, 23], [7, 7, 300, 41, 2, 90, 12]]
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
CHECKS = ("state", "base content", "adapter slots", "adapter content", "logprobs")
RAW = ("mean |Δlogp|", "p90 |Δlogp|", "mean |Δp|", "max |Δlogp|")


def _trainer(path: Path, experts: bool, device: str) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    # o_proj: scaling 6/4, not a power of two (the fault "scaling folded in another order" needs one)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=ATTN, target_parameters=EXPERTS if experts else None,
                     alpha_pattern={"o_proj": 6})
    return get_peft_model(model, cfg).eval()


def _plan(dtypes: str | None, on_cpu: bool, strategies: list[str]) -> list[tuple[str, str]]:
    if dtypes:
        return [(d, s) for d in dtypes.split(",") for s in strategies]
    if on_cpu:
        return [("float32", s) for s in strategies] + [("bfloat16", s) for s in strategies]
    return [("bfloat16", s) for s in strategies] + [("float32", "full")] * ("full" in strategies)


def run_bench_model(args: argparse.Namespace) -> dict[str, Any]:
    """The campaign on the sync bench's model (``--shapes``, ``--layers``): one engine, each strategy's trainer in
    turn (bf16 on GPUs, fp32 on CPU)."""
    import gc

    import vllm

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_sync as bs

    from hwsync import as_engine
    from hwsync.testing.faults import campaign

    bs.environment()
    gpu = bs._on_gpu()
    dtype = torch.bfloat16 if gpu else torch.float32
    path = bs._checkpoint(Path(tempfile.mkdtemp(prefix="verify_table_")), args.shapes, args.layers)
    llm = bs._engine(path, dtype, args.rank)
    results: list[dict[str, Any]] = []
    t0 = time.time()
    for strategy in args.strategies.split(","):
        model = bs._trainer(path, strategy, args.rank, dtype)
        try:
            res = campaign(llm, model, strategy, PROMPTS, steps=args.steps,
                           log=(lambda m: print(m, file=sys.stderr, flush=True)) if args.verbose else None)
        except Exception as e:  # noqa: BLE001 - record and go on with the next strategy
            print(f"{strategy}: {type(e).__name__}: {e}", file=sys.stderr)
            results.append({"dtype": str(dtype), "strategy": strategy, "error": f"{type(e).__name__}: {e}"})
            continue
        info = as_engine(llm).describe()
        res.update(dtype=info.dtype, device=info.device_type, engine=info.engine, seconds=time.time() - t0)
        results.append(res)
        print(f"{strategy}: " + json.dumps(res, default=str)[:3000], flush=True)  # kept if a later strategy fails
        # the engine handle's plans and verify's caches hold this trainer's tensors: at 48 layers the next trainer
        # fits beside the engine only once they are gone
        as_engine(llm).plans.clear()
        as_engine(llm).checks.clear()
        del model
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
    return {"device": "cuda" if gpu else "cpu", "vllm": vllm.__version__, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if gpu else None, "steps": args.steps, "runs": results,
            "model": f"{args.shapes} x {args.layers} layers, LoRA r{args.rank}"}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from hwsync.testing import close_llm, make_llm, make_tiny_moe, on_cpu
    from hwsync.testing.faults import campaign

    try:
        from hwsync.engine import vllm_plugin

        vllm_plugin.register()
    except Exception as e:  # noqa: BLE001 - the plugin is a convenience here; its absence shows in the numbers
        print(f"hwsync vLLM plugin not registered: {e}", file=sys.stderr)
    cpu = on_cpu()
    if cpu:
        torch.set_num_threads(max(1, int(args.threads)))
    device = "cpu" if cpu else "cuda"
    root = Path(tempfile.mkdtemp(prefix="verify_table_"))
    model_dir = make_tiny_moe(root / "tiny", "qwen3_moe")
    import vllm

    results: list[dict[str, Any]] = []
    runs = _plan(args.dtypes, cpu, args.strategies.split(","))
    for dtype in dict.fromkeys(d for d, _ in runs):
        strategies = [s for d, s in runs if d == dtype]
        lora = strategies != ["full"] or cpu
        engine_kw: dict[str, Any] = {"dtype": dtype}
        if lora:
            engine_kw.update(enable_lora=True, max_lora_rank=8, max_loras=1)
        t0 = time.time()
        try:
            llm = make_llm(model_dir, **engine_kw)
        except Exception as e:  # noqa: BLE001 - e.g. a build that does not serve this dtype with LoRA
            print(f"{dtype}: engine refused ({type(e).__name__}: {str(e)[:300]})", file=sys.stderr)
            results.append({"dtype": dtype, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        try:
            for strategy in strategies:
                from hwsync import as_engine

                info = as_engine(llm).describe()
                model = _trainer(model_dir, experts=strategy != "adapter" or info.moe_lora, device=device)
                try:
                    res = campaign(llm, model, strategy, PROMPTS, steps=args.steps,
                                   log=(lambda m: print(m, file=sys.stderr)) if args.verbose else None)
                except Exception as e:  # noqa: BLE001 - record and go on with the next strategy
                    print(f"{dtype} {strategy}: {type(e).__name__}: {e}", file=sys.stderr)
                    results.append({"dtype": dtype, "strategy": strategy, "error": f"{type(e).__name__}: {e}"})
                    continue
                res.update(dtype=dtype, device=info.device_type, engine=info.engine, seconds=time.time() - t0)
                results.append(res)
                del model
        finally:
            close_llm(llm)
    return {"device": device, "vllm": vllm.__version__, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if not cpu else None, "steps": args.steps, "runs": results}


def _f(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    if math.isinf(x):
        return "inf"
    return f"{x:.2g}"


def tables(data: dict[str, Any]) -> str:
    runs = [r for r in data["runs"] if "error" not in r]
    out = [f"vLLM {data['vllm']}, torch {data['torch']}, {data['gpu'] or 'CPU'}; {data['steps']} healthy syncs per "
           "strategy; values: base content = deviation from the trainer's tensors in units of its allowance (8 ulps "
           "of the largest element; 0: bit-equal), adapter content = views of the installed adapter that differ, "
           "state/slots = problems found, logprobs = largest ratio of a statistic to its gate (or to 4x the model's "
           "numerics spread, whichever is smaller); <= 1 passes for base content and logprobs, 0 for the others", ""]
    out.append("| dtype | check | healthy max | faulty min (faults it catches) | margin | catches |")
    out.append("|---|---|---|---|---|---|")
    for dtype in dict.fromkeys(r["dtype"] for r in runs):
        rs = [r for r in runs if r["dtype"] == dtype]
        for check in CHECKS:
            healthy = [h[check] for r in rs for h in r["healthy"] if check in h]
            faulty = {(r["strategy"], f): v[check] for r in rs for f, v in r["faults"].items() if check in v}
            caught = {(r["strategy"], f): v[check] for r in rs for f, v in r["faults"].items()
                      if check in v["failed"]}
            if not healthy and not faulty:
                continue
            hmax = max(healthy) if healthy else None
            fmin = min(caught.values()) if caught else None
            if hmax is not None and fmin is not None:
                margin = "exact" if hmax == 0 else _f(fmin / hmax) + "x"
            else:
                margin = "-"
            seen = sorted({f for (_, f) in caught})  # what a check does not see, another does: the fault table
            unseen = sorted({f for (_, f) in faulty} - set(seen))
            catches = f"every fault but {', '.join(unseen)}" if 0 < len(unseen) <= 2 < len(seen) else ", ".join(seen)
            out.append(f"| {dtype} | {check} | {_f(hmax)} | {_f(fmin)} | {margin} | {catches or '-'} |")
    out += ["", "| dtype | strategy | healthy: false alarms | healthy max mean/p90/max \\|Δlogp\\| |",
            "|---|---|---|---|"]
    for r in runs:
        hs = r["healthy"]
        alarms = sum(1 for h in hs if h["failed"])
        stats = "/".join(_f(max(h[k] for h in hs)) for k in ("mean |Δlogp|", "p90 |Δlogp|", "max |Δlogp|"))
        out.append(f"| {r['dtype']} | {r['strategy']} | {alarms} of {len(hs)} | {stats} |")
    out += ["", "| dtype | strategy | fault | caught by | base content (x allowance) | adapter content (x allowance) | "
            "logprobs (gate ratio) | mean \\|Δlogp\\| |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        for f, v in r["faults"].items():
            out.append(f"| {r['dtype']} | {r['strategy']} | {f} | {', '.join(v['failed']) or '**MISSED**'} | "
                       f"{_f(v.get('base content'))} | {_f(v.get('adapter content'))} | {_f(v.get('logprobs'))} | "
                       f"{_f(v.get('mean |Δlogp|'))} |")
    na = [f"- {r['dtype']} {r['strategy']}: {f}: not applicable ({why})" for r in runs
          for f, why in r.get("not_applicable", {}).items()]
    if na:
        out += [""] + na
    errors = [r for r in data["runs"] if "error" in r]
    if errors:
        out += [""] + [f"- {r['dtype']} {r.get('strategy', '')}: not run: {r['error']}" for r in errors]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", default="full,adapter,hybrid")
    p.add_argument("--dtypes", default=None, help="comma-separated engine dtypes (default: per platform, see above)")
    p.add_argument("--steps", type=int, default=20, help="healthy syncs per strategy")
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    p.add_argument("--json", default=None, help="write every measurement here")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--shapes", default=None, help="the sync bench's model shapes (default: the tiny fixture)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rank", type=int, default=8)
    args = p.parse_args(argv)
    data = run_bench_model(args) if args.shapes else run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1, default=str))
    print(tables(data))
    bad = [r for r in data["runs"] if "error" not in r and (
        any(h["failed"] for h in r["healthy"]) or any(not v["failed"] for v in r["faults"].values()))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
