"""``tests/test_verify_faults.py`` on a bf16 engine (vLLM's CPU build serves bf16 with LoRA): no false alarm over 20
healthy syncs per strategy although bf16 logprobs differ from the fp32 trainer's by up to ~6 on this tiny model,
and every fault caught (exact content checks; "post-load skipped" is reported not applicable where the experts'
post-load step leaves their bf16 storage unchanged). "scaling folded in another order" must be caught here (bf16
LoRA, o_proj's scaling 1.5): the adapter content check is bit-exact against vLLM's own construction of the adapter.
One engine for the module.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_verify_faults import ENGINE, assert_campaign

from hwsync.testing import patched_llm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def llm(tiny_qwen3_moe_dir: Path) -> Iterator[Any]:
    with patched_llm(tiny_qwen3_moe_dir, dtype="bfloat16", **ENGINE) as engine:  # + what VLLM_PLUGINS=hwsync does
        yield engine


@pytest.mark.parametrize("strategy", ["full", "adapter", "hybrid"])
def test_bf16_no_false_alarm_and_every_fault_caught(llm: Any, tiny_qwen3_moe_dir: Path, strategy: str) -> None:
    assert_campaign(llm, tiny_qwen3_moe_dir, strategy)
