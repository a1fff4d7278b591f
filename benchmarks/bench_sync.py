"""Weight-sync cost per strategy into a real vLLM engine, against baselines measured in the same run.

Tables:

1. Colocate (engine in this process), one row per strategy: bytes per sync (first / steady state), median seconds,
   GB/s, max |Δ logprob| after the last sync (``hwsync.verify``).
2. Baselines on the same engine and weights:
   * ms-swift colocate (``_load_state_dict_to_vllm``): one raw ``model.load_weights`` of the merged state dict;
   * whole-model ``reload_weights`` of the materialised merged state dict (no manifest, no validation, no patch);
   each with its seconds and the max |Δ logprob| it leaves (or the error it raises).
3. Bucket sweep, server mode (engine in a second process, gloo over loopback), ``full`` strategy: seconds and
   GB/s per bucket size. The default bucket size (``hwsync.sync.api._DEFAULT_MB``) comes from this table.

Usage: python benchmarks/bench_sync.py [--quick] [--json OUT.json]

The model is a synthetic Qwen3-MoE (``hwsync.testing.make_tiny_moe`` with larger sizes, ~100 MB fp32 by default),
so the numbers measure hwsync + vLLM's reload path, not a real checkpoint. Seconds are wall time of
``hwsync.sync`` (manifest, validation, transfer, reload, post-processing, adapter install, prefix-cache reset).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import torch

SIZES = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=4,
             num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256)
QUICK = dict(SIZES, num_hidden_layers=2, num_experts=16)
PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8], [3, 4, 200, 17, 18, 99]]
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
TOKEN = "bench"

ENGINE = textwrap.dedent("""
    import sys
    import hwsync.sync as hs
    from hwsync.testing import make_llm
    llm = make_llm(sys.argv[1])
    with hs.serve(llm, "127.0.0.1:0", sys.argv[2], timeout_s=600) as server:
        print("HWSYNC_ADDRESS", server.address, flush=True)
        server.wait()
""")


def _trainer(path: Path, lora: str | None) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if lora is None:
        return model
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=ATTN, target_parameters=EXPERTS if lora == "all" else None)
    return get_peft_model(model, cfg).eval()


def _step(model: Any, seed: int) -> None:
    """One 'optimizer step': LoRA factors move (or, without LoRA, every weight)."""
    g = torch.Generator().manual_seed(seed)
    has_lora = any("lora_" in n for n, _ in model.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
            elif not has_lora:
                p.mul_(1 + torch.randn(p.shape, generator=g) * 0.01)


def _row(name: str, reports: list[Any], diff: float | str) -> dict[str, Any]:
    steady = reports[1:] or reports
    sec = statistics.median(r.seconds for r in steady)
    return {"case": name, "first_MB": reports[0].bytes / 1e6, "steady_MB": steady[-1].bytes / 1e6,
            "seconds": sec, "GB/s": steady[-1].bytes / 1e9 / sec, "buckets": steady[-1].buckets, "max_dlogprob": diff}


def _print(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n## {title}")
    if not rows:
        return
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        cells = [f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()]
        print("| " + " | ".join(cells) + " |")


def colocate(path: Path, n: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    import hwsync
    from hwsync import vllm_plugin
    from hwsync.merged import merged_named_weights
    from hwsync.testing import make_llm

    vllm_plugin.register()
    llm = make_llm(path, enable_lora=True, max_lora_rank=8, max_loras=1, lora_target_modules=["qkv_proj", "o_proj"])
    rows = []
    cases = [("full (no LoRA)", "full", None), ("full (LoRA attn+experts, merged view)", "full", "all"),
             ("hybrid (LoRA attn + merged experts)", "hybrid", "all"), ("adapter (LoRA attn)", "adapter", "attn")]
    for label, strategy, lora in cases:
        model = _trainer(path, lora)
        reports = []
        for i in range(n):
            _step(model, i)
            reports.append(hwsync.sync(llm, model, strategy=strategy))
        rows.append(_row(label, reports, hwsync.verify(llm, model, PROMPTS, atol=1.0)))

    base = []
    model = _trainer(path, "all")
    _step(model, 99)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    state = None
    t0 = time.perf_counter()
    try:
        state = dict(merged_named_weights(model))
        runner.get_model().load_weights(state.items())
        diff: float | str = hwsync.sync.agreement(llm, model, PROMPTS).max_abs_diff
    except Exception as e:  # noqa: BLE001 - the baseline failing is a result
        diff = f"fails: {type(e).__name__}: {str(e)[:60]}"
    nbytes = sum(t.numel() * t.element_size() for t in (state or {}).values())
    sec = time.perf_counter() - t0
    base.append({"case": "ms-swift colocate: raw load_weights(merged)", "MB": nbytes / 1e6, "seconds": sec,
                 "GB/s": nbytes / 1e9 / sec, "max_dlogprob": diff})
    t0 = time.perf_counter()
    state = dict(merged_named_weights(model))
    runner.reload_weights(weights_iterator=iter(state.items()), is_checkpoint_format=True)
    llm.reset_prefix_cache()
    sec = time.perf_counter() - t0
    diff = hwsync.sync.agreement(llm, model, PROMPTS).max_abs_diff
    base.append({"case": "whole-model reload_weights(merged), unpatched", "MB": nbytes / 1e6, "seconds": sec,
                 "GB/s": nbytes / 1e9 / sec, "max_dlogprob": diff})
    r = hwsync.sync(llm, model, strategy="full")
    base.append({"case": "hwsync.sync(strategy='full'), same weights", "MB": r.bytes / 1e6, "seconds": r.seconds,
                 "GB/s": r.gbps, "max_dlogprob": hwsync.verify(llm, model, PROMPTS, atol=1.0)})
    return rows, base


def sweep(path: Path, sizes: list[float], n: int) -> list[dict[str, Any]]:
    import hwsync
    from hwsync.testing import vllm_cpu_env

    env = {**os.environ, **vllm_cpu_env()}
    proc = subprocess.Popen([sys.executable, "-c", ENGINE, str(path), TOKEN], env=env, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    address = next(line.split()[1] for line in proc.stdout if line.startswith("HWSYNC_ADDRESS"))
    # keep draining the engine's stdout (vLLM logs there): a full pipe would block the engine mid-sync
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    rows = []
    try:
        engine = hwsync.connect(address, TOKEN, timeout_s=600)
        model = _trainer(path, None)
        hwsync.sync(engine, model, strategy="full")  # warm-up: validation, group setup
        for mb in sizes:
            reports = []
            for i in range(n):
                _step(model, 1000 + i)
                reports.append(hwsync.sync(engine, model, strategy="full", bucket_mb=mb))
            row = _row(f"server full, bucket {mb:g} MB", [reports[0], *reports], hwsync.verify(engine, model, PROMPTS,
                                                                                              atol=1.0))
            rows.append(row)
        engine.shutdown()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller model, fewer syncs")
    ap.add_argument("--json", help="write all rows here")
    ap.add_argument("--buckets", default="1,4,16,64,256", help="bucket sizes (MB) for the sweep")
    args = ap.parse_args()
    # OMP_NUM_THREADS=1 unless told otherwise: on a small shared box, multi-threaded copies spin on busy cores
    # (a 256 KB copy_ takes 2.7 ms with 2 threads vs 0.09 ms with 1 here) and would dominate every number
    for key, value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                       "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_PLUGINS": "", "OMP_NUM_THREADS": "1"}.items():
        os.environ.setdefault(key, value)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from hwsync.testing import make_tiny_moe

    n = 3 if args.quick else 5
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_moe(Path(tmp) / "moe", **(QUICK if args.quick else SIZES))
        mb = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e6
        print(f"model: synthetic Qwen3-MoE {QUICK if args.quick else SIZES}, {mb:.1f} MB fp32; torch threads "
              f"{torch.get_num_threads()}")
        rows, base = colocate(path, n)
        _print("colocate, per strategy", rows)
        _print("baselines (same engine, same merged weights)", base)
        swept = sweep(path, [float(x) for x in args.buckets.split(",")], n)
        _print("server mode (gloo, loopback), bucket sweep", swept)
    if args.json:
        Path(args.json).write_text(json.dumps({"colocate": rows, "baselines": base, "sweep": swept}, indent=2,
                                              default=str))


if __name__ == "__main__":
    main()
