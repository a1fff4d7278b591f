"""``tests/test_verify_faults.py`` on a tiny Qwen3.5-MoE (Gated-DeltaNet + full-attention layers, fused experts, an MTP
layer in the checkpoint): no false alarm over 20 healthy syncs per strategy, every injected fault caught by the check
that names it. The engine runs in bf16 (GPU LoRA kernels; vLLM's CPU GDN kernel takes nothing else), where vLLM keeps
the GDN ``A_log`` in fp32 beside bf16 weights: the content fingerprints must hold across both. vLLM 0.32 cannot import
its Qwen3.5 module without torchvision (the CPU CI has none): there the module is skipped with that reason; the GPU
job runs it (``bash ci/gpu.sh qwen35``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_verify_faults import ENGINE, assert_campaign

from hwsync.testing import patched_llm, require_vllm
from hwsync.testing.engine import model_import_error

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def llm(tiny_qwen3_5_moe_dir: Path) -> Iterator[Any]:
    require_vllm()
    if err := model_import_error(tiny_qwen3_5_moe_dir):
        pytest.skip(f"vLLM cannot import its Qwen3.5 model class here ({err}); bash ci/gpu.sh qwen35 runs this")
    with patched_llm(tiny_qwen3_5_moe_dir, **ENGINE) as engine:  # + what VLLM_PLUGINS=hwsync does
        yield engine


@pytest.mark.parametrize("strategy", ["full", "adapter", "hybrid"])
def test_qwen3_5_no_false_alarm_and_every_fault_caught(llm: Any, tiny_qwen3_5_moe_dir: Path, strategy: str) -> None:
    assert_campaign(llm, tiny_qwen3_5_moe_dir, strategy)
