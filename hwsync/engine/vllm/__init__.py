"""Everything hwsync does inside vLLM (the hwsync package that imports vLLM; the few other modules that do, each
with its reason, are listed in docs/architecture.md, "Import direction", and checked by tests/test_layering.py).

* :mod:`hwsync.engine.vllm.local`     -- :class:`LocalEngine`, the handle on an in-process ``vllm.LLM`` (colocate)
* :mod:`hwsync.engine.vllm.worker`    -- the functions that run in each worker (``collective_rpc``)
* :mod:`hwsync.engine.vllm.extension` -- the same functions by name, as vLLM's ``worker_extension_cls``
* :mod:`hwsync.engine.vllm.applier`   -- how one worker takes base weights and adapters
* :mod:`hwsync.engine.vllm.dry_run`   -- manifest validation through the model's own loaders, writing nothing
"""

from __future__ import annotations

from hwsync.engine.vllm.extension import HwsyncWorkerExtension

__all__ = ["HwsyncWorkerExtension"]
