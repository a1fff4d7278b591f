"""Cost of sealing a bucket (server mode's keyed tag, :mod:`hwsync.common.transport.seal`) against a plain copy.

Every bucket is sealed by the trainer and checked by each engine worker before any loader sees it. On CPU the tag is
keyed BLAKE2b over the bytes; on accelerators a keyed linear hash runs where the bytes are (this script measures the
device path too when a GPU is present, and the CPU run of that same path as a lower bound of its arithmetic).

    PYTHONPATH=. python benchmarks/bench_seal.py [--mb 256] [--repeat 5]

Prints one table: operation | MB | best seconds | GB/s | x copy.
"""
from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

from hwsync.common.transport.seal import Sealer, derive_secret


def best(fn: Callable[[], object], repeat: int, sync: Callable[[], None] = lambda: None) -> float:
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--device-path-on-cpu", action="store_true",
                    help="also time the accelerator hash (keyed linear hash) computed on CPU (slow)")
    args = ap.parse_args()
    nbytes = args.mb << 20
    sealer = Sealer(derive_secret("bench token", "session"))
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    rows: list[tuple[str, float]] = []
    copy_s = best(lambda: dst.copy_(src), args.repeat)
    rows.append(("plain copy (cpu)", copy_s))
    tag = sealer.seal(src, 0, 1)
    rows.append(("seal: keyed BLAKE2b (cpu)", best(lambda: sealer.seal(src, 0, 1), args.repeat)))
    rows.append(("check: seal + compare (cpu)", best(lambda: sealer.check(src, 0, 1, tag), args.repeat)))
    if args.device_path_on_cpu:
        rows.append(("keyed linear hash (device path, on cpu)",
                     best(lambda: sealer._lane_digest(src), max(1, args.repeat // 2))))
    if torch.cuda.is_available():
        g = src.cuda()
        gd = torch.empty_like(g)
        sync = torch.cuda.synchronize
        sealer.seal(g, 0, 1)  # keys to the device once
        rows.append(("plain copy (cuda)", best(lambda: gd.copy_(g), args.repeat, sync)))
        rows.append(("seal: keyed linear hash (cuda)", best(lambda: sealer.seal(g, 0, 1), args.repeat, sync)))
    print(f"bucket {args.mb} MB, best of {args.repeat}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {os.cpu_count()} cores")
    print(f"{'operation':42} | {'MB':>5} | {'best s':>8} | {'GB/s':>7} | {'x copy':>7}")
    base = {"cpu": copy_s}
    for name, s in rows:
        ref = base["cuda"] if "(cuda)" in name and "cuda" in base else copy_s
        if name == "plain copy (cuda)":
            base["cuda"] = s
            ref = s
        print(f"{name:42} | {args.mb:5d} | {s:8.4f} | {nbytes / s / 1e9:7.2f} | {s / ref:7.1f}")


if __name__ == "__main__":
    main()
