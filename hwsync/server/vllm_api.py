"""Public face: ``vllm serve --middleware hwsync.server.vllm_api.SyncMiddleware`` (the path users pass to vLLM).

The code lives in :mod:`hwsync.integrations.vllm_serve` (the middleware, :func:`serve_args`) and
:mod:`hwsync.engine.served` (:class:`ServedEngine`, the engine host inside vLLM's API server).
"""

from hwsync.engine.served import GENERATION_ROUTES, ServedEngine
from hwsync.integrations.vllm_serve import SyncMiddleware, serve_args

__all__ = ["GENERATION_ROUTES", "ServedEngine", "SyncMiddleware", "serve_args"]
