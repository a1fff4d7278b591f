"""The adapter layout is traced on one layer per structure, whatever the depth (:mod:`hwsync.engine.vllm.lora_slots`).

A 6-layer model whose layer 4 has another LoRA rank (``rank_pattern``): two structures, so the trace runs vLLM's
construction on two layers -- the same count a 60-layer model would need -- and the install it builds for all six
layers equals vLLM's own construction and activation of the same tensors, slot buffer for slot buffer. CPU-only
engine (attention LoRA: vLLM's CPU build has no MoE-LoRA kernels); the GPU job runs the same module with expert LoRA.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hwsync
from hwsync.engine.vllm.lora_slots import layer_groups
from hwsync.testing import make_llm, make_tiny_moe, require_vllm
from hwsync.testing.trainer import lora_trainer, perturb

pytestmark = pytest.mark.vllm

LAYERS = 6
CUDA = torch.cuda.is_available()
DTYPE = torch.bfloat16 if CUDA else torch.float32
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def test_layer_groups_pick_one_layer_per_structure() -> None:
    meta = {f"model.layers.{i}.self_attn.{p}": ["linear", False, False] for i in range(60) for p in ("q", "o")}
    meta["lm_head"] = ["linear", False, False]
    shapes = {n: ((8, 64), (64, 8)) if ".7." not in n else ((4, 64), (64, 4)) for n in meta}
    groups = layer_groups(meta, shapes)
    assert set(groups.traced) == {
        "lm_head",
        "model.layers.0.self_attn.q",
        "model.layers.0.self_attn.o",
        "model.layers.7.self_attn.q",
        "model.layers.7.self_attn.o",
    }
    assert groups.members == {("model.layers", 0): tuple(i for i in range(60) if i != 7), ("model.layers", 7): (7,)}
    assert {n.split(".")[2] for n in groups.sampled if n.startswith("model.")} == {"0", "59", "7"}


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_moe(tmp_path_factory.mktemp("deep"), "qwen3_moe", num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def llm(deep_dir: Path) -> Iterator[Any]:
    require_vllm()
    from hwsync.engine import vllm_plugin

    vllm_plugin.register()
    kwargs: dict[str, Any] = dict(enable_lora=True, max_lora_rank=8, max_loras=2, dtype=str(DTYPE)[6:])
    if CUDA:
        kwargs.update(gpu_memory_utilization=0.2, num_gpu_blocks_override=256)
    else:
        kwargs["lora_target_modules"] = ["qkv_proj", "o_proj"]
    yield make_llm(deep_dir, **kwargs)


def _manager(llm: Any) -> Any:
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.lora_manager._adapter_manager


def _slots(llm: Any, lid: int) -> dict[str, torch.Tensor]:
    wm = _manager(llm)
    slot = wm.lora_index_to_id.index(lid)
    out = {}
    for name, module in wm.modules.items():
        for attr, value in vars(module).items():
            if attr.endswith("_stacked") and not (attr == "lora_a_stacked" and isinstance(value, list)):
                for i, t in enumerate(value if isinstance(value, (tuple, list)) else (value,)):
                    if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] > slot:
                        out[f"{name}.{attr}[{i}]"] = t[slot].detach().clone()
    return out


def test_trace_runs_on_one_layer_per_structure_and_installs_like_vllm(
    llm: Any, deep_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hwsync.engine.vllm.worker import receiver_of

    model = lora_trainer(
        deep_dir,
        ATTN,
        EXPERTS if CUDA else None,
        dtype=DTYPE,
        lora_dropout=0.0,
        rank_pattern={"model.layers.4.self_attn.o_proj": 8},
        alpha_pattern={"model.layers.4.self_attn.o_proj": 16},
    ).to("cuda" if CUDA else "cpu")
    perturb(model, 1)
    ours = hwsync.sync(llm, model, strategy="adapter")
    assert "adapter: built from vLLM's traced layout" in ours.path, ours.path
    worker = llm.llm_engine.model_executor.driver_worker.worker
    writers = [w for w in receiver_of(worker).applier._slot_writers.values() if w is not None]
    assert len(writers) == 1
    writer = writers[0]
    per_layer = len(writer.modules) // LAYERS
    assert len(writer.modules) == per_layer * LAYERS
    # two structures (layer 4's o_proj has rank 8): vLLM's construction ran on two layers, not six
    assert writer.traced_modules == 2 * per_layer, (writer.traced_modules, per_layer)
    assert not writer.no_blocks, writer.no_blocks
    lid = ours.lora_request.lora_int_id
    mine = _slots(llm, lid)
    with monkeypatch.context() as m:
        m.setenv("HWSYNC_DIRECT", "0")  # vLLM's construction of every layer, in the other slot
        theirs_report = hwsync.sync(llm, model, strategy="adapter", lora_int_id=lid + 1)
    assert "adapter: built by vLLM" in theirs_report.path, theirs_report.path
    theirs = _slots(llm, lid + 1)
    assert mine.keys() == theirs.keys() and mine
    assert not [k for k in mine if not torch.equal(mine[k], theirs[k])]
    # a steady rewrite of the traced blocks leaves the slots as vLLM's set_lora of the new tensors does
    hwsync.sync(llm, model, strategy="adapter")  # back to hwsync's own id, built from the cached layout
    perturb(model, 2)
    steady = hwsync.sync(llm, model, strategy="adapter")
    assert "rewritten in place; slots written directly" in steady.path, steady.path
    mine = _slots(llm, steady.lora_request.lora_int_id)
    with monkeypatch.context() as m:
        m.setenv("HWSYNC_DIRECT", "0")
        again = hwsync.sync(llm, model, strategy="adapter", lora_int_id=lid + 2)
    theirs = _slots(llm, again.lora_request.lora_int_id)
    assert not [k for k in mine if not torch.equal(mine[k], theirs[k])]
