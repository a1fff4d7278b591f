"""The family matrix: every MoE architecture both transformers and vLLM know (enumerated from their registries, plus
two dense controls with and without attention biases), a tiny local checkpoint each, one real vLLM engine each,
``SYNCS`` syncs per strategy the engine serves, every sync checked against transformers (``hwsync.verify``).

A family vLLM here cannot serve, or on which vLLM and transformers already disagree before any sync, is recorded with
the reason (the README table shows it); any hwsync failure fails the test. ``HWSYNC_FAMILY_RESULTS=<file>`` keeps the
results for ``python -m hwsync.testing.family_matrix --from <file> --write-readme``.
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
        from hwsync.testing.families import enumerate_families

        return enumerate_families()
    except ImportError:  # no vLLM: the test below skips (or fails on CI) through require_vllm
        return []


FAMILIES = _families()


@pytest.fixture(scope="module", autouse=True)
def engine_patches() -> Iterator[None]:
    """What VLLM_PLUGINS=hwsync does in a vLLM process (MoE + enable_lora on CPU); one thread (2 shared cores)."""
    require_vllm()
    import hwsync.patches as patches
    from hwsync import vllm_plugin

    before = {n for n in patches.names() if patches.get(n).installed}
    active = set(vllm_plugin.register()) - before
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    for name in active:
        patches.get(name).uninstall()
    out = os.environ.get("HWSYNC_FAMILY_RESULTS")
    if out and _RESULTS:
        from hwsync.testing.families import write_results

        write_results(_RESULTS, out)


def test_enumeration_comes_from_both_registries() -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from vllm.model_executor.models.registry import ModelRegistry

    from hwsync.testing.families import DENSE_CONTROLS

    names = {f.name for f in FAMILIES}
    assert {"mixtral", "qwen3_moe", "deepseek_v2", "gpt_oss"} <= names  # well-known MoE families are found
    assert set(DENSE_CONTROLS) <= names and "qwen3" not in names  # dense models only as the named controls
    served = set(ModelRegistry.get_supported_archs())
    for f in FAMILIES:
        assert f.arch in served
        archs = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[f.name]
        assert f.arch in ((archs,) if isinstance(archs, str) else archs)


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_family(family: Any, tmp_path: Path) -> None:
    from hwsync.testing.families import SYNCS, run_family

    result = run_family(family, tmp_path, syncs=SYNCS)
    _RESULTS.append(result)
    summary = {s: (e["status"], e.get("max_diff"), e["detail"]) for s, e in result.strategies.items()}
    print(f"{family.name}: {summary} ({result.seconds:.1f}s)")
    assert set(result.strategies) == {"full", "adapter", "hybrid"}  # every cell has an outcome and a reason
    failed = {s: e["detail"] for s, e in result.strategies.items() if e["status"] == "fail"}
    assert not failed, f"{family.name}: hwsync sync failed: {failed}"
    for s, e in result.strategies.items():
        assert e["status"] in {"pass", "not_served", "differs", "config", "known"} and (e["status"] == "pass" or e["detail"])
    if family.note:  # the dense controls are always served and always exact
        assert result.strategies["full"]["status"] == "pass"


def test_dry_run_names_the_parameter_of_a_loader_it_cannot_run(tmp_path: Path) -> None:
    """A weight loader that refuses on meta data and on a scratch copy: one ResolutionError naming the engine
    parameter and the loader, raised before any write (the engine still serves the weights it had)."""
    from transformers import AutoModelForCausalLM

    import hwsync
    from hwsync.errors import ResolutionError
    from hwsync.testing import close_llm, make_llm
    from hwsync.testing.families import PROMPTS, Family, make_family_checkpoint
    from hwsync.verify import verify

    path = make_family_checkpoint(tmp_path / "qwen2", Family("qwen2", "Qwen2ForCausalLM"))
    llm = make_llm(path, worker_extension_cls="hwsync.vllm.HwsyncWorkerExtension")
    try:
        trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        assert verify(llm, trainer, PROMPTS) <= 1e-4  # the engine serves the checkpoint

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
            with pytest.raises(ResolutionError, match=r"layers\.1\.self_attn\.qkv_proj\.bias.*opaque_loader.*"
                                                      r"NotImplementedError"):
                hwsync.sync(llm, changed, strategy="full")
        finally:
            bias.weight_loader = original
        assert verify(llm, trainer, PROMPTS) <= 1e-4  # nothing was written
        hwsync.sync(llm, changed, strategy="full")  # packed q/k/v biases through the dry run and the reload
        assert verify(llm, changed, PROMPTS) <= 1e-4
    finally:
        close_llm(llm)
