"""2 GPUs: an FSDP2 trainer on 2 ranks syncs into a tensor-parallel (TP=2) vLLM engine, exactly.

Layout (the one ms-swift's colocate mode with ``--vllm_tensor_parallel_size 2`` runs): two processes, one per GPU,
each a trainer rank (``fully_shard`` of a tiny PEFT MoE model, NCCL) and one worker of one TP=2 engine
(``distributed_executor_backend="external_launcher"``, the engine in-process). Every rank calls
``hwsync.sync(llm, model)``: the parameters are gathered bucket by bucket (:mod:`hwsync.gather`, never the whole
model), each rank hands the full tensors to its own worker, and the worker keeps its TP shard (vLLM's loaders /
``hwsync.layouts`` slice packed qkv / gate_up and the experts). Why each rank feeds its own worker instead of rank 0
feeding all: the gather leaves the full tensors on every rank anyway, so no extra traffic, and no cross-process hop.

After each of 6 syncs (full, adapter, adapter, full, adapter, full: 3 of each, the adapter syncs LoRA-only in steady
state) the engine's greedy tokens and logprobs must equal those of a fresh TP=2 engine (same arguments, bf16,
``distributed_executor_backend="mp"``) that vLLM loads from the same weights itself -- a transformers checkpoint of
the merged view for ``full``, ``W0`` plus PEFT's saved adapter for ``adapter`` (:class:`hwsync.testing.EngineReference`,
built from an unsharded copy of the trainer stepped identically) -- within ``EXACT_ATOL``.

Skips without 2 CUDA GPUs (conftest: ``multigpu``); on a machine with them, a failure fails, CI or not.
"""
from __future__ import annotations

import copy
import datetime
import json
import os
import socket
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.multigpu, pytest.mark.vllm, pytest.mark.slow]

WORLD = 2
PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8], [3, 4, 200, 17, 18, 99], [11, 400, 23]]
STRATEGIES = ["full", "adapter", "adapter", "full", "adapter", "full"]
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# 2-D MoE LoRA (vLLM's default expert-LoRA wrapper), bf16 (engine_args picks it with enable_lora on GPUs)
ENGINE: dict[str, Any] = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1, "tensor_parallel_size": WORLD}
BUCKET_MB = 0.5  # small buckets: the tiny model is gathered in several groups, as a large one would be
_LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _trainer(path: str, device: torch.device) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    # alpha/r = 2: a power of two, so LoRA scaling rounds alike on both loading paths in bf16
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=ATTN, target_parameters=EXPERTS, lora_dropout=0.0)
    return get_peft_model(model, cfg).eval()


def _shard(model: Any) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda", (WORLD,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _perturb(model: Any, k: int, *, base: bool) -> None:
    """The same deterministic change on the sharded and the unsharded copy (elementwise: shard-local)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(1.0 + 0.05 * (k + 1)).add_(0.002 * (k + 1))
            elif base:
                p.mul_(1.0 + 0.001 * (k + 1))


class _NoLaunchEnv:
    """The reference engine's process must not see this rank's torchrun-style variables (it is its own world)."""

    def __enter__(self) -> None:
        self.saved = {k: os.environ.pop(k) for k in _LAUNCH_ENV if k in os.environ}

    def __exit__(self, *exc: object) -> None:
        os.environ.update(self.saved)


def child(rank: int, port: int, model_dir: str, work: str) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from hwsync.testing.engine import vllm_env

    for key, value in vllm_env().items():
        os.environ.setdefault(key, value)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # external_launcher: the engine core in this process
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=WORLD, device_id=device,
                            timeout=datetime.timedelta(seconds=900))
    results: dict[str, Any] = {"syncs": []}
    out = Path(work) / f"rank{rank}.json"
    try:
        import hwsync
        from hwsync import gather, vllm_plugin
        from hwsync.api import as_engine
        from hwsync.testing import EXACT_ATOL, EngineReference
        from hwsync.testing.engine import make_llm
        from hwsync.testing.reference import compare_logprobs

        vllm_plugin.register()
        ref = _trainer(model_dir, device)  # unsharded copy: what the reference engine loads
        sharded = _shard(copy.deepcopy(ref))
        llm = make_llm(model_dir, worker_extension_cls="hwsync.vllm.HwsyncWorkerExtension",
                       distributed_executor_backend="external_launcher", **ENGINE)
        reference = None
        if rank == 0:
            reference = EngineReference(Path(work) / "reference", distributed_executor_backend="mp", **ENGINE)
        for k, strategy in enumerate(STRATEGIES):
            base = strategy == "full"  # full syncs also move W0; adapter syncs keep it (steady: LoRA only)
            _perturb(ref, k, base=base)
            _perturb(sharded, k, base=base)
            gather.stats.reset()
            report = hwsync.sync(llm, sharded, strategy=strategy, bucket_mb=BUCKET_MB)
            got = as_engine(llm).logprobs(PROMPTS, 4)  # SPMD: both ranks generate the same prompts
            entry: dict[str, Any] = {"strategy": report.strategy, "reason": report.reason,
                                     "base_tensors": report.base_tensors, "lora_tensors": report.lora_tensors,
                                     "mb": report.bytes / 1e6, "seconds": report.seconds,
                                     "peak_gathered_mb": gather.stats.peak / 1e6, "tokens": got[0][0]}
            if reference is not None:
                with _NoLaunchEnv():
                    want = reference.logprobs(ref, strategy, PROMPTS, 4)
                diff = compare_logprobs(got, want, f"TP=2 {strategy} sync {k + 1}")
                entry["max_abs_dlogp"] = diff
                assert diff <= EXACT_ATOL, f"{strategy} sync {k + 1}: |Δ logprob| {diff:.3g} > {EXACT_ATOL}"
            results["syncs"].append(entry)
            print(f"rank {rank} sync {k + 1}: {json.dumps(entry, default=str)}", flush=True)
            dist.barrier()
        results["ok"] = True
        if reference is not None:
            reference.close()
    except Exception:  # noqa: BLE001 - reported to the parent
        results["ok"] = False
        results["error"] = traceback.format_exc()
        raise
    finally:
        out.write_text(json.dumps(results, default=str))
        # vLLM's and NCCL's teardown at interpreter exit can hang with an engine still up: the result is written
        os._exit(0 if results.get("ok") else 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_fsdp2_trainer_into_tp2_engine_is_exact(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from hwsync.testing import make_tiny_moe

    model_dir = make_tiny_moe(tmp_path / "model")
    error = None
    try:
        mp.start_processes(child, args=(_free_port(), str(model_dir), str(tmp_path)), nprocs=WORLD, join=True,
                           start_method="spawn")
    except Exception as e:  # noqa: BLE001 - the per-rank results carry the traceback
        error = e
    results = []
    for r in range(WORLD):
        path = tmp_path / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {"ok": False, "error": "no result"})
    for r, res in enumerate(results):
        for entry in res.get("syncs", []):
            print(f"rank {r}: {entry}")
        assert res.get("ok"), f"rank {r}: {res.get('error')}\n{error}"
    assert error is None, error
    syncs = results[0]["syncs"]
    assert [s["strategy"] for s in syncs] == STRATEGIES
    assert all(s["max_abs_dlogp"] <= 1e-6 for s in syncs)
    # steady adapter sync: LoRA only (the engine kept W0 from the adapter sync before it)
    assert syncs[2]["base_tensors"] == 0 and syncs[2]["lora_tensors"] > 0, syncs[2]
    assert syncs[1]["base_tensors"] > 0  # after a full sync the base travels again
