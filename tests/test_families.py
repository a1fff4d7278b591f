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
