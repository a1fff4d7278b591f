"""hwsync as vLLM's weight-transfer backend: a real in-process ``LLM(..., weight_transfer_config={"backend":
"hwsync"})`` (tiny Qwen3-MoE, vLLM's CPU build) synced through vLLM's own ``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` for every strategy, checked against the trainer (``assert_serves``: as the colocated path's
tests); an adapter sync against vLLM's own loading of the same adapter (a fresh engine fed it as a ``LoRARequest``);
the faults: a bad manifest is refused before any write (nothing half-applied, the adapter still served), an older
version is refused, an interrupted update leaves the engine stale, an engine hwsync never attached to refuses; the
ledgered ``vllm_weight_transfer_lora_reset`` held only while the backend is in use; the API's absence is one error.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hwsync
import hwsync.patches as patches
from hwsync.common.errors import ResolutionError, StaleEngineError, SyncError, UnsupportedSetupError, VersionError
from hwsync.testing import EXACT_ATOL, EngineReference, assert_serves, on_cpu, patched_llm
from hwsync.testing.reference import compare_logprobs
from hwsync.testing.trainer import lora_trainer, perturb

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.distributed.weight_transfer")

PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8], [3, 4, 200, 17, 18, 99]]
ATOL = 1e-4
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
LORA = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
ENGINE = {**LORA, "weight_transfer_config": {"backend": "hwsync"}}
PATCH = "vllm_weight_transfer_lora_reset"


def _adapters(llm: Any) -> list[int]:
    """The adapter ids vLLM's LoRA manager holds (what vLLM's reset after finish_weight_update would have cleared)."""

    def ids(w: Any) -> list[int]:
        w = w.__dict__.get("worker", w)
        return sorted(w.model_runner.lora_manager.list_adapters())

    return list(llm.collective_rpc(ids)[0])


def _weights(llm: Any) -> dict[str, torch.Tensor]:
    def read(w: Any) -> dict[str, torch.Tensor]:
        w = w.__dict__.get("worker", w)
        return {n: p.detach().clone() for n, p in w.model_runner.get_model().named_parameters()}

    return dict(llm.collective_rpc(read)[0])


@pytest.fixture(scope="module")
def llm(tiny_qwen3_moe_dir: Path) -> Iterator[Any]:
    with patched_llm(tiny_qwen3_moe_dir, **ENGINE) as engine:  # patched_llm runs the plugin: registers "hwsync"
        yield engine


@pytest.fixture(scope="module")
def engine(llm: Any) -> hwsync.TransferBackendEngine:
    return hwsync.TransferBackendEngine(llm)


def _spy(llm: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Which of vLLM's weight-transfer methods the sync called, in order (the real methods still run)."""
    calls: list[str] = []
    for name in ("start_weight_update", "update_weights", "finish_weight_update"):
        real = getattr(type(llm), name)

        def wrapped(self: Any, *a: Any, _real: Any = real, _name: str = name, **k: Any) -> Any:
            calls.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(type(llm), name, wrapped)
    return calls


@pytest.mark.parametrize("strategy", ["full", "hybrid", "adapter"])
def test_every_strategy_through_vllms_protocol(
    llm: Any, engine: Any, tiny_qwen3_moe_dir: Path, strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = lora_trainer(tiny_qwen3_moe_dir, ATTN, EXPERTS if strategy != "adapter" else None)
    calls = _spy(llm, monkeypatch)
    gen = torch.Generator().manual_seed(11)
    versions = []
    for _ in range(2):
        perturb(model, gen, base=strategy == "full")
        report = hwsync.sync(engine, model, strategy=strategy)
        versions.append(report.version)
        assert report.strategy == strategy and "weight-transfer API" in report.path
        assert (report.lora_request is not None) == (strategy != "full")
        if strategy != "full":  # vLLM's finish_weight_update did not reset it away (vllm_weight_transfer_lora_reset)
            assert report.lora_request.lora_int_id in _adapters(llm)
        assert_serves(llm, model, PROMPTS, atol=ATOL, max_tokens=4)
    assert calls == ["start_weight_update", "update_weights", "finish_weight_update"] * 2
    assert versions[1] == versions[0] + 1
    assert llm.get_weight_version() == str(versions[1])


def test_adapter_sync_equals_vllms_own_loading(llm: Any, engine: Any, tiny_qwen3_moe_dir: Path, tmp_path: Path) -> None:
    """After adapter syncs through vLLM's protocol the engine serves exactly what a fresh engine serves when vLLM
    loads the same base and the same adapter (saved by PEFT) itself."""
    model = lora_trainer(tiny_qwen3_moe_dir, ATTN)
    gen = torch.Generator().manual_seed(7)
    with EngineReference(tmp_path, **LORA) as reference:
        for _ in range(2):
            perturb(model, gen)
            report = hwsync.sync(engine, model, strategy="adapter")
            assert report.lora_request.lora_int_id in _adapters(llm)
            got = engine.logprobs(PROMPTS, 4)
            want = reference.logprobs(model, "adapter", PROMPTS, 4, engine=llm)
            diff = compare_logprobs(got, want, "hwsync backend vs vLLM's own loading")
            print(
                f"adapter sync v{report.version} through vLLM's protocol vs vLLM's own loading: max |Δ logprob| "
                f"= {diff:.3g}"
            )
            assert diff == 0.0 if on_cpu() else diff <= EXACT_ATOL  # CPU: bit-equal logprobs


def test_bad_manifest_refused_before_any_write(llm: Any, engine: Any, tiny_qwen3_moe_dir: Path) -> None:
    """A manifest naming a tensor the engine has no place for: one error from validation, nothing written (weights
    bit-equal, version and adapter kept, not stale), vLLM's session closed, and the next sync goes through."""
    model = lora_trainer(tiny_qwen3_moe_dir, ATTN)
    hwsync.sync(engine, model, strategy="hybrid")
    before, weights, adapters = engine.state(), _weights(llm), _adapters(llm)
    bad = lora_trainer(tiny_qwen3_moe_dir, None)
    bad.model.layers[0].self_attn.register_parameter("bogus", torch.nn.Parameter(torch.ones(3, 5)))
    with pytest.raises(ResolutionError, match="bogus"):
        hwsync.sync(engine, bad, strategy="full")
    after = engine.state()
    assert (after["version"], after["stale"], after["base_writes"]) == (before["version"], False, before["base_writes"])
    assert llm.get_weight_version() == str(before["version"])
    assert _adapters(llm) == adapters  # vLLM's finish (and its LoRA reset) never ran: the update raised
    now = _weights(llm)
    assert now.keys() == weights.keys() and all(torch.equal(now[n], weights[n]) for n in weights)
    hwsync.sync(engine, model, strategy="hybrid")  # vLLM's session was closed by the failure: a new one starts
    assert_serves(llm, model, PROMPTS, atol=ATOL, max_tokens=4)


def test_older_version_refused_before_any_write(llm: Any, engine: Any, tiny_qwen3_moe_dir: Path) -> None:
    model = lora_trainer(tiny_qwen3_moe_dir, ATTN)
    hwsync.sync(engine, model, strategy="adapter")
    before = engine.state()
    perturb(model, 5)
    with pytest.raises(VersionError, match="not newer"):
        hwsync.sync(engine, model, strategy="adapter", version=before["version"])
    after = engine.state()
    assert (after["version"], after["stale"], after["base_writes"]) == (before["version"], False, before["base_writes"])


def test_interrupted_update_leaves_the_engine_stale(llm: Any, engine: Any, tiny_qwen3_moe_dir: Path) -> None:
    model = lora_trainer(tiny_qwen3_moe_dir, None)
    hwsync.sync(engine, model, strategy="full", bucket_mb=0.05)
    version = engine.state()["version"]
    perturb(model, 3, base=True)

    def die(bucket: int, total: int) -> None:
        if bucket == 2:
            raise RuntimeError("trainer died mid-sync")

    with pytest.raises((SyncError, RuntimeError)):
        hwsync.sync(engine, model, strategy="full", bucket_mb=0.05, progress=die)
    st = engine.state()
    assert st["stale"] and st["version"] == version
    with pytest.raises(StaleEngineError):
        hwsync.generate(engine, PROMPTS[:1])
    hwsync.sync(engine, model, strategy="full")  # a complete update clears it
    assert_serves(llm, model, PROMPTS, atol=ATOL, max_tokens=4)


def test_update_info_without_buckets_is_refused(llm: Any, engine: Any) -> None:
    llm.start_weight_update()
    with pytest.raises(SyncError, match="no in-process buckets"):
        llm.update_weights({"update_info": {"manifest": "{}", "buckets": None}})
    assert not engine.state()["stale"]


def test_engine_without_hwsync_receiver_refuses(llm: Any) -> None:
    """vLLM hands the backend a model; one that no hwsync receiver serves is refused at init, not searched for."""
    from hwsync.engine.vllm.weight_transfer import HwsyncInitInfo, HwsyncWeightTransferEngine

    config = llm.llm_engine.vllm_config
    stray = HwsyncWeightTransferEngine(
        config.weight_transfer_config, config, torch.device("cpu"), torch.nn.Linear(2, 2)
    )
    with pytest.raises(SyncError, match="no hwsync receiver serves this engine's model"):
        stray.init_transfer_engine(HwsyncInitInfo())


def test_vllms_reset_runs_where_no_hwsync_update_completed(llm: Any, engine: Any, tiny_qwen3_moe_dir: Path) -> None:
    """The patch skips vLLM's LoRA reset only after an update hwsync completed: a session without one gets vLLM's
    reset (the adapter is dropped, as vLLM does for every backend), and the next sync installs it again."""
    model = lora_trainer(tiny_qwen3_moe_dir, ATTN)
    lid = hwsync.sync(engine, model, strategy="adapter").lora_request.lora_int_id
    assert lid in _adapters(llm)
    llm.start_weight_update()
    llm.finish_weight_update()
    assert lid not in _adapters(llm)  # what vLLM's finish_weight_update does to an adapter without the patch
    perturb(model, 3)
    report = hwsync.sync(engine, model, strategy="adapter")
    assert report.lora_request.lora_int_id in _adapters(llm)
    assert_serves(llm, model, PROMPTS, atol=ATOL, max_tokens=4)


def test_lora_reset_patch_held_only_while_the_backend_is_used(llm: Any, engine: Any, tiny_qwen3_moe_dir: Path) -> None:
    patch = patches.get(PATCH)
    assert patch.probe().state == patches.APPLIES, patch.probe().reason
    assert patch.active and not patch.installed  # held by the backend (scoped), never process-wide
    if hasattr(llm, "shutdown_weight_transfer_engine"):  # vLLM 0.32: releases the trainer connection
        llm.shutdown_weight_transfer_engine()
    else:  # 0.30, 0.31: only the worker's shutdown calls the engine's shutdown; call it as that would
        llm.collective_rpc(lambda w: w.__dict__.get("worker", w).weight_transfer_engine.shutdown())
    assert not patch.active  # released: vLLM's Worker and LoRA mixin are their own again
    from vllm.v1.worker.gpu_worker import Worker

    assert not hasattr(Worker.finish_weight_update, "__hwsync_patch__")
    again = hwsync.TransferBackendEngine(llm)  # init_weight_transfer_engine again: held again, once
    hwsync.TransferBackendEngine(llm)
    assert patch.active and patch._refs == 1
    model = lora_trainer(tiny_qwen3_moe_dir, ATTN)
    report = hwsync.sync(again, model, strategy="adapter")
    assert report.lora_request.lora_int_id in _adapters(llm)


def test_the_config_line_is_all_it_takes(llm: Any, tiny_qwen3_moe_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that selected hwsync's backend is synced through vLLM's protocol by ``hwsync.sync(llm, model)``
    itself: ``as_engine`` hands out the one transfer handle of that engine, no wrapping by the user."""
    handle = hwsync.as_engine(llm)
    assert isinstance(handle, hwsync.TransferBackendEngine) and hwsync.as_engine(llm) is handle
    model = lora_trainer(tiny_qwen3_moe_dir, ATTN, EXPERTS)
    calls = _spy(llm, monkeypatch)
    perturb(model, 5)
    report = hwsync.sync(llm, model, strategy="hybrid")
    assert "weight-transfer API" in report.path and calls == [
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
    ]
    assert llm.get_weight_version() == str(report.version)
    assert_serves(llm, model, PROMPTS, atol=ATOL, max_tokens=4)


def test_ms_swifts_bare_engine_syncs_through_vllms_protocol(llm: Any, tiny_qwen3_moe_dir: Path) -> None:
    """ms-swift's colocated engine is a bare ``LLMEngine`` (no ``vllm.LLM`` verbs): what the plugin syncs
    (``as_engine(LLMEngineView.of(engine))``) runs the verbs as ``LLM``'s methods do, through the engine's
    ``collective_rpc``, and sets vLLM's weight version (``--vllm_engine_kwargs '{"weight_transfer_config": ...}'``)."""
    from hwsync.integrations.swift._engine_view import LLMEngineView

    engine = llm.llm_engine
    view = LLMEngineView.of(engine)
    handle = hwsync.as_engine(view)
    assert isinstance(handle, hwsync.TransferBackendEngine) and hwsync.as_engine(view) is handle
    verbs: list[str] = []
    real = engine.collective_rpc

    def spied(method: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(method, str):
            verbs.append(method)
        return real(method, *args, **kwargs)

    engine.collective_rpc = spied
    try:
        model = lora_trainer(tiny_qwen3_moe_dir, ATTN)
        perturb(model, 6)
        report = hwsync.sync(view, model, strategy="adapter")
    finally:
        del engine.collective_rpc
    assert "weight-transfer API" in report.path
    assert verbs == ["start_weight_update", "update_weights", "finish_weight_update"], verbs
    assert engine.get_weight_version() == str(report.version)
    assert report.lora_request.lora_int_id in _adapters(llm)
    assert_serves(llm, model, PROMPTS, atol=ATOL, max_tokens=4)


def test_absent_api_is_one_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from hwsync.trainer import transfer_backend

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "vllm.distributed.weight_transfer" else real(name, *a),
    )
    with pytest.raises(UnsupportedSetupError, match="has no weight-transfer API"):
        transfer_backend.check_weight_transfer_api()
