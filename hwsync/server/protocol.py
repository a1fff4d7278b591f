"""The control channel of server mode: authenticated, ordered messages over one TCP connection.

Threat model: anyone who can reach the engine's port may connect and send bytes; nobody without the shared token may
make the engine do anything, learn where the data plane meets, or feed it weights. (The channel is authenticated,
not encrypted: run it on the network your collectives use anyway.)

* Handshake: the server sends a fresh nonce, the client answers with its own and ``HMAC(token, both)``, the server
  proves the token back. A connection that fails or stalls is dropped; the token never travels.
* Frames: ``[4-byte length][32-byte MAC][JSON body]``, ``MAC = HMAC(session_key, direction, sequence, body)``. The
  MAC is checked before the body is even parsed, sequence numbers make replays and reorderings fail, and a frame
  larger than :data:`MAX_FRAME` is refused before it is read.
* Secrets for one sync (the data-plane group id and the bucket-sealing key) travel encrypted under the session key,
  so reading the traffic does not tell where to join.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
from typing import Any

from hwsync.errors import SyncError

__all__ = ["Channel", "DEFAULT_TIMEOUT_S", "MAX_FRAME", "client_handshake", "group_prefix", "server_handshake",
           "split_address"]

DEFAULT_TIMEOUT_S = float(os.environ.get("HWSYNC_TIMEOUT_S", "600"))
"""Longest a data-plane transfer may stall before both sides give up (the server caps what clients ask for)."""
MAX_FRAME = 256 << 20
"""Largest control message (a manifest of ~10^6 tensors fits); bigger frames are refused unread."""
_LEN = struct.Struct("<I")
_MAC_BYTES = 32
HANDSHAKE_TIMEOUT_S = 10.0


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (IPv6 as ``[::1]:port``); the one parser every address goes through."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise SyncError(f"address {address!r} must be 'host:port'")
    host = host.strip("[]")
    return host or "127.0.0.1", int(port)


def _mac(key: bytes, *parts: bytes | str | int) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        b = p if isinstance(p, bytes) else str(p).encode()
        h.update(_LEN.pack(len(b)))
        h.update(b)
    return h.digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


class Channel:
    """One authenticated connection (either end)."""

    def __init__(self, sock: socket.socket, session_key: bytes, side: str) -> None:
        self.sock = sock
        # small frames in both directions (a sync's "go" then its result): with Nagle on, the second frame waits for
        # the peer's delayed ACK of the first, ~40 ms per sync on Linux -- measured as a fixed 43-48 ms per
        # server-mode sync on CPU and on 2 x H200 whatever the bytes moved
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.key = session_key
        self.side = side
        self.other = "server" if side == "client" else "client"
        self.sent = 0
        self.received = 0

    def send(self, body: dict[str, Any]) -> None:
        data = json.dumps(body, separators=(",", ":")).encode()
        if len(data) > MAX_FRAME:
            raise SyncError(f"control message of {len(data)} bytes exceeds {MAX_FRAME}")
        self.sent += 1
        mac = _mac(self.key, self.side, self.sent, data)
        self.sock.sendall(_LEN.pack(len(data)) + mac + data)

    def recv(self) -> dict[str, Any]:
        (n,) = _LEN.unpack(_recv_exact(self.sock, _LEN.size))
        if n > MAX_FRAME:
            raise SyncError(f"refused a control frame of {n} bytes (> {MAX_FRAME})")
        mac = _recv_exact(self.sock, _MAC_BYTES)
        data = _recv_exact(self.sock, n)
        if not hmac.compare_digest(mac, _mac(self.key, self.other, self.received + 1, data)):
            raise SyncError("control frame fails authentication (forged, replayed or reordered)")
        self.received += 1
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            raise SyncError("control frame is not JSON") from None
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
        try:
            self.sock.close()
        except OSError:
            pass


def server_handshake(sock: socket.socket, token: str) -> Channel:
    """Authenticate a new connection; raise (and the caller drops it) on anything but the right token."""
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    server_nonce = secrets.token_bytes(32)
    sock.sendall(b"HWSY" + server_nonce)
    msg = _recv_exact(sock, 4 + 32 + _MAC_BYTES)
    if msg[:4] != b"HWSC":
        raise SyncError("not an hwsync client")
    client_nonce, proof = msg[4:36], msg[36:]
    if not hmac.compare_digest(proof, _mac(token.encode(), "client-auth", server_nonce, client_nonce)):
        raise SyncError("wrong token")
    sock.sendall(_mac(token.encode(), "server-auth", client_nonce, server_nonce))
    sock.settimeout(None)
    return Channel(sock, _mac(token.encode(), "session", server_nonce, client_nonce), "server")


def client_handshake(sock: socket.socket, token: str, address: str) -> Channel:
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        hello = _recv_exact(sock, 4 + 32)
        if hello[:4] != b"HWSY":
            raise SyncError(f"{address} is not an hwsync sync server")
        server_nonce = hello[4:]
        client_nonce = secrets.token_bytes(32)
        sock.sendall(b"HWSC" + client_nonce + _mac(token.encode(), "client-auth", server_nonce, client_nonce))
        proof = _recv_exact(sock, _MAC_BYTES)
    except (ConnectionError, socket.timeout, OSError) as e:
        raise SyncError(f"the engine at {address} refused the token (connection closed during authentication: "
                        f"{e}): pass the token its serve() was started with") from None
    if not hmac.compare_digest(proof, _mac(token.encode(), "server-auth", client_nonce, server_nonce)):
        raise SyncError(f"the server at {address} does not know the token (another service on that port?)")
    sock.settimeout(None)
    return Channel(sock, _mac(token.encode(), "session", server_nonce, client_nonce), "client")


def group_prefix(group_id: bytes) -> str:
    """Store prefix of one data-plane group: only holders of the (secret, encrypted in transit) group id know it."""
    return f"hwsync/g/{group_id.hex()}/"
