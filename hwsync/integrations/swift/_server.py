"""Server mode: hwsync's sync server inside ``swift rollout``, the GRPO trainer connects to it.

``swift rollout`` keeps its HTTP routes for generation; weights no longer travel through them (they broadcast with
PyNccl, which vLLM's CPU build silently disables). Instead, once ``swift rollout`` has built its engine, hwsync
serves syncs into it (:func:`hwsync.serve`: an authenticated control channel, tensors over a gloo / NCCL
group, manifest validated before any write) on ``HWSYNC_SERVER``, and the trainer reaches it with
:func:`hwsync.connect` and the shared ``HWSYNC_TOKEN``. ms-swift hands plugins no reference to the engine it
builds, so the patch ``swift_rollout_serve`` (``hwsync/patches/swift_rollout.py``) calls :func:`serve_rollout_engine`
right after ``SwiftRolloutDeploy.get_infer_engine``.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from swift.utils import get_logger

from hwsync.common.errors import UnsupportedSetupError
from hwsync.integrations.swift._engine_view import LLMEngineView
from hwsync.integrations.swift._options import ENV, SWIFT_SERVER, SwiftOptions

__all__ = [
    "SWIFT_WEIGHT_METHODS",
    "close_weight_routes",
    "connect_to_rollout_engine",
    "guard_generation",
    "keep_engine_in_process",
    "rollout_address",
    "serve_rollout_engine",
]

logger = get_logger()

_servers: list[Any] = []  # the sync servers of this process (kept alive with it)


_IN_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"


def keep_engine_in_process() -> None:
    """Before ``swift rollout`` builds its engine: keep vLLM's engine core in the rollout worker when hwsync serves it.

    hwsync's server writes into the model of the process it runs in; vLLM (on GPUs, by default) would move the
    engine core, and with it the model, into a child process out of reach. Unset -> set to 0 (logged); set to 1
    -> one error before the engine is built."""
    if SwiftOptions.from_env().server is None:
        return
    value = os.environ.get(_IN_PROCESS)
    if value is None:
        os.environ[_IN_PROCESS] = "0"
        logger.info(f"hwsync: {_IN_PROCESS}=0 for swift rollout's engine (hwsync serves syncs into it in-process)")
    elif value.strip() != "0":  # vLLM reads it as bool(int(value))
        raise UnsupportedSetupError(
            f"{ENV['server']} is set, so hwsync serves syncs into swift rollout's engine from its worker process, "
            f"but {_IN_PROCESS}={value} moves vLLM's engine core (and the model) into a child process: unset "
            f"{_IN_PROCESS} or set it to 0 for `swift rollout`"
        )


def serve_rollout_engine(engine: Any, data_parallel_size: int | None = None) -> Any:
    """Serve hwsync syncs into ``swift rollout``'s engine when ``HWSYNC_SERVER`` is set; returns the server or None.

    ``swift rollout --vllm_data_parallel_size N`` builds N engines, one per worker process (``SWIFT_ROLLOUT_DP_RANK``
    = k): ``HWSYNC_SERVER`` then lists N addresses and engine k serves on the k-th (``data_parallel_size``: N, from
    swift's arguments, checked against the list)."""
    opts = SwiftOptions.from_env()
    if opts.server is None:
        return None
    _, token = opts.server_credentials(*SWIFT_SERVER)
    dp_rank = int(os.environ.get("SWIFT_ROLLOUT_DP_RANK", "0") or 0)
    dp_size = max(data_parallel_size or 1, dp_rank + 1)
    address = rollout_address(opts, dp_rank, dp_size)
    llm_engine = getattr(engine, "engine", None)
    if not hasattr(llm_engine, "model_executor"):
        raise UnsupportedSetupError(
            f"hwsync serves syncs into swift rollout's in-process LLMEngine, but this one is a "
            f"{type(llm_engine).__name__}: drop --vllm_use_async_engine, and run the engine in the rollout worker "
            f"({_IN_PROCESS}=0)"
        )
    from hwsync.engine.server import serve

    server = serve(LLMEngineView.of(llm_engine), address, token)
    _servers.append(server)
    guard_generation(engine, server.engine)
    close_weight_routes(llm_engine, server.address)
    logger.info(
        f"hwsync: serving weight syncs into swift rollout's engine on {server.address}"
        + (f" (data-parallel engine {dp_rank} of {dp_size})" if dp_size > 1 else "")
    )
    return server


def rollout_address(opts: SwiftOptions, dp_rank: int, dp_size: int) -> str:
    """Where data-parallel engine ``dp_rank`` of ``dp_size`` serves: the ``dp_rank``-th of ``HWSYNC_SERVER``'s
    addresses, which must be one per engine."""
    addresses = opts.servers
    if len(addresses) != dp_size:
        raise UnsupportedSetupError(
            f"{ENV['server']} lists {len(addresses)} address(es), but swift rollout runs {dp_size} data-parallel "
            f"engine(s) (--vllm_data_parallel_size): list one host:port per engine, comma-separated (engine k serves "
            f"on the k-th), and give swift rlhf the same list"
        )
    return addresses[dp_rank]


def guard_generation(engine: Any, handle: Any) -> None:
    """Make ``swift rollout``'s generation (every route ends in ``engine.infer``) take the engine's one lock and
    refuse while the engine is stale: no rollout is computed from a half-written engine."""
    original = engine.infer
    if getattr(original, "_hwsync_guarded", False):
        return

    @functools.wraps(original)
    def infer(*args: Any, **kwargs: Any) -> Any:
        with handle.lock:  # waits for a sync in progress
            handle.check_servable()  # StaleEngineError while an interrupted sync left weights half-written
            return original(*args, **kwargs)

    infer._hwsync_guarded = True  # type: ignore[attr-defined]
    engine.infer = infer


SWIFT_WEIGHT_METHODS = frozenset(
    {
        "update_named_param",
        "update_adapter_flattened_param",
        "update_adapter_param",
        "update_flattened_params",
        "process_weights_after_loading",
        "update_weights_from_ipc",
    }
)
"""The methods of ms-swift's ``WeightSyncWorkerExtension`` that write weights, reached from ``swift rollout``'s weight
routes (``/update_flattened_params/``, ...) through ``collective_rpc``: no token, no lock, no stale flag.

``init_communicator`` (and ``close_communicator``) stay ms-swift's: its GRPO trainer opens the communicator while it
parses its arguments (``RLHFArguments._init_external_vllm``), before ``--external_plugins`` are imported, and would
wait 300 s for an engine that refused to join. The group it opens carries nothing while hwsync serves."""


def close_weight_routes(llm_engine: Any, address: str) -> None:
    """While hwsync serves this engine, ``swift rollout``'s own weight-writing routes end in one error each: the
    engine's ``collective_rpc`` refuses :data:`SWIFT_WEIGHT_METHODS` (ms-swift's worker loop logs it). hwsync's
    trainer never calls them."""
    original = llm_engine.collective_rpc
    if getattr(original, "_hwsync_closed", False):
        return

    @functools.wraps(original)
    def collective_rpc(method: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(method, str) and method in SWIFT_WEIGHT_METHODS:
            raise UnsupportedSetupError(
                f"swift rollout's weight route '{method}' is closed: hwsync serves this engine's weights (only "
                f"through its authenticated sync server on {address}, {ENV['server']}); sync with swift rlhf and the "
                "hwsync plugin, or unset HWSYNC_SERVER to use ms-swift's own routes"
            )
        return original(method, *args, **kwargs)

    collective_rpc._hwsync_closed = True  # type: ignore[attr-defined]
    llm_engine.collective_rpc = collective_rpc


def connect_to_rollout_engine(opts: SwiftOptions) -> Any:
    """The trainer's handle on the engine(s) served by :func:`serve_rollout_engine` (``HWSYNC_SERVER`` /
    ``_TOKEN``): every data-parallel engine, fed by one broadcast per sync."""
    _, token = opts.server_credentials(*SWIFT_SERVER)
    from hwsync.trainer.client import connect

    return connect(opts.servers, token)
