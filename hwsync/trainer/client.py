"""Trainer side of server mode: :func:`connect` returns the :class:`RemoteEngine` handle ``hwsync.sync`` drives.

One handle may span several engines (data parallel: ``connect(["host1:p", "host2:p"], token)``): every engine
validates a sync's manifest and says go while holding its lock, and only once all of them have does the trainer
commit (one refusal: the others are cancelled, nothing is applied anywhere); then the buckets travel once, by
broadcast, to every worker of every engine (one data-plane group: the trainer at rank 0, each engine's workers after
it; tensor-parallel workers take their shards on arrival). An abort reaches every worker of every engine.
:func:`hwsync.verify` checks each engine (:meth:`RemoteEngine.parts`). The trainer hosts the group's rendezvous store,
bound to the interface it reaches the engines from; where the group meets is secret (a random id sent encrypted to each
engine), and every bucket is sealed with a fresh per-sync key (:mod:`hwsync.common.transport.seal`).
"""

from __future__ import annotations

import logging
import secrets
import select
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from hwsync.common.backend import open_link
from hwsync.common.errors import EngineBusyError, SyncError, UnsupportedSetupError, decode_error
from hwsync.common.protocol import (
    DEFAULT_TIMEOUT_S,
    Channel,
    IdleTimeout,
    check_token,
    client_handshake,
    group_prefix,
    split_address,
)
from hwsync.common.target import Engine, EngineQueries, ProgressFn
from hwsync.common.transport.base import LinkSpec
from hwsync.common.transport.buckets import bucket_lists
from hwsync.common.transport.plane import SendingEnd
from hwsync.common.wire import EngineInfo, Manifest

__all__ = ["RemoteEngine", "connect"]

logger = logging.getLogger("hwsync.server")


class _Conn:
    """The connection to one engine. Every wait for an answer is bounded by ``timeout_s``; a connection the server
    closed while idle (``bye``) is opened again before the next request."""

    def __init__(self, address: str, token: str, timeout_s: float) -> None:
        self.address = address
        self.label = ""  # "engine <address>: " in front of its errors when a handle spans several engines
        self.timeout_s = timeout_s
        self._token = token
        self.channel: Channel | None = None
        self._open()

    def _open(self) -> None:
        host, port = split_address(self.address)
        patience = time.monotonic() + min(self.timeout_s, 30.0)
        pause = 0.2
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=min(self.timeout_s, 30.0))
            except OSError as e:
                raise SyncError(
                    f"cannot reach an hwsync engine at {self.address} ({e}); is serve() running there?"
                ) from None
            try:
                self.channel = client_handshake(sock, self._token, self.address, min(self.timeout_s, 30.0))
                break
            except EngineBusyError:
                sock.close()
                if time.monotonic() + pause > patience:
                    raise
                time.sleep(pause)  # a flood of handshakes holds the slots for a few seconds at most: try again
                pause = min(2 * pause, 2.0)
            except BaseException:
                sock.close()
                raise
        self.local_host = sock.getsockname()[0]

    def _drop(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def live(self) -> Channel:
        """The channel, opened again if the server closed it: between requests the server only ever speaks to say
        so (``bye``, then EOF)."""
        ch = self.channel
        if ch is not None and select.select([ch.sock], [], [], 0)[0]:
            try:
                bye = ch.recv(wait=1.0)
            except (OSError, SyncError):
                bye = {}
            logger.info(
                "hwsync: the engine at %s closed the connection (%s); reconnecting",
                self.address,
                str(bye.get("bye", "connection closed"))[:200],
            )
            self._drop()
        if self.channel is None:
            self._open()
        assert self.channel is not None
        return self.channel

    def request(self, op: str, args: dict[str, Any], *, reopen: bool = True) -> None:
        """Send a request (``reopen``: on a fresh connection if the server closed the idle one; ``False`` inside a
        sync, whose steps belong to one connection)."""
        ch = self.live() if reopen else self.channel
        if ch is None:
            raise SyncError(f"{self.label}lost the engine at {self.address} during the sync")
        try:
            ch.send({"op": op, "args": args})
        except (OSError, SyncError) as e:
            self._drop()
            raise SyncError(f"{self.label}lost the engine at {self.address} ({e})") from None

    def reply(self, deadline: float | None = None) -> Any:
        """The answer to the last request, within ``timeout_s`` (or by ``deadline``, ``time.monotonic()``: what is
        left of the whole call's); past it the connection is closed (a late answer would be out of step) and the
        next request opens a new one."""
        ch = self.channel
        if ch is None:
            raise SyncError(f"{self.label}lost the engine at {self.address}")
        wait = self.timeout_s if deadline is None else max(deadline - time.monotonic(), 0.01)
        try:
            rep = ch.recv(wait=wait)
        except IdleTimeout:
            self._drop()
            raise SyncError(
                f"{self.label}the engine at {self.address} did not answer within {self.timeout_s:g} s "
                "(stopped, overloaded or unreachable); the connection was closed, the next call opens a "
                "new one"
            ) from None
        except (ConnectionError, OSError, SyncError) as e:
            self._drop()
            raise SyncError(f"{self.label}lost the engine at {self.address} ({e})") from None
        if "bye" in rep:  # closed as idle just as the request left: the server never read it
            self._drop()
            raise _Closed(
                f"{self.label}the engine at {self.address} closed the connection ({str(rep['bye'])[:100]}) "
                "before reading the request: nothing was done"
            )
        if not rep.get("ok"):
            error = dict(rep.get("error") or {})
            raise decode_error({**error, "message": self.label + str(error.get("message", "remote error"))})
        return rep.get("result")

    def call(self, op: str, args: dict[str, Any]) -> Any:
        self.request(op, args)
        try:
            return self.reply()
        except _Closed:
            self.request(op, args)
            return self.reply()


class _Closed(SyncError):
    """The server closed the connection before reading the request (idle): nothing was done."""


class _RemoteQueries(EngineQueries):
    """The queries of a handle on engines served by :func:`hwsync.serve`, over its connections (``conns``)."""

    mode = "server"
    conns: list[_Conn]
    _workers: list[int] | None = None
    _device_type = "cpu"

    @property
    def address(self) -> str:
        return ",".join(c.address for c in self.conns)

    # -- queries --------------------------------------------------------------------------------------------------
    def describe(self, lora_paths: Sequence[str] = (), base: Mapping[str, Sequence[int]] | None = None) -> EngineInfo:
        args: dict[str, Any] = {"lora_paths": list(lora_paths)}
        if base is not None:
            args["base"] = {str(n): [int(d) for d in s] for n, s in base.items()}
        infos = [EngineInfo.from_dict(c.call("describe", args)) for c in self.conns]
        self._workers = [i.workers for i in infos]
        first = infos[0]
        self._device_type = first.device_type
        if any(i.engine != first.engine or i.dtype != first.dtype for i in infos[1:]):
            raise UnsupportedSetupError(
                f"the engines at {self.address} serve different builds or dtypes: one sync feeds engines of one model"
            )
        return EngineInfo.from_dict(
            {
                **first.to_dict(),
                "version": max(i.version for i in infos),
                "stale": any(i.stale for i in infos),
                "base_key": first.base_key if len({i.base_key for i in infos}) == 1 else None,
                "workers": sum(i.workers for i in infos),
            }
        )

    def state(self) -> dict[str, Any]:
        states = [c.call("state", {}) for c in self.conns]
        out = dict(states[0])
        out["version"] = max(s["version"] for s in states)
        out["stale"] = any(s["stale"] for s in states)
        return out

    def logprobs(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
        """Greedy logprobs from the first engine (:func:`hwsync.verify` asks each engine through :meth:`parts`)."""
        out = self.conns[0].call(
            "logprobs", {"prompts": [list(map(int, p)) for p in prompts], "max_tokens": max_tokens}
        )
        return [(list(ids), list(vals)) for ids, vals in out]

    def fingerprints(self, request: dict[str, Any]) -> dict[str, Any] | None:
        """Content fingerprints of what the engine's kernels read (:mod:`hwsync.engine.vllm.fingerprint`), for
        :func:`hwsync.verify`; ``None`` from an engine with several workers. One engine per handle: see
        :meth:`parts`."""
        if len(self.conns) > 1:
            raise UnsupportedSetupError("fingerprints come from one engine: ask each of RemoteEngine.parts()")
        got: dict[str, Any] | None = self.conns[0].call("fingerprints", request)
        return got

    def parts(self) -> list[_RemoteQueries]:
        """One handle per engine (itself when it spans one), over the same connections and lock, for queries:
        :func:`hwsync.verify` checks every engine. They do not sync (that is this handle's job)."""
        return [self] if len(self.conns) == 1 else [_EngineView(self, conn) for conn in self.conns]


class RemoteEngine(_RemoteQueries, Engine):
    """A handle on one or more engines served by :func:`hwsync.serve` in other processes."""

    mode = "server"

    def __init__(
        self,
        addresses: str | Sequence[str],
        token: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        data_host: str | None = None,
    ) -> None:
        super().__init__()
        addrs = [addresses] if isinstance(addresses, str) else list(addresses)
        if not addrs:
            raise SyncError("connect() needs at least one engine address")
        if len(set(addrs)) != len(addrs):
            raise SyncError(f"connect() got the same engine address twice ({', '.join(addrs)}): list each engine once")
        self.timeout_s = float(timeout_s)
        check_token(token)
        self.conns = [_Conn(a, token, self.timeout_s) for a in addrs]
        if len(self.conns) > 1:
            for conn in self.conns:
                conn.label = f"engine {conn.address}: "
        self.data_host = data_host or self.conns[0].local_host
        self.plane = SendingEnd(self.data_host, self.timeout_s, open_link)
        """The trainer's end of the data plane (:mod:`hwsync.common.transport.plane`)."""
        self._workers: list[int] | None = None
        self._device_type = "cpu"
        self.last_timings: dict[str, float] = {}
        """Milliseconds of the last sync's phases: ``go`` (validated by every engine), ``stream`` (the buckets sent),
        ``reply`` (waiting for the engines' results), and the engine's own ``engine validate`` / ``engine receive``."""

    def shutdown(self) -> None:
        """Ask every serving process to stop waiting (``SyncServer.wait()`` returns)."""
        for c in self.conns:
            c.call("shutdown", {})

    def close(self) -> None:
        self.plane.close()
        for c in self.conns:
            c._drop()

    # -- the sync -------------------------------------------------------------------------------------------------
    def _device(self, info_device_type: str) -> torch.device:
        if info_device_type == "cpu":
            return torch.device("cpu")
        from hwsync.common.backend import get_backend

        backend = get_backend(info_device_type)
        return backend.current_device()

    def send(
        self, manifest: Manifest, produce: Callable[[], Iterator[Tensor]], progress: ProgressFn | None
    ) -> dict[str, Any]:
        with self.lock:
            if self._workers is None:
                self.describe()
            assert self._workers is not None
            t0 = time.perf_counter()
            deadline = time.monotonic() + self.timeout_s  # one deadline for the whole call, every wait inside it
            store = self.plane.store()
            held, fresh = self.plane.group_ids()
            data_key = secrets.token_bytes(32)
            world = 1 + sum(self._workers)
            firsts = [1 + sum(self._workers[:k]) for k in range(len(self.conns))]
            several = len(self.conns) > 1
            for conn, first in zip(self.conns, firsts):
                ch = conn.live()  # the secrets are sealed for this connection's next frame
                conn.request(
                    "sync",
                    {
                        "manifest": manifest.to_json(),
                        "group": {"host": self.data_host, "port": store.port, "world_size": world, "first_rank": first},
                        "group_id": ch.seal_secret("group", held),
                        "new_group_id": ch.seal_secret("new_group", fresh),
                        "data_key": ch.seal_secret("data", data_key),
                        "timeout": self.timeout_s,
                        "confirm": several,  # several engines: each waits for the commit below before the data plane
                    },
                    reopen=False,
                )
            answers = self._answers(deadline=deadline)
            t_go = time.perf_counter()
            refusal = next((v for ok, v in answers if not ok), None)
            if refusal is not None:
                # nothing was written anywhere: the engines that said go are cancelled (and answer that)
                self._verdict(
                    [c for c, (ok, _) in zip(self.conns, answers) if ok],
                    "cancel",
                    {"reason": str(refusal)[:500]},
                    deadline=deadline,
                )
                self.plane.drop()
                raise refusal
            reuse = all(go.get("reuse") for _, go in answers)  # every engine still holds this trainer's group
            if several:
                self._verdict(self.conns, "commit", {"reuse": reuse}, wait=False)
            group_id = held if reuse else fresh
            spec = LinkSpec(
                self.data_host, store.port, group_prefix(group_id), world, max(deadline - time.monotonic(), 0.01)
            )
            device = self._device(self._device_type)
            try:
                self.plane.stream(manifest, bucket_lists(manifest, produce, progress), spec, group_id, device, data_key)
            except BaseException as e:  # the plane published why and sent ABORT: the engines answer with it
                results = self._collect(deadline)
                self.plane.drop()
                if isinstance(results, BaseException):
                    raise SyncError(str(results)) from e
                raise
            t_sent = time.perf_counter()
            results = self._collect(deadline)
            t_end = time.perf_counter()
            self.plane.done(ok=not isinstance(results, BaseException))
            if isinstance(results, BaseException):
                raise results
            summary: dict[str, Any] = results[0]
            self.last_timings = {
                "go": (t_go - t0) * 1e3,
                "stream": (t_sent - t_go) * 1e3,
                "reply": (t_end - t_sent) * 1e3,
                **{f"engine {k}": v for k, v in (summary.get("engine_ms") or {}).items()},
            }
            return summary

    def _verdict(
        self, conns: Sequence[_Conn], op: str, args: dict[str, Any], wait: bool = True, deadline: float | None = None
    ) -> None:
        """Send ``commit`` / ``cancel`` to engines waiting after their go; ``wait``: read the (cancelled) sync's
        reply so each channel stays in step."""
        for conn in conns:
            conn.request(op, args, reopen=False)
        if wait:
            self._answers(conns, deadline)

    def _answers(self, conns: Sequence[_Conn] | None = None, deadline: float | None = None) -> list[tuple[bool, Any]]:
        """One reply from each engine, in order, by ``deadline``: ``(True, result)`` or ``(False, error)``."""
        out: list[tuple[bool, Any]] = []
        for conn in self.conns if conns is None else conns:
            try:
                out.append((True, conn.reply(deadline)))
            except BaseException as e:  # noqa: BLE001
                out.append((False, e))
        return out

    def _collect(self, deadline: float | None = None) -> list[Any] | BaseException:
        answers = self._answers(deadline=deadline)
        return next((v for ok, v in answers if not ok), None) or [v for _, v in answers]


class _EngineView(_RemoteQueries):
    """One engine of a :class:`RemoteEngine` that spans several (:meth:`RemoteEngine.parts`): queries only."""

    def __init__(self, parent: _RemoteQueries, conn: _Conn) -> None:  # shares the parent's connection
        super().__init__()
        self.lock, self.plans = parent.lock, parent.plans  # the trainer's plans hold for every engine alike
        self.conns = [conn]


def connect(
    address: str | Sequence[str], token: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, data_host: str | None = None
) -> RemoteEngine:
    """A handle on the engine(s) :func:`hwsync.serve`-d at ``address`` (several: data-parallel engines fed by one
    broadcast); a wrong ``token`` raises :class:`~hwsync.common.errors.SyncError` here (the engine proves the token
    first). Every answer is awaited at most ``timeout_s``; a connection the engine closed as idle is opened again by the
    next call. ``data_host`` is the interface the engines reach this trainer on for the data plane (default: the one
    this process reaches the first engine from).
    """
    return RemoteEngine(address, token, timeout_s=timeout_s, data_host=data_host)
