"""Public face: ``worker_extension_cls="hwsync.vllm.HwsyncWorkerExtension"`` (the path users pass to vLLM).

The code lives in :mod:`hwsync.engine.vllm`.
"""

from hwsync.engine.vllm.extension import HwsyncWorkerExtension

__all__ = ["HwsyncWorkerExtension"]
