"""hwsync's sync server inside ``vllm serve`` (and ``trl vllm-serve``): :func:`serve_args` (the flags) and
:class:`SyncMiddleware` (the ASGI middleware that starts the server on ``HWSYNC_SERVER`` with the app and holds
generation while a sync runs). The engine host it starts is :class:`hwsync.engine.served.ServedEngine`; users
name both through the public face :mod:`hwsync.server.vllm_api`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Mapping
from typing import Any

from hwsync.common.errors import OptionError
from hwsync.engine.served import GENERATION_ROUTES, ServedEngine

__all__ = ["MIDDLEWARE", "EXTENSION", "WEIGHT_ROUTES", "SyncMiddleware", "serve_args"]

logger = logging.getLogger("hwsync.server")

MIDDLEWARE = "hwsync.server.vllm_api.SyncMiddleware"
EXTENSION = "hwsync.vllm.HwsyncWorkerExtension"

WEIGHT_ROUTES = (
    "/init_weight_transfer_engine",
    "/shutdown_weight_transfer_engine",
    "/start_weight_update",
    "/start_draft_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/update_weight_version",
    "/weight_checker",
    "/collective_rpc",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
)
"""vLLM's routes that write the engine's weights, adapters or weight version behind hwsync (dev mode's weight
transfer, checker reset and ``collective_rpc``; runtime LoRA loading): unauthenticated, and a second writer would
leave hwsync's version, stale flag and checks describing weights the engine no longer holds. Closed while hwsync's
server serves the engine (``HWSYNC_VLLM_WEIGHT_ROUTES=open`` leaves them to vLLM)."""


def serve_args(max_lora_rank: int = 8) -> list[str]:
    """The ``vllm serve`` flags that put hwsync's sync server in the server (``trl vllm-serve ... <these>``):
    LoRA serving up to ``max_lora_rank``, hwsync's worker functions, the middleware. Both processes also need
    ``HWSYNC_SERVER`` / ``HWSYNC_TOKEN`` in their environment."""
    return [
        "--enable-lora",
        "--max-lora-rank",
        str(int(max_lora_rank)),
        "--max-loras",
        "1",
        "--worker-extension-cls",
        EXTENSION,
        "--middleware",
        MIDDLEWARE,
    ]


class SyncMiddleware:
    """ASGI middleware (``vllm serve --middleware hwsync.server.vllm_api.SyncMiddleware``): starts hwsync's sync
    server with the app (``HWSYNC_SERVER`` / ``HWSYNC_TOKEN``), holds generation while a sync runs or after one
    failed half-way, and closes vLLM's own weight routes (:data:`WEIGHT_ROUTES`) while hwsync serves the engine."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.engine: ServedEngine | None = None
        self.server: Any = None
        self._lock = threading.Lock()
        self.routes_closed = _routes_closed()

    async def __call__(self, scope: Mapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] in ("lifespan", "http") and self.server is None:
            self._start(scope["app"])  # at startup (or the first request where the server runs no lifespan)
        if scope["type"] == "http" and self.engine is not None:
            path = str(scope.get("path", ""))
            route = path.rstrip("/")
            if self.routes_closed and route in WEIGHT_ROUTES:
                await _reply(
                    send,
                    403,
                    f"{route} is closed: hwsync serves this engine's weights (HWSYNC_SERVER), and vLLM's weight "
                    "routes are unauthenticated and would write behind hwsync's version and checks. Sync through "
                    "hwsync.connect(...) with the token, or start the server with HWSYNC_VLLM_WEIGHT_ROUTES=open",
                )
                return
            if path.startswith(GENERATION_ROUTES):
                refused = self.engine.refusal()
                if refused is not None:
                    await _reply(send, *refused)
                    return
        await self.app(scope, receive, send)

    def _start(self, app: Any) -> None:
        from hwsync.engine.server import serve
        from hwsync.integrations.options import SyncOptions

        with self._lock:
            if self.server is not None:
                return
            state = app.state
            opts = SyncOptions.server_from_env()  # the engine process: nothing of the trainer's side loaded
            address, token = opts.server_credentials(
                "hwsync's middleware in `vllm serve`", "the vLLM server and the trainer", "vLLM's --port"
            )
            if len(opts.servers) != 1:
                raise OptionError(
                    f"{opts.server!r}: one vLLM server serves one engine, so HWSYNC_SERVER names one "
                    "host:port here (the trainer lists one per server)"
                )
            self.engine = ServedEngine(
                state.engine_client, asyncio.get_running_loop(), getattr(state, "openai_serving_models", None)
            )
            self.server = serve(self.engine, address, token)
            logger.info("hwsync: serving weight syncs into this vLLM server's engine on %s", self.server.address)


def _routes_closed() -> bool:
    from hwsync.common.config import read

    value = str(read("HWSYNC_VLLM_WEIGHT_ROUTES")).lower()
    if value not in ("closed", "open"):
        raise OptionError(f"HWSYNC_VLLM_WEIGHT_ROUTES={value!r}: expected 'closed' (the default) or 'open'")
    return value == "closed"


async def _reply(send: Any, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "HwsyncSync", "code": status}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
