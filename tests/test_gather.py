"""Sharded trainers on the CPU: FSDP2 (``fully_shard``) and DeepSpeed ZeRO-3 of a tiny PEFT MoE model on 2 gloo ranks.

What each rank streams bucket by bucket (:mod:`hwsync.common.gather`) equals what the unsharded model streams (merged
view included, bit for bit in fp32), an adapter sync gathers only LoRA parameters, the gathered bytes alive at once stay
within 2 buckets and never reach the model's size, and ``hwsync.sync`` runs the collective protocol: rank 0 syncs
into an engine handle, rank 1 passes ``None``; an abort on rank 0 reaches every rank without a hang.

Two ranks are spawned once per sharding; every case runs on both and reports back, one pytest test per case.
ZeRO-3 runs DeepSpeed's CPU accelerator over gloo (``deepspeed.initialize`` with stage 3, every parameter
partitioned); its first start compiles DeepSpeed's small shared-memory op with the system C++ compiler (~1 min).
The engine here is ``make_recorder()``, an :class:`hwsync.common.target.Engine` that keeps what it receives: these tests
are about the trainer side; the vLLM side of a sharded sync is the 2-GPU test (tests/test_multigpu_fsdp_tp.py).
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import socket
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

WORLD = 2
CASES = ("full", "adapter_first", "adapter_steady", "sync", "abort", "refusals", "rank0_value")
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


# --------------------------------------------------------------------------------- models


def tiny_peft() -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3MoeForCausalLM

    from hwsync.testing import tiny_moe_config

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(tiny_moe_config("qwen3_moe", num_experts=4, moe_intermediate_size=32))
    cfg = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=EXPERTS,
    )
    return get_peft_model(model, cfg)


def shard(model: Any, how: str = "fsdp2") -> Any:
    if how == "zero3":
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            # every parameter partitioned (DeepSpeed keeps small ones whole by default)
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        }
        engine, *_ = deepspeed.initialize(model=model, config=config)
        return engine.module
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def step(model: Any, k: int) -> None:
    """A deterministic "optimizer step" on the LoRA factors (in place, shard-local under FSDP2 and ZeRO-3, whose
    shard is ``ds_tensor``: a ZeRO-3 parameter's own data is empty outside a gather)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                getattr(p, "ds_tensor", p).mul_(1.0 + 0.01 * k).add_(0.001 * k)


def info(**kw: Any) -> Any:
    from hwsync.common.wire import EngineInfo

    base = dict(
        engine="recorder",
        dtype="float32",
        lora_enabled=True,
        lora_dtype="float32",
        max_lora_rank=16,
        moe_lora=True,
        lora_layout="3d",
    )
    base.update(kw)
    return EngineInfo(**base)


def payloads(ref: Any, sharded: Any, strategy: str, limit: int, steady: bool = False) -> tuple[Any, Any]:
    from hwsync.common.wire import Strategy
    from hwsync.trainer.payload import build_payload, read_lora
    from hwsync.trainer.strategy import Choice

    st = Strategy.parse(strategy)
    out = []
    for m in (ref, sharded):
        i = info()
        if steady:  # the engine already holds this model's base
            i = info(base_key=payloads(m, m, strategy, limit)[0].base_key)
        lora = read_lora(m, i)
        assert not isinstance(lora, Exception), lora
        out.append(
            build_payload(m, Choice(st, "test"), lora if st is not Strategy.FULL else None, i, gather_bytes=limit)
        )
    return out[0], out[1]


def stream(payload: Any, model: Any, limit: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The sharded payload through the real bucketing consumer (one bucket list alive at a time)."""
    from hwsync.common import gather
    from hwsync.common.transport.buckets import bucket_lists
    from hwsync.common.wire import Manifest, plan_buckets

    manifest = Manifest(
        version=1, strategy=payload.strategy, specs=tuple(payload.specs), buckets=plan_buckets(payload.specs, limit)
    )
    steps = gather.run_groups(model, payload.schedule)
    for bucket, tensors in zip(manifest.buckets, bucket_lists(manifest, lambda: payload.produce_sharded(steps), None)):
        for i, t in zip(bucket.entries, tensors):
            yield manifest.specs[i].name, t
        del tensors
    gather.drain(steps)


def model_bytes(model: Any) -> int:
    from hwsync.common import gather

    return sum(gather.global_nbytes(p) for p in model.parameters())


def bucket_bytes(model: Any) -> int:
    """An eighth of the model, but at least its largest parameter (a larger one travels in a bucket of its own
    size, so "2 buckets" would mean 2 of those)."""
    from hwsync.common import gather

    return max(model_bytes(model) // 8, max(gather.global_nbytes(p) for p in model.parameters()))


# --------------------------------------------------------------------------------- cases (run on every rank)


def compare(ref: Any, sharded: Any, strategy: str, steady: bool = False) -> dict[str, Any]:
    from hwsync.common import gather

    total = model_bytes(sharded)
    limit = bucket_bytes(sharded)
    pr, ps = payloads(ref, sharded, strategy, limit, steady)
    assert [s.name for s in pr.specs] == [s.name for s in ps.specs]
    assert [s.shape for s in pr.specs] == [s.shape for s in ps.specs]
    want = pr.produce()
    gather.stats.reset()
    n = 0
    for (name, got), w in zip(stream(ps, sharded, limit), want, strict=True):
        assert got.dtype == w.dtype and got.shape == w.shape, name
        assert torch.equal(got, w), f"{name}: sharded stream differs from the unsharded model's"
        n += 1
    gathered = {p for g in ps.schedule for p in g}
    return dict(
        tensors=n,
        groups=len(ps.schedule),
        peak=gather.stats.peak,
        limit=limit,
        total=total,
        gathered_bytes=gather.stats.total,
        only_lora=all(".lora_" in p for p in gathered),
        merged=sum(1 for s in ps.specs if s.kind == "base"),
        base_key=ps.base_key,
    )


def make_recorder() -> Any:
    from hwsync.common.target import Engine
    from hwsync.common.transport.buckets import bucket_lists

    class _Recorder(Engine):
        def __init__(self) -> None:
            super().__init__()
            self.version = 0
            self.base_key: str | None = None
            self.got: dict[str, torch.Tensor] = {}

        def describe(self, lora_paths: Sequence[str] = (), base: Any = None) -> Any:
            return info(version=self.version, base_key=self.base_key)

        def state(self) -> dict[str, Any]:
            return {"version": self.version}

        def send(self, manifest: Any, produce: Callable[[], Iterator[torch.Tensor]], progress: Any) -> dict[str, Any]:
            got = {}
            for bucket, tensors in zip(manifest.buckets, bucket_lists(manifest, produce, progress)):
                for i, t in zip(bucket.entries, tensors):
                    got[manifest.specs[i].name] = t.clone()
            self.got = got
            self.version = manifest.version
            self.base_key = manifest.base_key
            return {}

        def logprobs(self, prompts: Any, max_tokens: int) -> Any:  # pragma: no cover - not used here
            raise NotImplementedError

    return _Recorder()


def case_sync(ref: Any, sharded: Any, rank: int) -> dict[str, Any]:
    import hwsync
    from hwsync.common import gather

    limit = bucket_bytes(sharded)
    mb = limit / (1 << 20)
    engine = make_recorder() if rank == 0 else None
    ref_engine = make_recorder()  # the unsharded model's syncs, same sequence: what the sharded ones must equal
    out: dict[str, Any] = {"reports": []}
    for k, strategy in enumerate(["full", "adapter", "adapter", "full"]):
        step(ref, k)
        step(sharded, k)
        hwsync.sync(ref_engine, ref, strategy=strategy, bucket_mb=mb)
        want = ref_engine.got
        gather.stats.reset()
        report = hwsync.sync(engine, sharded, strategy=strategy, bucket_mb=mb)
        if rank == 0:
            assert report is not None
            assert engine.got.keys() == want.keys(), (sorted(engine.got)[:4], sorted(want)[:4])
            for n, w in want.items():
                assert torch.equal(engine.got[n], w), f"sync {k} ({strategy}): {n} differs"
            out["reports"].append([report.strategy, report.base_tensors, report.lora_tensors, report.reason])
        else:
            assert report is None
        out.setdefault("peaks", []).append(gather.stats.peak)
    out["limit"] = limit
    return out


def case_abort(ref: Any, sharded: Any, rank: int) -> dict[str, Any]:
    import hwsync
    from hwsync.common.errors import SyncError

    limit = bucket_bytes(sharded)
    engine = make_recorder() if rank == 0 else None

    def progress(i: int, n: int) -> None:
        if i == 2:
            raise RuntimeError("abort from the progress callback")

    try:
        hwsync.sync(engine, sharded, strategy="full", bucket_mb=limit / (1 << 20), progress=progress)
    except SyncError as e:  # before RuntimeError: SyncError is one
        err = f"SyncError: {e}"
    except RuntimeError as e:
        err = f"RuntimeError: {e}"
    else:
        err = "no error"
    # both ranks are still in step: a sync right after works
    report = hwsync.sync(engine, sharded, strategy="full", bucket_mb=limit / (1 << 20))
    return {"error": err, "after": None if report is None else report.version}


def case_refusals(ref: Any, sharded: Any, rank: int) -> dict[str, Any]:
    import hwsync
    from hwsync.common import gather
    from hwsync.common.errors import OptionError, SyncError, UnsupportedSetupError

    out = {}
    try:
        hwsync.sync(None, ref)
    except OptionError as e:
        out["none_unsharded"] = str(e)
    try:  # a read that was not gathered is refused, never computed on a shard
        gather.full(next(sharded.parameters()))
    except SyncError as e:
        out["ungathered"] = str(e)

    class FullyShardedDataParallel(torch.nn.Module):
        pass

    wrapped = torch.nn.Sequential(FullyShardedDataParallel())
    try:
        gather.sharding(wrapped)
    except UnsupportedSetupError as e:
        out["fsdp1"] = str(e)
    return out


def child(rank: int, port: int, out_dir: str, how: str) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=120),
    )
    if how == "zero3":
        os.environ["DS_ACCELERATOR"] = "cpu"  # these ranks are CPU/gloo ranks, also on a machine with GPUs
        import deepspeed

        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(WORLD),
            LOCAL_WORLD_SIZE=str(WORLD),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        deepspeed.init_distributed(dist_backend="gloo")  # takes over the group above
    results: dict[str, Any] = {}
    try:
        ref = tiny_peft()
        sharded = shard(copy.deepcopy(ref), how)
        for case in CASES:
            try:
                if case == "full":
                    res = compare(ref, sharded, "full")
                elif case == "adapter_first":
                    res = compare(ref, sharded, "adapter")
                elif case == "adapter_steady":
                    res = compare(ref, sharded, "adapter", steady=True)
                elif case == "sync":
                    res = case_sync(copy.deepcopy(ref), shard(copy.deepcopy(ref), how), rank)
                elif case == "abort":
                    res = case_abort(ref, sharded, rank)
                elif case == "rank0_value":  # the swift plugin's check prompts: rank 0's on every rank
                    from hwsync.common.gather import rank0_value

                    res = {"got": rank0_value([[1, 2, 3], [4, 5]] if rank == 0 else [[9, 9]])}
                else:
                    res = case_refusals(ref, sharded, rank)
                results[case] = {"ok": True, **res}
            except Exception:  # noqa: BLE001 - reported to the parent, which fails that case
                results[case] = {"ok": False, "error": traceback.format_exc()}
                raise  # the ranks are out of step after a failed case: stop both
            finally:
                with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
                    json.dump(results, f, default=str)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module", params=["fsdp2", "zero3"])
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    pytest.importorskip("peft")
    import torch.multiprocessing as mp

    how = request.param
    if how == "zero3" and not os.environ.get("CI"):
        pytest.importorskip("deepspeed")  # CI installs it (ci/install.sh): a missing deepspeed fails there
    out = tmp_path_factory.mktemp(f"gather-{how}")
    try:
        mp.start_processes(child, args=(_free_port(), str(out), how), nprocs=WORLD, join=True, start_method="spawn")
    except Exception as e:  # noqa: BLE001 - the per-case results say which case failed
        print(f"ranks failed: {e}")
    got = []
    for r in range(WORLD):
        path = out / f"rank{r}.json"
        got.append(json.loads(path.read_text()) if path.exists() else {})
    return got


def _case(results: list[dict[str, Any]], case: str) -> list[dict[str, Any]]:
    per_rank = [r.get(case) for r in results]
    for rank, res in enumerate(per_rank):
        assert res is not None, f"rank {rank} did not run {case} (an earlier case failed)"
        assert res["ok"], f"rank {rank}:\n{res['error']}"
    return per_rank  # type: ignore[return-value]


def _bounded(res: dict[str, Any]) -> None:
    # the measured bound: gathered bytes alive at once <= 2 buckets, and far from the whole model
    assert res["peak"] <= 2 * res["limit"], res
    assert res["peak"] < res["total"] / 2, res
    print(f"peak gathered {res['peak']} B, bucket {res['limit']} B, model {res['total']} B, groups {res['groups']}")


def test_full_sync_streams_the_unsharded_merged_view(results: list[dict[str, Any]]) -> None:
    for res in _case(results, "full"):
        assert res["groups"] > 3 and res["tensors"] == res["merged"] > 0
        _bounded(res)


def test_adapter_first_sync_streams_base_and_lora(results: list[dict[str, Any]]) -> None:
    for res in _case(results, "adapter_first"):
        assert res["tensors"] > res["merged"] > 0  # W0 and the LoRA factors
        assert not res["only_lora"]
        _bounded(res)


def test_adapter_steady_sync_gathers_only_lora(results: list[dict[str, Any]]) -> None:
    for res in _case(results, "adapter_steady"):
        assert res["merged"] == 0 and res["tensors"] > 0
        assert res["only_lora"]
        _bounded(res)


def test_sync_rank0_engine_rank1_none(results: list[dict[str, Any]]) -> None:
    r0, r1 = _case(results, "sync")
    assert [r[0] for r in r0["reports"]] == ["full", "adapter", "adapter", "full"]
    assert r0["reports"][1][1] > 0 and r0["reports"][2][1] == 0 and r0["reports"][2][2] > 0, r0["reports"]
    assert all("gather groups" in r[3] for r in r0["reports"])
    for peaks in (r0["peaks"], r1["peaks"]):
        assert max(peaks) <= 2 * r0["limit"], (peaks, r0["limit"])


def test_abort_on_rank0_reaches_every_rank(results: list[dict[str, Any]]) -> None:
    r0, r1 = _case(results, "abort")
    assert r0["error"].startswith("RuntimeError: abort from the progress callback"), r0
    assert r1["error"].startswith("SyncError: hwsync.sync failed on rank 0"), r1
    assert r0["after"] is not None and r1["after"] is None


def test_refusals(results: list[dict[str, Any]]) -> None:
    for res in _case(results, "refusals"):
        assert "not sharded" in res["none_unsharded"]
        assert "without being gathered" in res["ungathered"]
        assert "FSDP1" in res["fsdp1"] and "fully_shard" in res["fsdp1"]


def test_rank0_value_is_rank_zeros_everywhere(results: list[dict[str, Any]]) -> None:
    """The swift plugin's check prompts: every rank scores rank 0's (one TP engine's ranks generate alike; a sharded
    forward runs on every rank at once)."""
    assert [r["got"] for r in _case(results, "rank0_value")] == [[[1, 2, 3], [4, 5]]] * 2
