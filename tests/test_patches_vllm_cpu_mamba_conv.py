"""vllm_cpu_mamba_conv: a weight reload on vLLM's CPU build keeps Mamba2's causal-conv weights current.

The probe must match the machine (the prepack branch is taken on CPUs with AVX512-BF16 / Arm bf16 only). Where it
applies: one real engine on a tiny Granite-MoE-hybrid (Mamba2 + attention, bf16: vLLM's CPU kernels for it take no
fp32), a reload of changed conv weights through vLLM's own ``reload_weights`` leaves ``conv_weights`` at the old
values without the patch and at the new ones under it. Everywhere: the refresh itself on real modules.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hwsync.patches as patches
from hwsync.patches.vllm_cpu_mamba_conv import refresh_conv_weights
from hwsync.testing import vllm_missing_reason

PATCH = patches.get("vllm_cpu_mamba_conv")


def test_probe_matches_the_installed_stack() -> None:
    result = PATCH.probe()
    if vllm_missing_reason() is not None:
        assert result.state == patches.TARGET_MISSING and "vllm" in result.reason
        return
    from vllm.platforms import current_platform

    assert result.state == (patches.APPLIES if current_platform.is_cpu() else patches.NOT_NEEDED), result


def test_refresh_copies_only_stale_conv_weights() -> None:
    class Mixer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1d = torch.nn.Module()
            weight = torch.randn(6, 1, 4)
            self.register_buffer("conv_weights", weight.view(6, 4), persistent=False)
            self.conv1d._cpu_unpacked_conv_weight = weight.view(6, 4).clone()

    model = torch.nn.Sequential(Mixer(), Mixer(), torch.nn.Linear(2, 2))
    storage = model[0].conv_weights.data_ptr()
    model[0].conv1d._cpu_unpacked_conv_weight = torch.randn(6, 4)  # what a reload unpacked
    assert refresh_conv_weights(model) == 1  # the second mixer is current: left alone
    assert torch.equal(model[0].conv_weights, model[0].conv1d._cpu_unpacked_conv_weight)
    assert model[0].conv_weights.data_ptr() == storage  # in place: the storage the forward reads
    assert refresh_conv_weights(model) == 0


@pytest.mark.vllm
def test_reload_without_and_with_the_patch(tmp_path: Path) -> None:
    from hwsync.testing import require_vllm

    require_vllm()
    if PATCH.probe().state != patches.APPLIES:
        pytest.skip(f"not affected here: {PATCH.probe().reason}")
    from hwsync.testing import close_llm, make_llm
    from hwsync.testing.families import make_family_checkpoint

    path = make_family_checkpoint(tmp_path / "granite", "granitemoehybrid")
    llm = make_llm(path, skip_tokenizer_init=True)
    try:
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        mixer = next(m for m in runner.model.modules() if "conv_weights" in m._buffers)
        if getattr(mixer.conv1d, "_cpu_unpacked_conv_weight", None) is None:
            pytest.skip("this engine did not prepack its conv weights (fp32, or no bf16 CPU support)")
        from safetensors.torch import load_file

        checkpoint = load_file(str(path / "model.safetensors"))
        name = next(n for n in checkpoint if n.endswith("0.mamba.conv1d.weight"))  # the first layer's mixer
        shape = mixer.conv1d._cpu_unpacked_conv_weight.shape
        new = torch.randn(checkpoint[name].shape, dtype=torch.bfloat16)

        def reload() -> None:
            runner.reload_weights(weights_iterator=iter([(name, new)]), is_checkpoint_format=True)

        reload()
        assert not torch.equal(mixer.conv_weights, new.view(shape)), (
            "unpatched reload updated conv_weights: stale probe?"
        )
        with PATCH:
            reload()
        assert not PATCH.active
        assert torch.equal(mixer.conv_weights, new.view(shape))
    finally:
        close_llm(llm)
