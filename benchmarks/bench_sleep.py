"""Sleep-mode benchmark (CUDA only): level-2 wake + hwsync refill against vLLM's level-1 wake and vLLM's reload.

One engine (``enable_sleep_mode=True``) and one trainer per strategy (``full``, ``adapter``), at Qwen3-30B-A3B shapes
by default (the model and engine of ``benchmarks/bench_sync.py``, imported from it), measured side by side in one run:

* **no sleep**: a training step (forward + backward of the trainer on one batch) and a steady sync;
* **level 1**: sleep(1), the training step, vLLM's wake (host -> device copy of the weights), the steady sync;
* **level 2**: sleep(2), the training step, wake (fresh memory), hwsync's refill (base + adapter: the first sync after
  the wake), exactness of the refill: every base parameter and every LoRA slot of the engine checksummed against
  the same engine before the sleep, with the same trainer weights (bench_sync checks that state against vLLM's own
  loading); the logprobs of the check prompts are reported beside the engine's own repeat spread (two runs before
  the sleep), and must be equal only without LoRA (vLLM's MoE-LoRA kernels are not bit-reproducible at 48 layers);
* **the driver's floor** under the level-2 wake: while the engine sleeps, the time to get the same bytes of fresh
  device memory from the driver, in one allocation and in the engine's pieces (one per weight storage), and one full
  ``gc.collect()`` (vLLM's wake_up starts with one); the level-2 wake itself taken apart (``_wake_probe``: the
  worker's ``wake_up``, the allocator's, its ``create_and_map`` calls and host copies); ``benchmarks/bench_wake_floor.py``
  does the same without a model;
* **vLLM's reload path**: ``reload_weights`` of the same base weights (what a framework without hwsync runs after a
  level-2 wake).

Per phase: seconds of each part, the step time (sleep + train + wake + sync), the device memory in use during
the training step (``total - free`` after it: what the trainer has) and the largest rollout each level leaves room
for: the KV budget (without sleep the KV cache stays resident through the training step and can grow by what the step
leaves free; with sleep it is discarded while the trainer trains and can take all the awake engine and trainer do not
hold), in tokens and in sequences of ``--rollout-len`` tokens (an upper bound: generation's activations share it). The table gives ratios against the baselines
of the same run (level-1 wake, vLLM's reload, no sleep). ``--json OUT`` writes every row.

    python benchmarks/bench_sleep.py --shapes qwen3-30b-a3b --layers 48 --rank 32 --json OUT

vLLM's CPU build has no sleep mode: on a machine without CUDA the script refuses (exit 2) after parsing its
arguments; the refill logic itself is tested on CPU by tests/test_sleep_refill.py.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sync import (  # noqa: E402 - the benchmark's model and engine live there
    ATTN,
    SHAPES,
    _base_sums,
    _checkpoint,
    _delta,
    _engine,
    environment,
    _logprobs,
    _on_gpu,
    _print,
    _slot_sums,
    _step,
    _sync_device,
    _trainer,
)
from bench_wake_floor import fresh_memory  # noqa: E402 - the floor's one home


def _timed(fn: Any) -> tuple[float, Any]:
    _sync_device()
    t0 = time.perf_counter()
    out = fn()
    _sync_device()
    return time.perf_counter() - t0, out


def _train_step(model: Any, batch: int, seq: int) -> float:
    """One forward + backward on random tokens (the trainer's activations and gradients), then the gradients freed;
    returns the device memory in use right after the backward (GB): what the training phase needs beside vLLM."""
    ids = torch.randint(0, int(model.config.vocab_size), (batch, seq), device="cuda")
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    model.zero_grad(set_to_none=True)
    model.eval()
    return (total - free) / 1e9


def _kv_cache(llm: Any, runner: Any) -> tuple[int, float]:
    """The engine's KV cache: its bytes (every storage its layers' caches view, once) and bytes per token slot."""
    storages: dict[int, int] = {}
    todo = list(getattr(runner, "kv_caches", None) or [])
    while todo:
        t = todo.pop()
        if isinstance(t, (list, tuple)):
            todo.extend(t)
        elif isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    cache = llm.llm_engine.vllm_config.cache_config
    slots = max(1, int(cache.num_gpu_blocks or 0) * int(cache.block_size))
    total = sum(storages.values())
    return total, total / slots


def _in_use() -> float:
    """Device memory in use (GB) once the trainer's allocator returned what it only caches."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 1e9


def _rollout(kv_budget: float, per_token: float, seq: int) -> dict[str, Any]:
    """The largest rollout a KV budget (GB) holds: tokens, and sequences of ``seq`` tokens (an upper bound: vLLM's
    activations during generation come out of the same memory)."""
    tokens = int(max(0.0, kv_budget) * 1e9 / max(per_token, 1.0))
    return dict(kv_budget_gb=kv_budget, rollout_tokens=tokens, rollout_seqs=tokens // seq)


@contextlib.contextmanager
def _wake_probe() -> Any:
    """Time the layers of one wake (benchmark only; every wrapper removed on exit): the worker's ``wake_up`` (vLLM's
    GPU worker: the sleep backend's resume, saved buffers copied back, a device sync), CuMemAllocator's ``wake_up``
    (a gc.collect, an empty_cache, then per allocation ``create_and_map`` and, for offloaded ones, a host copy back),
    and inside it every ``create_and_map`` and ``cudaMemcpy`` (calls and bytes). ``llm.wake_up()`` minus the worker's
    is the engine's dispatch and hwsync's sleep watch (its address check)."""
    from vllm.device_allocator import cumem
    from vllm.v1.worker.gpu_worker import Worker

    acc: dict[str, float] = {k: 0.0 for k in ("worker_s", "allocator_s", "map_s", "map_n", "map_gb", "copy_s",
                                              "copy_n", "copy_gb")}
    saved = [(cumem, "create_and_map", cumem.create_and_map), (cumem.CuMemAllocator, "wake_up",
             cumem.CuMemAllocator.wake_up), (Worker, "wake_up", Worker.wake_up)]
    memcpy = cumem.libcudart.cudaMemcpy if cumem.libcudart is not None else None

    def timed(key: str, fn: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                torch.cuda.synchronize()
                acc[key] += time.perf_counter() - t0
        return run

    def mapped(handle: Any) -> None:
        t0 = time.perf_counter()
        saved[0][2](handle)
        acc["map_s"] += time.perf_counter() - t0
        acc["map_n"] += 1
        acc["map_gb"] += handle[1] / 1e9

    def copied(dst: Any, src: Any, n: int) -> Any:
        t0 = time.perf_counter()
        out = memcpy(dst, src, n)
        acc["copy_s"] += time.perf_counter() - t0
        acc["copy_n"] += 1
        acc["copy_gb"] += n / 1e9
        return out

    cumem.create_and_map = mapped
    cumem.CuMemAllocator.wake_up = timed("allocator_s", saved[1][2])
    Worker.wake_up = timed("worker_s", saved[2][2])
    if memcpy is not None:
        cumem.libcudart.cudaMemcpy = copied
    try:
        yield acc
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
        if memcpy is not None:
            cumem.libcudart.cudaMemcpy = memcpy


def _state(llm: Any, runner: Any, lid: int | None) -> dict[str, Any]:
    return {"base": _base_sums(runner), "slots": _slot_sums(llm, lid) if lid is not None else {}}


def phase(path: Path, strategy: str, args: argparse.Namespace, dtype: torch.dtype) -> list[dict[str, Any]]:
    import gc

    import hwsync
    from hwsync.trainer.api import as_engine
    from hwsync.trainer.merged import merged_named_weights
    from hwsync.engine.vllm.applier import vllm_reload

    llm = _engine(path, dtype, args.rank, enable_sleep_mode=True)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    model = _trainer(path, strategy, args.rank, dtype)
    if strategy == "full":  # gradients of 60 GB of experts do not fit beside anything: the attention projections
        for n, p in model.named_parameters():  # train, as in benchmarks/bench_step.py
            p.requires_grad_(any(f"{a}." in n for a in ATTN))
    model.gradient_checkpointing_enable()
    if hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    hwsync.sync(llm, model, strategy=strategy)
    for s in range(args.warmup):
        _step(model, 100 + s)
        hwsync.sync(llm, model, strategy=strategy)
    rows: list[dict[str, Any]] = []

    def lid() -> int | None:
        req = as_engine(llm).lora_request
        return None if req is None else req.lora_int_id

    # the largest rollout each level leaves room for (issue 40): without sleep the KV cache stays resident through
    # the training step, so it can grow by what the step leaves free; with sleep it is discarded while the trainer
    # trains, so it can take everything the awake engine and trainer do not hold
    total_gb = torch.cuda.mem_get_info()[1] / 1e9
    kv_bytes, per_token = _kv_cache(llm, runner)
    kv_gb = kv_bytes / 1e9
    # what a level-2 wake must map again: the engine's weights, one allocation per parameter storage (vLLM's pool)
    weight_sizes = list({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                         for p in runner.model.parameters()}.values())
    # no sleep (where the training step fits beside the resident engine: that it may not is why sleep mode exists)
    steady, train, mem = [], [], []
    fits = True
    for s in range(args.repeats):
        try:
            t, used = _timed(lambda: _train_step(model, args.batch, args.seq))
        except torch.cuda.OutOfMemoryError:
            fits = False
            model.zero_grad(set_to_none=True)
            model.eval()
            gc.collect()
            torch.cuda.empty_cache()
            break
        train.append(t)
        mem.append(used)
        _step(model, 200 + s)
        steady.append(_timed(lambda: hwsync.sync(llm, model, strategy=strategy))[0])
    if fits:
        rows.append(dict(strategy=strategy, sleep="none", sleep_s=0.0, train_s=statistics.median(train), wake_s=0.0,
                         sync_s=statistics.median(steady), step_s=statistics.median(train) + statistics.median(steady),
                         train_mem_gb=max(mem), path="steady", exact="",
                         **_rollout(kv_gb + total_gb - max(mem), per_token, args.rollout_len)))
    else:
        rows.append(dict(strategy=strategy, sleep="none", sleep_s=0.0, train_s=None, wake_s=0.0, sync_s=None,
                         step_s=None, train_mem_gb=None, path="does not fit: the training step runs out of memory "
                         "beside the resident engine", exact=""))
    # level 1 and level 2
    for level in (1, 2):
        parts: dict[str, list[float]] = {"sleep": [], "train": [], "wake": [], "sync": []}
        mem, exact, how = [], [], ""
        same_state, lp_delta, lp_spread, awake, floor_one, floor_pieces, gc_s = [], [], [], [], [], [], []
        probes: list[dict[str, float]] = []
        for s in range(args.repeats):
            before = _state(llm, runner, lid()) if level == 2 else None
            out_before = _logprobs(llm, as_engine(llm).lora_request) if level == 2 else None
            if level == 2:  # vLLM's own repeat spread: its MoE-LoRA kernels are not bit-reproducible at depth
                lp_spread.append(_delta(out_before, _logprobs(llm, as_engine(llm).lora_request)))
            parts["sleep"].append(_timed(lambda: llm.sleep(level=level))[0])
            t, used = _timed(lambda: _train_step(model, args.batch, args.seq))
            parts["train"].append(t)
            mem.append(used)
            if level == 2:  # the driver's floor for the wake: the same bytes in one allocation, and in vLLM's pieces
                floor_one.append(fresh_memory([sum(weight_sizes)]))
                floor_pieces.append(fresh_memory(weight_sizes))
                gc_s.append(_timed(gc.collect)[0])  # what vLLM's wake_up does first
            with _wake_probe() if level == 2 else contextlib.nullcontext() as probe:  # level 2: taken apart
                parts["wake"].append(_timed(lambda: llm.wake_up())[0])
            if probe is not None:
                probes.append(probe)
            if level == 1:
                _step(model, 300 + s)
            t, report = _timed(lambda: hwsync.sync(llm, model, strategy=strategy))
            parts["sync"].append(t)
            awake.append(_in_use())  # trainer + engine awake, before any generation
            how = report.path
            if level == 2:  # the same trainer weights as before the sleep: everything must be back, bit for bit
                after = _state(llm, runner, lid())
                out_after = _logprobs(llm, as_engine(llm).lora_request)
                same_state.append(after == before)
                lp_delta.append(_delta(out_before, out_after))
                if after != before:
                    differ = [k for k in before["base"] if before["base"][k] != after["base"].get(k)]
                    differ += [k for k in before["slots"] if before["slots"][k] != after["slots"].get(k)]
                    print(f"bench_sleep: {strategy}: {len(differ)} tensors differ after the refill, e.g. {differ[:4]}",
                          file=sys.stderr)
                # exact: every base parameter and LoRA slot bit-equal to before the sleep. The logprobs are reported
                # beside it, not gated when the engine serves LoRA: vLLM's MoE-LoRA kernels (split-K, fp32 atomics)
                # give one state different logprobs run to run (measured at 48 layers: 0.09-1.47 between two runs of
                # one state), so one delta against one repeat spread compares two draws of the same noise
                exact.append(after == before and (lid() is not None or lp_delta[-1] == 0))
                assert "full refill" in report.reason, report.reason
                _step(model, 400 + s)
                hwsync.sync(llm, model, strategy=strategy)  # the step's own sync (steady again)
        med = {k: statistics.median(v) for k, v in parts.items()}
        rows.append(dict(strategy=strategy, sleep=f"level {level}", sleep_s=med["sleep"], train_s=med["train"],
                         wake_s=med["wake"], sync_s=med["sync"], step_s=sum(med.values()), train_mem_gb=max(mem),
                         path=how, exact=all(exact) if exact else "",
                         state_bit_equal=all(same_state) if same_state else "",
                         logprob_delta=max(lp_delta) if lp_delta else "",
                         logprob_repeat_spread=max(lp_spread) if lp_spread else "",
                         fresh_memory_one_s=statistics.median(floor_one) if floor_one else "",
                         fresh_memory_pieces_s=statistics.median(floor_pieces) if floor_pieces else "",
                         weights_gb=sum(weight_sizes) / 1e9,
                         gc_collect_s=statistics.median(gc_s) if gc_s else "",
                         **{f"wake_{k}": statistics.median(p[k] for p in probes) for k in (probes[0] if probes else ())},
                         **_rollout(total_gb - (max(awake) - kv_gb), per_token, args.rollout_len)))
    if args.profile_refill:  # one more level-2 cycle, not measured: the host side of its refill under cProfile
        import cProfile
        import io
        import pstats

        llm.sleep(level=2)
        llm.wake_up()
        prof = cProfile.Profile()
        t, _ = _timed(lambda: prof.runcall(hwsync.sync, llm, model, strategy=strategy))
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(30)
        print(f"bench_sleep: {strategy}: one level-2 refill under cProfile ({t * 1e3:.1f} ms)\n{text.getvalue()}",
              file=sys.stderr)
    # vLLM's reload path of the same base weights (what runs after a level-2 wake without hwsync)
    # merged one tensor at a time, as bench_sync's reload row: a list of every merged expert block (an adapter
    # trainer's 60 GB) does not fit beside the engine
    reload_s = statistics.median(
        _timed(lambda: vllm_reload(runner, merged_named_weights(model)))[0] for _ in range(args.repeats)
    )
    rows.append(dict(strategy=strategy, sleep="vLLM reload_weights", sleep_s=0.0, train_s=0.0, wake_s=0.0,
                     sync_s=reload_s, step_s=reload_s, train_mem_gb=0.0, path="vLLM reload_weights", exact=""))
    del model, llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Level-2 wake + refill against the baselines of the same run, per strategy."""
    out = []
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        by = {r["sleep"]: r for r in rows if r["strategy"] == strategy}
        l1, l2, none, reload = by["level 1"], by["level 2"], by["none"], by["vLLM reload_weights"]
        refill = l2["wake_s"] + l2["sync_s"]
        out.append(dict(strategy=strategy, wake2_refill_ms=refill * 1e3, wake1_ms=l1["wake_s"] * 1e3,
                        refill_vs_wake1=refill / max(l1["wake_s"], 1e-9),
                        refill_vs_vllm_reload=l2["sync_s"] / max(reload["sync_s"], 1e-9),
                        step_l1_vs_none=l1["step_s"] / none["step_s"] if none["step_s"] else None,
                        step_l2_vs_none=l2["step_s"] / none["step_s"] if none["step_s"] else None,
                        train_mem_gb_none=none["train_mem_gb"], train_mem_gb_l1=l1["train_mem_gb"],
                        train_mem_gb_l2=l2["train_mem_gb"], state_bit_equal=l2.get("state_bit_equal", ""),
                        logprob_delta=l2.get("logprob_delta", ""),
                        logprob_repeat_spread=l2.get("logprob_repeat_spread", ""),
                        wake2_ms=l2["wake_s"] * 1e3,
                        gc_collect_ms=_ms(l2.get("gc_collect_s")),
                        wake_worker_ms=_ms(l2.get("wake_worker_s")),
                        wake_allocator_ms=_ms(l2.get("wake_allocator_s")),
                        wake_map_ms=_ms(l2.get("wake_map_s")),
                        wake_copy_ms=_ms(l2.get("wake_copy_s")),
                        fresh_memory_ms=_ms(l2.get("fresh_memory_one_s")),
                        fresh_memory_pieces_ms=_ms(l2.get("fresh_memory_pieces_s")),
                        rollout_seqs_none=none.get("rollout_seqs", ""), rollout_seqs_l1=l1.get("rollout_seqs", ""),
                        rollout_seqs_l2=l2.get("rollout_seqs", ""), exact=l2["exact"]))
    return out


def _ms(seconds: Any) -> Any:
    return seconds * 1e3 if isinstance(seconds, (int, float)) else ""


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--strategies", default="full,adapter")
    ap.add_argument("--repeats", type=int, default=3, help="sleep/wake cycles per level (medians reported)")
    ap.add_argument("--warmup", type=int, default=2, help="syncs before measuring (first and second sync)")
    ap.add_argument("--batch", type=int, default=4, help="training step: sequences")
    ap.add_argument("--seq", type=int, default=512, help="training step: tokens per sequence")
    ap.add_argument("--rollout-len", type=int, default=1024, help="tokens per rollout sequence (the batch column)")
    ap.add_argument("--profile-refill", action="store_true",
                    help="after the measured cycles, one more level-2 cycle: its refill's host side under cProfile "
                    "(top 30 cumulative), on stderr")
    ap.add_argument("--json", help="write the rows and ratios here")
    args = ap.parse_args(argv)
    bad = [s for s in args.strategies.split(",") if s not in ("full", "adapter", "hybrid")]
    if bad:
        ap.error(f"--strategies: unknown {bad} (full, adapter, hybrid)")
    return args


def _without(argv: list[str], *options: str) -> list[str]:
    """``argv`` less the given options and their values (``--opt value`` and ``--opt=value``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in options:
            skip = True
        elif not any(a.startswith(o + "=") for o in options):
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not _on_gpu():
        print("bench_sleep: needs CUDA: vLLM's CPU build has no sleep mode (CPUWorker.sleep only logs). The refill "
              "logic is tested on CPU by tests/test_sleep_refill.py (a stand-in sleep on a real engine).",
              file=sys.stderr)
        return 2
    environment()  # the engine in this process (the bench reaches its worker): VLLM_ENABLE_V1_MULTIPROCESSING=0
    dtype = torch.bfloat16
    rows: list[dict[str, Any]] = []
    failed: list[str] = []
    strategies = args.strategies.split(",")
    if len(strategies) > 1:  # vLLM's CuMem allocator serves one sleep-mode engine per process (gpu_worker.py
        # asserts an empty pool before the weights): one process per strategy, rows handed back as JSON
        import subprocess

        with tempfile.TemporaryDirectory() as tmp:
            for strategy in strategies:
                out = Path(tmp) / f"{strategy}.json"
                given = argv if argv is not None else sys.argv[1:]
                cmd = [sys.executable, __file__, *_without(given, "--strategies", "--json"),
                       "--strategies", strategy, "--json", str(out)]
                code = subprocess.call(cmd)
                if not out.exists():  # the next strategies still run: one call of device time measures them all
                    print(f"bench_sleep: the {strategy} phase failed (exit {code})", file=sys.stderr)
                    failed.append(strategy)
                    continue
                rows += json.loads(out.read_text())["rows"]
    else:
        with tempfile.TemporaryDirectory() as tmp:
            path = _checkpoint(Path(tmp), args.shapes, args.layers)
            rows += phase(path, strategies[0], args, dtype)
    keys = list(dict.fromkeys(k for r in rows for k in r))  # one column set: the level-2 rows carry exactness
    rows = [{k: r.get(k, "") for k in keys} for r in rows]
    table = ratios(rows)
    _print(f"sleep modes, {args.shapes} x {args.layers} layers, LoRA r{args.rank}", rows)
    _print("level-2 wake + refill against the baselines of this run", table)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "ratios": table}, indent=1))
    if failed:
        print(f"bench_sleep: failed phases: {', '.join(failed)}", file=sys.stderr)
    return 0 if not failed and all(r["exact"] is True for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
