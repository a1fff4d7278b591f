"""Issue 29, measured: how far an engine is from vLLM's own loading and from the fp32 trainer, when hwsync folds the
LoRA scalings into B in vLLM's order (cast to the LoRA dtype, then scaled in it: what hwsync does) or in fp32 with
one rounding (what it did before).

Per LoRA cell of ``hwsync.testing.lora_configs`` whose scalings are not all powers of two (and ``alpha = 2r`` as the
control), on one bf16 engine with LoRA (CPU build: attention LoRA; GPU: ``enable_mixed_moe_lora_format``): ``--syncs``
adapter syncs with changing weights; after each, the engine is synced once in each order (same weights) and its
prompt + greedy logprobs are compared with vLLM's own loading of the saved adapter (a reference engine) and with
the trainer's fp32 forward on the same tokens (``hwsync.verify.agreement``). Prints a Markdown table (``--json``).

    python benchmarks/lora_fold_order.py [--syncs 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

CELLS = ("alpha = 2r", "alpha/r not a power of two", "rsLoRA", "rank/alpha_pattern by name",
         "rank/alpha_pattern by regex", "experts, rank ≠ attention", "two adapters, set_adapter")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import hwsync
    from hwsync.testing import EngineReference, close_llm, engine_patches, make_llm, make_tiny_moe, on_cpu
    from hwsync.testing.faults import fold_fp32
    from hwsync.testing.lora_configs import CELLS as ALL
    from hwsync.testing.lora_configs import PROMPTS, _step, make_trainer
    from hwsync.testing.reference import ReferenceMismatch, compare_logprobs
    from hwsync.trainer.verify import agreement

    cpu = on_cpu()
    if cpu:
        torch.set_num_threads(1)
    kwargs: dict[str, Any] = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1, "dtype": "bfloat16"}
    if not cpu:
        kwargs["enable_mixed_moe_lora_format"] = True
    root = Path(tempfile.mkdtemp(prefix="fold_order_"))
    ckpt = make_tiny_moe(root / "tiny", "qwen3_moe")
    rows = []
    with engine_patches(threads=None):
        llm = make_llm(ckpt, worker_extension_cls="hwsync.vllm.HwsyncWorkerExtension", **kwargs)
        reference = EngineReference(root / "reference", **kwargs)
        serves_experts = reference.serves_expert_lora()
        try:
            for cell in (c for c in ALL if c.name in CELLS):
                if cell.experts and not serves_experts:
                    continue
                model = make_trainer(cell, ckpt)
                gen = torch.Generator().manual_seed(7)
                acc: dict[str, dict[str, float]] = {o: {"vllm": 0.0, "flips": 0, "trainer_max": 0.0,
                                                        "trainer_mean": 0.0} for o in ("vllm order", "fp32 once")}
                for i in range(args.syncs):
                    _step(model, cell, gen, i)
                    want = None
                    for order in ("fp32 once", "vllm order"):  # the right one last: the engine keeps it
                        hwsync.sync(llm, model, strategy="adapter", fold=fold_fp32 if order == "fp32 once" else None)
                        got = hwsync.as_engine(llm).logprobs(PROMPTS, 4)
                        want = want or reference.logprobs(model, "adapter", PROMPTS, 4, engine=llm)
                        a = acc[order]
                        try:
                            a["vllm"] = max(a["vllm"], compare_logprobs(got, want))
                        except ReferenceMismatch:
                            a["flips"] += 1
                            a["vllm"] = float("inf")
                        t = agreement(llm, model, PROMPTS, max_tokens=4)
                        a["trainer_max"] = max(a["trainer_max"], t.max_abs_diff)
                        a["trainer_mean"] += t.mean_abs_diff / args.syncs
                rows.append({"cell": cell.name, "syncs": args.syncs, **{o: v for o, v in acc.items()}})
                print(json.dumps(rows[-1]), flush=True)
        finally:
            reference.close()
            close_llm(llm)
    from hwsync.testing.families import _device_name, _versions

    return {"platform": "cpu" if cpu else _device_name(), "versions": _versions(), "engine": kwargs, "rows": rows}


def table(data: dict[str, Any]) -> str:
    def num(x: float) -> str:
        return "tokens differ" if x == float("inf") else ("0" if x == 0 else f"{x:.2g}")

    lines = [f"{data['platform']}, engine {json.dumps(data['engine'], sort_keys=True)}; versions "
             + ", ".join(f"{k} {v}" for k, v in data["versions"].items()), "",
             "| cell | syncs | vs vLLM's own loading: vLLM order | fp32 once | vs fp32 trainer, max / mean \\|Δ\\|: "
             "vLLM order | fp32 once |", "|---|---|---|---|---|---|"]
    for r in data["rows"]:
        v, o = r["vllm order"], r["fp32 once"]
        flips = f" ({o['flips']} of {r['syncs']} syncs: other greedy tokens)" if o["flips"] else ""
        lines.append(f"| {r['cell']} | {r['syncs']} | {num(v['vllm'])} | {num(o['vllm'])}{flips} | "
                     f"{num(v['trainer_max'])} / {num(v['trainer_mean'])} | "
                     f"{num(o['trainer_max'])} / {num(o['trainer_mean'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    data = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
