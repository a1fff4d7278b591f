"""Broadcast throughput through hwsync.broadcast on two ranks (nccl on >= 2 GPUs, else gloo on CPU).

Two questions, one table each:
1. Large buffers (weight-sync bucket sizes): GB/s of ``hwsync.broadcast`` vs a raw
   ``torch.distributed.broadcast`` of the same buffer — hwsync's staging/dispatch must cost nothing.
2. Many small tensors (a MoE LoRA adapter is tens of thousands of ~10-30 KB tensors): one
   broadcast per tensor vs ``hwsync.broadcast_coalesced`` into buckets; ratio vs per-tensor.

Usage: python benchmarks/bench_broadcast.py [--json OUT.json] [--quick]
Bandwidth is algorithm bandwidth: payload bytes / wall seconds on the source rank, after a barrier
and a device synchronize on both ends of the timed region.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hwsync.common.backend import get_backend
from hwsync.common.comm import broadcast, broadcast_coalesced

WORLD = 2
MB = 1 << 20


def _timed(fn: Callable[[], Any], sync: Callable[[], None], iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    sync()
    dist.barrier()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters


def _small_tensors(device: torch.device, count: int, seed: int = 0) -> list[torch.Tensor]:
    """LoRA-on-experts shaped tensors (rank 8, hidden 2048, moe_intermediate 768), bf16."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(8, 2048), (1536, 8), (8, 768), (2048, 8)]  # gate_up A/B, down A/B
    return [torch.randn(shapes[i % 4], generator=g).to(torch.bfloat16).to(device) for i in range(count)]


def _worker(rank: int, backend_name: str, init_file: str, args: argparse.Namespace, out: str) -> None:
    if os.path.isdir("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    backend = get_backend(backend_name)
    device = torch.device("cpu") if backend.device_type == "cpu" else backend.device(rank)
    kwargs: dict[str, Any] = {}
    if device.type != "cpu":
        torch.get_device_module(device.type).set_device(device)
        kwargs["device_id"] = device
    dist.init_process_group(backend.dist_backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=300), **kwargs)

    def sync() -> None:
        backend.synchronize(device)

    rows: dict[str, list[dict[str, Any]]] = {"large": [], "small": []}
    sizes_mb = [16, 64, 256] if args.quick else [16, 64, 256, 512, 1024, 2048]
    if device.type == "cpu":
        sizes_mb = [1, 4, 16, 64] if args.quick else [1, 16, 64, 256]
    for size in sizes_mb:
        buf = torch.empty(size * MB, dtype=torch.uint8, device=device)
        iters = max(3, min(20, 4096 // size)) if device.type != "cpu" else 3
        t_raw = _timed(lambda b=buf: dist.broadcast(b, 0), sync, iters)
        t_hw = _timed(lambda b=buf: broadcast(b, 0, None), sync, iters)
        rows["large"].append({"MB": size, "raw_GBps": size * MB / t_raw / 1e9,
                              "hwsync_GBps": size * MB / t_hw / 1e9, "hwsync_vs_raw": t_raw / t_hw})

    count = args.tensors or (8192 if device.type != "cpu" else 1024)
    tensors = _small_tensors(device, count)
    total = sum(t.numel() * t.element_size() for t in tensors)
    iters = 3

    def per_tensor_raw() -> None:
        for t in tensors:
            dist.broadcast(t, 0)

    def per_tensor_hwsync() -> None:
        for t in tensors:
            broadcast(t, 0, None)

    t_base = _timed(per_tensor_raw, sync, iters, warmup=1)
    methods: list[tuple[str, Callable[[], Any], int]] = [
        ("per-tensor dist.broadcast", per_tensor_raw, count),
        ("per-tensor hwsync.broadcast", per_tensor_hwsync, count),
    ]
    for bucket_mb in ([4, 16, 64, 256] if device.type != "cpu" else [4, 16, 64]):
        bucket = bucket_mb * MB
        n_buckets = -(-total // bucket)
        methods.append((f"coalesced, {bucket_mb} MB buckets",
                        lambda b=bucket: broadcast_coalesced(tensors, 0, None, bucket_bytes=b), n_buckets))
    for name, fn, calls in methods:
        t = t_base if name.startswith("per-tensor dist") else _timed(fn, sync, iters, warmup=1)
        rows["small"].append({"method": name, "collectives": calls, "ms": t * 1e3,
                              "GBps": total / t / 1e9, "speedup_vs_per_tensor": t_base / t})
    if rank == 0:
        rows["meta"] = [{"backend": backend.name, "dist_backend": backend.dist_backend,
                         "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
                         "torch": torch.__version__, "small_tensors": count, "small_total_MB": total / MB}]
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def _table(rows: list[dict[str, Any]]) -> str:
    cols = list(rows[0])
    fmt = [lambda v: f"{v:.2f}" if isinstance(v, float) else str(v)] * len(cols)
    cells = [[f(r[c]) for f, c in zip(fmt, cols)] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    parser.add_argument("--tensors", type=int, default=0, help="number of small tensors")
    parser.add_argument("--backend", default=None, help="hwsync backend (default: auto / $HWSYNC_BACKEND)")
    args = parser.parse_args()
    backend = get_backend(args.backend)
    if backend.device_type != "cpu" and backend.device_count() < WORLD:
        raise SystemExit(f"{backend.name}: needs {WORLD} devices, found {backend.device_count()}")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.start_processes(_worker, args=(backend.name, os.path.join(tmp, "store"), args, out),
                           nprocs=WORLD, start_method="spawn")
        with open(out) as f:
            rows = json.load(f)
    meta = rows["meta"][0]
    print(f"# hwsync broadcast benchmark: {WORLD} ranks, {meta['dist_backend']} on {meta['device']}, "
          f"torch {meta['torch']}")
    print("\n## Large buffers (one broadcast each)\n")
    print(_table(rows["large"]))
    print(f"\n## {meta['small_tensors']} small bf16 tensors ({meta['small_total_MB']:.1f} MB total)\n")
    print(_table(rows["small"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
