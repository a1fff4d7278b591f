"""A sharded trainer feeding a tensor-parallel engine, checked against a fresh TP engine: the 2-rank scenario behind
``tests/test_multigpu_fsdp_tp.py`` (2 GPUs, NCCL) and ``tests/test_fsdp_tp_cpu.py`` (vLLM's CPU build, gloo).

Layout (ms-swift's colocate mode with ``--vllm_tensor_parallel_size 2``): two processes, each a trainer rank
(``fully_shard`` of a PEFT MoE model) and one worker of one TP=2 engine (``distributed_executor_backend=
"external_launcher"``, engine core in-process). Every rank calls ``hwsync.sync(llm, model)``: parameters are gathered
bucket by bucket (:mod:`hwsync.common.gather`), each rank hands the full tensors to its own worker, and the worker keeps
its TP shard (vLLM's loaders; hwsync's in-place writers slice through :mod:`hwsync.engine.names` /
:mod:`hwsync.common.layouts`). Each rank feeds its own worker rather than rank 0 feeding all: after the gather every
rank holds the full tensors anyway, so this costs no extra traffic and no cross-process copy.

:func:`run` spawns the ranks; after each sync they record the engine's greedy logprobs and rank 0 writes the weights
the sync delivered (merged checkpoint for ``full``, ``W0`` + PEFT's adapter for ``adapter``) from an unsharded copy
stepped identically. Once the ranks are gone, :func:`check` starts fresh TP engines (``distributed_executor_backend=
"mp"``, same arguments) on those weights, one at a time, and compares.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import os
import socket
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "CPU_STRATEGIES",
    "PROMPTS",
    "STRATEGIES",
    "TRAINERS",
    "check",
    "free_port",
    "init_rank",
    "peft_trainer",
    "run",
    "run_and_check",
    "shard",
    "step",
]

WORLD = 2
PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8], [3, 4, 200, 17, 18, 99], [11, 400, 23]]
STRATEGIES = ["full", "adapter", "adapter", "full", "adapter", "full"]
CPU_STRATEGIES = STRATEGIES[:5]
"""The CPU variant's syncs: every transition of :data:`STRATEGIES` -- the first (full), full -> adapter (the base
travels again, the adapter plan built), adapter steady (LoRA only), adapter -> full (the full plan reused),
full -> adapter (the adapter plan reused) -- without its last sync, which repeats the fourth's path exactly
(adapter -> full, the full plan reused; the same report) and costs one more fresh TP=2 reference engine (~40 s of a
2-core machine with nothing beside it)."""
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
BUCKET_MB = 0.25  # small buckets: the tiny model is gathered in several groups, as a large one would be
_LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def engine_kwargs(cuda: bool) -> dict[str, Any]:
    """The TP=2 engine's arguments besides :func:`hwsync.testing.engine_args` (bf16 with LoRA on GPUs, fp32 on
    CPU). On CPU vLLM serves no expert LoRA: attention LoRA only."""
    kw: dict[str, Any] = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1, "tensor_parallel_size": WORLD}
    return kw


def _targets(cuda: bool) -> tuple[list[str], list[str] | None]:
    return (ATTN, EXPERTS) if cuda else (ATTN, None)


def peft_trainer(path: str, device: Any, cuda: bool) -> Any:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    modules, params = _targets(cuda)
    # alpha/r = 2: a power of two, so LoRA scaling rounds alike on both loading paths in bf16
    cfg = LoraConfig(
        r=4, lora_alpha=8, target_modules=modules, target_parameters=params, lora_dropout=0.0, init_lora_weights=False
    )
    # the same LoRA initialisation on every rank (as a trainer's synced init would give): fully_shard keeps each
    # rank's shard of its own copy, so different copies would gather into a mixture the reference never sees
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        return get_peft_model(model, cfg).eval()


TRAINERS = ("fsdp2", "zero3")


def shard(model: Any, device_type: str, trainer: str = "fsdp2") -> Any:
    """``fsdp2``: ``fully_shard`` per decoder layer and the root; ``zero3``: DeepSpeed stage 3 with every parameter
    partitioned (its default keeps small ones whole), no optimizer (the scenario steps the shards itself)."""
    if trainer == "zero3":
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        }
        engine, *_ = deepspeed.initialize(model=model, config=config)
        return engine.module
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type, (WORLD,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def step(model: Any, k: int, *, base: bool) -> None:
    """The same deterministic change on the sharded and the unsharded copy (elementwise: shard-local; a ZeRO-3
    parameter's shard is its ``ds_tensor``, its own data is empty outside a gather)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            p = getattr(p, "ds_tensor", p)
            if "lora_" in name:
                p.mul_(1.0 + 0.05 * (k + 1)).add_(0.002 * (k + 1))
            elif base:
                p.mul_(1.0 + 0.001 * (k + 1))


def init_rank(rank: int, port: int, *, cuda: bool, trainer: str = "fsdp2") -> Any:
    """This process as trainer rank ``rank`` of :data:`WORLD` (torchrun's variables, NCCL on GPU ``rank`` or gloo on
    CPU; ``zero3``: DeepSpeed takes the group over, with its CPU accelerator on CPU); returns the rank's device."""
    import torch
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group(
            "nccl", rank=rank, world_size=WORLD, device_id=device, timeout=datetime.timedelta(seconds=900)
        )
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=900))
    if trainer == "zero3":
        if not cuda:
            os.environ["DS_ACCELERATOR"] = "cpu"  # CPU/gloo ranks, also on a machine with GPUs
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")  # takes over the group above
    return device


def _child(rank: int, port: int, model_dir: str, work: str, cuda: bool, trainer: str, strategies: list[str]) -> None:
    import torch.distributed as dist

    from hwsync.testing.engine import vllm_env

    for key, value in vllm_env().items():
        os.environ.setdefault(key, value)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # external_launcher: the engine core in this process
    device = init_rank(rank, port, cuda=cuda, trainer=trainer)
    results: dict[str, Any] = {"syncs": []}
    out = Path(work) / f"rank{rank}.json"
    try:
        import hwsync
        from hwsync.common import gather
        from hwsync.engine import vllm_plugin
        from hwsync.testing.engine import make_llm
        from hwsync.testing.reference import write_adapter, write_checkpoint
        from hwsync.trainer.api import as_engine
        from hwsync.trainer.verify import check as verify_check

        vllm_plugin.register()
        ref = peft_trainer(model_dir, device, cuda)  # unsharded copy: the weights the reference engine loads
        sharded = shard(copy.deepcopy(ref), device.type, trainer)
        llm = make_llm(
            model_dir,
            worker_extension_cls="hwsync.vllm.HwsyncWorkerExtension",
            distributed_executor_backend="external_launcher",
            **engine_kwargs(cuda),
        )
        largest = max(gather.global_nbytes(p) for p in sharded.parameters())
        for k, strategy in enumerate(strategies):
            base = strategy == "full"  # full syncs also move W0; adapter syncs keep it (steady state: LoRA only)
            step(ref, k, base=base)
            step(sharded, k, base=base)
            gather.stats.reset()
            report = hwsync.sync(llm, sharded, strategy=strategy, bucket_mb=BUCKET_MB)
            assert report is not None  # this rank holds an engine
            got = as_engine(llm).logprobs(PROMPTS, 4)  # SPMD: both ranks generate the same prompts
            # hwsync.verify from the sharded trainer: both ranks at once (the sharded forward is collective; the
            # ranks of the one engine generate the same prompts); content checks skip a TP engine, the gate runs
            verdict = verify_check(llm, sharded, PROMPTS)
            entry: dict[str, Any] = {
                "strategy": report.strategy,
                "reason": report.reason,
                "base_tensors": report.base_tensors,
                "lora_tensors": report.lora_tensors,
                "mb": report.bytes / 1e6,
                "buckets": report.buckets,
                "seconds": round(report.seconds, 3),
                "peak_gathered_mb": gather.stats.peak / 1e6,
                "bound_mb": 2 * max(BUCKET_MB * (1 << 20), largest) / 1e6,
                "got": got,
                "verify_ok": verdict.ok,
                "verify": verdict.message()
                if not verdict.ok
                else f"passed (mean |Δ| {verdict.agreement.mean_abs_diff:.2g}); {'; '.join(verdict.skipped)}",
            }
            if rank == 0:
                root = Path(work) / "weights"
                root.mkdir(exist_ok=True)
                if strategy == "full":
                    entry["checkpoint"] = str(write_checkpoint(ref, root, True))
                else:
                    entry["checkpoint"] = str(write_checkpoint(ref, root, False))
                    entry["adapter"] = str(write_adapter(ref, root / f"adapter-{k}", moe_format="2d"))
            results["syncs"].append(entry)
            dist.barrier()
        results["ok"] = True
    except Exception:  # noqa: BLE001 - reported to the parent
        results["ok"] = False
        results["error"] = traceback.format_exc()
    finally:
        out.write_text(json.dumps(results, default=str))
        # vLLM's and the process group's teardown at interpreter exit can hang with the engine up: results are written
        os._exit(0 if results.get("ok") else 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _remove_cpu_shm(since: float) -> None:
    """Remove vLLM CPU all-reduce segments created since ``since`` (vLLM 0.32 leaves them behind at exit)."""
    shm = Path("/dev/shm")
    for leftover in shm.glob("*cpushm*") if shm.is_dir() else []:
        try:
            if leftover.stat().st_mtime >= since - 1:
                leftover.unlink()
        except OSError:
            pass


def run(
    work: Path, model_dir: Path, *, cuda: bool, trainer: str = "fsdp2", strategies: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """Spawn the 2 ranks (``trainer``: ``fsdp2`` or ``zero3``) for the syncs ``strategies``; their results (per rank:
    ``ok``, ``syncs`` or ``error``)."""
    if trainer not in TRAINERS:
        raise ValueError(f"trainer={trainer!r}: one of {TRAINERS}")
    import time

    import torch.multiprocessing as mp

    error = None
    port = free_port()
    start = time.time()
    try:
        mp.start_processes(
            _child,
            args=(port, str(model_dir), str(work), cuda, trainer, list(strategies or STRATEGIES)),
            nprocs=WORLD,
            join=True,
            start_method="spawn",
        )
    except Exception as e:  # noqa: BLE001 - the per-rank results carry the traceback
        error = e
    finally:
        # the ranks exit hard (os._exit): remove the shared memory their CPU all-reduce left behind. vLLM's CPU
        # worker names it after the init method ("env://" under external_launcher: the same name every run), so a
        # leftover would make the next run fail with "create shm in SHMManager failed. errno: 17"
        _remove_cpu_shm(start)
    results = []
    for r in range(WORLD):
        path = Path(work) / f"rank{r}.json"
        res = json.loads(path.read_text()) if path.exists() else {"ok": False, "error": f"no result ({error})"}
        results.append(res)
    return results


class _ReferenceEnv:
    """The reference engine's process must not see torchrun-style variables (it is its own world). On CPU its
    engines' ``mp`` workers get 1 s instead of vLLM's 5 to exit when an engine is closed: vLLM's CPU workers never
    exit within the grace period (each close ended in SIGTERM after 5 idle seconds), and a close comes only after
    that engine's answer was received, so nothing it computes depends on it."""

    def __init__(self, cuda: bool = True) -> None:
        self.extra = {} if cuda else {"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "1"}

    def __enter__(self) -> None:
        self.saved = {k: os.environ.pop(k) for k in _LAUNCH_ENV if k in os.environ}
        self.before = {k: os.environ.get(k) for k in self.extra}
        os.environ.update(self.extra)

    def __exit__(self, *exc: object) -> None:
        for k, v in self.before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        os.environ.update(self.saved)


def check(work: Path, syncs: list[dict[str, Any]], *, cuda: bool) -> list[float]:
    """Fresh TP=2 engines (``mp`` executor, same arguments) on the weights each sync delivered: the max
    |Δ logprob| per sync (raises :class:`~hwsync.testing.ReferenceMismatch` when greedy tokens differ)."""
    import time

    from hwsync.testing.reference import EngineReference, compare_logprobs

    diffs = []
    start = time.time()
    with _ReferenceEnv(cuda), contextlib.ExitStack() as cleanup:
        cleanup.callback(_remove_cpu_shm, start)  # after the reference engine is closed (callbacks run last-in first)
        reference = cleanup.enter_context(
            EngineReference(
                Path(work) / "reference", distributed_executor_backend="mp", daemon=False, **engine_kwargs(cuda)
            )
        )
        for k, entry in enumerate(syncs):
            adapter = Path(entry["adapter"]) if entry.get("adapter") else None
            want = reference._ask(Path(entry["checkpoint"]), adapter, PROMPTS, 4)
            got = [(list(ids), list(vals)) for ids, vals in entry["got"]]
            diffs.append(compare_logprobs(got, want, f"TP=2 {entry['strategy']} sync {k + 1}"))
    return diffs


def run_and_check(
    work: Path, model_dir: Path, *, cuda: bool, trainer: str = "fsdp2", strategies: Sequence[str] | None = None
) -> list[float]:
    """The whole scenario with its assertions (the CPU and the 2-GPU test share it): every rank ran every sync, both
    workers of the one engine answered alike, gathered bytes stayed within 2 buckets, the adapter steady state sent
    LoRA only, and each sync equals a fresh TP=2 engine within ``EXACT_ATOL``. Returns the per-sync |Δ logprob|."""
    from hwsync.testing import EXACT_ATOL

    strategies = list(strategies or STRATEGIES)
    results = run(work, model_dir, cuda=cuda, trainer=trainer, strategies=strategies)
    for r, res in enumerate(results):
        for entry in res.get("syncs", []):
            print(f"{trainer} rank {r}: " + ", ".join(f"{k}={v}" for k, v in entry.items() if k not in ("got",)))
        assert res.get("ok"), f"rank {r}:\n{res.get('error')}"
    syncs = results[0]["syncs"]
    assert [s["strategy"] for s in syncs] == strategies
    assert [s["got"] for s in syncs] == [s["got"] for s in results[1]["syncs"]]  # one engine, same answers
    for res in results:  # gathered bytes alive at once: <= 2 buckets (a bucket is at least the largest tensor)
        assert all(s["peak_gathered_mb"] <= s["bound_mb"] for s in res["syncs"]), res["syncs"]
    for res in results:  # hwsync.verify from the sharded trainer passed on every rank after every sync
        assert all(s["verify_ok"] for s in res["syncs"]), [s["verify"] for s in res["syncs"]]
    assert syncs[1]["base_tensors"] > 0  # after a full sync, the base travels again
    assert syncs[2]["base_tensors"] == 0 and syncs[2]["lora_tensors"] > 0, syncs[2]  # steady: LoRA only
    diffs = check(work, syncs, cuda=cuda)
    print(f"max |Δ logprob| per sync vs a fresh TP=2 engine: {diffs}")
    assert all(d <= EXACT_ATOL for d in diffs), diffs
    return diffs
