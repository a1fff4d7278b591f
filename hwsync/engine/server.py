"""Engine side of server mode: :func:`serve` accepts syncs into a ``vllm.LLM`` running in this process.

One thread accepts connections on exactly the address given (loopback by default) and survives any error of
``accept`` (logged, retried: e.g. out of file descriptors); each connection gets a thread of its own, first for the
handshake (one deadline, at most ``4 * max_clients`` at once), then, authenticated, as one of ``max_clients`` trainers
(state per client is its connection only). A trainer idle for ``idle_s`` loses its slot (its handle reconnects by
itself); with every slot held, a new one is told the engine is busy. Requests are a small table of operations
(:attr:`SyncServer.OPS`). A sync holds the engine's lock (the same lock generation through hwsync takes) from
validation to the last bucket; its transfer timeout is the smaller of the client's and the server's.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from hwsync.common.errors import SyncError, UnsupportedSetupError, encode_error
from hwsync.common.protocol import (
    DEFAULT_TIMEOUT_S,
    HANDSHAKE_TIMEOUT_S,
    IDLE_TIMEOUT_S,
    Channel,
    IdleTimeout,
    check_token,
    group_prefix,
    refuse_busy,
    server_handshake,
    split_address,
    stretch,
    welcome,
)
from hwsync.common.target import EngineQueries, Generating
from hwsync.common.transport.base import LinkSpec
from hwsync.common.wire import Manifest
from hwsync.engine.vllm.local import local_engine

__all__ = ["SyncServer", "serve"]

logger = logging.getLogger("hwsync.server")


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to (IPv4 or IPv6) is loopback."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos)
    except (OSError, ValueError):
        return False


def _capped_timeout(asked: Any, cap: float) -> float:
    """The client's transfer timeout, capped by the server's: a stalled trainer never holds the engine longer."""
    try:
        t = float(asked)
    except (TypeError, ValueError):
        raise SyncError(f"transfer timeout {str(asked)[:40]!r} is not a number of seconds") from None
    if not t > 0:  # also NaN
        raise SyncError(f"transfer timeout must be a positive number of seconds, got {t}")
    return min(t, cap)


def _base_shapes(base: Any) -> dict[str, list[int]] | None:
    """The trainer's ``base`` names and shapes of a describe request, checked before the engine resolves them."""
    if base is None:
        return None
    if not isinstance(base, dict) or len(base) > 1 << 20:
        raise SyncError("describe: 'base' must map at most 2^20 tensor names to shapes")
    for name, shape in base.items():
        if not (
            isinstance(name, str)
            and 0 < len(name) <= 1024
            and isinstance(shape, list)
            and len(shape) <= 8
            and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in shape)
        ):
            raise SyncError(f"describe: 'base' entry {str(name)[:80]!r} is not a name with a shape of <= 8 sizes")
    return base


class ServedTarget(Protocol):
    """What :class:`SyncServer` drives: an engine handle of this process (``hwsync.engine.vllm.local.LocalEngine`` for
    an in-process ``vllm.LLM``, ``hwsync.engine.served.ServedEngine`` inside ``vllm serve``) and the lock it shares
    with generation. The first also generates (:class:`~hwsync.common.target.Generating`); inside ``vllm serve``
    generation is vLLM's HTTP routes'."""

    lock: Any

    def describe(self, lora_paths: Any = (), base: Any = None) -> Any: ...
    def state(self) -> dict[str, Any]: ...
    def prepare(self, manifest: Manifest) -> None: ...
    def receive_remote(
        self, manifest: Manifest, spec: LinkSpec, first_rank: int, secret: bytes, abort_key: str
    ) -> dict[str, Any]: ...
    def fingerprints(self, request: dict[str, Any]) -> dict[str, Any] | None: ...
    def logprobs(self, prompts: Any, max_tokens: int) -> Any: ...


class SyncServer:
    """Serves syncs into an in-process ``vllm.LLM`` for trainers that :func:`hwsync.connect` with the token."""

    def __init__(
        self,
        llm: Any,
        address: str = "127.0.0.1:0",
        token: str = "",
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_clients: int = 8,
        idle_s: float = IDLE_TIMEOUT_S,
        handshake_s: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        salt = secrets.token_bytes(16)  # fresh per server: no guess computed for another one applies here
        self._key = stretch(check_token(token), salt)
        self._salt = salt
        # the one handle of this engine (also hwsync.sync's and hwsync.generate's): its lock guards both
        # (an Engine as it is: ``trl vllm-serve``'s ServedEngine drives its workers through vLLM's engine client)
        self.engine: ServedTarget = llm if isinstance(llm, EngineQueries) else local_engine(llm)  # type: ignore[assignment]
        self.timeout_s = float(timeout_s)
        self.idle_s = float(idle_s)
        self.handshake_s = float(handshake_s)
        host, port = split_address(address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=family, backlog=16)
        self.host, self.port = host, self._sock.getsockname()[1]
        if not is_loopback(host):
            logger.warning(
                "hwsync sync server listens on %s (not loopback): anyone who reaches it may connect; "
                "only holders of the token can sync",
                self.address,
            )
        self.max_clients = max_clients
        self._slots = threading.BoundedSemaphore(max_clients)  # authenticated trainers
        self._pending = threading.BoundedSemaphore(4 * max_clients)  # handshakes in progress (handshake_s each)
        self._held: bytes | None = None  # the data-plane group the workers hold (persistent links only)
        self._stop = threading.Event()
        self._shutdown = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="hwsync-sync-server", daemon=True)
        self._thread.start()

    OPS: Mapping[str, Callable[[SyncServer, Channel, Mapping[str, Any]], Any]]

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    # -- public, engine process -----------------------------------------------------------------------------------
    def generate(self, prompts: Any, sampling_params: Any = None, **kwargs: Any) -> Any:
        """``LLM.generate`` serialized with syncs; refuses on a stale engine."""
        if not isinstance(self.engine, Generating):
            raise UnsupportedSetupError(
                "this server runs inside vLLM's API server: generate through its HTTP routes (its clients), which "
                "hwsync guards against a sync in progress"
            )
        return self.engine.generate(prompts, sampling_params, **kwargs)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a trainer sent ``shutdown`` (or ``timeout``); True if it did."""
        return self._shutdown.wait(timeout)

    def close(self) -> None:
        """Stop listening (idempotent); the engine stays usable in this process."""
        if self._stop.is_set():
            return
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout=30)

    def __enter__(self) -> SyncServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- connections ----------------------------------------------------------------------------------------------
    def _accept(self) -> None:
        failing = 0
        while not self._stop.is_set():
            try:
                conn, peer = self._sock.accept()
            except OSError as e:
                if self._stop.is_set():
                    break
                if not failing:  # once per streak: a loop of errors must not flood the log either
                    logger.error("hwsync sync server on %s: accept failed (%s); retrying", self.address, e)
                failing += 1
                time.sleep(min(1.0, 0.05 * failing))
                continue
            if failing:
                logger.warning(
                    "hwsync sync server on %s: accepting again after %d failed accepts", self.address, failing
                )
                failing = 0
            if not self._pending.acquire(blocking=False):
                logger.warning("hwsync sync server: refused %s (too many unauthenticated connections)", peer)
                refuse_busy(conn)
                continue
            try:
                threading.Thread(
                    target=self._serve_client, args=(conn, peer), daemon=True, name=f"hwsync-client-{peer}"
                ).start()
            except RuntimeError as e:  # no thread to be had: drop this connection, keep accepting
                self._pending.release()
                conn.close()
                logger.error("hwsync sync server: cannot serve %s (%s)", peer, e)

    def _serve_client(self, conn: socket.socket, peer: Any) -> None:
        try:
            channel = server_handshake(conn, self._key, self._salt, self.handshake_s)
        except Exception as e:  # noqa: BLE001 - wrong token, garbage, too slow: drop it
            logger.warning("hwsync sync server: refused a connection from %s (%s)", peer, e)
            conn.close()
            return
        finally:
            self._pending.release()
        if not self._slots.acquire(blocking=False):
            logger.warning("hwsync sync server: %s is busy (%d trainers connected)", peer, self.max_clients)
            with contextlib.suppress(OSError, SyncError):
                channel.send(
                    {
                        "busy": f"all {self.max_clients} trainer slots are held by other connections (a "
                        f"trainer idle for {self.idle_s:g} s loses its slot); retry later or close "
                        "handles you no longer use"
                    }
                )
            channel.close()
            return
        try:
            channel.send(welcome())
            while not self._stop.is_set():
                try:
                    msg = channel.recv(wait=self.idle_s)
                except IdleTimeout:
                    logger.info("hwsync sync server: closed %s, idle for %g s", peer, self.idle_s)
                    channel.send({"bye": f"idle for {self.idle_s:g} s"})  # the trainer's handle reconnects
                    break
                except (ConnectionError, OSError, SyncError) as e:  # gone, stalled mid-frame, forged, replayed
                    if not isinstance(e, ConnectionError):
                        logger.warning("hwsync sync server: dropped %s: %s", peer, e)
                    break
                op = msg.get("op")
                handler = self.OPS.get(op) if isinstance(op, str) else None
                args = msg.get("args", {})
                try:
                    if handler is None:
                        raise SyncError(f"unknown operation {str(op)[:40]!r}")
                    if not isinstance(args, dict):
                        raise SyncError("request arguments must be a JSON object")
                    reply = {"ok": True, "result": handler(self, channel, args)}
                except Exception as e:  # noqa: BLE001 - every failure goes back to the trainer
                    reply = {"ok": False, "error": encode_error(e)}
                channel.send(reply)
        except (OSError, SyncError):  # the trainer does not take its frames: this connection is done
            pass
        finally:
            channel.close()
            self._slots.release()

    # -- operations -----------------------------------------------------------------------------------------------
    def _describe(self, channel: Channel, args: Mapping[str, Any]) -> Any:
        return self.engine.describe(list(args.get("lora_paths", ())), _base_shapes(args.get("base"))).to_dict()

    def _state(self, channel: Channel, args: Mapping[str, Any]) -> Any:
        return self.engine.state()

    def _logprobs(self, channel: Channel, args: Mapping[str, Any]) -> Any:
        prompts = [[int(t) for t in p] for p in args["prompts"]]
        return self.engine.logprobs(prompts, int(args["max_tokens"]))

    def _prepare(self, channel: Channel, args: Mapping[str, Any]) -> Any:
        with self.engine.lock:
            self.engine.prepare(Manifest.from_json(args["manifest"]))
        return True

    def _fingerprints(self, channel: Channel, args: Mapping[str, Any]) -> Any:
        """Content fingerprints for :func:`hwsync.verify` (``None`` with several workers: each holds a shard)."""
        return self.engine.fingerprints(dict(args))

    def _shutdown_op(self, channel: Channel, args: Mapping[str, Any]) -> Any:
        self._shutdown.set()
        return True

    def _sync(self, channel: Channel, args: Mapping[str, Any]) -> Any:
        """Validate, say go, receive the buckets over the data plane, report (the reply to the request).

        Where the link is persistent (NCCL, HCCL) the workers keep their data-plane group between syncs; the trainer
        proposes the group it holds and a new one, and the server picks the held one only if its workers still hold
        it (no other trainer synced since, no failure closed it). gloo groups are closed after every sync."""
        manifest = Manifest.from_json(args["manifest"])
        group = args["group"]
        held = channel.open_secret("group", args["group_id"])
        fresh = channel.open_secret("new_group", args["new_group_id"])
        data_key = channel.open_secret("data", args["data_key"])
        timeout = _capped_timeout(args.get("timeout", self.timeout_s), self.timeout_s)
        first_rank, world = int(group["first_rank"]), int(group["world_size"])
        if not 1 <= first_rank < world <= 1 << 16:
            raise SyncError(
                f"data-plane group of {world} ranks with this engine at rank {first_rank}: the trainer "
                "is rank 0 and engines follow it"
            )
        with self.engine.lock:
            t0 = time.perf_counter()
            self.engine.prepare(manifest)  # raises -> error reply; nothing written, no transfer started
            t1 = time.perf_counter()
            reuse = self._held == held
            channel.send({"ok": True, "result": {"go": True, "reuse": reuse}})
            if args.get("confirm"):  # one of several engines: nothing moves until every engine said go
                reuse = self._await_commit(channel, manifest, timeout) and reuse
            gid = held if reuse else fresh
            spec = LinkSpec(
                host=str(group["host"]),
                port=int(group["port"]),
                prefix=group_prefix(gid),
                world_size=world,
                timeout_s=timeout,
            )
            self._held = None
            t2 = time.perf_counter()
            result = self.engine.receive_remote(manifest, spec, first_rank, data_key, spec.prefix + "abort")
            self._held = gid if result.pop("link_kept", False) else None
            # where the engine side's time went (the trainer's report shows it beside its own phases)
            result["engine_ms"] = {
                "validate": (t1 - t0) * 1e3,
                "receive": (time.perf_counter() - t2) * 1e3,
                "of which reset": result.pop("reset_ms", float("nan")),
                **result.pop("worker_ms", {}),
            }
            return result

    @staticmethod
    def _await_commit(channel: Channel, manifest: Manifest, timeout: float) -> bool:
        """One sync into several engines (data parallel): after saying go, wait -- engine lock held, nothing
        written -- for the trainer's verdict, sent once every engine has validated the manifest: ``commit`` (and
        whether the engines may keep their held data-plane group) or ``cancel`` (another engine refused: nothing is
        applied anywhere). No verdict within the transfer timeout, or anything else on the channel: this
        connection is dropped, nothing applied."""
        ready, _, _ = select.select([channel.sock], [], [], timeout)
        try:
            if not ready:
                raise SyncError(f"no commit within {timeout:g} s")
            msg = channel.recv()
        except (ConnectionError, OSError, SyncError) as e:
            channel.close()  # the trainer is gone or out of step: this connection is done
            raise SyncError(
                f"sync v{manifest.version}: the trainer's commit did not arrive ({e}); nothing was applied"
            ) from None
        raw = msg.get("args")
        args = raw if isinstance(raw, dict) else {}
        if msg.get("op") == "commit":
            return args.get("reuse") is True
        if msg.get("op") == "cancel":
            raise SyncError(
                f"sync v{manifest.version} cancelled by the trainer before any byte was sent "
                f"({str(args.get('reason', ''))[:500]}); nothing was applied"
            )
        channel.close()
        raise SyncError(
            f"sync v{manifest.version}: expected the trainer's commit, got {str(msg.get('op'))[:40]!r}; "
            "nothing was applied"
        )


SyncServer.OPS = {
    "describe": SyncServer._describe,
    "state": SyncServer._state,
    "logprobs": SyncServer._logprobs,
    "prepare": SyncServer._prepare,
    "fingerprints": SyncServer._fingerprints,
    "sync": SyncServer._sync,
    "shutdown": SyncServer._shutdown_op,
}


def serve(
    llm: Any,
    address: str = "127.0.0.1:0",
    token: str = "",
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    idle_s: float = IDLE_TIMEOUT_S,
) -> SyncServer:
    """Accept syncs into ``llm`` (in this process) from trainers holding ``token``; returns at once.

    ``address`` is ``host:port`` to listen on, exactly (``port`` 0 picks a free one: read ``server.address``);
    the default is loopback. Serving on another interface is logged. ``token``: a random secret of at least 32
    characters (``hwsync token`` prints one). A trainer idle for ``idle_s`` loses its slot; its handle reconnects.
    """
    return SyncServer(llm, address, token, timeout_s=timeout_s, idle_s=idle_s)
