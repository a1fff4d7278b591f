"""The control channel of server mode: authenticated, ordered messages over one TCP connection.

Threat model: anyone who can reach the engine's port may connect and send bytes; nobody without the shared token may
make the engine do anything, learn where the data plane meets, or feed it weights. (The channel is authenticated,
not encrypted: run it on the network your collectives use anyway.)

* Token: a random secret of at least 32 characters (:func:`hwsync.common.tokens.check_token`; ``hwsync token`` makes
  one). Neither side ever sends it or a plain MAC of it: both prove knowledge of ``scrypt(token, salt)``, the salt
  drawn fresh by each server, so one recorded or provoked proof costs an offline guesser a scrypt per guess (tens of
  milliseconds) instead of one HMAC (~300k per second and core).
* Handshake, the server proving first: server hello (salt, nonce), client nonce, the server's proof over both nonces,
  then the client's; the client sends nothing derived from the token to a peer that has not proven it knows it. The
  whole handshake has one deadline (:data:`HANDSHAKE_TIMEOUT_S`), however slowly the bytes trickle in. An
  authenticated connection then gets one frame, ``welcome`` or ``busy`` (every trainer slot held); the welcome names
  the server's :data:`WIRE` and hwsync version, and a client of another wire refuses it before any request.
* Frames: ``[4-byte length][32-byte MAC][JSON body]``, ``MAC = HMAC(session_key, direction, sequence, body)``. The
  MAC is checked before the body is even parsed, sequence numbers make replays and reorderings fail, a frame larger
  than :data:`MAX_FRAME` is refused before it is read, and one whose first byte arrived must be complete within
  :data:`FRAME_TIMEOUT_S`. Sockets keep TCP keepalive on, so a peer that vanished is noticed while waiting.
* Secrets for one sync (the data-plane group id and the bucket-sealing key) travel encrypted under the session key,
  so reading the traffic does not tell where to join.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import json
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

from hwsync.common.config import read
from hwsync.common.errors import EngineBusyError, SyncError
from hwsync.common.tokens import MIN_TOKEN_CHARS, check_token, new_token
from hwsync.common.version import __version__

__all__ = [
    "WIRE",
    "Channel",
    "DEFAULT_TIMEOUT_S",
    "FRAME_TIMEOUT_S",
    "HANDSHAKE_TIMEOUT_S",
    "IDLE_TIMEOUT_S",
    "IdleTimeout",
    "MAX_FRAME",
    "MIN_TOKEN_CHARS",
    "check_token",
    "client_handshake",
    "group_prefix",
    "new_token",
    "refuse_busy",
    "server_handshake",
    "split_address",
    "stretch",
]

DEFAULT_TIMEOUT_S = float(read("HWSYNC_TIMEOUT_S"))
"""Longest a data-plane transfer may stall, and a trainer waits for any answer, before giving up (the server caps what
clients ask for)."""
MAX_FRAME = 256 << 20
"""Largest control message (a manifest of ~10^6 tensors fits); bigger frames are refused unread."""
HANDSHAKE_TIMEOUT_S = 10.0
"""Deadline of a whole handshake, from the connection's accept to its last byte."""
FRAME_TIMEOUT_S = 60.0
"""Deadline of the rest of a frame once its first byte arrived (and of sending one): 256 MB at ~4.5 MB/s."""
IDLE_TIMEOUT_S = 300.0
"""An authenticated trainer that sends nothing for this long loses its slot (its handle reconnects by itself)."""
_LEN = struct.Struct("<I")
_MAC_BYTES = 32
_NONCE_BYTES = 32
_SALT_BYTES = 16
_HELLO = b"HWS2"  # server hello of this protocol (the first one, before the server proved first, was HWSY)
_BUSY = b"HWSB"  # server hello when every handshake slot is taken (a flood): retry shortly
_CLIENT = b"HWC2"

_SCRYPT = {"n": 1 << 14, "r": 8, "p": 1, "maxmem": 64 << 20, "dklen": 32}  # ~16 MiB and tens of ms per guess

WIRE = 2
"""The shape of every JSON form that crosses the control channel (:mod:`hwsync.common.wire`: manifest, engine
description, state). Bumped whenever one changes (2: the engine describes its LoRA layout, ``EngineInfo.lora_layout``,
not ``moe_format``), so a trainer and an engine of different hwsync releases refuse each other at the handshake with
both versions named, instead of misreading a field."""


def welcome() -> dict[str, Any]:
    """The server's first frame to an authenticated client that got a slot."""
    return {"welcome": True, "wire": WIRE, "hwsync": __version__}


class IdleTimeout(TimeoutError):
    """No frame started within the time given (the peer is idle, stopped or gone); the channel is still in step."""


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (IPv6 as ``[::1]:port``); the one parser every address goes through."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise SyncError(f"address {address!r} must be 'host:port'")
    host = host.strip("[]")
    return host or "127.0.0.1", int(port)


@functools.lru_cache(maxsize=16)
def stretch(token: str, salt: bytes) -> bytes:
    """The key both sides prove knowledge of: ``scrypt(token, salt)`` (cached per server salt)."""
    return hashlib.scrypt(token.encode(), salt=b"hwsync/token/" + salt, **_SCRYPT)


def _mac(key: bytes, *parts: bytes | bytearray | str | int) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        b = p if isinstance(p, (bytes, bytearray)) else str(p).encode()
        h.update(_LEN.pack(len(b)))
        h.update(b)
    return h.digest()


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    """``n`` bytes, all by ``deadline`` (``time.monotonic()``; ``None``: no limit), or ``TimeoutError``."""
    chunks = []
    while n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline passed")
            sock.settimeout(left)
        else:
            sock.settimeout(None)
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _recv_body(sock: socket.socket, n: int, deadline: float) -> bytearray:
    """``n`` bytes read into one buffer of exactly that size (no chunks joined: one copy in memory)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        sock.settimeout(left)
        k = sock.recv_into(view[got:], min(n - got, 1 << 20))
        if not k:
            raise ConnectionError("connection closed")
        got += k
    return buf


class _FrameBudget:
    """Bytes of control-frame bodies this process holds at once, over every connection: a frame is admitted (its
    size reserved) before a byte of it is read, so a few huge frames cannot multiply the process's memory."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def reserve(self, n: int) -> Iterator[None]:
        with self._lock:
            if self.used + n > self.limit:
                raise SyncError(
                    f"refused a control frame of {n} bytes: {self.used} bytes of other frames are being "
                    f"read and at most {self.limit} may be at once"
                )
            self.used += n
        try:
            yield
        finally:
            with self._lock:
                self.used -= n


_FRAMES = _FrameBudget(MAX_FRAME)


def _send_by(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(max(deadline - time.monotonic(), 1e-3))
    sock.sendall(data)


def _keepalive(sock: socket.socket) -> None:
    """Probe a silent peer after 30 s, give up after 3 unanswered probes 10 s apart (Linux knobs where present)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class Channel:
    """One authenticated connection (either end)."""

    def __init__(self, sock: socket.socket, session_key: bytes, side: str) -> None:
        self.sock = sock
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            # small frames in both directions (a sync's "go" then its result): with Nagle on, the second frame waits
            # for the peer's delayed ACK of the first, ~40 ms per sync on Linux -- measured as a fixed 43-48 ms per
            # server-mode sync on CPU and on 2 x H200 whatever the bytes moved
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _keepalive(sock)
        self.key = session_key
        self.side = side
        self.other = "server" if side == "client" else "client"
        self.sent = 0
        self.received = 0

    def send(self, body: dict[str, Any]) -> None:
        """Send one frame; a peer that does not take it within :data:`FRAME_TIMEOUT_S` raises ``TimeoutError``."""
        data = json.dumps(body, separators=(",", ":")).encode()
        if len(data) > MAX_FRAME:
            raise SyncError(f"control message of {len(data)} bytes exceeds {MAX_FRAME}")
        self.sent += 1
        mac = _mac(self.key, self.side, self.sent, data)
        _send_by(self.sock, _LEN.pack(len(data)) + mac + data, time.monotonic() + FRAME_TIMEOUT_S)

    def recv(self, wait: float | None = None) -> dict[str, Any]:
        """The next frame: its first byte within ``wait`` seconds (``None``: however long; past it
        :class:`IdleTimeout`), the rest within :data:`FRAME_TIMEOUT_S` (past it ``TimeoutError``)."""
        try:
            first = _recv_exact(self.sock, 1, None if wait is None else time.monotonic() + wait)
        except TimeoutError:
            raise IdleTimeout(f"no frame within {wait:g} s") from None
        deadline = time.monotonic() + FRAME_TIMEOUT_S
        try:
            (n,) = _LEN.unpack(first + _recv_exact(self.sock, _LEN.size - 1, deadline))
            if n > MAX_FRAME:
                raise SyncError(f"refused a control frame of {n} bytes (> {MAX_FRAME})")
            with _FRAMES.reserve(n):
                mac = _recv_exact(self.sock, _MAC_BYTES, deadline)
                data = _recv_body(self.sock, n, deadline)
                if not hmac.compare_digest(mac, _mac(self.key, self.other, self.received + 1, data)):
                    raise SyncError("control frame fails authentication (forged, replayed or reordered)")
                self.received += 1
                try:
                    body = json.loads(data)
                except (ValueError, UnicodeDecodeError):
                    raise SyncError("control frame is not JSON") from None
                del data
        except TimeoutError:
            raise TimeoutError(f"a control frame stalled: not complete {FRAME_TIMEOUT_S:g} s after it began") from None
        if not isinstance(body, dict):
            raise SyncError("control frame is not a JSON object")
        return body

    def seal_secret(self, purpose: str, secret: bytes) -> str:
        """A 32-byte ``secret`` encrypted for the other end (one-time pad from the session key, bound to ``purpose``
        and to the frame it travels in)."""
        if len(secret) != 32:
            raise SyncError("internal: secrets sent over the control channel are 32 bytes")
        pad = _mac(self.key, "pad", self.side, self.sent + 1, purpose)
        return bytes(a ^ b for a, b in zip(secret, pad)).hex()

    def open_secret(self, purpose: str, sealed: str) -> bytes:
        """Inverse of :meth:`seal_secret` for the frame just received."""
        try:
            raw = bytes.fromhex(sealed) if isinstance(sealed, str) else b""
        except ValueError:
            raw = b""
        if len(raw) != 32:
            raise SyncError(f"malformed sealed secret for {purpose!r} (expected 64 hex digits)")
        pad = _mac(self.key, "pad", self.other, self.received, purpose)
        return bytes(a ^ b for a, b in zip(raw, pad))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def server_handshake(sock: socket.socket, key: bytes, salt: bytes, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> Channel:
    """Authenticate a new connection within ``timeout_s`` (one deadline for the whole exchange); raise (and the
    caller drops it) on anything but a client that proves ``key`` (:func:`stretch` of the token and ``salt``)."""
    deadline = time.monotonic() + timeout_s
    server_nonce = secrets.token_bytes(_NONCE_BYTES)
    _send_by(sock, _HELLO + salt + server_nonce, deadline)
    msg = _recv_exact(sock, 4 + _NONCE_BYTES, deadline)
    if msg[:4] != _CLIENT:
        raise SyncError("not an hwsync client of this version")
    client_nonce = msg[4:]
    _send_by(sock, _mac(key, "server-auth", server_nonce, client_nonce), deadline)
    proof = _recv_exact(sock, _MAC_BYTES, deadline)
    if not hmac.compare_digest(proof, _mac(key, "client-auth", server_nonce, client_nonce)):
        raise SyncError("wrong token")
    return Channel(sock, _mac(key, "session", server_nonce, client_nonce), "server")


def refuse_busy(sock: socket.socket) -> None:
    """Tell a connection that every handshake slot is taken (no authentication: a hint to retry, then close)."""
    try:
        sock.setblocking(False)
        sock.send(_BUSY)
    except OSError:
        pass
    sock.close()


def client_handshake(sock: socket.socket, token: str, address: str, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> Channel:
    """Authenticate to the server on ``sock``: it proves the token first, then this side; its first frame says
    ``welcome`` (or ``busy``: :class:`EngineBusyError`)."""
    deadline = time.monotonic() + timeout_s
    try:
        tag = _recv_exact(sock, 4, deadline)
        if tag == _BUSY:
            raise EngineBusyError(
                f"the engine at {address} is busy authenticating other connections (every "
                "handshake slot is taken: a connection flood?); retry shortly"
            )
        if tag != _HELLO:
            raise SyncError(
                f"{address} is not an hwsync sync server of this version (both sides must run the same hwsync)"
            )
        hello = _recv_exact(sock, _SALT_BYTES + _NONCE_BYTES, deadline)
        salt, server_nonce = hello[:_SALT_BYTES], hello[_SALT_BYTES:]
        client_nonce = secrets.token_bytes(_NONCE_BYTES)
        _send_by(sock, _CLIENT + client_nonce, deadline)
        proof = _recv_exact(sock, _MAC_BYTES, deadline)
    except (ConnectionError, TimeoutError, OSError) as e:
        raise SyncError(
            f"the engine at {address} closed the connection during authentication ({e}): is it an "
            "hwsync engine of this version?"
        ) from None
    key = stretch(token, salt)
    if not hmac.compare_digest(proof, _mac(key, "server-auth", server_nonce, client_nonce)):
        raise SyncError(
            f"the engine at {address} does not know this token (its serve() was started with another "
            "one, or another service answers there): pass the token the engine was served with"
        )
    channel = Channel(sock, _mac(key, "session", server_nonce, client_nonce), "client")
    try:
        _send_by(sock, _mac(key, "client-auth", server_nonce, client_nonce), deadline)
        first = channel.recv(wait=max(deadline - time.monotonic(), 1e-3))
    except (ConnectionError, TimeoutError, OSError) as e:
        raise SyncError(f"the engine at {address} closed the connection after authenticating itself ({e})") from None
    if "busy" in first:
        raise EngineBusyError(f"the engine at {address} is busy: {str(first['busy'])[:300]}")
    if first.get("welcome") is not True:
        raise SyncError(f"the engine at {address} answered the handshake with {str(first)[:80]}")
    if first.get("wire") != WIRE:
        channel.close()
        raise SyncError(
            f"the engine at {address} runs hwsync {str(first.get('hwsync', 'of an earlier wire'))[:40]} (wire "
            f"{str(first.get('wire', 1))[:10]}), this trainer hwsync {__version__} (wire {WIRE}): both sides must run "
            "the same hwsync release; install this one where the engine runs"
        )
    return channel


def group_prefix(group_id: bytes) -> str:
    """Store prefix of one data-plane group: only holders of the (secret, encrypted in transit) group id know it."""
    return f"hwsync/g/{group_id.hex()}/"
