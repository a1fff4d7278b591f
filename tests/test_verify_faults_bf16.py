"""``tests/test_verify_faults.py`` on a bf16 engine (vLLM's CPU build serves bf16 with LoRA): no false alarm over 20
healthy syncs per strategy although bf16 logprobs differ from the fp32 trainer's by up to ~6 on this tiny model,
and every fault caught (exact content checks; "post-load skipped" is reported not applicable where the experts'
post-load step leaves their bf16 storage unchanged). One engine for the module.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_verify_faults import ENGINE, assert_campaign

from hwsync.testing import close_llm, make_llm, require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def llm(tiny_qwen3_moe_dir: Path) -> Iterator[Any]:
    require_vllm()
    import hwsync.patches as patches

    from hwsync import vllm_plugin

    before = {n for n in patches.names() if patches.get(n).installed}
    active = set(vllm_plugin.register()) - before
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = make_llm(tiny_qwen3_moe_dir, dtype="bfloat16", **ENGINE)
    yield engine
    close_llm(engine)
    torch.set_num_threads(threads)
    for name in active:
        patches.get(name).uninstall()


@pytest.mark.parametrize("strategy", ["full", "adapter", "hybrid"])
def test_bf16_no_false_alarm_and_every_fault_caught(llm: Any, tiny_qwen3_moe_dir: Path, strategy: str) -> None:
    assert_campaign(llm, tiny_qwen3_moe_dir, strategy)
