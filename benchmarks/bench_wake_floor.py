"""Where a level-2 wake's time goes (CUDA only): vLLM's CuMem re-mapping against the driver's other ways to get the
same memory back, without a model.

Allocates the weights of ``--layers`` layers of Qwen3-30B-A3B shapes (one tensor per parameter, the pieces vLLM's
sleep pool holds: fused w13 / w2 experts, qkv, o, router, norms) in vLLM's ``CuMemAllocator`` pool, then per cycle:

* **vLLM's wake**: ``allocator.sleep(offload_tags=())`` (level 2: discard) and ``allocator.wake_up()``, timed;
* **the same handles re-mapped by hand**: ``unmap_and_release`` every handle, then ``create_and_map`` them
  (cuMemCreate + cuMemMap + cuMemSetAccess each, vLLM's C extension), one thread, then 8 threads;
* **cudaMalloc** of the same pieces (torch's caching allocator, its cache emptied first): the driver's floor for
  fresh memory at new addresses -- which a sleeping engine cannot take (its CUDA graphs and every view hold the old).

    python benchmarks/bench_wake_floor.py --layers 48 --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch


def pieces(layers: int) -> list[int]:
    """Bytes of every weight tensor of ``layers`` Qwen3-30B-A3B layers in bf16 (the sync bench's model)."""
    h, heads, kv, hd, experts, inter = 2048, 32, 4, 128, 128, 768
    per_layer = [
        (heads + 2 * kv) * hd * h,  # qkv_proj
        h * heads * hd,  # o_proj
        experts * h,  # router
        experts * 2 * inter * h,  # w13
        experts * h * inter,  # w2
        h, h, hd, hd,  # input / post-attention norms, q / k norms
    ]
    return [2 * n for _ in range(layers) for n in per_layer]


def fresh_memory(sizes: list[int]) -> float:
    """Seconds the driver takes to hand out fresh device memory of ``sizes`` (bytes; one allocation each, torch's
    cache emptied first, so every one is a new cudaMalloc): the floor under any wake that re-acquires as much memory,
    vLLM's level-2 wake included (it maps new physical memory for every weight allocation it discarded). Used by
    ``bench_sleep.py`` too, while its engine sleeps."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    held: list[torch.Tensor] = []
    seconds = _timed(lambda: held.extend(torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes))
    held.clear()
    torch.cuda.empty_cache()
    return seconds


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_wake_floor: needs CUDA (vLLM's CuMem allocator)", file=sys.stderr)
        return 2
    from vllm.device_allocator.cumem import CuMemAllocator, create_and_map, unmap_and_release

    sizes = pieces(args.layers)
    gb = sum(sizes) / 1e9
    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool(tag="weights"):
        held = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    handles = [d.handle for d in allocator.pointer_to_data.values() if d.tag == "weights"]
    rows: dict[str, list[float]] = {"vLLM sleep (discard)": [], "vLLM wake_up": [], "create_and_map, 1 thread": [],
                                    "create_and_map, 8 threads": [], "cudaMalloc, same pieces": [],
                                    "cudaMalloc, one piece": [],
                                    "gc.collect (wake_up's first step)": [], "empty_cache (its second)": []}

    def remap(threads: int) -> float:
        for hd in handles:
            unmap_and_release(hd)
        if threads == 1:
            return _timed(lambda: [create_and_map(hd) for hd in handles])
        with ThreadPoolExecutor(threads) as pool:
            return _timed(lambda: list(pool.map(create_and_map, handles)))

    for _ in range(args.repeats):
        rows["vLLM sleep (discard)"].append(_timed(lambda: allocator.sleep(offload_tags=())))
        rows["vLLM wake_up"].append(_timed(allocator.wake_up))
        rows["gc.collect (wake_up's first step)"].append(_timed(gc.collect))
        rows["empty_cache (its second)"].append(_timed(torch.accelerator.empty_cache))
        rows["create_and_map, 1 thread"].append(remap(1))
        rows["create_and_map, 8 threads"].append(remap(8))
        rows["cudaMalloc, same pieces"].append(fresh_memory(sizes))
        rows["cudaMalloc, one piece"].append(fresh_memory([sum(sizes)]))
    base = statistics.median(rows["vLLM wake_up"])
    print(f"\n## re-acquiring {gb:.1f} GB in {len(sizes)} pieces ({args.layers} layers), median of {args.repeats}")
    print("| path | ms | GB/s | x vLLM wake_up |\n|---|---|---|---|")
    for name, ts in rows.items():
        t = statistics.median(ts)
        print(f"| {name} | {t * 1e3:.1f} | {gb / t:.0f} | {t / base:.2f} |")
    del held
    return 0


if __name__ == "__main__":
    sys.exit(main())
