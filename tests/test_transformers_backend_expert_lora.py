"""Expert LoRA on vLLM's Transformers modeling backend (FlexOlmo, HunYuan-V1-MoE, Mellum): not LoRA-servable.

Seen on the H100 (family matrix, ``hybrid``): vLLM 0.32's ``TransformersRoutedExperts.get_expert_mapping`` lists
every expert under two checkpoint spellings (gate/down/up_proj and w1/w2/w3), ``process_packed_modules_mapping``
copies both into the LoRA manager's packing list, and ``PackedLoRALayerWeights.pack_moe`` -- which reads that list
as one triplet per expert -- asserts on any expert adapter, vLLM's own loading of one included. hwsync now reports
those experts unservable (:func:`hwsync.vllm.applier.expert_packing_problem`): ``hybrid`` merges them, ``adapter``
refuses naming the reason, before anything is written.

The packing list is built when vLLM's LoRA manager starts, on every platform: vLLM's CPU build shows it as well
(there the experts are unservable anyway, having no MoE-LoRA kernels). One engine for the module (tiny FlexOlmo).
"""
from __future__ import annotations

import re

import pytest
import torch

import hwsync
from hwsync.errors import AdapterFormatError
from hwsync.vllm.applier import expert_packing_problem

pytestmark = pytest.mark.vllm
FAMILY = "flex_olmo"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    from hwsync.testing import patched_llm, require_vllm
    from hwsync.testing.families import enumerate_families, make_family_checkpoint

    require_vllm()
    family = next(f for f in enumerate_families() if f.name == FAMILY)
    path = make_family_checkpoint(tmp_path_factory.mktemp("tbl") / FAMILY, family)
    with patched_llm(path, max_model_len=256, enable_lora=True, max_lora_rank=8, max_loras=1,
                     worker_extension_cls="hwsync.vllm.HwsyncWorkerExtension") as llm:
        yield llm, path


def _manager(llm):
    from hwsync.vllm.applier import lora_manager_of

    return lora_manager_of(llm.llm_engine.model_executor.driver_worker.worker)


def _expert_trainer(path):
    from hwsync.testing.families import _trainer

    model = _trainer(path, "hybrid")  # attention LoRA + LoRA on the fused experts (target_parameters)
    assert any(".experts." in n and "lora_" in n for n, _ in model.named_parameters())
    return model


def test_probe_matches_what_vllm_packs(engine) -> None:
    """The probe flags exactly the lists vLLM's own ``pack_moe`` cannot pack (real vLLM code, this engine's list)."""
    from vllm.lora.lora_weights import LoRALayerWeights, PackedLoRALayerWeights

    llm, _ = engine
    names = list(_manager(llm).packed_modules_mapping["experts"])
    experts = {int(m.group(1)) for n in names if (m := re.fullmatch(r"experts\.(\d+)\..+", n))}
    problem = expert_packing_problem({"experts": names})

    def pack(entries: list[str], spelled: tuple[str, ...]) -> None:
        # what vLLM's manager does for an adapter whose expert LoRA is spelled one way: None where absent
        loras = [LoRALayerWeights.create_dummy_lora_weights(n, 8, 8, 2, torch.float32, "cpu")
                 if n.rsplit(".", 1)[-1] in spelled else None for n in entries]
        PackedLoRALayerWeights.pack_moe(loras, "model.layers.0.mlp.experts")

    one_spelling = [n for n in names if n.rsplit(".", 1)[-1] in ("gate_proj", "down_proj", "up_proj")]
    assert len(one_spelling) == 3 * len(experts)
    assert expert_packing_problem({"experts": one_spelling}) is None
    pack(one_spelling, ("gate_proj", "down_proj", "up_proj"))  # one triplet per expert: vLLM packs it
    if problem is None:  # vLLM lists one spelling per expert (a fixed vLLM): it must pack what it lists
        pack(names, ("gate_proj", "down_proj", "up_proj"))
        return
    assert len(names) == 6 * len(experts) and "expert 0: gate_proj/down_proj/up_proj/w1/w2/w3" in problem
    with pytest.raises(AssertionError):  # vLLM 0.32: the second spelling reads as experts E..2E-1, all missing
        pack(names, ("gate_proj", "down_proj", "up_proj"))


def test_engine_reports_expert_lora_unservable(engine) -> None:
    llm, path = engine
    model = _expert_trainer(path)
    if expert_packing_problem(_manager(llm).packed_modules_mapping) is None:
        pytest.skip("this vLLM packs expert LoRA of the Transformers backend")
    from hwsync.api import describe_for

    info, lora = describe_for(hwsync.as_engine(llm), model)
    experts = [p for p in lora.vllm_paths if ".experts" in p]
    assert experts and all("PackedLoRALayerWeights.pack_moe" in info.unservable[p] for p in experts)
    assert not any(p in info.unservable for p in lora.vllm_paths if ".experts" not in p)


def test_adapter_refuses_and_hybrid_merges_the_experts(engine) -> None:
    llm, path = engine
    if expert_packing_problem(_manager(llm).packed_modules_mapping) is None:
        pytest.skip("this vLLM packs expert LoRA of the Transformers backend")
    model = _expert_trainer(path)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    version = hwsync.as_engine(llm).state().get("version")
    with pytest.raises(AdapterFormatError, match=r"pack_moe.*hybrid"):
        hwsync.sync(llm, model, strategy="adapter")
    assert hwsync.as_engine(llm).state().get("version") == version  # refused before anything was written
    report = hwsync.sync(llm, model)  # auto
    assert report.strategy == "hybrid" and "experts" in report.reason, report.reason
    from hwsync.testing import on_cpu
    from hwsync.testing.families import PROMPTS

    if on_cpu():
        assert hwsync.verify(llm, model, PROMPTS, atol=1e-4) <= 1e-4
