"""TRL under DeepSpeed ZeRO-3 (``GRPOConfig(deepspeed=<stage-3 config>)``, one rank, every parameter partitioned):
hwsync gathers the trainer's parameters bucket by bucket inside TRL's own sync call (``hwsync.common.gather``), the
check after each sync gathers its reference tensors the same way and runs the trainer's forward under ZeRO-3, and
the engine samples from the trained policy (on vLLM's CPU build in fp32: equal to the trainer within 1e-4).

Several ranks (each with its colocated engine, or rank 0 feeding a vLLM server) run the same code path with a
collective schedule: tests/test_gather.py and tests/test_server_sharded.py run it on 2 gloo ranks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_trl_grpo import ROOT  # noqa: E402  (skips without TRL 1.16)

sys.path.insert(0, str(ROOT / "examples"))
import trl_grpo_tiny_moe as job  # noqa: E402

pytest.importorskip("deepspeed", reason="ZeRO-3 needs deepspeed (ci/install.sh installs it)")
pytestmark = [pytest.mark.trl, pytest.mark.vllm, pytest.mark.slow]

STEPS = 2
# every parameter partitioned (so every sync really gathers); precision follows the run ("auto")
ZERO3 = {
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}


def test_zero3_trainer_syncs_bucket_by_bucket_and_is_checked(tmp_path, monkeypatch):
    from hwsync.testing import require_vllm

    require_vllm()
    if not job.has_gpu():
        for key, value in {**job.CPU_ENV, "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}.items():
            monkeypatch.setenv(key, os.environ.get(key, value))
    # one rank, as torchrun would describe it (DeepSpeed initializes torch.distributed from these)
    for key, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(job.free_port()),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }.items():
        monkeypatch.setenv(key, os.environ.get(key, value))
    metrics = tmp_path / "m.jsonl"
    monkeypatch.setenv("HWSYNC_METRICS", str(metrics))
    monkeypatch.setenv("HWSYNC_VERIFY_LOGPROBS_EVERY", "1")  # every sync's record carries the prompts' logprobs
    model_dir, data = job.prepare(tmp_path)
    trainer = job.train(model_dir, data, tmp_path / "out", steps=STEPS, deepspeed=ZERO3)
    assert trainer.is_deepspeed_enabled
    recs = job.records(metrics)
    syncs = [r for r in recs if r["event"] == "sync"]
    assert len(syncs) == STEPS, syncs
    assert all("sharded trainer" in s["reason"] for s in syncs), [s["reason"] for s in syncs]
    assert all(s["verify_ok"] and not s["verify_failed"] and not s["verify_skipped"] for s in syncs), syncs
    results = job.checks(recs, trainer, STEPS)  # the TRL main job's checks, the trained LoRA read gathered
    assert all(results.values()), json.dumps(results, indent=1)
