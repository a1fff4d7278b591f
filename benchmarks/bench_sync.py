"""What a sync costs, per strategy, into a real vLLM engine -- against baselines measured in the same run.

    python benchmarks/bench_sync.py                                   # CPU: tiny MoE, colocate (what .ci/run runs)
    python benchmarks/bench_sync.py --shapes qwen3-30b-a3b --layers 4 # GPU: exact Qwen3-30B-A3B layer shapes
    python benchmarks/bench_sync.py --shapes qwen3-30b-a3b --layers 4 --server   # + server mode (needs 2 GPUs)
    python benchmarks/bench_sync.py --shapes qwen3.5-moe --layers 4   # GPU: Qwen3.5-35B-A3B (3 GDN + 1 attention)

Per strategy (``full`` on a model without LoRA; ``adapter`` and ``hybrid`` with rank-``--rank`` LoRA on attention
and experts), after ``--warmup`` syncs, the median of ``--syncs`` steady-state syncs, each after a fresh "optimizer
step" of the trainer. The table gives seconds, bytes, GB/s and the ratio to the baseline of the same bytes:

* colocate: one device copy of that many bytes (``dst.copy_(src)``), the floor of any in-process sync;
* server: one NCCL broadcast of that many bytes between the two GPUs (or gloo between two CPU processes).

It also times vLLM's own path for the same update (``reload_weights`` of the merged weights; the adapter built by
vLLM's ``LoRAModel`` construction under a new id), and checks **exactness**: the synced engine's logprobs must equal
those of the same engine after vLLM's own path loaded the same weights (``Δ`` = max |logprob difference|, 0 means
bit-identical outputs), and on CPU also the trainer's (``hwsync.verify``). A server-mode engine must equal the
colocated engine fed the same weights. The script exits non-zero if an exactness check fails; it asserts no time.
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

PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8], [3, 4, 200, 17, 18, 99]]
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
TOKEN = "bench_sync: a fixed token, 32+ characters"  # the engine process imports it (no command line)
SHAPES = {
    # the tiny fixture (hwsync.testing) grown a little: what the CPU job runs
    "tiny": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=16,
                 num_experts_per_tok=4, moe_intermediate_size=128),
    # Qwen3-30B-A3B's decoder layer (config.json of the release); vocabulary kept small (the layers are the cost)
    "qwen3-30b-a3b": dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
    # Qwen3.5-35B-A3B's text decoder layers (Qwen's model card: hidden 2048; 40 layers laid out 10 x (3 Gated DeltaNet
    # -> MoE, 1 Gated Attention -> MoE); GDN 16 QK / 32 V heads of dim 128; attention 16 Q / 2 KV heads of dim 256;
    # 256 experts, 8 routed + 1 shared, expert intermediate 512 -- the defaults of transformers' Qwen3_5MoeTextConfig,
    # documented against checkpoint Qwen/Qwen3.5-35B-A3B). --layers 4 gives one full block: 3 GDN layers + 1 attention
    # layer (tiny_moe_config's Qwen3.5 layer pattern); vocabulary kept small
    "qwen3.5-moe": dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                        shared_expert_intermediate_size=512, linear_num_key_heads=16, linear_num_value_heads=32,
                        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4),
}
FAMILY = {"qwen3.5-moe": "qwen3_5_moe"}  # presets of another family than qwen3_moe (hwsync.testing.tiny_moe)


def _on_gpu() -> bool:
    return torch.cuda.is_available()


def _sync_device() -> None:
    if _on_gpu():
        torch.cuda.synchronize()


def _checkpoint(tmp: Path, shapes: str, layers: int) -> Path:
    """config.json + tokenizer only: the engine starts with ``load_format="dummy"`` and hwsync writes every weight."""
    from hwsync.testing import tiny_moe_config
    from hwsync.testing.tokenizer import write_tokenizer

    path = tmp / f"{shapes}-{layers}"
    path.mkdir(parents=True, exist_ok=True)
    family = FAMILY.get(shapes, "qwen3_moe")
    config = tiny_moe_config(family, num_hidden_layers=layers, **SHAPES[shapes])  # type: ignore[arg-type]
    config.save_pretrained(path)
    write_tokenizer(path, family, model_max_length=config.max_position_embeddings)
    return path


def _trainer(path: Path, strategy: str, rank: int, dtype: torch.dtype, lora_in_fp32: bool = True) -> Any:
    """``full``: no LoRA; ``adapter``: LoRA on attention and experts (attention only on CPU: vLLM's CPU build has no
    MoE-LoRA kernels); ``hybrid``: attention and experts (the experts travel merged where they are not served).
    ``lora_in_fp32``: PEFT's default (LoRA parameters upcast to fp32); ``False`` keeps them in ``dtype``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    device = "cuda" if _on_gpu() else "cpu"
    config = AutoConfig.from_pretrained(path)
    with torch.device(device):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if strategy == "full":
        return model.eval()
    from peft import LoraConfig, get_peft_model

    experts = EXPERTS if strategy == "hybrid" or _on_gpu() else None
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=ATTN, target_parameters=experts)
    model = get_peft_model(model, cfg, autocast_adapter_dtype=lora_in_fp32).eval()
    _step(model, 0)  # B starts at zero in PEFT: make the adapter matter from the first sync
    return model


def _step(model: Any, seed: int) -> None:
    """One 'optimizer step': LoRA factors move (or, without LoRA, every weight), in place as an optimizer does."""
    g = torch.Generator(device="cuda" if _on_gpu() else "cpu").manual_seed(seed)
    has_lora = any("lora_" in n for n, _ in model.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype) * 0.02)
            elif not has_lora:
                p.mul_(1 + torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype) * 0.01)


def _gpu_blocks(path: Path) -> str:
    """``BENCH_GPU_BLOCKS``' default (see :func:`_engine`). A hybrid model's KV block holds one Gated-DeltaNet state
    per layer (vLLM sizes attention blocks to match it: ~2 MB at Qwen3.5-35B-A3B shapes), so the 40 layers of the real
    model get ~700 blocks from the ~60 GB that give a 48-layer Qwen3-30B-A3B ~10,000."""
    layer_types = json.loads((path / "config.json").read_text()).get("layer_types") or ()
    return "700" if "linear_attention" in layer_types else "10000"


def environment() -> None:
    """In-process engines; on CPU vLLM's CPU settings and hwsync's plugin alone (the CPU MoE-LoRA patches; no other
    installed plugin, e.g. ms-swift's, which imports vision code)."""
    if not _on_gpu():
        for key, value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_PLUGINS": "hwsync"}.items():
            os.environ.setdefault(key, value)
    else:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _engine(path: Path, dtype: torch.dtype, rank: int, lora: bool = True, **extra: Any) -> Any:
    """The benchmark's engine; ``extra``: more ``LLM`` arguments (``enable_sleep_mode``: benchmarks/bench_sleep.py)."""
    from vllm import LLM

    args: dict[str, Any] = dict(model=str(path), load_format="dummy", dtype=str(dtype).removeprefix("torch."),
                                enforce_eager=True, enable_lora=lora, seed=0,
                                max_model_len=512, max_num_seqs=int(os.environ.get("BENCH_MAX_SEQS", "8")), **extra)
    if lora:
        args.update(max_lora_rank=rank, max_loras=1)
    if _on_gpu():
        from hwsync.testing.engine import portable_kernel_args

        args.update(portable_kernel_args(path))  # Qwen3.5's GDN layers: vLLM's Triton/FLA prefill, no FlashInfer
        args["gpu_memory_utilization"] = float(os.environ.get("BENCH_GPU_MEM", "0.35"))
        if os.environ.get("BENCH_KV_BYTES"):  # a fixed KV budget skips vLLM's start-up memory profiling, which fails
            args["kv_cache_memory_bytes"] = int(os.environ["BENCH_KV_BYTES"])  # while neighbours free GPU memory
        # the KV blocks a 48-layer Qwen3-30B-A3B gets from ~60 GB: vLLM's prefix-cache reset (every sync) walks
        # every block, so a 4-layer model with the same memory would inflate it ~12x
        args["num_gpu_blocks_override"] = int(os.environ.get("BENCH_GPU_BLOCKS", _gpu_blocks(path)))
    else:
        args.update(num_gpu_blocks_override=32)
        if lora:
            args.update(lora_target_modules=["qkv_proj", "o_proj"])
    return LLM(**args)


def _logprobs(llm: Any, lora_request: Any = None) -> list[list[float]]:
    from vllm import SamplingParams

    from hwsync.trainer.verify import engine_logprobs

    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, prompt_logprobs=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, lora_request=lora_request,
                        use_tqdm=False)
    return [engine_logprobs(o)[1] for o in outs]


def _delta(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def _copy_seconds(nbytes: int, cap: int = 4 << 30) -> float:
    """Median time of one device copy of ``nbytes`` (the floor of a colocated sync). Beyond ``cap`` (60 GB of a
    48-layer model would need 120 GB for source and destination) a ``cap``-sized copy is timed and scaled: a copy
    this large runs at the device's bandwidth, linear in bytes."""
    device = "cuda" if _on_gpu() else "cpu"
    n = min(nbytes, cap)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        _sync_device()
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync_device()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * nbytes / max(n, 1)


def _timed_syncs(llm: Any, model: Any, strategy: str, warmup: int, n: int, **kw: Any) -> tuple[float, Any]:
    import hwsync

    reports = []
    for i in range(warmup + n):
        _step(model, 100 + i)
        _sync_device()
        t0 = time.perf_counter()
        r = hwsync.sync(llm, model, strategy=strategy, **kw)
        _sync_device()
        reports.append((time.perf_counter() - t0, r))
    return statistics.median(s for s, _ in reports[warmup:]), reports[-1][1]


class _NoFiniteCheck:
    """The baseline of the non-finite check's cost (:mod:`hwsync.common.finite`): the receiver's flags with nothing checked,
    copies plain."""

    checked_in_copy = 0

    def open(self, *args: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def writing(self) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def non_finite(self) -> list[int]:
        return []


def _unchecked_seconds(llm: Any, model: Any, strategy: str, n: int) -> float:
    """Median steady sync with the receiver's non-finite check off (in-process engines only; NaN elsewhere), on
    the same engine and trainer: what the check costs is the difference."""
    import hwsync.engine.receiver as receiver

    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0":
        return float("nan")
    checked = receiver.FiniteFlags
    receiver.FiniteFlags = _NoFiniteCheck  # type: ignore[assignment,misc]
    try:
        seconds, _ = _timed_syncs(llm, model, strategy, 1, n)
    finally:
        receiver.FiniteFlags = checked  # type: ignore[misc]
    return seconds


def _profile(llm: Any, model: Any, strategy: str, syncs: int = 10) -> None:
    """Where steady-state syncs spend their time: cProfile over ``syncs`` syncs (by cumulative and by own time), and
    on CUDA the kernels they launch (torch.profiler: count and device time), so Python overhead and device work can
    be told apart."""
    import cProfile
    import io
    import pstats

    import hwsync

    for i in range(2):
        _step(model, 990 + i)
        hwsync.sync(llm, model, strategy=strategy)
    _sync_device()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    for i in range(syncs):
        _step(model, 1000 + i)
        prof.enable()
        hwsync.sync(llm, model, strategy=strategy)
        _sync_device()
        prof.disable()
    wall = (time.perf_counter() - t0) / syncs
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("cumulative").print_stats(30)
    stats.sort_stats("tottime").print_stats(20)
    print(f"\n### profile of {syncs} steady-state {strategy} syncs (incl. trainer steps: {wall * 1e3:.2f} ms per "
          f"step+sync under cProfile)\n" + out.getvalue())
    if not _on_gpu():
        return
    from torch.profiler import ProfilerActivity, profile

    _step(model, 2000)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
        hwsync.sync(llm, model, strategy=strategy)
        _sync_device()
    launches = sum(e.count for e in tp.key_averages() if e.key.startswith(("cudaLaunchKernel", "cudaMemcpyAsync",
                                                                           "cudaMemsetAsync", "cuLaunchKernel")))
    print(f"### one {strategy} sync under torch.profiler: {launches} kernel launches / copies")
    print(tp.key_averages().table(sort_by="device_time_total", row_limit=20))


def _reset_seconds(llm: Any, repeats: int = 7) -> float:
    """Median time of vLLM's own ``reset_prefix_cache()`` (every sync ends with one: cached KV of the old weights
    must not be reused). It walks every KV block in Python, so it grows with the KV cache, not with the sync."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        llm.reset_prefix_cache()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _allocated() -> int:
    return torch.cuda.memory_allocated() if _on_gpu() else 0


def _checksum(t: torch.Tensor, chunk: int = 1 << 24) -> tuple[float, float]:
    """Two float64 sums (plain and position-weighted), chunk by chunk: equal tensors give equal sums, and 60 GB of
    weights are compared without a copy of them."""
    flat = t.detach().reshape(-1)
    plain = weighted = 0.0
    with torch.no_grad():
        for lo in range(0, flat.numel(), chunk):
            v = flat[lo: lo + chunk].to(torch.float64)
            w = torch.arange(lo, lo + v.numel(), device=v.device, dtype=torch.float64).remainder_(9973).add_(1)
            plain += float(v.sum())
            weighted += float((v * w).sum())
    return plain, weighted


def _slot_sums(llm: Any, lid: int) -> dict[str, tuple[float, float]]:
    """Checksums of every LoRA slot buffer of adapter ``lid``: what the kernels read for it."""
    wm = llm.llm_engine.model_executor.driver_worker.worker.model_runner.lora_manager._adapter_manager
    if lid not in wm.lora_index_to_id:
        return {}
    slot = wm.lora_index_to_id.index(lid)
    out = {}
    for name, module in wm.modules.items():
        for attr, value in vars(module).items():
            if attr.endswith("_stacked") and not (attr == "lora_a_stacked" and isinstance(value, list)):
                for i, t in enumerate(value if isinstance(value, (tuple, list)) else (value,)):
                    if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] > slot:
                        out[f"{name}.{attr}[{i}]"] = _checksum(t[slot])
    return out


def _base_sums(runner: Any) -> dict[str, tuple[float, float]]:
    return {name: _checksum(p) for name, p in runner.get_model().named_parameters() if "lora" not in name}


def colocate(path: Path, args: argparse.Namespace, dtype: torch.dtype) -> tuple[list[dict[str, Any]], dict, Any]:
    """Each strategy in its own phase on one engine: its trainer is built, synced (first, second, steady), compared
    with vLLM's own path, and freed before the next one (at 48 layers one trainer and one engine fill an H200)."""
    import gc

    import hwsync
    from hwsync.common import progress
    from hwsync.trainer.merged import merged_named_weights
    from hwsync.engine.vllm.applier import vllm_reload

    llm = _engine(path, dtype, args.rank)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    rows: list[dict[str, Any]] = []
    served: dict[str, Any] = {}
    reset = _reset_seconds(llm)
    for k, strategy in enumerate(args.strategies):
        model = _trainer(path, strategy, args.rank, dtype)
        gc.collect()
        times, peaks = [], []
        held = (float("nan"), float("nan"))
        report = None
        for i in range(args.warmup + args.syncs):
            _step(model, 100 + i)
            _sync_device()
            before = _allocated()
            if _on_gpu():
                torch.cuda.reset_peak_memory_stats()
            history = i == 0 and args.memory_history and _on_gpu()
            if history:  # every allocation of the first sync, with its stack: what its peak is made of
                torch.cuda.memory._record_memory_history(stacks="python", max_entries=2_000_000)
            t0 = time.perf_counter()
            report = hwsync.sync(llm, model, strategy=strategy)
            _sync_device()
            times.append(time.perf_counter() - t0)
            if history:
                out = Path(args.memory_history).with_suffix(f".{strategy}.pickle")
                torch.cuda.memory._dump_snapshot(str(out))
                torch.cuda.memory._record_memory_history(enabled=None)
                print(f"{strategy}: first sync's allocations in {out} (before: {before / 1e9:.2f} GB)", flush=True)
            if _on_gpu():  # extra memory of this sync: its peak over what was held before and after it
                peaks.append(torch.cuda.max_memory_allocated() - max(before, _allocated()))
                if i == 0:  # and what the first sync leaves held (the adapter vLLM holds, kept buffers), and its
                    held = (_allocated() - before, torch.cuda.max_memory_allocated() - before)  # peak over before
            if i == 0:
                print(f"{strategy}: first sync {times[0]:.2f} s: {report.path}", flush=True)
                print(f"{strategy}: first sync's phases: " + ", ".join(f"{w} {sec:.2f} s" for w, sec in progress.recent),
                      flush=True)
            progress.recent.clear()
        assert report is not None
        seconds = statistics.median(times[max(args.warmup, 2):] or times[-1:])
        second = times[1] if len(times) > 1 else 0.0
        print(f"{strategy}: steady {seconds * 1e3:.2f} ms (median), second sync {second:.4f} s, peak extra first/"
              f"steady {peaks[0] / 1e9 if peaks else 0:.2f}/{max(peaks[1:], default=0) / 1e9:.2f} GB; the first sync "
              f"holds {held[0] / 1e9:.2f} GB more after it than before, peak {held[1] / 1e9:.2f} GB over before",
              flush=True)  # kept if vLLM's own path below fails
        unchecked = _unchecked_seconds(llm, model, strategy, args.syncs)
        print(f"{strategy}: steady without the non-finite check {unchecked * 1e3:.2f} ms: the check costs "
              f"{(seconds - unchecked) / unchecked * 100:+.1f} %", flush=True)
        if args.profile:
            _profile(llm, model, strategy)
        ours = _logprobs(llm, report.lora_request)
        ours_again = _logprobs(llm, report.lora_request)
        lora_bytes = report.bytes if strategy == "adapter" else 0  # steady adapter syncs carry the adapter only
        mine = _slot_sums(llm, report.lora_request.lora_int_id) if report.lora_request else {}
        base_mine = _base_sums(runner)
        trainer_gap = hwsync.agreement(llm, model, PROMPTS).max_abs_diff if not _on_gpu() or args.layers <= 4 \
            else float("nan")
        # vLLM's own path for the same update, timed on the same engine, then compared output for output and
        # content for content: a new adapter id built by vLLM's construction (HWSYNC_DIRECT=0: no traced layout,
        # no in-place writes), or vLLM's reload_weights of the merged weights
        if report.lora_tensors and _on_gpu():  # vLLM's own construction needs two more adapter copies: the plan's
            from hwsync.trainer.api import as_engine  # kept fold buffers go first (at 48 layers the GPU is full)

            as_engine(llm).plans.clear()
            gc.collect()
            torch.cuda.empty_cache()
        _sync_device()
        t0 = time.perf_counter()
        if report.lora_tensors:
            os.environ["HWSYNC_DIRECT"] = "0"
            try:
                ref = hwsync.sync(llm, model, strategy=strategy, lora_int_id=4242 + k)
            finally:
                del os.environ["HWSYNC_DIRECT"]
            lora_request = ref.lora_request
            del ref
        else:
            vllm_reload(runner, merged_named_weights(model))
            llm.reset_prefix_cache()
            lora_request = None
        _sync_device()
        vllm_seconds = time.perf_counter() - t0
        theirs = _logprobs(llm, lora_request)
        theirs_again = _logprobs(llm, lora_request)
        slots_equal = None
        if report.lora_request is not None:
            slots_equal = bool(mine) and mine == _slot_sums(llm, lora_request.lora_int_id)
        base_equal = base_mine == _base_sums(runner)
        exact = _delta(ours, theirs)
        # vLLM's dense-LoRA shrink kernel splits K with fp32 atomic adds (vllm/lora/ops/triton_ops/utils.py, unless
        # VLLM_BATCH_INVARIANT=1): the same engine state may not reproduce its own logprobs bit for bit, so both
        # paths' repeat spreads are reported beside the gap, and the content itself is compared
        repeat = max(_delta(theirs, theirs_again), _delta(ours, ours_again))
        copy = _copy_seconds(report.bytes)
        print(f"{strategy}: {report.line()}", flush=True)
        row = {"layers": args.layers, "strategy": strategy, "rank": args.rank if report.lora_tensors else 0,
               "tensors": report.tensors, "MB": report.bytes / 1e6,
               "first_s": times[0], "second_s": times[1] if len(times) > 1 else float("nan"),
               "seconds": seconds, "unchecked_s": unchecked, "check_%": (seconds - unchecked) / unchecked * 100,
               "GB/s": report.bytes / 1e9 / seconds, "copy_s": copy, "x_copy": seconds / copy,
               "of_which_cache_reset_s": reset,
               "peak_extra_first_GB": peaks[0] / 1e9 if peaks else float("nan"),
               "peak_extra_steady_GB": max(peaks[1:], default=float("nan")) / 1e9 if peaks else float("nan"),
               "held_after_first_GB": held[0] / 1e9, "peak_first_over_before_GB": held[1] / 1e9,
               "adapter_GB": lora_bytes / 1e9, "vllm_path_s": vllm_seconds,
               "speedup_vs_vllm": vllm_seconds / seconds, "slots_equal": slots_equal, "base_equal": base_equal,
               "Δ_vs_vllm_path": exact, "Δ_repeat": repeat, "Δ_vs_trainer": trainer_gap}
        rows.append(row)
        if args.json:  # row by row: a later phase that fails keeps what was measured
            Path(args.json).write_text(json.dumps({"colocate": rows, "server": []}, indent=2, default=str))
        if lora_request is not None:  # vLLM's own copy of the adapter: its memory goes back before anything else
            llm.llm_engine.remove_lora(lora_request.lora_int_id)
        if k + 1 < len(args.strategies) or args.server:  # leave the engine on hwsync's own state for what follows
            hwsync.sync(llm, model, strategy=strategy)
        if args.server:
            served[strategy] = model
        else:  # the engine handle's cached plans hold the trainer: drop them, so the next phase has its memory
            from hwsync.trainer.api import as_engine

            as_engine(llm).plans.clear()
        del model, report
        gc.collect()
        if _on_gpu():
            torch.cuda.empty_cache()
    return rows, served, llm


ENGINE = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, os.path.dirname(sys.argv[1]))
    import bench_sync as b
    import hwsync
    if os.environ.get("BENCH_PROFILE_SERVER"):
        b._profile_server_syncs()
    llm = b._engine(b.Path(sys.argv[2]), getattr(torch, sys.argv[3]), int(sys.argv[4]))
    with hwsync.serve(llm, "127.0.0.1:0", b.TOKEN, timeout_s=600) as server:
        print("HWSYNC_ADDRESS", server.address, flush=True)
        server.wait()
""")

BROADCAST = textwrap.dedent("""
    import datetime, os, sys, time, torch, torch.distributed as dist
    rank, port, nbytes = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=2)
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    times = []
    for _ in range(5):
        dist.barrier()
        if cuda: torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.broadcast(buf, 0)
        if cuda: torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        print("BROADCAST_S", sorted(times[1:])[len(times[1:]) // 2], flush=True)
    dist.destroy_process_group()
""")


def _profile_server_syncs(every: int = 6) -> None:
    """In the engine process (``--profile`` with ``--server``): every ``every``-th sync the server handles is run
    under cProfile and its top entries go to stderr, so where the engine side of a steady sync spends its time is
    in the log (the warm-up syncs come first: the 6th of each strategy's is a steady one)."""
    import cProfile
    import io
    import pstats

    from hwsync.engine.server import SyncServer

    original = SyncServer._sync
    count = [0]

    def _sync(self: Any, channel: Any, args: Any) -> Any:
        count[0] += 1
        if count[0] % every:
            return original(self, channel, args)
        prof = cProfile.Profile()
        prof.enable()
        try:
            return original(self, channel, args)
        finally:
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
            print(f"### engine side of server sync {count[0]} (by own time)\n{out.getvalue()}", file=sys.stderr,
                  flush=True)

    SyncServer._sync = _sync  # the benchmark's own engine process only
    SyncServer.OPS["sync"] = _sync


def _broadcast_seconds(nbytes: int, cap: int = 4 << 30) -> float:
    """Median time of one NCCL (gloo on CPU) broadcast of ``nbytes`` between two processes: the link's floor. Beyond
    ``cap`` a ``cap``-sized broadcast is timed and scaled (GPU 0 holds the trainer and the colocated engine of a
    48-layer model: no room for 60 GB more)."""
    import socket

    n = min(nbytes, cap)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", BROADCAST, str(r), str(port), str(n)],
                              stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    out = procs[0].communicate(timeout=300)[0]
    procs[1].wait(timeout=60)
    seconds = float(next(line.split()[1] for line in out.splitlines() if line.startswith("BROADCAST_S")))
    return seconds * nbytes / max(n, 1)


def server(path: Path, args: argparse.Namespace, dtype: torch.dtype, served: dict, local: Any) -> list[dict[str, Any]]:
    import hwsync

    env = dict(os.environ)
    if _on_gpu():
        env["CUDA_VISIBLE_DEVICES"] = "1"
    if args.profile:
        env["BENCH_PROFILE_SERVER"] = "1"
    proc = subprocess.Popen([sys.executable, "-c", ENGINE, str(Path(__file__).resolve()), str(path),
                             str(dtype).removeprefix("torch."), str(args.rank)], env=env, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    address = next(line.split()[1] for line in proc.stdout if line.startswith("HWSYNC_ADDRESS"))
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep the pipe drained
    rows = []
    try:
        engine = hwsync.connect(address, TOKEN, timeout_s=600)
        for strategy in args.strategies:
            model = served[strategy]
            seconds, report = _timed_syncs(engine, model, strategy, args.warmup, args.syncs)
            if args.profile:  # the trainer's side here; the engine's side is in the engine process's stderr
                _profile(engine, model, strategy, syncs=5)
            # the served engine must equal the colocated engine fed the same weights (that one equals vLLM's path)
            remote = [v for _, v in engine.logprobs(PROMPTS, 4)]
            lora_request = hwsync.sync(local, model, strategy=strategy).lora_request
            mine = _logprobs(local, lora_request)
            exact = _delta(remote, mine)
            # vLLM's LoRA shrink kernel adds split-K partials with fp32 atomics (see colocate()): each engine's own
            # repeat spread is measured, so a gap can be told from run-to-run noise of the same state
            repeat = max(_delta(remote, [v for _, v in engine.logprobs(PROMPTS, 4)]),
                         _delta(mine, _logprobs(local, lora_request)))
            base = _broadcast_seconds(report.bytes)
            rows.append({"strategy": strategy, "tensors": report.tensors, "MB": report.bytes / 1e6,
                         "seconds": seconds, "GB/s": report.bytes / 1e9 / seconds, "broadcast_s": base,
                         "x_broadcast": seconds / base, "buckets": report.buckets, "Δ_vs_colocated": exact,
                         "Δ_repeat": repeat})
            # where a steady sync's time goes (the last timed one): trainer-side phases and the engine's own
            print(f"server {strategy}: last sync's phases (ms): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in getattr(engine, "last_timings", {}).items()), flush=True)
        engine.shutdown()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return rows


def _print(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n## {title}")
    if not rows:
        return
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()) + " |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--layers", default="2", help="layer count, or a comma list: each count in its own process, "
                    "then one scaling table")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--strategies", default="full,adapter,hybrid")
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--server", action="store_true", help="also server mode (2 GPUs on CUDA; 2 processes on CPU)")
    ap.add_argument("--json", help="write the tables here")
    ap.add_argument("--profile", action="store_true", help="cProfile one steady-state sync per strategy")
    ap.add_argument("--memory-history", help="CUDA: record the first sync's allocations (with stacks) and write "
                    "torch's memory snapshot to PATH.<strategy>.pickle (pytorch.org/memory_viz)")
    args = ap.parse_args(argv)
    counts = [int(x) for x in str(args.layers).split(",") if x.strip()]
    if len(counts) > 1:
        return _scaling(counts, argv if argv is not None else sys.argv[1:], args.json)
    args.layers = counts[0]
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("hwsync").setLevel(logging.INFO)
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    environment()
    dtype = torch.bfloat16 if _on_gpu() else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        path = _checkpoint(Path(tmp), args.shapes, args.layers)
        device = torch.cuda.get_device_name() if _on_gpu() else "cpu"
        family = {"qwen3_moe": "Qwen3-MoE", "qwen3_5_moe": "Qwen3.5-MoE"}[FAMILY.get(args.shapes, "qwen3_moe")]
        print(f"model: {family}, {args.layers} layers of {args.shapes} shapes, {dtype}, LoRA rank {args.rank}; "
              f"device {device}; torch {torch.__version__}")
        rows, served, local = colocate(path, args, dtype)
        _print("colocate (engine in this process)", rows)
        srows = server(path, args, dtype, served, local) if args.server else []
        if srows:
            _print("server mode (engine in another process)", srows)
    if args.json:
        Path(args.json).write_text(json.dumps({"colocate": rows, "server": srows}, indent=2, default=str))
    failed = [r["strategy"] for r in rows if not _exact(r)]
    failed += [f"server {r['strategy']}" for r in srows if not r["Δ_vs_colocated"] <= 1e-6]
    if failed:
        print(f"EXACTNESS FAILED: {failed}")
        return 1
    print("exactness: every synced engine equals vLLM's own load path (slot and base content equal; logprobs within "
          "the paths' own repeat spread, Δ_repeat)")
    return 0


def _exact(row: dict[str, Any]) -> bool:
    """The synced engine holds what vLLM's own path holds (slots and base compared where measured) and serves the
    same logprobs up to the repeat spread of the same engine state."""
    if row.get("slots_equal") is False or row.get("base_equal") is False:
        return False
    if row.get("base_equal") and row.get("slots_equal") in (True, None) and _on_gpu():
        # what the kernels read is bit for bit vLLM's own: a logprob gap beyond the repeat spread is vLLM's LoRA
        # kernels (split-K fp32 atomics, not batch-invariant) on the same state, reported beside it
        return True
    return row["Δ_vs_vllm_path"] <= (1e-6 if _on_gpu() else 1e-5) + row["Δ_repeat"]


def _scaling(counts: list[int], argv: list[str], json_path: str | None) -> int:
    """One process per layer count (a fresh engine and trainer each), then the rows side by side."""
    rows: list[dict[str, Any]] = []
    rc = 0
    base = [a for i, a in enumerate(argv) if a not in ("--layers", "--json") and not a.startswith("--layers=")
            and (i == 0 or argv[i - 1] not in ("--layers", "--json"))]
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            out = Path(tmp) / f"{n}.json"
            code = subprocess.call([sys.executable, __file__, *base, "--layers", str(n), "--json", str(out)])
            rc = rc or code
            if out.exists():
                rows += json.loads(out.read_text())["colocate"]
            else:
                rows.append({"layers": n, "strategy": "(failed)", "rc": code})
    keys = ["layers", "strategy", "rank", "MB", "first_s", "second_s", "seconds", "GB/s", "peak_first_over_before_GB",
            "check_%", "held_after_first_GB", "peak_extra_first_GB",
            "peak_extra_steady_GB", "adapter_GB", "vllm_path_s", "slots_equal", "base_equal",
            "Δ_vs_vllm_path", "Δ_repeat"]
    _print("scaling (one process per layer count)", [{k: r.get(k, "") for k in keys} for r in rows])
    if json_path:
        Path(json_path).write_text(json.dumps({"scaling": rows}, indent=2, default=str))
    return rc


if __name__ == "__main__":
    sys.exit(main())
