"""Server mode: hwsync's sync server inside TRL's vLLM server (``trl vllm-serve`` + :func:`hwsync.trl.serve_args`).

* The TRL main job with ``vllm_mode="server"``: generation over TRL's HTTP client with the synced adapter (by name),
  weights through hwsync's authenticated channel and data plane, every check after every sync (content checks read
  back over the control channel).
* Stale on failure, as an HTTP client sees it: a sync that dies half-way through writing base weights leaves the
  engine stale, and the server then refuses generation (409, naming the cause) instead of serving half-written
  weights, until a complete sync lands; then it serves the trainer's policy again, exactly.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_trl_grpo import ROOT, check_job, run_job  # noqa: E402  (skips without TRL 1.16)
from test_vllm_serve_middleware import post  # noqa: E402

sys.path.insert(0, str(ROOT / "examples"))
import trl_grpo_tiny_moe as job  # noqa: E402

pytestmark = [pytest.mark.trl, pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8], [3, 4, 200, 17, 18, 99]]


def test_grpo_server(tmp_path):
    check_job(*run_job(tmp_path, "--server"), mode="server")


def _completion(port: int, model: str) -> tuple[int, dict]:
    return post(port, "/v1/completions", {"model": model, "prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0.0})


def test_a_failed_sync_stops_generation_until_a_complete_one(tmp_path, monkeypatch):
    from hwsync.testing import require_vllm

    require_vllm()
    if not job.has_gpu():
        for key, value in {**job.CPU_ENV, "CUDA_VISIBLE_DEVICES": ""}.items():
            monkeypatch.setenv(key, os.environ.get(key, value))
    import hwsync
    from hwsync.common.errors import HwsyncError
    from hwsync.testing.trainer import fail_at, lora_trainer, perturb

    model_dir, _ = job.prepare(tmp_path)
    token, address = secrets.token_hex(16), f"127.0.0.1:{job.free_port()}"
    monkeypatch.setenv("HWSYNC_SERVER", address)
    monkeypatch.setenv("HWSYNC_TOKEN", token)
    port = job.free_port()
    with job.vllm_server(model_dir, port, tmp_path / "vllm-serve.log", {}):
        engine = hwsync.connect(address, token)
        model = lora_trainer(model_dir, ["q_proj", "v_proj"], ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
        atol = None if job.has_gpu() else 1e-4
        report = hwsync.sync(engine, model)
        assert report.lora_request is not None
        assert _completion(port, report.lora_request.lora_name)[0] == 200  # served under hwsync's adapter name
        hwsync.verify(engine, model, PROMPTS, atol=atol)
        # a sync that dies after writing some base weights (merged experts; small buckets so there are several)
        perturb(model, 1)
        strategy = report.strategy
        # merged experts (CPU: hybrid) fill several buckets: fail at the third; an adapter (GPU: the experts served
        # as LoRA) may travel in fewer than three (it did on an H200, 2026-11-28: the sync did not fail), so fail it
        # before its first bucket
        with pytest.raises(HwsyncError):
            hwsync.sync(
                engine, model, strategy=strategy, bucket_mb=0.05, progress=fail_at(0 if strategy == "adapter" else 2)
            )
        status, body = _completion(port, report.lora_request.lora_name)
        if strategy != "adapter":  # merged experts were being written: stale, and the server says so
            assert engine.state()["stale"]
            assert status == 409 and "stale" in body["error"]["message"], (status, body)
            assert (
                post(
                    port, "/v1/chat/completions", {"model": "hwsync", "messages": [{"role": "user", "content": "1+1"}]}
                )[0]
                == 409
            )
        else:  # an adapter-only sync writes nothing until its last bucket: the previous adapter still serves
            assert not engine.state()["stale"] and status == 200, (status, body)
        # a complete sync: serving again, exactly the trainer's current policy
        hwsync.sync(engine, model, strategy=strategy)
        assert _completion(port, report.lora_request.lora_name)[0] == 200
        hwsync.verify(engine, model, PROMPTS, atol=atol)
        engine.close()
