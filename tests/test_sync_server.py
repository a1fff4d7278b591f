"""Server mode: the engine in its own process (``hwsync.serve``), the trainer here (``hwsync.connect``).

Control over a token-authenticated ``TCPStore``, tensors over the backend's data plane (gloo on CPU and on one GPU;
NCCL with 2 GPUs, where the engine gets GPU 1). The engine process loads hwsync through
vLLM's plugin entry point (``VLLM_PLUGINS=hwsync``), as a ``vllm serve`` deployment would. Engine settings per
platform come from ``hwsync.testing.engine_args``; "the engine serves these weights" is
``hwsync.testing.assert_serves`` (engine == trainer within 1e-4 on the CPU build, engine == vLLM's own loading of the
same weights within 1e-6 elsewhere).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hwsync
from hwsync.common.errors import StaleEngineError, SyncError
from hwsync.testing import EngineReference, assert_serves, require_vllm
from hwsync.testing.served import served_engine
from hwsync.testing.trainer import fail_at, lora_trainer, perturb

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
pytestmark = pytest.mark.vllm

TOKEN = "served engine in its own process: test token"
PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8], [3, 4, 200, 17, 18, 99]]
ATOL = 1e-4
ENGINE_ARGS = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}

DYING_TRAINER = textwrap.dedent("""
    import os, sys, torch
    import hwsync
    from transformers import AutoModelForCausalLM
    engine = hwsync.connect(sys.argv[1], os.environ["HWSYNC_TOKEN"], timeout_s=20)
    model = AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    def die(index, total):
        if index == 2:
            os._exit(17)  # killed mid-sync: no abort header, no reply
    hwsync.sync(engine, model, strategy="full", bucket_mb=0.2, progress=die)
""")


@pytest.fixture(scope="module")
def server(tiny_qwen3_moe_dir: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    require_vllm()
    # with 2 GPUs the engine gets its own (the trainer stays on GPU 0): the data plane is then NCCL between GPUs;
    # on one GPU it is the gloo fallback of the CUDA link, on CPU gloo
    env = {"CUDA_VISIBLE_DEVICES": "1"} if torch.cuda.device_count() >= 2 else {}
    with served_engine(tiny_qwen3_moe_dir, TOKEN, ENGINE_ARGS, env=env) as served:
        yield served


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineReference]:
    with EngineReference(tmp_path_factory.mktemp("reference"), **ENGINE_ARGS) as ref:
        yield ref


def test_wrong_token_is_rejected(server: tuple[str, Any]) -> None:
    address, _ = server
    with pytest.raises(SyncError, match="does not know this token"):
        hwsync.connect(address, "not the token, though strong enough", timeout_s=30)


def test_syncs_across_processes_verify_each(
    server: tuple[str, Any], reference: EngineReference, tiny_qwen3_moe_dir: Path
) -> None:
    address, _ = server
    engine = hwsync.connect(address, TOKEN, timeout_s=60)
    gen = torch.Generator().manual_seed(0)
    model = lora_trainer(tiny_qwen3_moe_dir, ATTN, EXPERTS)
    reports = []
    for _step in range(6):
        perturb(model, gen, base=False)
        # auto: hybrid on vLLM's CPU build, adapter on GPUs (74 KB in bf16 there: one 0.25 MB bucket, seen on an H100)
        r = hwsync.sync(engine, model, bucket_mb=0.02)
        reports.append(r)
        assert r.mode == "server" and r.buckets >= 2
        assert assert_serves(engine, model, PROMPTS, atol=ATOL, reference=reference) <= ATOL
    assert reports[0].base_tensors > reports[1].base_tensors  # W0 once, then only what changes
    full = lora_trainer(tiny_qwen3_moe_dir)
    for _ in range(2):
        perturb(full, gen, base=True)
        r = hwsync.sync(engine, full, strategy="full", bucket_mb=0.25)
        assert r.strategy == "full"
        assert assert_serves(engine, full, PROMPTS, atol=ATOL, reference=reference) <= ATOL
    print("server:", "; ".join(r.line() for r in reports[:2]))


def test_sender_exception_and_killed_sender_leave_engine_stale_then_recover(
    server: tuple[str, Any], reference: EngineReference, tiny_qwen3_moe_dir: Path
) -> None:
    address, _ = server
    engine = hwsync.connect(address, TOKEN, timeout_s=60)
    model = lora_trainer(tiny_qwen3_moe_dir)

    with pytest.raises(SyncError, match="optimizer blew up.*engine is stale"):
        hwsync.sync(engine, model, strategy="full", bucket_mb=0.25, progress=fail_at(1))
    with pytest.raises(StaleEngineError):
        hwsync.verify(engine, model, PROMPTS)
    hwsync.sync(engine, model, strategy="full", bucket_mb=0.25)
    assert assert_serves(engine, model, PROMPTS, atol=ATOL, reference=reference) <= ATOL

    # a trainer process killed in the middle of a sync: the engine notices, turns stale, and a new trainer recovers
    dying = subprocess.run(
        [sys.executable, "-c", DYING_TRAINER, address, str(tiny_qwen3_moe_dir)],
        env={**os.environ, "HWSYNC_TOKEN": TOKEN},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert dying.returncode == 17, dying.stderr[-2000:]
    state = engine.state()
    for _ in range(60):
        if state["stale"]:
            break
        import time

        time.sleep(0.5)
        state = engine.state()
    assert state["stale"], state
    with pytest.raises(StaleEngineError):
        hwsync.verify(engine, model, PROMPTS)
    hwsync.sync(engine, model, strategy="full")
    assert assert_serves(engine, model, PROMPTS, atol=ATOL, reference=reference) <= ATOL


def test_a_stopped_engine_bounds_every_trainer_call(
    server: tuple[str, Any], reference: EngineReference, tiny_qwen3_moe_dir: Path
) -> None:
    """The engine process is stopped (SIGSTOP) in the middle of a sync, then between syncs: each trainer call ends
    after ``timeout_s`` with one SyncError instead of waiting forever; once the engine runs again the same handle
    reconnects and a complete sync brings the engine back."""
    import signal
    import time

    address, proc = server
    engine = hwsync.connect(address, TOKEN, timeout_s=5)
    model = lora_trainer(tiny_qwen3_moe_dir)
    perturb(model, 31, base=True)
    hwsync.sync(engine, model, strategy="full", bucket_mb=0.25)

    def stop_engine(index: int, total: int) -> None:
        if index == 1:
            os.kill(proc.pid, signal.SIGSTOP)

    took = {}
    try:
        t0 = time.monotonic()
        with pytest.raises(SyncError):
            hwsync.sync(engine, model, strategy="full", bucket_mb=0.25, progress=stop_engine)
        took["sync"] = time.monotonic() - t0
        t0 = time.monotonic()
        with pytest.raises(SyncError, match="within 5 s|during authentication"):
            engine.state()
        took["state()"] = time.monotonic() - t0
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert took["sync"] < 60 and took["state()"] < 20, took  # bounded (the data plane's timeout, then the reply's)
    for _ in range(60):
        if engine.state()["stale"]:  # the engine notices the broken transfer once it runs again
            break
        time.sleep(0.5)
    hwsync.sync(engine, model, strategy="full", bucket_mb=0.25)
    assert assert_serves(engine, model, PROMPTS, atol=ATOL, reference=reference) <= ATOL
    engine.close()
