"""The engine host inside vLLM's OpenAI-compatible server (``vllm serve``, which ``trl vllm-serve`` runs):
:class:`ServedEngine`, the surface :class:`~hwsync.engine.server.SyncServer` drives over vLLM's async engine
client. The middleware that starts it and the flags that put it in the
server are :mod:`hwsync.integrations.vllm_serve`; users name them through the public face
:mod:`hwsync.server.vllm_api`.

Two of vLLM's own extension points, no patch (:func:`hwsync.integrations.vllm_serve.serve_args` prints the flags):

* ``--worker-extension-cls hwsync.vllm.HwsyncWorkerExtension``: every worker gets hwsync's receiver functions,
  callable by name through ``collective_rpc``;
* ``--middleware hwsync.server.vllm_api.SyncMiddleware``: in the API server process, where ``app.state`` holds the
  engine client, the middleware starts :class:`~hwsync.engine.server.SyncServer` on ``HWSYNC_SERVER`` (token
  ``HWSYNC_TOKEN``) over :class:`ServedEngine`, and guards the generation routes.

Why this process: vLLM runs the engine core (and its workers) in child processes reached only through the engine
client; ``collective_rpc`` there executes between the engine core's scheduling steps, so a sync never interleaves
with a forward pass, and it reaches every worker of a tensor-parallel engine, each joining the data plane to receive
its buckets. The control channel is hwsync's (authenticated, every frame MACed, buckets sealed): vLLM's HTTP
weight routes are left alone. The trainer connects with :func:`hwsync.connect` as to any hwsync server.

After a sync that installed an adapter, the API server serves it under hwsync's adapter name (``"model":
"hwsync"`` in a request; :data:`hwsync.engine.vllm.applier.LORA_NAME`), registered with vLLM's model registry without a
load from disk (the adapter lives in the workers' memory). While a sync runs, generation requests get 503 (TRL's
client retries); after a sync failed half-way (the engine stale), 409 with the reason until a complete sync lands.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from hwsync.common.errors import SyncError, UnsupportedSetupError, decode_error
from hwsync.common.target import EngineQueries
from hwsync.common.transport.base import LinkSpec
from hwsync.common.wire import EngineInfo, Manifest

__all__ = ["GENERATION_ROUTES", "ServedEngine"]

logger = logging.getLogger("hwsync.server")

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/inference/", "/generate")
"""Path prefixes of vLLM's generation routes: the ones held while a sync runs or the engine is stale."""

_ids = itertools.count()


class ServedEngine(EngineQueries):
    """The engine-process surface :class:`SyncServer` drives, over vLLM's async engine client: it receives syncs and
    answers queries; generation is vLLM's HTTP routes' (:data:`GENERATION_ROUTES`).

    Calls run as coroutines on the API server's event loop (:meth:`_run`, from the sync server's threads) and reach
    the workers as ``collective_rpc("hwsync_call", ...)`` (:class:`hwsync.vllm.HwsyncWorkerExtension`)."""

    mode = "server"

    def __init__(self, engine_client: Any, loop: asyncio.AbstractEventLoop, models: Any = None) -> None:
        super().__init__()
        self.client = engine_client
        self.loop = loop
        self.models = models  # vLLM's OpenAIServingModels: where the adapter's name is registered
        self.syncing = threading.Event()
        self.stale_reason: str | None = None
        parallel = engine_client.vllm_config.parallel_config
        # Limitation L10 (docs/limitations.md): one engine per `vllm serve`
        if parallel.data_parallel_size > 1:
            raise UnsupportedSetupError(
                f"hwsync's sync server in `vllm serve` drives one engine; this server runs "
                f"{parallel.data_parallel_size} data-parallel engines: run one `vllm serve` per engine, each with its "
                "own HWSYNC_SERVER address, and hwsync.connect([...]) to all of them"
            )
        if engine_client.vllm_config.lora_config is None:
            logger.warning(
                "hwsync: this vLLM server serves no LoRA (no --enable-lora): syncs will send merged "
                "weights (strategy full)"
            )

    # -- plumbing -------------------------------------------------------------------------------------------------
    def _run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def _rpc_all(self, name: str, *args: Any) -> list[Any]:
        """``hwsync.engine.vllm.worker.<name>(worker, *args)`` on every worker, replies in rank order; the first failure
        raised with its hwsync type once every worker answered."""
        replies = self._run(self.client.collective_rpc("hwsync_call", args=(name, *args)))
        for status, value in replies:
            if status != "ok":
                raise decode_error(value)
        return [value for _, value in replies]

    # -- queries ---------------------------------------------------------------------------------------------------
    def describe(self, lora_paths: Sequence[str] = (), base: Mapping[str, Sequence[int]] | None = None) -> EngineInfo:
        shapes = None if base is None else {str(n): [int(d) for d in s] for n, s in base.items()}
        return EngineInfo.from_dict(self._rpc_all("describe", list(lora_paths), shapes)[0])

    def state(self) -> dict[str, Any]:
        return self._rpc_all("state")[0]

    def prepare(self, manifest: Manifest) -> None:
        self._rpc_all("prepare", manifest.to_json())

    def receive_remote(
        self, manifest: Manifest, spec: LinkSpec, first_rank: int, secret: bytes, abort_key: str
    ) -> dict[str, Any]:
        """Every worker joins the data plane and receives its buckets (inside the engine core's loop, between
        scheduling steps); then the API server learns which adapter to serve, or that the engine is stale."""
        with self._syncing():
            try:
                results = self._rpc_all(
                    "receive_remote", manifest.to_json(), dict(spec.__dict__), first_rank, secret, abort_key
                )
            except BaseException as e:
                try:
                    state = self.state()
                except Exception:  # noqa: BLE001 - the engine cannot even say: refuse generation
                    state = {"stale": True, "last_error": str(e)}
                self.stale_reason = (state.get("last_error") or str(e)) if state.get("stale") else None
                raise
            self.stale_reason = None
            self._reset_or_stale(manifest)
            self._serve_adapter(self.state())
            return results[0]

    def _reset_or_stale(self, manifest: Manifest) -> None:
        """vLLM's prefix cache holds KV computed with the old weights: reset it before the sync counts as done. A
        reset that fails in any way (declined, raised, interrupted) leaves the engine stale and keeps its error,
        as the colocated handle does (:meth:`hwsync.engine.vllm.local.LocalEngine.committed`)."""
        try:
            self.reset_cache()
        except BaseException as e:
            reason = (
                f"sync v{manifest.version} wrote the weights but vLLM's prefix-cache reset failed "
                f"({type(e).__name__}: {e}), so cached KV of the old weights could mix in"
            )
            with contextlib.suppress(Exception):  # the API server refuses generation through stale_reason anyway
                self._rpc_all("mark_stale", reason)
            self.stale_reason = reason
            raise

    def fingerprints(self, request: dict[str, Any]) -> dict[str, Any] | None:
        with self.lock:
            results = self._rpc_all("fingerprints", request)
        return results[0] if len(results) == 1 else None

    def reset_cache(self) -> None:
        if not self._run(self.client.reset_prefix_cache()) and not self._run(
            self.client.reset_prefix_cache(reset_running_requests=True)
        ):
            raise SyncError(
                "the weights were written but vLLM could not reset its prefix cache even after "
                "preempting its running requests: do not serve from this engine"
            )

    def logprobs(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
        from hwsync.engine.vllm.outputs import engine_logprobs

        with self.lock:
            self.check_servable()
            lora = self.lora_request
            return [engine_logprobs(self._run(self._final(list(p), max_tokens, lora))) for p in prompts]

    async def _final(self, ids: list[int], max_tokens: int, lora: Any) -> Any:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, prompt_logprobs=0, detokenize=False)
        last = None
        async for out in self.client.generate(
            {"prompt_token_ids": ids}, params, f"hwsync-check-{next(_ids)}", lora_request=lora
        ):
            last = out
        return last

    # -- the API server's side ------------------------------------------------------------------------------------
    @contextmanager
    def _syncing(self) -> Iterator[None]:
        self.syncing.set()
        try:
            yield
        finally:
            self.syncing.clear()

    def _serve_adapter(self, state: Mapping[str, Any]) -> None:
        """Register the adapter hwsync installed under its name in vLLM's model registry (in memory: the workers
        hold it under that id already, so vLLM's ``add_lora`` for it would be a no-op); drop it when a full sync
        left none."""
        if self.models is None:
            return
        from vllm.lora.request import LoRARequest

        requests = self.models.lora_requests
        for name in [n for n, r in requests.items() if str(r.lora_path).startswith("hwsync-in-memory://")]:
            requests.pop(name)
        if state.get("lora_int_id") is not None:
            name = state["lora_name"]
            requests[name] = LoRARequest(name, state["lora_int_id"], f"hwsync-in-memory://{name}")

    def refusal(self) -> tuple[int, str] | None:
        """Why a generation request must wait (503) or fail (409) now; ``None`` when it may run."""
        if self.syncing.is_set():
            return 503, "hwsync: a weight sync is in progress; retry"
        if self.stale_reason is not None:
            return 409, (
                f"hwsync: the engine is stale ({self.stale_reason}): an interrupted sync left part of the "
                "weights written; run a complete hwsync.sync before generating"
            )
        return None
