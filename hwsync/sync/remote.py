"""Server mode: trainer and engine in different processes.

Control channel: a ``torch.distributed.TCPStore`` hosted by the engine process (:func:`serve`). Requests and replies
are small JSON documents under per-request keys, each carrying an HMAC-SHA256 over a server nonce, the request
number and the body, keyed by the shared token: the token never travels, a wrong token is refused before anything
runs, and a reply cannot be forged by another store client. (The store is not encrypted: run it on the trusted
network your collectives use anyway.)

Data plane: a standalone ``torch.distributed`` process group (gloo on CPU; one per session, rendezvous through the
same store, independent of any default group the trainer or vLLM initialised). Each bucket is packed into one
reusable flat buffer (one ``torch.cat`` per dtype run) and sent with :func:`hwsync.comm.broadcast`, preceded by a
two-int header (``[1, index]`` = data follows, ``[0, index]`` = the sender aborted), so the receiver knows at
once whether to apply, and never waits on a dead sender longer than the group timeout.

Engine side, the worker joins that group through :meth:`HwsyncWorkerExtension.hwsync_receive_dist` (``collective_rpc``),
so the receive runs where the weights live, as for multi-worker engines.
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

import hwsync.errors as errors
from hwsync.errors import SyncError
from hwsync.sync.engine import Engine, LocalEngine, ProgressFn, bucket_lists
from hwsync.sync.manifest import Manifest

__all__ = ["serve", "connect", "SyncServer", "RemoteEngine", "receive_buckets", "send_buckets", "worker_link",
           "abort_reason", "GlooLink", "pack", "unpack"]

logger = logging.getLogger("hwsync.sync")

_PREFIX = "hwsync/"
_QUEUE = _PREFIX + "requests"
_STOP = b"__hwsync_stop__"
_LISTEN = datetime.timedelta(hours=1)
DEFAULT_TIMEOUT_S = float(os.environ.get("HWSYNC_TIMEOUT_S", "600"))


def _split(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise SyncError(f"address {address!r} must be 'host:port'")
    return host or "127.0.0.1", int(port)


def _mac(token: str, *parts: object) -> str:
    msg = "|".join(str(p) for p in parts).encode()
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def _error_from(d: Mapping[str, Any]) -> Exception:
    cls = getattr(errors, str(d.get("type", "")), None)
    if not (isinstance(cls, type) and issubclass(cls, errors.HwsyncError)):
        cls = SyncError
    return cls(str(d.get("message", "remote error")))


# ---------------------------------------------------------------------------------------------------------------
# data plane
# ---------------------------------------------------------------------------------------------------------------
class GlooLink:
    """A standalone process group as the communicator :func:`hwsync.comm.broadcast` accepts."""

    def __init__(self, store: Any, prefix: str, rank: int, world_size: int, timeout_s: float) -> None:
        self.store = store
        pstore = dist.PrefixStore(prefix, store)
        self.pg = dist.ProcessGroupGloo(pstore, rank, world_size, datetime.timedelta(seconds=timeout_s))
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device("cpu")

    def broadcast(self, tensor: Tensor, src: int, stream: Any = None) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self.pg.broadcast([tensor], opts).wait()


def _use_count(buf: Tensor) -> int | None:
    count = getattr(torch._C, "_storage_Use_Count", None)  # no public API says "is anyone else holding a view?"
    return None if count is None else int(count(buf.untyped_storage()._cdata))


def _buffer(owner: dict[str, Any], nbytes: int, device: torch.device, pool_size: int = 3) -> Tensor:
    """A flat buffer from the owner's small pool, reused only while nothing else references its memory.

    The receiver's engine may keep views of a bucket past the bucket (vLLM's layer-wise reload holds a layer's
    tensors until the layer is complete; LoRA tensors wait for the last bucket; a generator chain still holds the
    previous item). Overwriting them would corrupt weights silently, so only a buffer without outside views is
    reused; in steady state two buffers alternate (receive bucket b+1 while bucket b's last views are released).
    """
    pool: list[tuple[Tensor, int | None]] = owner.setdefault("_hwsync_pool", [])
    for i, (buf, baseline) in enumerate(pool):
        if baseline is not None and _use_count(buf) == baseline and buf.numel() >= nbytes and buf.device == device:
            pool.append(pool.pop(i))  # most recently used last
            return buf
    buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
    pool.append((buf, _use_count(buf)))
    del pool[:-pool_size]  # forget the oldest; whoever still holds views keeps that memory alive
    return buf


def pack(manifest: Manifest, bucket_index: int, tensors: Sequence[Tensor], buf: Tensor) -> Tensor:
    """Pack one bucket into ``buf`` (one ``torch.cat`` per dtype run, casting to the wire dtype on the way)."""
    bucket = manifest.buckets[bucket_index]
    by_index = dict(zip(bucket.entries, tensors))
    for dtype, off, entries in bucket.runs(manifest.specs):
        n = sum(manifest.specs[i].nbytes for i in entries)
        out = buf[off : off + n].view(dtype)
        parts = [by_index[i].detach().reshape(-1) for i in entries]
        parts = [p if p.device == buf.device else p.to(buf.device) for p in parts]
        if len(parts) == 1:
            out.copy_(parts[0])
        else:
            torch.cat(parts, out=out)
    return buf[: bucket.nbytes]


def unpack(manifest: Manifest, bucket_index: int, buf: Tensor) -> list[Tensor]:
    """Views of one bucket's tensors in ``buf`` (no copies), in ``bucket.entries`` order."""
    bucket = manifest.buckets[bucket_index]
    out = []
    for i, off in zip(bucket.entries, bucket.offsets):
        spec = manifest.specs[i]
        out.append(buf[off : off + spec.nbytes].view(spec.dtype).view(spec.shape))
    return out


def send_buckets(manifest: Manifest, produce: Callable[[], Iterator[Tensor]], comm: Any, owner: dict[str, Any],
                 progress: ProgressFn | None, on_abort: Callable[[BaseException], None]) -> None:
    from hwsync.comm import broadcast

    size = max((b.nbytes for b in manifest.buckets), default=0)
    buf = _buffer(owner, size, comm.device)
    header = torch.zeros(2, dtype=torch.int64)
    lists = bucket_lists(manifest, produce, progress)
    for bucket in manifest.buckets:
        try:
            data = pack(manifest, bucket.index, next(lists), buf)
        except BaseException as e:
            on_abort(e)
            header[0], header[1] = 0, bucket.index
            broadcast(header, 0, comm)
            raise
        header[0], header[1] = 1, bucket.index
        broadcast(header, 0, comm)
        broadcast(data, 0, comm)


def receive_buckets(manifest: Manifest, comm: Any, src: int = 0, owner: dict[str, Any] | None = None,
                    abort_reason: Callable[[], str] | None = None) -> Iterator[list[Tensor]]:
    from hwsync.comm import broadcast

    owner = owner if owner is not None else {}
    size = max((b.nbytes for b in manifest.buckets), default=0)
    header = torch.zeros(2, dtype=torch.int64)
    for bucket in manifest.buckets:
        buf = _buffer(owner, size, comm.device)  # a fresh one if the engine still holds views of the last bucket
        broadcast(header, src, comm)
        if int(header[0]) != 1:
            why = abort_reason() if abort_reason else ""
            raise SyncError(f"sender aborted before bucket {bucket.index}" + (f": {why}" if why else ""))
        if int(header[1]) != bucket.index:
            raise SyncError(f"bucket {int(header[1])} arrived where {bucket.index} was expected")
        broadcast(buf[: bucket.nbytes], src, comm)
        views = unpack(manifest, bucket.index, buf)
        del buf
        yield views
        del views


def worker_link(worker: Any, link: Mapping[str, Any]) -> GlooLink:
    """The worker's end of a session's group (created once per session, reused by later syncs)."""
    links = worker.__dict__.setdefault("_hwsync_links", {})
    key = link["prefix"]
    comm = links.get(key)
    if comm is None:
        store = dist.TCPStore(link["host"], int(link["port"]), is_master=False,
                              timeout=datetime.timedelta(seconds=float(link["timeout"])))
        rank = 1 + int(getattr(worker, "rank", 0) or 0)
        comm = GlooLink(store, key, rank, int(link["world"]), float(link["timeout"]))
        links.clear()  # one live session per worker: an older sender is gone
        links[key] = comm
    return comm


def abort_reason(comm: Any, link: Mapping[str, Any]) -> Callable[[], str]:
    """Reads the sender's reason for an abort (it writes it before the abort header)."""

    def read() -> str:
        store = getattr(comm, "store", None)
        key = link.get("abort_key")
        if store is None or not key:
            return ""
        try:
            if store.check([key]):
                value = store.get(key)
                store.delete_key(key)
                return value.decode(errors="replace")
        except Exception:  # noqa: BLE001
            return ""
        return ""

    return read


# ---------------------------------------------------------------------------------------------------------------
# engine side
# ---------------------------------------------------------------------------------------------------------------
class SyncServer:
    """Serves syncs into an in-process ``vllm.LLM`` for trainers that :func:`connect` with the token."""

    def __init__(self, llm: Any, address: str, token: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not token:
            raise SyncError("serve() needs a non-empty token (a shared secret the trainer passes to connect())")
        self.engine = LocalEngine(llm)
        self.host, self.port = _split(address)
        self.token = token
        self.timeout_s = timeout_s
        self.store = dist.TCPStore(self.host, self.port, is_master=True, wait_for_workers=False,
                                   timeout=_LISTEN)
        self.port = self.store.port  # port 0 -> the one the OS picked
        self.nonce = secrets.token_hex(16)
        self.store.set(_PREFIX + "nonce", self.nonce)
        self._seen: set[str] = set()
        self._group: tuple[str, str] | None = None  # (session, store prefix) of the group the workers hold
        self._groups = 0
        self._stop = threading.Event()
        self._shutdown = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hwsync-sync-server", daemon=True)
        self._thread.start()

    @property
    def _connect_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # public, engine process
    def generate(self, prompts: Any, sampling_params: Any = None, **kwargs: Any) -> Any:
        """``LLM.generate`` serialized with syncs; refuses on a stale engine."""
        return self.engine.generate(prompts, sampling_params, **kwargs)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a trainer sent ``shutdown`` (or ``timeout``); True if it did."""
        return self._shutdown.wait(timeout)

    def close(self) -> None:
        """Stop listening (idempotent); the engine stays usable in this process."""
        if self._stop.is_set():
            return
        self._stop.set()
        # the listener thread blocks inside queue_pop on self.store: wake it through a second client (one store
        # client cannot serve two threads at once)
        waker = dist.TCPStore(self._connect_host, self.port, is_master=False, timeout=datetime.timedelta(seconds=30))
        waker.queue_push(_QUEUE, _STOP)
        self._thread.join(timeout=30)

    def __enter__(self) -> SyncServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # the loop
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                raw = self.store.queue_pop(_QUEUE, block=True)
            except Exception:  # noqa: BLE001 - the listener's long timeout expired: keep listening
                continue
            if raw == _STOP:
                break
            try:
                rid = str(json.loads(raw)["rid"])
            except (ValueError, KeyError, TypeError):
                continue
            if rid in self._seen:  # a replayed request
                continue
            self._seen.add(rid)
            self._handle(rid, raw)

    def _reply(self, n: str, body: Mapping[str, Any], kind: str = "rep") -> None:
        text = json.dumps(body)
        self.store.set(f"{_PREFIX}{kind}/{n}", json.dumps({"body": text, "mac": _mac(self.token, self.nonce, n, kind,
                                                                                       text)}))

    def _handle(self, n: str, raw: bytes) -> None:
        try:
            req = json.loads(raw)
            body = req["body"]
            if not hmac.compare_digest(str(req.get("mac", "")), _mac(self.token, self.nonce, n, "req", body)):
                logger.warning("hwsync server %s: request %s refused (wrong token)", self.address, n)
                # unsigned on purpose: the caller cannot check our MAC without the right token
                self.store.set(f"{_PREFIX}rep/{n}", json.dumps({"body": "{}", "mac": "", "refused": True}))
                return
            msg = json.loads(body)
            op, args = msg["op"], msg.get("args", {})
        except (ValueError, KeyError, TypeError) as e:
            self._reply(n, {"ok": False, "error": {"type": "SyncError", "message": f"malformed request: {e}"}})
            return
        try:
            if op == "sync":
                self._sync(n, args)
                return
            result = self._op(op, args)
            self._reply(n, {"ok": True, "result": result})
        except Exception as e:  # noqa: BLE001 - every failure goes back to the trainer
            self._reply(n, {"ok": False, "error": {"type": type(e).__name__, "message": str(e)}})

    def _group_prefix(self, session: str) -> str:
        """One data-plane group at a time: a new one when another trainer session syncs, or after a failure."""
        if self._group is None or self._group[0] != session:
            self._groups += 1
            self._group = (session, f"{_PREFIX}pg/{self._groups}/")
        return self._group[1]

    def _op(self, op: str, args: Mapping[str, Any]) -> Any:
        if op == "hello":
            return {"engine": self.engine.describe().engine, "session": secrets.token_hex(8)}
        if op == "describe":
            return self.engine._describe(list(args.get("lora_paths", ())))
        if op == "state":
            return self.engine.state()
        if op == "logprobs":
            return self.engine.logprobs([list(p) for p in args["prompts"]], int(args["max_tokens"]))
        if op == "shutdown":
            self._shutdown.set()
            return True
        raise SyncError(f"unknown operation {op!r}")

    def _sync(self, n: str, args: Mapping[str, Any]) -> None:
        manifest = Manifest.from_json(args["manifest"])
        engine = self.engine
        with engine.lock:
            engine.rpc("hwsync_prepare", manifest)  # raises -> error reply, nothing written
            link = {"host": self._connect_host, "port": self.port,
                    "prefix": self._group_prefix(args["session"]), "world": 1 + len(engine.llm.collective_rpc(_rank)),
                    "abort_key": f"{_PREFIX}abort/{n}",
                    "timeout": float(args.get("timeout", self.timeout_s))}
            self._reply(n, {"ok": True, "result": {"link": link}})
            try:
                result = engine.rpc("hwsync_receive_dist", manifest, link)
                done: dict[str, Any] = {"ok": True, "result": result}
            except Exception as e:  # noqa: BLE001
                done = {"ok": False, "error": {"type": type(e).__name__, "message": str(e)}}
                self._group = None  # the group may be mid-collective or broken: the next sync builds a fresh one
            finally:
                engine.llm.reset_prefix_cache()
            self._reply(n, done, kind="done")


def _rank(worker: Any) -> int:
    return int(getattr(worker, "rank", 0) or 0)


def serve(llm: Any, address: str, token: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> SyncServer:
    """Accept syncs into ``llm`` (in this process) from trainers holding ``token``; returns at once.

    ``address`` is ``host:port`` to listen on (``port`` 0 picks a free one: read ``server.address``).
    """
    return SyncServer(llm, address, token, timeout_s=timeout_s)


# ---------------------------------------------------------------------------------------------------------------
# trainer side
# ---------------------------------------------------------------------------------------------------------------
class RemoteEngine(Engine):
    """A handle on an engine served by :func:`serve` in another process."""

    mode = "server"

    def __init__(self, address: str, token: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__()
        self.address = address
        self.token = token
        self.timeout_s = timeout_s
        host, port = _split(address)
        try:
            self.store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as e:  # noqa: BLE001
            raise SyncError(f"cannot reach an hwsync engine at {address} ({e}); is serve() running there?") from e
        self.nonce = self.store.get(_PREFIX + "nonce").decode()
        self._client = secrets.token_hex(6)
        self._count = 0
        self._links: dict[str, GlooLink] = {}
        self._owner: dict[str, Any] = {}
        hello = self._call("hello", {})
        self.session = hello["session"]
        self.engine_name = hello["engine"]

    def _send(self, op: str, args: Mapping[str, Any]) -> str:
        self._count += 1
        rid = f"{self._client}-{self._count}"
        body = json.dumps({"op": op, "args": args})
        self.store.queue_push(_QUEUE, json.dumps({"rid": rid, "body": body,
                                                  "mac": _mac(self.token, self.nonce, rid, "req", body)}))
        return rid

    def _wait(self, n: str, kind: str = "rep") -> Any:
        key = f"{_PREFIX}{kind}/{n}"
        try:
            raw = json.loads(self.store.get(key))
        except (RuntimeError, dist.DistError) as e:
            raise SyncError(f"no reply from the engine at {self.address} within {self.timeout_s:g} s ({e})") from None
        self.store.delete_key(key)
        body = raw["body"]
        if not hmac.compare_digest(str(raw.get("mac", "")), _mac(self.token, self.nonce, n, kind, body)):
            if raw.get("refused"):
                raise SyncError(f"the engine at {self.address} refused the token: pass the token its serve() was "
                                "started with")
            raise SyncError(f"reply {n} from {self.address} fails authentication: wrong token, or another process "
                            "writes into the store")
        rep = json.loads(body)
        if not rep.get("ok"):
            raise _error_from(rep.get("error", {}))
        return rep.get("result")

    def _call(self, op: str, args: Mapping[str, Any]) -> Any:
        return self._wait(self._send(op, args))

    # Engine API
    def _describe(self, lora_paths: Sequence[str]) -> dict[str, Any]:
        return self._call("describe", {"lora_paths": list(lora_paths)})

    def state(self) -> dict[str, Any]:
        return self._call("state", {})

    def logprobs(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
        out = self._call("logprobs", {"prompts": [list(map(int, p)) for p in prompts], "max_tokens": max_tokens})
        return [(list(ids), list(vals)) for ids, vals in out]

    def shutdown(self) -> None:
        """Ask the serving process to stop waiting (``SyncServer.wait()`` returns)."""
        self._call("shutdown", {})

    def apply(self, manifest: Manifest, produce: Callable[[], Iterator[Tensor]],
              progress: ProgressFn | None) -> dict[str, Any]:
        n = self._send("sync", {"manifest": manifest.to_json(), "session": self.session, "timeout": self.timeout_s})
        link = self._wait(n)["link"]  # validation errors surface here, before any tensor travels
        comm = self._links.get(link["prefix"])
        if comm is None:
            comm = GlooLink(self.store, link["prefix"], 0, int(link["world"]), float(link["timeout"]))
            self._links = {link["prefix"]: comm}
        def on_abort(e: BaseException) -> None:
            self.store.set(link["abort_key"], f"{type(e).__name__}: {e}"[:2000])

        try:
            send_buckets(manifest, produce, comm, self._owner, progress, on_abort)
        except BaseException as e:
            try:
                self._wait(n, "done")
            except errors.HwsyncError as remote:
                raise SyncError(str(remote)) from e
            raise
        return self._wait(n, "done")


def connect(address: str, token: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> RemoteEngine:
    """A handle on the engine :func:`serve`-d at ``address``; a wrong ``token`` raises :class:`SyncError` here."""
    return RemoteEngine(address, token, timeout_s=timeout_s)
