"""Server mode from a sharded trainer, with hwsync's check after every sync: FSDP2 and DeepSpeed ZeRO-3 on 2 gloo
ranks, one served engine (``hwsync.serve`` in a process of its own), rank 0 alone connected to it.

Every rank calls ``hwsync.sync`` (rank 1 with ``None``: it takes part in the gathers) and then ``hwsync.verify.check``
(rank 1 with ``None``): only rank 0 queries the engine -- its fingerprints and logprobs --, every rank gathers the
reference tensors and runs the trainer's forward on the engine's token ids, and every rank reaches the same verdict.
Faults, each caught on every rank: "previous step synced" (:mod:`hwsync.testing.faults`: another trainer copy
syncs the previous step's weights into the engine) fails the check on both ranks, a sender failing mid-sync leaves
the engine stale and the check raises on both ranks; the next sync repairs both.
"""

from __future__ import annotations

import copy
import json
import os
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hwsync.testing import on_cpu, require_vllm, tp
from hwsync.testing.served import served_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOKEN = "sharded trainer, served engine: test token"
ATOL = 1e-4
PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8], [3, 4, 200, 17, 18, 99]]
ENGINE_ARGS = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
STRATEGIES = ["full", "adapter", "adapter"]


def _outcome(report: Any) -> dict[str, Any]:
    return {
        "ok": report.ok,
        "ran": sorted({c.name for c in report.checks}),
        "failed": sorted({c.name for c in report.failed}),
        "max": report.agreement.max_abs_diff,
        "skipped": list(report.skipped),
    }


def _rank(rank: int, port: int, address: str, model_dir: str, out: str, trainer: str) -> None:
    """One trainer rank: syncs, checks, faults (results to ``rank<r>.json``)."""
    results: dict[str, Any] = {"checks": []}
    try:
        import hwsync
        from hwsync.common.errors import StaleEngineError, SyncError
        from hwsync.testing.trainer import fail_at
        from hwsync.trainer.verify import check

        device = tp.init_rank(rank, port, cuda=False, trainer=trainer)
        ref = tp.peft_trainer(model_dir, device, False)  # unsharded copy, one step behind after each sync
        sharded = tp.shard(copy.deepcopy(ref), "cpu", trainer)
        engine = hwsync.connect(address, TOKEN, timeout_s=120) if rank == 0 else None

        def sync_and_check(strategy: str, **kw: Any) -> dict[str, Any]:
            report = hwsync.sync(engine, sharded, strategy=strategy, bucket_mb=0.25, **kw)
            got = _outcome(check(engine, sharded, PROMPTS, atol=ATOL))
            got["version"] = report.version if report is not None else None
            return got

        for k, strategy in enumerate(STRATEGIES):
            tp.step(sharded, k, base=strategy == "full")
            results["checks"].append(sync_and_check(strategy))
            if k < len(STRATEGIES) - 1:
                tp.step(ref, k, base=strategy == "full")
        # "previous step synced": another trainer copy (rank 0's unsharded one, one step behind) syncs into the engine
        if rank == 0:
            hwsync.sync(engine, ref, strategy=STRATEGIES[-1])
        results["fault"] = _outcome(check(engine, sharded, PROMPTS, atol=ATOL))
        results["repaired"] = sync_and_check(STRATEGIES[-1])  # re-plans (the engine moved on) and syncs
        # the sender fails mid-sync: every rank's sync raises, the engine is stale, every rank's check raises
        tp.step(sharded, 9, base=True)
        try:
            hwsync.sync(engine, sharded, strategy="full", bucket_mb=0.05, progress=fail_at(1))
        except SyncError as e:
            results["sync_error"] = f"{type(e).__name__}: {e}"
        try:
            check(engine, sharded, PROMPTS)
        except StaleEngineError as e:
            results["stale"] = f"{type(e).__name__}: {e}"
        results["recovered"] = sync_and_check("full")
        if trainer == "fsdp2":  # the ms-swift plugin's step (layout-independent; one trainer is enough)
            results["plugin"] = _plugin_syncs(rank, engine, sharded)
        results["ok"] = True
    except Exception:  # noqa: BLE001 - reported to the parent
        results["ok"] = False
        results["error"] = traceback.format_exc()
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(results, default=str))
        os._exit(0 if results.get("ok") else 1)  # no teardown hang with a peer gone


def _plugin_syncs(rank: int, engine: Any, model: Any) -> dict[str, Any]:
    """Two syncs through the ms-swift plugin's own step (``HwsyncGRPOTrainer._hwsync_sync``) on both ranks, rank 1
    without the engine as in a ``swift rlhf --vllm_mode server --fsdp fsdp2`` run (which cannot run here: accelerate
    on CPU sees torchrun's ranks as one process, or, with --use_cpu, as MULTI_CPU, which wraps neither FSDP nor
    DeepSpeed). The trainer object holds what that step reads; everything it calls is the plugin's and hwsync's."""
    from collections import defaultdict
    from types import SimpleNamespace

    from hwsync.integrations.swift._options import SwiftOptions
    from hwsync.integrations.swift._trainer import HwsyncGRPOTrainer
    from hwsync.integrations.trainer_sync import TrainerSync

    trainer = HwsyncGRPOTrainer.__new__(HwsyncGRPOTrainer)  # not a whole GRPO run: its step, on real ranks
    options = SwiftOptions(strategy="adapter", verify_atol=ATOL, verify_logprobs_every=1)
    trainer.__dict__.update(
        hwsync_options=options,
        vllm_mode="server",
        model=model,
        accelerator=SimpleNamespace(is_main_process=rank == 0, unwrap_model=lambda m: m),
        _is_fsdp2=True,
        _hwsync_target=engine,
        _hwsync=TrainerSync(options),
        state=SimpleNamespace(global_step=0),
        _metrics={"train": defaultdict(list)},
    )
    trainer._hwsync.probe = trainer._same_on_every_rank(PROMPTS if rank == 0 else [[7, 7]])
    shifts = []
    for k in range(2):
        tp.step(model, 20 + k, base=False)
        trainer._hwsync_sync()
        shifts.append(trainer._hwsync.policy_shift(model))
    return {
        "syncs": trainer._hwsync.syncs,
        "probe": trainer._hwsync.probe,
        "shifts": shifts,
        "verified": list(trainer._metrics["train"]["hwsync/verify_max_abs_dlogp"]),
    }


@pytest.fixture(scope="module")
def address(tiny_qwen3_moe_dir: Path) -> Iterator[str]:
    require_vllm()
    if not on_cpu():
        pytest.skip("the CPU variant (gloo trainer ranks beside one CPU engine)")
    with served_engine(tiny_qwen3_moe_dir, TOKEN, ENGINE_ARGS) as (served, _):
        yield served


@pytest.mark.parametrize("trainer", tp.TRAINERS)
def test_sharded_trainer_checks_a_served_engine_on_every_rank(
    trainer: str, address: str, tiny_qwen3_moe_dir: Path, tmp_path: Path
) -> None:
    if trainer == "zero3" and not os.environ.get("CI"):
        pytest.importorskip("deepspeed")  # CI installs it: a missing deepspeed fails there
    import torch.multiprocessing as mp

    try:
        mp.start_processes(
            _rank,
            args=(tp.free_port(), address, str(tiny_qwen3_moe_dir), str(tmp_path), trainer),
            nprocs=tp.WORLD,
            join=True,
            start_method="spawn",
        )
    except Exception as e:  # noqa: BLE001 - the per-rank results say what failed
        print(f"ranks failed: {e}")
    ranks = []
    for r in range(tp.WORLD):
        path = tmp_path / f"rank{r}.json"
        ranks.append(json.loads(path.read_text()) if path.exists() else {"error": "no result"})
        assert ranks[r].get("ok"), f"rank {r}:\n{ranks[r].get('error')}"
    r0, r1 = ranks
    # every rank reached rank 0's verdicts (the same checks, the same numbers)
    for key in ("checks", "fault", "repaired", "recovered"):
        assert [{k: v for k, v in c.items() if k != "version"} for c in _list(r0[key])] == [
            {k: v for k, v in c.items() if k != "version"} for c in _list(r1[key])
        ], key
    for c in r0["checks"]:  # healthy syncs: every check passed, content checks included (fingerprints over the wire)
        assert c["ok"] and {"state", "base content", "logprobs", "max |Δ logprob|"} <= set(c["ran"]), c
        assert c["max"] <= ATOL
    assert "adapter content" in r0["checks"][-1]["ran"]
    # the previous step's weights in the engine: caught on both ranks, by the exact checks and the logprobs
    fault = r0["fault"]
    assert not fault["ok"] and {"state", "adapter content"} <= set(fault["failed"]), fault
    assert {"logprobs", "max |Δ logprob|"} & set(fault["failed"]), fault
    assert "optimizer blew up" in r0["sync_error"] and "engine is stale" in r0["sync_error"], r0["sync_error"]
    assert r1["sync_error"].startswith("SyncError: hwsync.sync failed on rank 0"), r1["sync_error"]
    for r in ranks:
        assert "stale" in r["stale"] and r["stale"].startswith("StaleEngineError"), r["stale"]
        assert r["recovered"]["ok"]
    if trainer == "fsdp2":  # the plugin's step: both ranks synced and checked (rank 0 records the verdict)
        p0, p1 = r0["plugin"], r1["plugin"]
        assert p0["syncs"] == p1["syncs"] == 2 and p0["probe"] == p1["probe"] == PROMPTS
        assert p0["shifts"] == p1["shifts"] and p0["shifts"][-1] > 0
        assert len(p0["verified"]) == 2 and max(p0["verified"]) <= ATOL and p1["verified"] == []
    print(
        f"{trainer}: max |Δ logprob| per healthy check {[c['max'] for c in r0['checks']]}; "
        f"fault caught by {r0['fault']['failed']} (max {r0['fault']['max']:.3g}); recovered "
        f"{r0['recovered']['max']:.2g}"
    )


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]
