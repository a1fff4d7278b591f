"""Why a healthy engine's logprobs move away from the trainer's with depth: numerics or semantics?

    python benchmarks/verify_depth.py --shapes qwen3-30b-a3b --layers 4,12,24,48 --dtypes bfloat16,float32 --json OUT

For each (dtype, depth), in a process of its own: a random model of the given shapes (the bench's), an engine
without LoRA synced from it with ``hwsync.sync(strategy="full")`` (bit-equal to vLLM's own loading: bench_sync's
exactness rows), then one prefill of the same token ids through both, traced layer by layer:

* **residual stream**: the relative error of the engine's residual stream after each decoder layer (vLLM's
  ``hidden_states + residual``) against transformers' (``output_hidden_states``): where the gap starts and how it
  grows. A semantic difference (router normalisation, top-k ties, norm eps, RoPE, the MoE combine) shows as an O(1)
  error at the first layer in fp32; numerics start at the dtype's rounding and grow by a constant factor per layer;
* **routing**: per layer, the share of tokens whose top-k expert set differs between the two, and the trainer's
  router margin (k-th minus (k+1)-th logit) at those tokens against its median margin (near-ties or not);
* **logprobs**: engine vs trainer over prompt + 16 greedy tokens, and the trainer's own numerics spread
  (:func:`hwsync.verify.numerics_spread`: every layer's output rounded by one unit of the engine's precision) --
  the scale :func:`hwsync.verify.check` reads the gap against.

fp32 runs set ``TRITON_F32_DEFAULT=ieee`` (vLLM's fused-MoE Triton ``tl.dot`` takes Triton's fp32 default, TF32
otherwise) and turn torch's TF32 off, so both sides compute in IEEE fp32. ``--train-steps N`` first trains the random
model N SGD steps of next-token prediction on local text (this repository's docs, the bench's tokenizer), giving
its routers margins a random model lacks; the engine keeps the untrained policy meanwhile, so each row also says
what :func:`hwsync.verify.check` concludes on an engine serving another policy (logprobs alone: its content checks
would catch it exactly) beside its verdict once synced. Prints one table; exits non-zero only when a child fails.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_sync as bs  # noqa: E402

PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8, 41, 12, 90, 3], [3, 4, 200, 17, 18, 99, 250, 6, 61]]


def _vllm_layers(llm: Any) -> list[Any]:
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    return list(model.model.layers)


def _trace_engine(llm: Any, ids: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """One prefill of ``ids``: the residual stream after each layer and each layer's router logits."""
    from vllm import SamplingParams

    streams: list[torch.Tensor] = []
    routers: list[torch.Tensor | None] = []
    handles = []
    layers = _vllm_layers(llm)
    seen: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(layers):
        def after(module: Any, args: Any, out: Any, i: int = i) -> None:
            if len(streams) < len(layers) and len(streams) == i:
                h, r = out if isinstance(out, tuple) else (out, None)
                streams.append((h if r is None else h + r).float().cpu())
        handles.append(layer.register_forward_hook(after))
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None:
            def logits(module: Any, args: Any, out: Any, i: int = i) -> None:
                if i not in seen:
                    seen[i] = (out[0] if isinstance(out, tuple) else out).float().cpu()
            handles.append(gate.register_forward_hook(logits))
    try:
        llm.reset_prefix_cache()
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    finally:
        for h in handles:
            h.remove()
    routers = [seen.get(i) for i in range(len(layers))]
    return streams, routers


def _trace_trainer(model: Any, ids: list[int], experts: int) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    seen: dict[int, torch.Tensor] = {}
    handles = []
    from hwsync.trainer.verify import decoder_layers

    for i, layer in enumerate(decoder_layers(model)):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is None:
            continue

        def logits(module: Any, args: Any, out: Any, i: int = i) -> None:
            outs = out if isinstance(out, tuple) else (out,)
            for t in outs:
                if isinstance(t, torch.Tensor) and t.shape[-1] == experts and t.is_floating_point():
                    seen[i] = t.reshape(-1, experts).float().cpu()
                    return
        handles.append(gate.register_forward_hook(logits))
    try:
        with torch.no_grad():
            x = torch.tensor([ids], device=next(model.parameters()).device)
            out = model(input_ids=x, use_cache=False, output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    hs = [h[0].float().cpu() for h in out.hidden_states[1:]]
    return hs, [seen.get(i) for i in range(len(hs))]


def _train(model: Any, steps: int, device: str) -> float:
    """``steps`` SGD steps of next-token prediction on this repository's docs, tokenized by the bench's tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model.name_or_path)
    text = " ".join(p.read_text() for p in sorted((HERE.parent / "docs").glob("*.md")))
    ids = torch.tensor(tok(text)["input_ids"][: 64 * 8 * steps + 1])
    vocab = model.config.vocab_size
    ids = ids.clamp(max=vocab - 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model.train()
    loss = float("nan")
    for s in range(steps):
        chunk = ids[s * 512: s * 512 + 513]
        if chunk.numel() < 513:
            chunk = ids[:513]
        x = chunk[:-1].reshape(8, 64).to(device)
        y = chunk[1:].reshape(8, 64).to(device)
        logits = model(input_ids=x, use_cache=False).logits.float()
        lossT = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        lossT.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = float(lossT)
    model.eval()
    return loss


def child(args: argparse.Namespace) -> dict[str, Any]:
    import hwsync
    from hwsync.trainer.verify import agreement, check, numerics_spread, rounding_unit

    dtype = getattr(torch, args.dtype)
    if dtype == torch.float32:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    tmp = Path(tempfile.mkdtemp())
    path = bs._checkpoint(tmp, args.shapes, args.depth)
    model = bs._trainer(path, "full", 0, dtype)
    model.name_or_path = str(path)
    device = "cuda" if bs._on_gpu() else "cpu"
    llm = bs._engine(path, dtype, 0, lora=False)
    loss, other = None, None
    if args.train_steps:  # the engine keeps the policy before training: verify must call that another policy
        hwsync.sync(llm, model, strategy="full")
        loss = _train(model, args.train_steps, device)
        other = _verdict(check(llm, model, PROMPTS, max_tokens=16, content=False))
    hwsync.sync(llm, model, strategy="full")
    healthy = _verdict(check(llm, model, PROMPTS, max_tokens=16))
    experts = bs.SHAPES[args.shapes]["num_experts"]
    k = bs.SHAPES[args.shapes]["num_experts_per_tok"]
    a = agreement(llm, model, PROMPTS, max_tokens=16)
    info = hwsync.as_engine(llm).describe()
    spread = numerics_spread(model, a.sequences, rounding_unit(info.device_type, info.dtype))
    ids = list(a.sequences[0][0])
    e_streams, e_routers = _trace_engine(llm, ids)
    t_streams, t_routers = _trace_trainer(model, ids, experts)
    layers = []
    # transformers' last hidden state is after the final norm, vLLM's residual stream is not: layers 0..L-2
    for i, (e, t) in enumerate(zip(e_streams[:-1], t_streams[:-1])):
        if e.shape != t.shape:
            layers.append({"layer": i, "note": f"shapes {list(e.shape)} vs {list(t.shape)}"})
            continue
        rel = ((e - t).norm(dim=-1) / t.norm(dim=-1).clamp(min=1e-30))
        row: dict[str, Any] = {"layer": i, "rel_median": float(rel.median()), "rel_max": float(rel.max())}
        er, tr = e_routers[i], t_routers[i]
        if er is not None and tr is not None and er.shape == tr.shape:
            es, ts = er.topk(k).indices.sort().values, tr.topk(k).indices.sort().values
            differ = (es != ts).any(-1)
            top = tr.topk(k + 1).values
            margin = top[:, k - 1] - top[:, k]
            row.update(route_differ=float(differ.float().mean()),
                       margin_at_differ=float(margin[differ].median()) if differ.any() else None,
                       margin_median=float(margin.median()))
        layers.append(row)
    first = next((r for r in layers if "rel_median" in r), {})
    last = next((r for r in reversed(layers) if "rel_median" in r), {})
    n = max(1, (last.get("layer", 0) - first.get("layer", 0)))
    growth = (last.get("rel_median", 0) / max(first.get("rel_median", 1e-30), 1e-30)) ** (1 / n) if n else None
    return dict(shapes=args.shapes, depth=args.depth, dtype=args.dtype, train_steps=args.train_steps, train_loss=loss,
                mean_abs=a.mean_abs_diff, p90_abs=a.p90_abs_diff, max_abs=a.max_abs_diff, tokens=a.tokens,
                spread_mean=spread.mean_abs if spread else None, spread_p90=spread.p90_abs if spread else None,
                ratio=a.mean_abs_diff / spread.mean_abs if spread and spread.mean_abs else None,
                layer0_rel=first.get("rel_median"), last_rel=last.get("rel_median"), growth_per_layer=growth,
                route_differ_first=first.get("route_differ"), route_differ_last=last.get("route_differ"),
                verify=healthy, other_policy=other, layers=layers)


def _verdict(report: Any) -> dict[str, Any]:
    """What hwsync's check concluded: passed or not, decisive or weak, and the logprob line it gave."""
    logprobs = next((c for c in report.checks if c.name == "logprobs"), None)
    return {"ok": report.ok, "failed": [c.name for c in report.failed], "weak": bool(report.weak),
            "logprobs": logprobs.detail if logprobs else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="tiny", choices=sorted(bs.SHAPES))
    ap.add_argument("--layers", default="2,4")
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--train-steps", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--depth", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    bs.environment()
    if args.child:
        print("RESULT " + json.dumps(child(args), default=str), flush=True)
        return 0
    rows, failed = [], 0
    for dtype in args.dtypes.split(","):
        for depth in [int(x) for x in args.layers.split(",")]:
            env = dict(os.environ)
            if dtype == "float32":
                env["TRITON_F32_DEFAULT"] = "ieee"
            cmd = [sys.executable, __file__, "--child", "--shapes", args.shapes, "--depth", str(depth), "--dtype",
                   dtype, "--train-steps", str(args.train_steps)]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            got = [line[7:] for line in p.stdout.splitlines() if line.startswith("RESULT ")]
            if p.returncode or not got:
                failed += 1
                print(f"{dtype} x {depth}: FAILED\n{(p.stdout + p.stderr)[-3000:]}", flush=True)
                continue
            rows.append(json.loads(got[0]))
            r = rows[-1]
            print(f"{dtype} x {depth}: mean |Δ| {r['mean_abs']:.3g}, spread {r['spread_mean']}, layer-0 rel "
                  f"{r['layer0_rel']}, last {r['last_rel']}, growth/layer {r['growth_per_layer']}; verify synced "
                  f"{r['verify']}, on the untrained policy {r['other_policy']}", flush=True)
    print("\n| dtype | layers | trained (loss) | mean \\|Δ logprob\\| | numerics spread | gap / spread | residual rel. "
          "err. layer 0 | layer L-2 | growth per layer | top-k differs, layer 0 | last layer | verify, synced | "
          "verify, engine on the untrained policy |")
    print("|" + "|".join("---" for _ in range(13)) + "|")
    for r in rows:
        def f(x: Any) -> str:
            return "-" if x is None else f"{x:.3g}"

        def v(x: dict[str, Any] | None) -> str:
            return "-" if not x else ("passed" + (" (weak evidence)" if x["weak"] else "") if x["ok"]
                                      else "failed: " + ", ".join(x["failed"]))
        trained = f"{r['train_steps']} ({f(r['train_loss'])})" if r["train_steps"] else "-"
        print(f"| {r['dtype']} | {r['depth']} | {trained} | {f(r['mean_abs'])} | {f(r['spread_mean'])} | "
              f"{f(r['ratio'])} | {f(r['layer0_rel'])} | {f(r['last_rel'])} | {f(r['growth_per_layer'])} | "
              f"{f(r['route_differ_first'])} | {f(r['route_differ_last'])} | {v(r.get('verify'))} | "
              f"{v(r.get('other_policy'))} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
