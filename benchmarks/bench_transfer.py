"""hwsync through vLLM's weight-transfer API, side by side with hwsync's own path and vLLM's built-in IPC backend.

    python benchmarks/bench_transfer.py --shapes qwen3-30b-a3b --layers 48 --rank 32 --json OUT

The sync bench's model (``bench_sync.py``: config + tokenizer, a dummy-loaded engine, a trainer of the same shapes),
one process per path so each has the GPU to itself, every path timed the same way (``--warmup`` syncs, then the
median of ``--syncs``, each after an "optimizer step" that changes every weight it carries):

* **hwsync-as-backend**: ``LLM(..., weight_transfer_config={"backend": "hwsync"})`` and ``hwsync.sync(llm, model)``,
  which drives vLLM's own verbs (``start_weight_update`` / ``update_weights`` / ``finish_weight_update``);
* **hwsync direct**: the same engine synced through hwsync's own handle (``hwsync.engine.vllm.local.local_engine``),
  the path ``hwsync.sync`` takes for an engine that did not select the backend;
* **vLLM ipc**: vLLM's built-in colocated backend (``weight_transfer_config={"backend": "ipc"}``, the engine core in
  its own process as vLLM runs it, CUDA IPC handles, ``packed=True`` with a buffer of max(1 GiB, the largest
  tensor), ``ModuleSource(model)``, the offline ``LLM``'s weight-transfer methods as the client). CUDA only.

``full`` moves every weight (no LoRA in the engine); ``adapter`` moves the LoRA (rank ``--rank``, attention + experts)
through hwsync's two paths only: vLLM's backends have no adapter sync. Exactness: after its first sync each path's
engine serves the same untouched trainer, so its check-prompt logprobs must equal hwsync direct's bit for bit
(full: vLLM's repeat spread is 0 without LoRA); the backend and direct paths are also compared on one state (base
and LoRA slot checksums equal; logprobs equal for full, reported for adapter: vLLM's LoRA kernels on a GPU repeat
only within their own spread). vLLM's ``nccl`` backend needs a second GPU (NCCL refuses one device twice): not run
on one. The table gives each path's ratio to hwsync direct. Exits 1 when a path is not exact.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_sync as bs  # noqa: E402 - the benchmark's model, trainer and engine live there

PATHS = ("backend", "direct", "ipc")


class OfflineClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over an offline ``vllm.LLM`` (its weight-transfer methods)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


def _timed(sync: Any, model: Any, n: int) -> tuple[list[float], Any]:
    """``n`` syncs, each after one step that changes every weight it carries: seconds each (device synchronized)
    and the last sync's result."""
    times, out = [], None
    for i in range(n):
        bs._step(model, 100 + i)
        bs._sync_device()
        t0 = time.perf_counter()
        out = sync()
        bs._sync_device()
        times.append(time.perf_counter() - t0)
    return times, out


def _row(path: str, strategy: str, first: float, times: list[float], warmup: int, nbytes: int) -> dict[str, Any]:
    """One path's row: the first sync, the median of the steady ones, the bytes a steady sync carries."""
    steady = statistics.median(times[warmup:] or times[-1:])
    return {"path": path, "strategy": strategy, "first_s": first, "seconds": steady, "MB": nbytes / 1e6,
            "GB/s": nbytes / 1e9 / steady if steady else float("nan")}


def child_hwsync(args: argparse.Namespace, path: Path, dtype: torch.dtype) -> list[dict[str, Any]]:
    """One engine that selected hwsync's backend; ``args.strategy``'s trainer synced through the backend and direct."""
    import hwsync
    from hwsync.engine.vllm.local import local_engine

    lora = args.strategy == "adapter"
    llm = bs._engine(path, dtype, args.rank, lora=lora, weight_transfer_config={"backend": "hwsync"})
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    model = bs._trainer(path, args.strategy, args.rank, dtype)
    direct = local_engine(llm)
    ways = {"backend": lambda: hwsync.sync(llm, model, strategy=args.strategy),
            "direct": lambda: hwsync.sync(direct, model, strategy=args.strategy)}
    rows = []
    for way, sync in ways.items():  # the backend's first sync is the engine's; direct's is its handle's first
        t0 = time.perf_counter()
        report = sync()
        bs._sync_device()
        first = time.perf_counter() - t0
        print(f"{way} {args.strategy}: first sync {first:.2f} s: {report.path}", flush=True)
        # the untouched trainer's logprobs, after the engine's first sync: other processes' paths compare to them
        logprobs = bs._logprobs(llm) if way == "backend" and not lora else None
        times, last = _timed(sync, model, args.warmup + args.syncs)
        row = _row(way, args.strategy, first, times, args.warmup, last.bytes)
        if logprobs is not None:
            row["first_logprobs"] = logprobs
        rows.append(row)
        print(f"{way} {args.strategy}: steady {row['seconds'] * 1e3:.2f} ms", flush=True)
    # one state, both paths: the same weights (base checksums, LoRA slots), the same logprobs
    seen = {}
    for way, sync in ways.items():
        report = sync()
        lid = report.lora_request.lora_int_id if report.lora_request else None
        seen[way] = (bs._base_sums(runner), bs._slot_sums(llm, lid) if lid else {},
                     bs._logprobs(llm, report.lora_request))
    same = seen["backend"][:2] == seen["direct"][:2]
    for row in rows:
        row.update(equal_to_direct=same, Δ_vs_direct=bs._delta(seen["backend"][2], seen["direct"][2]))
    return rows


def child_ipc(args: argparse.Namespace, path: Path, dtype: torch.dtype) -> list[dict[str, Any]]:
    """vLLM's own colocated backend: the engine core in its own process, CUDA IPC handles, packed."""
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

    llm = bs._engine(path, dtype, args.rank, lora=False, weight_transfer_config={"backend": "ipc"})
    model = bs._trainer(path, "full", args.rank, dtype)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    engine = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=0, packed=True, packed_buffer_size_bytes=max(1 << 30, largest)),
        client=OfflineClient(llm), source=ModuleSource(model))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    t0 = time.perf_counter()
    engine.send_weights()
    llm.reset_prefix_cache()
    bs._sync_device()
    first = time.perf_counter() - t0
    logprobs = bs._logprobs(llm)

    def sync() -> None:
        engine.send_weights()
        llm.reset_prefix_cache()

    row = _row("ipc", "full", first, _timed(sync, model, args.warmup + args.syncs)[0], args.warmup, nbytes)
    row["first_logprobs"] = logprobs
    print(f"ipc full: first {first:.2f} s, steady {row['seconds'] * 1e3:.2f} ms", flush=True)
    return [row]


def _child(args: argparse.Namespace) -> int:
    if args.path == "ipc":  # vLLM's IPC backend opens the trainer's handles in another process: its engine core's
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the handles ride the engine's RPC
    bs.environment()
    dtype = torch.bfloat16 if bs._on_gpu() else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        path = bs._checkpoint(Path(tmp), args.shapes, args.layers)
        rows = (child_ipc if args.path == "ipc" else child_hwsync)(args, path, dtype)
    print("RESULT " + json.dumps(rows, default=str), flush=True)
    return 0


def _exact(rows: list[dict[str, Any]]) -> list[str]:
    """What was not exact: backend vs direct on one state, every full path's first logprobs vs hwsync's."""
    # one state: the weights must be equal; the logprobs too where no LoRA kernel runs (vLLM's LoRA shrink kernel
    # splits K with fp32 atomics on a GPU, so an adapter's logprobs repeat only within its own spread: reported)
    bad = [f"{r['path']} {r['strategy']}" for r in rows if r.get("equal_to_direct") is False
           or (r["strategy"] == "full" and (r.get("Δ_vs_direct") or 0.0) > 0.0)]
    ref = next((r["first_logprobs"] for r in rows if r.get("first_logprobs") and r["path"] == "backend"), None)
    for r in rows:
        if r.get("first_logprobs") and ref is not None:
            r["Δ_first_vs_hwsync"] = bs._delta(r["first_logprobs"], ref)
            if r["Δ_first_vs_hwsync"] > 0.0:
                bad.append(f"{r['path']} {r['strategy']} (first sync)")
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", choices=sorted(bs.SHAPES), default="tiny")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--strategies", default="full,adapter")
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-ipc", action="store_true", help="skip vLLM's ipc backend (it needs CUDA)")
    ap.add_argument("--json", help="write every row here")
    ap.add_argument("--child", choices=("hwsync", "ipc"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--strategy", default="full", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.path = args.child
        return _child(args)
    jobs = [("hwsync", s.strip()) for s in args.strategies.split(",") if s.strip()]
    if "full" in args.strategies and not args.no_ipc:
        if torch.cuda.is_available():
            jobs.append(("ipc", "full"))
        else:
            print("vLLM ipc: not run (CUDA IPC needs a GPU)")
    rows: list[dict[str, Any]] = []
    failed = []
    common = ["--shapes", args.shapes, "--layers", str(args.layers), "--rank", str(args.rank), "--syncs",
              str(args.syncs), "--warmup", str(args.warmup)]
    for child, strategy in jobs:
        cmd = [sys.executable, __file__, "--child", child, "--strategy", strategy, *common]
        p = subprocess.run(cmd, capture_output=True, text=True)
        got = [line[7:] for line in p.stdout.splitlines() if line.startswith("RESULT ")]
        print("\n".join(line for line in p.stdout.splitlines() if line.startswith(PATHS)), flush=True)
        if p.returncode or not got:
            failed.append(f"{child} {strategy}")
            print(f"{child} {strategy}: FAILED (exit {p.returncode})\n{(p.stdout + p.stderr)[-3000:]}", flush=True)
            continue
        rows += json.loads(got[0])
    failed += _exact(rows)
    direct = {r["strategy"]: r["seconds"] for r in rows if r["path"] == "direct"}
    names = {"backend": "hwsync-as-backend (vLLM's verbs)", "direct": "hwsync direct", "ipc": "vLLM ipc (packed)"}
    print(f"\n{args.layers} layers of {args.shapes} shapes, rank {args.rank}; "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}")
    print("| path | strategy | MB | first sync s | steady ms | GB/s | x hwsync direct | exact |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["seconds"] / direct[r["strategy"]] if r["strategy"] in direct else float("nan")
        exact = "no" if any(f.startswith(f"{r['path']} {r['strategy']}") for f in failed) else "yes"
        print(f"| {names[r['path']]} | {r['strategy']} | {r['MB']:.0f} | {r['first_s']:.2f} | "
              f"{r['seconds'] * 1e3:.2f} | {r['GB/s']:.1f} | {ratio:.2f} | {exact} |")
    if args.json:
        Path(args.json).write_text(json.dumps([{k: v for k, v in r.items() if k != "first_logprobs"} for r in rows],
                                              indent=1, default=str))
    if failed:
        print(f"NOT EXACT or FAILED: {failed}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
