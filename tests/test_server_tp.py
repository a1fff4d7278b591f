"""Server mode into a tensor-parallel engine: ``hwsync.serve`` in a TP=2 engine whose workers are processes of their
own (vLLM's ``mp`` executor), the trainer here.

Every worker joins the data plane and keeps its own TP shard of what the trainer streams (packed QKV, the experts'
w13/w2); after each sync the served engine must serve the trainer's weights (``hwsync.testing.assert_serves``: on
vLLM's CPU build the engine equals the trainer within 1e-4; on GPUs it equals a fresh TP=2 engine loading the same
weights itself). Also: a sender that fails mid-sync leaves
*every* worker stale (generation refused) until the next sync, which recovers all of them.
On CPU (CI) the engine is vLLM's CPU build (TP over gloo/shared memory; attention LoRA only); on CUDA this needs 2
GPUs (the engine's two workers; the trainer shares GPU 0, so the data plane is the CUDA link's gloo fallback).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hwsync
from hwsync.common.errors import StaleEngineError, SyncError
from hwsync.testing import EngineReference, assert_serves, on_cpu, require_vllm
from hwsync.testing.served import served_engine
from hwsync.testing.trainer import fail_at, lora_trainer, perturb

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOKEN = "tensor parallel, two workers: test token"
ATOL = 1e-4
PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8], [3, 4, 200, 17, 18, 99]]
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ENGINE_ARGS: dict[str, Any] = {
    "enable_lora": True,
    "max_lora_rank": 8,
    "max_loras": 1,
    "tensor_parallel_size": 2,
    "distributed_executor_backend": "mp",
}


@pytest.fixture(scope="module")
def served(tiny_qwen3_moe_dir: Path) -> Iterator[str]:
    require_vllm()
    if not on_cpu() and torch.cuda.device_count() < 2:
        pytest.skip("a TP=2 engine needs 2 GPUs")
    with served_engine(tiny_qwen3_moe_dir, TOKEN, ENGINE_ARGS) as (address, _):
        yield address


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineReference | None]:
    if on_cpu():  # the CPU build equals the trainer: no second TP engine needed
        yield None
        return
    with EngineReference(tmp_path_factory.mktemp("reference"), daemon=False, **ENGINE_ARGS) as ref:
        yield ref


def test_every_worker_receives_its_shard(
    served: str, reference: EngineReference | None, tiny_qwen3_moe_dir: Path
) -> None:
    engine = hwsync.connect(served, TOKEN, timeout_s=120)
    assert engine.describe().workers == 2  # the data plane has a rank per worker
    gen = torch.Generator().manual_seed(0)
    lora = lora_trainer(tiny_qwen3_moe_dir, ATTN, None if on_cpu() else EXPERTS)
    strategies = ["full", "adapter", "adapter", "hybrid" if on_cpu() else "adapter"]
    for k, strategy in enumerate(strategies):
        perturb(lora, gen, base=k == 0)
        r = hwsync.sync(engine, lora, strategy=strategy, bucket_mb=0.005)  # several buckets, LoRA only too
        assert r.mode == "server" and r.strategy == strategy and r.buckets >= 2, r.line()
        assert assert_serves(engine, lora, PROMPTS, atol=ATOL, reference=reference) <= ATOL
    full = lora_trainer(tiny_qwen3_moe_dir)
    perturb(full, gen, base=True)
    hwsync.sync(engine, full, strategy="full", bucket_mb=0.25)
    assert assert_serves(engine, full, PROMPTS, atol=ATOL, reference=reference) <= ATOL


def test_failed_sync_leaves_every_worker_stale_then_recovers(
    served: str, reference: EngineReference | None, tiny_qwen3_moe_dir: Path
) -> None:
    engine = hwsync.connect(served, TOKEN, timeout_s=120)
    model = lora_trainer(tiny_qwen3_moe_dir)
    perturb(model, 7, base=True)

    with pytest.raises(SyncError, match="optimizer blew up.*engine is stale"):
        hwsync.sync(engine, model, strategy="full", bucket_mb=0.05, progress=fail_at(1))
    with pytest.raises(StaleEngineError):
        engine.logprobs(PROMPTS, 2)
    hwsync.sync(engine, model, strategy="full", bucket_mb=0.05)
    assert assert_serves(engine, model, PROMPTS, atol=ATOL, reference=reference) <= ATOL
