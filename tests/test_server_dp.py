"""Data-parallel engines behind one handle: two ``hwsync.serve`` engine processes, one ``hwsync.connect([a, b])``.

Every sync is one broadcast into both engines. After each, both must serve the trainer's weights (``hwsync.verify``
checks each engine: content fingerprints + logprobs within 1e-4 of transformers on vLLM's CPU build) and each other's
(the same greedy ids and logprobs), at the same version. The guarantees across engines: a manifest one engine refuses
is applied by neither (the other is cancelled before any byte moves); a sender failing mid-sync leaves both stale
until the next sync recovers both. On vLLM's CPU build, or on a machine with two GPUs: one engine per GPU (the
trainer stays on the CPU, so its data plane is gloo); not sized for one GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hwsync
from hwsync.common.errors import StaleEngineError, SyncError, VersionError
from hwsync.testing import on_cpu, require_vllm
from hwsync.testing.served import served_engines
from hwsync.testing.trainer import fail_at, lora_trainer, perturb
from hwsync.trainer.verify import check

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOKEN = "two engines, one broadcast: test token"
ATOL = 1e-4
PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8], [3, 4, 200, 17, 18, 99]]
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ENGINE_ARGS = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}


@pytest.fixture(scope="module")
def addresses(tiny_qwen3_moe_dir: Path) -> Iterator[list[str]]:
    require_vllm()
    envs: list[dict[str, str]] = []
    if not on_cpu():
        if torch.cuda.device_count() < 2:
            pytest.skip("two engine processes need two GPUs (or vLLM's CPU build)")
        envs = [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(2)]
    with served_engines(tiny_qwen3_moe_dir, TOKEN, [ENGINE_ARGS, ENGINE_ARGS], envs=envs) as served:
        yield [address for address, _ in served]


def outputs(engine: Any) -> list[Any]:
    """Each engine's greedy ids and logprobs on the prompts (raises StaleEngineError on a stale one)."""
    return [part.logprobs(PROMPTS, 4) for part in engine.parts()]


def versions(engine: Any) -> list[tuple[int, bool]]:
    return [(s["version"], s["stale"]) for s in (part.state() for part in engine.parts())]


def assert_same(a: Any, b: Any, atol: float = 1e-6) -> None:
    """Two engines' (or one engine's, before and after) outputs: the same ids, logprobs within ``atol``."""
    for (ids_a, lp_a), (ids_b, lp_b) in zip(a, b):
        assert ids_a == ids_b
        assert float((torch.tensor(lp_a) - torch.tensor(lp_b)).abs().max()) <= atol


def check_both(engine: Any, model: Any, version: int) -> float:
    """Both engines serve ``model`` (each verified) and each other's outputs, both at ``version``."""
    report = check(engine, model, PROMPTS, atol=ATOL if on_cpu() else None)  # hwsync.verify's, on every engine
    assert report.ok, report.message()
    # content (fingerprints read back over the channel) and logprobs; a max |Δ| bound where one is given (CPU: GPUs
    # run the logprob gate alone, hwsync.verify's default there)
    want = {"state", "base content", "logprobs"} | ({"max |Δ logprob|"} if on_cpu() else set())
    for address in engine.address.split(","):
        ran = {c.name for c in report.checks if c.detail.startswith(f"engine {address}: ")}
        assert want <= ran, (address, report.message())
    first, second = outputs(engine)
    assert_same(first, second)
    assert versions(engine) == [(version, False)] * 2
    assert report.agreement is not None
    return report.agreement.max_abs_diff


def test_one_broadcast_feeds_both_engines(addresses: list[str], tiny_qwen3_moe_dir: Path) -> None:
    engine = hwsync.connect(addresses, TOKEN, timeout_s=120)
    assert engine.describe().workers == 2  # one data-plane rank per engine worker
    gen = torch.Generator().manual_seed(0)
    # the CPU build serves no expert LoRA: adapter syncs with attention LoRA, hybrid with expert LoRA merged
    attn = lora_trainer(tiny_qwen3_moe_dir, ATTN)
    both = lora_trainer(tiny_qwen3_moe_dir, ATTN, EXPERTS)
    rows = []
    for k, (model, strategy) in enumerate(
        [(attn, "full"), (attn, "adapter"), (attn, "adapter"), (both, "hybrid"), (both, "hybrid")]
    ):
        perturb(model, gen, base=k == 0)
        r = hwsync.sync(engine, model, strategy=strategy, bucket_mb=0.005)  # several buckets, LoRA too
        assert r.mode == "server" and r.strategy == strategy and r.buckets >= 2, r.line()
        rows.append(f"{strategy}: max |Δ logprob| {check_both(engine, model, r.version):.2e}, {r.seconds * 1e3:.1f} ms")
    report = engine.describe()
    assert report.version == r.version and not report.stale
    print("two engines:", "; ".join(rows))


def test_a_manifest_one_engine_refuses_is_applied_by_neither(addresses: list[str], tiny_qwen3_moe_dir: Path) -> None:
    engine = hwsync.connect(addresses, TOKEN, timeout_s=120)
    model = lora_trainer(tiny_qwen3_moe_dir, ATTN)
    perturb(model, 1, base=True)
    v = hwsync.sync(engine, model, strategy="full").version
    before = outputs(engine)
    # another trainer syncs the second engine alone, far ahead: it now refuses versions <= v + 10
    solo = hwsync.connect(addresses[1], TOKEN, timeout_s=120)
    perturb(model, 2, base=True)
    hwsync.sync(solo, model, strategy="full", version=v + 10)
    solo.close()
    moved = outputs(engine)
    perturb(model, 3, base=True)
    with pytest.raises(VersionError, match=f"engine {addresses[1]}: .*{v + 5}"):
        hwsync.sync(engine, model, strategy="full", version=v + 5)
    # the first engine validated and said go, then was cancelled: nothing applied, not stale, same outputs
    assert versions(engine) == [(v, False), (v + 10, False)]
    first, second = outputs(engine)
    assert_same(first, before[0], atol=0.0)
    assert_same(second, moved[1], atol=0.0)
    # the next sync re-plans (the engines changed behind this trainer) and brings both to one version
    r = hwsync.sync(engine, model, strategy="full")
    assert r.version == v + 11
    check_both(engine, model, v + 11)


def test_sender_failing_mid_sync_leaves_both_stale_then_recovers(
    addresses: list[str], tiny_qwen3_moe_dir: Path
) -> None:
    engine = hwsync.connect(addresses, TOKEN, timeout_s=120)
    model = lora_trainer(tiny_qwen3_moe_dir)
    perturb(model, 4, base=True)
    v = engine.describe().version
    with pytest.raises(SyncError, match="optimizer blew up.*engine is stale"):
        hwsync.sync(engine, model, strategy="full", bucket_mb=0.05, progress=fail_at(1))
    assert [stale for _, stale in versions(engine)] == [True, True]
    for part in engine.parts():  # each engine refuses to generate from half-written weights
        with pytest.raises(StaleEngineError):
            part.logprobs(PROMPTS, 2)
    with pytest.raises(StaleEngineError):
        hwsync.verify(engine, model, PROMPTS)
    r = hwsync.sync(engine, model, strategy="full", bucket_mb=0.05)
    assert r.version > v
    check_both(engine, model, r.version)
