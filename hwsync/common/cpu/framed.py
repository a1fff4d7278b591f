"""The CPU data plane: plain TCP with length-checked frames and an authenticated rendezvous (:class:`FramedLink`).

Why not gloo: a gloo receive of ``n`` bytes aborts the whole process (``op.preamble.length <= op.nbytes``,
``std::terminate``) when the peer sends more, so one oversized bucket from whoever holds rank 0 killed the engine;
and gloo's rendezvous is whatever the store says, so a store client that wins rank 0 is the sender. Here:

* Rendezvous: rank 0 (the trainer) listens on the interface that reaches the store, publishes only its address
  under the group's prefix, and accepts ``world_size - 1`` connections, then stops listening. Each connection
  proves knowledge of the sync's secret both ways (``HMAC(secret, nonces, rank)``, rank 0 first); a process
  without it is dropped and can neither send a bucket nor read one. A forged address in the store makes the
  workers meet an impostor that cannot prove the secret: a refused sync, nothing applied.
* Frames: ``[8-byte length][bytes]``. A receiver reads the length first and refuses any length other than its
  buffer's (:class:`~hwsync.common.errors.SyncError`), before a byte of the body reaches memory: a bucket whose size
  disagrees with the manifest is an error, never a crash.
* Every operation is bounded by the link's deadline (one deadline for the whole sync, from ``spec.timeout_s``).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
import socket
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from hwsync.common.cpu.link import local_address
from hwsync.common.errors import SyncError
from hwsync.common.transport.base import LinkSpec

__all__ = ["FramedLink"]

_LEN = struct.Struct("<Q")
_NONCE = 32
_ADDR_KEY = "framed/addr"


def _mac(secret: bytes, *parts: bytes | str | int) -> bytes:
    h = hmac.new(secret, b"hwsync/framed-link", hashlib.sha256)
    for p in parts:
        b = p if isinstance(p, bytes) else str(p).encode()
        h.update(_LEN.pack(len(b)) + b)
    return h.digest()


class _Done:
    """A broadcast in flight. It holds its tensor, as gloo's work does: the buffer pools see the buffer as busy
    while the caller keeps this handle (:class:`hwsync.common.transport.buckets._Pool`)."""

    def __init__(self, future: Future[None], tensor: torch.Tensor) -> None:
        self.future = future
        self.tensor = tensor

    def wait(self) -> None:
        self.future.result()


class FramedLink:
    """Rank ``rank`` of a star of TCP connections around rank 0 (see the module docstring).

    Not persistent: like gloo's group it exists only during one sync, so nothing listens between syncs."""

    persistent = False

    def __init__(self, store: Any, spec: LinkSpec, rank: int, secret: bytes) -> None:
        if len(secret) < 16:
            raise SyncError("internal: the data plane needs the sync's secret to authenticate its peers")
        self.rank = rank
        self.world_size = spec.world_size
        self.device = torch.device("cpu")
        self._secret = secret
        self._deadline = time.monotonic() + spec.timeout_s
        self._timeout_s = spec.timeout_s
        self._peers: list[socket.socket] = []  # rank 0: ranks 1.. in order; others: [rank 0]
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hwsync-framed")  # one op at a time, in order
        self._lock = threading.Lock()
        key = spec.prefix + _ADDR_KEY
        self._found: dict[int, socket.socket] = {}
        if rank == 0:
            self._serve(store, key, spec)
        else:
            self._join(store, key)

    # -- rendezvous -----------------------------------------------------------------------------------------------
    def _left(self) -> float:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise SyncError(f"data plane: the sync's deadline ({self._timeout_s:g} s) passed")
        return left

    def _serve(self, store: Any, key: str, spec: LinkSpec) -> None:
        host = local_address(spec.host, spec.port)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.create_server((host, 0), family=family, backlog=64)
        try:
            store.set(key, f"{host}|{listener.getsockname()[1]}")
            found = self._found
            while len(found) < self.world_size - 1:
                listener.settimeout(self._left())
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    raise SyncError(
                        f"data plane: {self.world_size - 1 - len(found)} engine worker(s) did not join "
                        f"within {self._timeout_s:g} s"
                    ) from None
                try:
                    peer = self._prove_as_root(conn)
                except (OSError, SyncError):
                    conn.close()  # anyone without the secret: dropped, the rendezvous goes on
                    continue
                if peer in found or not 0 < peer < self.world_size:
                    conn.close()
                    continue
                found[peer] = conn
            self._peers = [found[r] for r in range(1, self.world_size)]
        except BaseException:
            for c in self._found.values():
                c.close()
            raise
        finally:
            listener.close()  # nothing listens once the group is complete

    def _prove_as_root(self, conn: socket.socket) -> int:
        conn.settimeout(min(self._left(), 10.0))
        mine = secrets.token_bytes(_NONCE)
        conn.sendall(mine)
        head = _recv_exact(conn, _NONCE + 8)
        theirs, (peer,) = head[:_NONCE], _LEN.unpack(head[_NONCE:])
        conn.sendall(_mac(self._secret, "root", mine, theirs, peer))
        if not hmac.compare_digest(_recv_exact(conn, 32), _mac(self._secret, "peer", mine, theirs, peer)):
            raise SyncError("data plane: a peer failed to prove the sync's secret")
        return int(peer)

    def _join(self, store: Any, key: str) -> None:
        import datetime

        store.wait([key], datetime.timedelta(seconds=self._left()))
        host, _, port = store.get(key).decode(errors="replace").rpartition("|")
        conn = socket.create_connection((host, int(port)), timeout=min(self._left(), 10.0))
        try:
            theirs = _recv_exact(conn, _NONCE)
            mine = secrets.token_bytes(_NONCE)
            conn.sendall(mine + _LEN.pack(self.rank))
            if not hmac.compare_digest(_recv_exact(conn, 32), _mac(self._secret, "root", theirs, mine, self.rank)):
                raise SyncError(
                    "data plane: the peer at the rendezvous address cannot prove the sync's secret (not "
                    "the trainer: someone rewrote the rendezvous store); nothing was applied"
                )
            conn.sendall(_mac(self._secret, "peer", theirs, mine, self.rank))
        except BaseException:
            conn.close()
            raise
        self._peers = [conn]

    # -- frames ---------------------------------------------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> _Done:
        if src != 0:
            raise SyncError("internal: the framed data plane broadcasts from rank 0 only")
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise SyncError("internal: the framed data plane moves contiguous CPU tensors")
        data = tensor.view(-1).view(torch.uint8) if tensor.numel() else tensor.view(torch.uint8)
        op = self._send if self.rank == 0 else self._recv
        return _Done(self._pool.submit(op, data), data)

    def _send(self, data: torch.Tensor) -> None:
        view = memoryview(data.numpy().data) if data.numel() else memoryview(b"")
        for conn in self._peers:
            conn.settimeout(self._left())
            conn.sendall(_LEN.pack(data.numel()))
            if data.numel():
                conn.sendall(view)

    def _recv(self, data: torch.Tensor) -> None:
        conn = self._peers[0]
        conn.settimeout(self._left())
        (n,) = _LEN.unpack(_recv_exact(conn, _LEN.size))
        if n != data.numel():
            self._drop()
            raise SyncError(
                f"data plane: a frame of {n} bytes arrived where this sync's manifest expects {data.numel()}"
                " (a bucket larger or smaller than its manifest): refused unread, nothing of it applied; "
                "the next sync forms a new group"
            )
        if n:
            _recv_into(conn, memoryview(data.numpy().data), self._deadline)

    def _drop(self) -> None:
        for conn in self._peers:
            with contextlib.suppress(OSError):
                conn.close()

    def close(self) -> None:
        """Close every connection (idempotent); a later sync forms a new group."""
        self._drop()
        self._peers = []
        self._pool.shutdown(wait=False, cancel_futures=True)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    got = 0
    view = memoryview(buf)
    while got < n:
        k = conn.recv_into(view[got:])
        if not k:
            raise ConnectionError("data plane: the peer closed the connection")
        got += k
    return bytes(buf)


def _recv_into(conn: socket.socket, view: memoryview, deadline: float) -> None:
    got = 0
    n = len(view)
    while got < n:
        conn.settimeout(max(deadline - time.monotonic(), 1e-3))
        k = conn.recv_into(view[got:], min(n - got, 1 << 22))
        if not k:
            raise ConnectionError("data plane: the peer closed the connection mid-frame")
        got += k
