"""The LoRA configuration matrix (``hwsync.testing.lora_configs``): every cell, every strategy, either exact against
vLLM's own loading of the same adapter or refused by ``hwsync.sync`` before anything is written.

One engine and two reference processes for the module (tiny Qwen3-MoE; ``full`` syncs in one, ``adapter``/``hybrid``
in the other, whose base engine then serves cell after cell). On vLLM's CPU build the engine is bf16 -- the
LoRA dtype where the order in which a scaling is folded into B shows (issue 29) -- with LoRA on attention (the CPU
build has no MoE-LoRA kernels: expert LoRA is refused by ``adapter`` and merged by ``hybrid``); 10 syncs per cell for
adapter/hybrid and 3 for full (each checked full sync starts a reference engine). The reference is asked at the
syncs that take distinct paths (first, second, last, any path change; every sync of the two-adapter cell), each other
sync passes ``hwsync.verify``'s complete, bit-exact content comparison or is compared too
(``HWSYNC_LORA_REFERENCE=every``: every sync; ``hwsync.testing.lora_configs.reference_policy``). On a GPU: bf16,
``enable_mixed_moe_lora_format=True`` (PEFT's fused expert adapter loads from disk as it was saved), 10 syncs each
(``HWSYNC_LORA_SYNCS`` / ``HWSYNC_LORA_FULL_SYNCS`` change both; ``HWSYNC_LORA_CELLS=k/n`` runs a shard).
``HWSYNC_LORA_RESULTS=<file>`` writes the results the docs table is generated from
(``python -m hwsync.testing.lora_configs --from <file> --write-docs``).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hwsync
from hwsync.testing import EngineReference, close_llm, engine_patches, make_llm, on_cpu, require_vllm
from hwsync.testing.lora_configs import (
    CELLS,
    DOC,
    STRATEGIES,
    SplitReference,
    expected_refusal,
    load,
    make_trainer,
    render,
    run_cell,
    selected_cells,
    syncs_per_strategy,
    write_results,
)

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
LORA = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
ENGINE = {**LORA, "dtype": "bfloat16"} if on_cpu() else {**LORA, "enable_mixed_moe_lora_format": True}
RESULTS: dict[str, Any] = {}


def _id(cell: Any) -> str:
    return re.sub(r"\W+", "-", cell.name.replace("≠", "ne")).strip("-")


@pytest.fixture(scope="module")
def matrix(tiny_qwen3_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    require_vllm()
    with engine_patches():  # what VLLM_PLUGINS=hwsync does in a vLLM process
        llm = make_llm(tiny_qwen3_moe_dir, worker_extension_cls="hwsync.vllm.HwsyncWorkerExtension", **ENGINE)
        # full syncs in one reference process, adapter/hybrid in another: the base engine the latter keeps is not
        # restarted after each cell's full syncs (every answer is still a fresh engine's own loading)
        reference = SplitReference(
            EngineReference(tmp_path_factory.mktemp("lora-configs-reference-full"), **ENGINE),
            EngineReference(tmp_path_factory.mktemp("lora-configs-reference"), **ENGINE),
        )
        try:
            yield llm, reference
        finally:
            reference.close()
            close_llm(llm)


def _write() -> None:
    out = os.environ.get("HWSYNC_LORA_RESULTS")
    if out:
        from hwsync.testing.families import _device_name

        write_results(
            RESULTS,
            out,
            platform="cpu" if on_cpu() else _device_name(),
            engine={k: v for k, v in ENGINE.items() if k != "enable_lora"},
            syncs=syncs_per_strategy(not on_cpu()),
        )


@pytest.mark.parametrize("cell", selected_cells(), ids=_id)
def test_cell(matrix: tuple[Any, Any], tiny_qwen3_moe_dir: Path, cell: Any) -> None:
    llm, reference = matrix
    syncs, full_syncs = syncs_per_strategy(not on_cpu())
    result = run_cell(
        cell,
        llm,
        reference,
        tiny_qwen3_moe_dir,
        serves_expert_lora=reference.serves_expert_lora(),
        syncs=syncs,
        full_syncs=full_syncs,
        log=print,
    )
    RESULTS[cell.name] = result
    _write()
    failed = {s: r["detail"] for s, r in result.items() if r["status"] == "fail"}
    assert not failed, f"{cell.name}: {failed}"
    for s, r in result.items():
        want = "refused" if expected_refusal(cell, s, reference.serves_expert_lora()) else "exact"
        assert r["status"] == want, f"{cell.name}/{s}: {r}"


def test_trained_biases_are_refused_before_anything_is_written(
    matrix: tuple[Any, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """bias='all' / 'lora_only' on a model that has biases trains base weights: adapter and hybrid refuse it (naming
    the option and strategy="full") before the engine is touched. (The matrix's model has none: there the option
    trains nothing and the adapter is served.)"""
    from hwsync.testing import make_tiny_moe
    from hwsync.testing.lora_configs import Cell, _lora

    llm, _ = matrix
    biased = make_tiny_moe(tmp_path_factory.mktemp("biased"), "qwen3_moe", attention_bias=True)
    engine = hwsync.as_engine(llm)
    for mode in ("all", "lora_only"):
        model = make_trainer(Cell("b", "", _lora(bias=mode)), biased)
        for strategy in ("adapter", "hybrid"):
            before = engine.state()
            with pytest.raises(
                hwsync.AdapterFormatError,
                match=rf"bias='{mode}' trains \d+ bias tensor.*q_proj.bias.*strategy=\"full\"",
            ):
                hwsync.sync(llm, model, strategy=strategy)
            assert engine.state() == before


def test_vllm_derives_peft_scalings_for_every_cell(tmp_path: Path, tiny_qwen3_moe_dir: Path) -> None:
    """vLLM's own loading is a yardstick worth matching: for every LoRA cell, vLLM's ``PEFTHelper`` derives from the
    saved ``adapter_config.json`` (rank_pattern / alpha_pattern by name and regex, rsLoRA, fused-expert patterns)
    the rank and scaling PEFT's layers use, for every module the adapter file holds. (No engine.)"""
    require_vllm()
    from safetensors import safe_open
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    checked = 0
    for cell in CELLS:
        if cell.kind != "lora" or cell.refused:
            continue
        model = make_trainer(cell, tiny_qwen3_moe_dir)
        for adapter in ["default"] + (["other"] if cell.second else []):
            model.set_adapter(adapter)
            out = tmp_path / re.sub(r"\W+", "_", cell.name) / adapter
            model.save_pretrained(out, selected_adapters=[adapter])
            src = out if (out / "adapter_config.json").exists() else out / adapter
            helper = PEFTHelper.from_dict(json.loads((src / "adapter_config.json").read_text()))
            truth = {
                path.removeprefix("base_model.model."): (layer.r[adapter], layer.scaling[adapter])
                for path, layer in model.named_modules()
                if isinstance(getattr(layer, "scaling", None), dict) and adapter in layer.scaling
            }
            with safe_open(str(src / "adapter_model.safetensors"), "pt") as f:
                keys = [k for k in f.keys() if k.endswith("lora_A.weight")]  # noqa: SIM118 - safe_open has no __iter__
            assert keys
            for key in keys:
                module, _ = parse_fine_tuned_lora_name(key)
                rank, scaling = helper.get_rank_and_scaling(module)
                want_rank, want_scaling = truth[module]
                assert rank == want_rank and math.isclose(scaling, want_scaling, rel_tol=0, abs_tol=0), (
                    f"{cell.name}/{adapter}: vLLM {module} r={rank} s={scaling}, PEFT r={want_rank} s={want_scaling}"
                )
                checked += 1
    assert checked > 100


def test_docs_table_is_generated_from_the_results() -> None:
    """docs/lora-configs.md holds exactly what the results files render (nothing in the table is written by hand),
    and the CPU results cover every cell and strategy with the outcome the matrix expects on the CPU build."""
    cpu_file, gpu_file = ROOT / "docs/lora-configs.json", ROOT / "docs/lora-configs-gpu.json"
    cpu = load([cpu_file])
    gpu = load([gpu_file]) if gpu_file.exists() else None
    text = (ROOT / DOC).read_text()
    assert render(cpu, gpu) in text, (
        "regenerate: python -m hwsync.testing.lora_configs --from docs/lora-configs.json "
        "[--gpu docs/lora-configs-gpu.json] --write-docs"
    )
    rows = {r["cell"]: r["strategies"] for r in cpu["results"]}
    assert set(rows) == {c.name for c in CELLS}
    for c in CELLS:
        for s in STRATEGIES:
            want = "refused" if expected_refusal(c, s, serves_expert_lora=False) else "exact"
            assert rows[c.name][s]["status"] == want, (c.name, s, rows[c.name][s])


def test_fold_order_matters_for_these_cells() -> None:
    """The matrix exercises the rounding order: in bf16, folding these cells' scalings in fp32 with one rounding
    gives other bits than vLLM's order for some of B's elements (a power-of-two scaling would not)."""
    from hwsync.common.lora_formats import fold_scaling

    b = torch.randn(256, 8, generator=torch.Generator().manual_seed(0)) * 0.05
    for scaling in (6 / 4, 6 / math.sqrt(8), 5 / 4, 3 / 4):
        once = (b * scaling).to(torch.bfloat16)
        assert not torch.equal(fold_scaling(b, scaling, torch.bfloat16), once), scaling
    assert torch.equal(fold_scaling(b, 2.0, torch.bfloat16), (b * 2.0).to(torch.bfloat16))


def test_2d_reference_adapter_keeps_the_expert_scalings(tmp_path: Path, tiny_qwen3_moe_dir: Path) -> None:
    """The per-expert (2-D) adapter the tests write for engines without ``enable_mixed_moe_lora_format`` carries
    the fused experts' own rank/alpha patterns as explicit per-expert patterns: vLLM derives, for every per-expert
    key, the scaling PEFT applies to that expert's fused module. (No engine.)"""
    require_vllm()
    from safetensors import safe_open
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    from hwsync.testing.reference import write_adapter

    cell = next(c for c in CELLS if c.name == "experts, rank ≠ attention")
    model = make_trainer(cell, tiny_qwen3_moe_dir)
    out = write_adapter(model, tmp_path / "a2d", moe_format="2d")
    helper = PEFTHelper.from_dict(json.loads((out / "adapter_config.json").read_text()))
    truth = {}
    for path, layer in model.named_modules():
        if isinstance(getattr(layer, "scaling", None), dict) and getattr(layer, "parameter_name", None):
            owner = path.removeprefix("base_model.model.").replace(".base_layer", "")
            truth[(owner, layer.parameter_name)] = (layer.r["default"], layer.scaling["default"])
    checked = 0
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            m = re.search(
                r"^(.*\.experts)\.\d+\.(gate_proj|up_proj|down_proj)\.lora_A\.weight$",
                key.removeprefix("base_model.model."),
            )
            if m is None:
                continue
            module, _ = parse_fine_tuned_lora_name(key)
            pname = "down_proj" if m[2] == "down_proj" else "gate_up_proj"
            assert helper.get_rank_and_scaling(module) == truth[(m[1], pname)], module
            checked += 1
    assert checked == 2 * 8 * 3


def test_cells_are_picked_by_shard_or_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from hwsync.testing.lora_configs import CELLS, CELLS_ENV

    monkeypatch.setenv(CELLS_ENV, "all-linear;experts, rank ≠ attention")  # a name with a comma: ";" separates
    assert [c.name for c in selected_cells()] == ["all-linear", "experts, rank ≠ attention"]
    monkeypatch.setenv(CELLS_ENV, "rsLoRA, DoRA")
    assert [c.name for c in selected_cells()] == ["rsLoRA", "DoRA"]
    monkeypatch.setenv(CELLS_ENV, f"2/{len(CELLS)}")
    assert [c.name for c in selected_cells()] == [CELLS[1].name]
    monkeypatch.setenv(CELLS_ENV, "rsLoRA;no such cell")
    with pytest.raises(ValueError, match="no such cell"):
        selected_cells()
