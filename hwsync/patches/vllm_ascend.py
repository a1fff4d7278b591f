"""vllm-ascend: keep MoE expert weights loadable across post-load processing and sleep / wake-up.

The layout knowledge lives in :mod:`hwsync.common.npu.ascend_layouts`; this module only wires it around

* ``AscendUnquantizedFusedMoEMethod.process_weights_after_loading`` (``vllm_ascend.ops.fused_moe.routed_experts``
  on main, ``vllm_ascend.ops.fused_moe.fused_moe`` in releases 0.13 .. 0.25), which transposes the experts to the
  processed layout and (in releases) drops their ``weight_loader`` -- afterwards the Parameters carry a loader that
  writes the processed layout; on experts hwsync marked processed it is skipped (it would transpose them twice);
* ``NPUWorker.wake_up``, which (0.13 .. 0.23) transposes them back guessing from shapes and drops the loaders
  again -- afterwards the Parameters it replaced are put back (processed experts stay processed and loadable).

Tested against the released functions of vllm-ascend 0.23.0.post1 on a vLLM CPU engine
(``tests/test_vllm_ascend_released_code_on_cpu.py``); never run on an Ascend NPU.
"""

from __future__ import annotations

import functools
from typing import Any

from ._base import APPLIES, Patch, ProbeResult, register

__all__ = ["VllmAscendPatch"]

_PROCESS = (
    "vllm_ascend.ops.fused_moe.routed_experts:AscendUnquantizedFusedMoEMethod.process_weights_after_loading",
    "vllm_ascend.ops.fused_moe.fused_moe:AscendUnquantizedFusedMoEMethod.process_weights_after_loading",
)
_WAKE_UP = "vllm_ascend.worker.worker:NPUWorker.wake_up"


class VllmAscendPatch(Patch):
    name = "vllm_ascend"
    targets = (_PROCESS, _WAKE_UP)
    upstream = "https://github.com/vllm-project/vllm-ascend/blob/v0.23.0/vllm_ascend/ops/fused_moe/fused_moe.py"
    seen_in = (
        "vllm-ascend 0.13.0 .. 0.25.1rc1 (new Parameter without weight_loader)",
        "vllm-ascend main 2026-11 (loader kept, but writes checkpoint orientation into processed storage)",
    )
    remove_when = (
        "vllm-ascend's processed experts carry a layout-aware weight_loader and wake_up no longer "
        "guesses layouts from shapes"
    )

    def check(self) -> ProbeResult:
        import vllm_ascend

        version = getattr(vllm_ascend, "__version__", "unknown")
        return ProbeResult(
            APPLIES,
            f"vllm-ascend {version}: processed experts have no layout-aware weight_loader "
            "in any known release (version range; no NPU-free behavioural probe)",
        )

    def replacement(self, original: Any, target: str) -> Any:
        if target == _WAKE_UP:
            return _wake_up(original)
        return _process_weights_after_loading(original)


def _process_weights_after_loading(original: Any) -> Any:
    @functools.wraps(original)
    def process_weights_after_loading(method: Any, layer: Any, *args: Any, **kwargs: Any) -> Any:
        from hwsync.common.npu import ascend_layouts

        snapshot = ascend_layouts.before_process_weights(layer)
        if snapshot is None:  # processed already, and written since in the processed layout
            return None
        result = original(method, layer, *args, **kwargs)
        ascend_layouts.after_process_weights(snapshot)
        return result

    return process_weights_after_loading


def _wake_up(original: Any) -> Any:
    @functools.wraps(original)
    def wake_up(worker: Any, tags: list[str] | None = None) -> Any:
        from hwsync.common.npu import ascend_layouts

        snapshots = ascend_layouts.before_wake_up(worker.model_runner.model)
        result = original(worker, tags)
        ascend_layouts.after_wake_up(snapshots)
        return result

    return wake_up


register(VllmAscendPatch())
