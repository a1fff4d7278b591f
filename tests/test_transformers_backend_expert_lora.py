"""Expert LoRA on vLLM's Transformers modeling backend (FlexOlmo, HunYuan-V1-MoE, Mellum).

Seen on the H100 (family matrix, ``hybrid``): vLLM 0.32's ``TransformersRoutedExperts.get_expert_mapping`` lists
every expert under two checkpoint spellings (gate/down/up_proj and w1/w2/w3), ``process_packed_modules_mapping``
copies both into the LoRA manager's packing list, and ``PackedLoRALayerWeights.pack_moe`` -- which reads that list
as one triplet per expert -- asserts on any expert adapter, vLLM's own loading of one included. Two layers of fix:

* the engine patch ``vllm_lora_expert_spellings`` keeps one spelling per expert: vLLM packs and serves expert LoRA
  of these models (on a platform with MoE-LoRA kernels: ``adapter`` with expert LoRA, checked against vLLM's own
  loading on a GPU);
* an engine without it (the list vLLM builds unpatched, put in the live manager) gets those experts reported
  unservable (:func:`hwsync.engine.vllm.applier.expert_packing_problem`): ``hybrid`` merges them, ``adapter`` refuses
  naming the reason before anything is written.

The packing list is built when vLLM's LoRA manager starts, on every platform: vLLM's CPU build shows it too (there the
experts are unservable anyway: no MoE-LoRA kernels). One engine for the module (tiny FlexOlmo, built under the engine
patches, as ``VLLM_PLUGINS=hwsync`` builds it).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import hwsync
import hwsync.patches as patches
from hwsync.common.errors import AdapterFormatError
from hwsync.engine.vllm.applier import expert_packing_problem
from hwsync.testing import EXACT_ATOL, on_cpu

pytestmark = pytest.mark.vllm
FAMILY = "flex_olmo"
PATCH = patches.get("vllm_lora_expert_spellings")


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    from hwsync.testing import EngineReference, patched_llm, require_vllm
    from hwsync.testing.families import make_family_checkpoint

    require_vllm()
    if PATCH.probe().state != patches.APPLIES:
        pytest.skip(f"not affected here: {PATCH.probe().reason}")
    path = make_family_checkpoint(tmp_path_factory.mktemp("tbl") / FAMILY, FAMILY)
    kwargs = dict(max_model_len=256, enable_lora=True, max_lora_rank=8, max_loras=1)
    with (
        patched_llm(path, worker_extension_cls="hwsync.vllm.HwsyncWorkerExtension", **kwargs) as llm,
        EngineReference(tmp_path_factory.mktemp("tbl-ref"), **kwargs) as reference,
    ):
        yield llm, path, reference


def _manager(llm: Any) -> Any:
    from hwsync.engine.vllm.applier import lora_manager_of

    return lora_manager_of(llm.llm_engine.model_executor.driver_worker.worker)


def _unpatched_list(llm: Any) -> list[str]:
    """The packing list vLLM builds for this model without the patch (its own function, unwrapped), as at the
    manager's construction: where the experts are LoRA-wrapped by now (a GPU), vLLM's wrapper has since set
    ``lora_base_layer_prefix``, which suffixes every per-expert name with ``.base_layer``."""
    manager = _manager(llm)
    raw = PATCH.original()(
        manager.model,
        force_2d_moe=manager._enable_mixed_moe_lora_format,  # noqa: SLF001
        enable_moe_shared_loras=manager._enable_moe_shared_loras,
    )["experts"]  # noqa: SLF001
    return [n.removesuffix(".base_layer") for n in raw]


@contextlib.contextmanager
def _as_unpatched(llm: Any) -> Iterator[None]:
    """The live manager holds the list an engine built without the patch holds (restored afterwards)."""
    mapping = _manager(llm).packed_modules_mapping
    kept = mapping["experts"]
    mapping["experts"] = _unpatched_list(llm)
    try:
        yield
    finally:
        mapping["experts"] = kept


def _expert_trainer(path: Any, seed: int = 0) -> Any:
    from hwsync.testing.families import _trainer

    model = _trainer(path, "hybrid")  # attention LoRA + LoRA on the fused experts (target_parameters)
    assert any(".experts." in n and "lora_" in n for n, _ in model.named_parameters())
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=gen)
    return model


def _pack(entries: list[str]) -> None:
    """What vLLM's manager does with an adapter whose expert LoRA is spelled gate/down/up_proj: one LoRA per list
    entry of that spelling, None elsewhere, then vLLM's own ``pack_moe``."""
    from vllm.lora.lora_weights import LoRALayerWeights, PackedLoRALayerWeights

    loras = [
        LoRALayerWeights.create_dummy_lora_weights(n, 8, 8, 2, torch.float32, "cpu")
        if n.rsplit(".", 1)[-1] in ("gate_proj", "down_proj", "up_proj")
        else None
        for n in entries
    ]
    PackedLoRALayerWeights.pack_moe(loras, "model.layers.0.mlp.experts")


def test_patch_gives_vllm_a_list_it_can_pack(engine) -> None:
    """Real vLLM code on this engine's lists: the patched one packs; the one vLLM builds alone asserts."""
    llm, _, _ = engine
    patched = list(_manager(llm).packed_modules_mapping["experts"])
    raw = _unpatched_list(llm)
    experts = {int(m.group(1)) for n in raw if (m := re.fullmatch(r"experts\.(\d+)\..+", n))}
    assert len(raw) == 6 * len(experts) and len(patched) == 3 * len(experts)
    assert patched == [n for n in raw if n.rsplit(".", 1)[-1] in ("gate_proj", "down_proj", "up_proj")]
    assert expert_packing_problem({"experts": patched}) is None
    _pack(patched)
    problem = expert_packing_problem({"experts": raw})
    assert problem is not None and "expert 0: gate_proj/down_proj/up_proj/w1/w2/w3" in problem
    with pytest.raises(AssertionError):  # the second spelling reads as experts E..2E-1, all missing
        _pack(raw)


def test_patched_engine_serves_expert_lora_where_moe_lora_runs(engine) -> None:
    """``adapter`` with expert LoRA: served as LoRA on a GPU (equal to vLLM's own loading of the same adapter, with the
    patch in the reference process too); refused on vLLM's CPU build for the platform's reason, not packing."""
    from hwsync.trainer.api import as_engine, describe_for

    llm, path, reference = engine
    model = _expert_trainer(path)
    info, lora = describe_for(as_engine(llm), model)
    experts = [p for p in lora.vllm_paths if ".experts" in p]
    assert experts and not any("pack_moe" in info.unservable.get(p, "") for p in experts)
    if on_cpu():
        with pytest.raises(AdapterFormatError, match="no MoE-LoRA kernels"):
            hwsync.sync(llm, model, strategy="adapter")
        return
    for step in range(2):
        model = _expert_trainer(path, seed=step)
        report = hwsync.sync(llm, model, strategy="adapter")
        assert report.strategy == "adapter" and report.lora_tensors > 0
        assert reference.check(llm, model, _prompts()) <= EXACT_ATOL


def test_unpatched_engine_reports_the_experts_and_hybrid_merges_them(engine) -> None:
    from hwsync.trainer.api import as_engine, describe_for

    llm, path, reference = engine
    model = _expert_trainer(path, seed=3)
    with _as_unpatched(llm):
        info, lora = describe_for(as_engine(llm), model)
        experts = [p for p in lora.vllm_paths if ".experts" in p]
        assert experts and all("PackedLoRALayerWeights.pack_moe" in info.unservable[p] for p in experts)
        assert not any(p in info.unservable for p in lora.vllm_paths if ".experts" not in p)
        version = as_engine(llm).state().get("version")
        with pytest.raises(AdapterFormatError, match=r"pack_moe.*hybrid"):
            hwsync.sync(llm, model, strategy="adapter")
        assert as_engine(llm).state().get("version") == version  # refused before anything was written
        report = hwsync.sync(llm, model)  # auto
        assert report.strategy == "hybrid" and "experts" in report.reason, report.reason
        if on_cpu():
            assert hwsync.verify(llm, model, _prompts(), atol=1e-4) <= 1e-4
        else:  # the reference merges what hwsync merged on this engine (its describe, with the unpatched list)
            assert reference.check(llm, model, _prompts()) <= EXACT_ATOL


def _prompts() -> list[list[int]]:
    from hwsync.testing.families import PROMPTS

    return PROMPTS
