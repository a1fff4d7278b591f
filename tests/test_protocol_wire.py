"""The control channel's welcome names the wire (``hwsync.common.protocol.WIRE``): a trainer and an engine whose JSON
forms differ (another hwsync release) refuse each other at the handshake with both versions named, before any request
could be misread. Real sockets, the real handshake; no engine."""

from __future__ import annotations

import secrets
import socket
import threading
from typing import Any

import pytest

from hwsync.common.errors import SyncError
from hwsync.common.protocol import WIRE, client_handshake, server_handshake, stretch, welcome
from hwsync.common.version import __version__

TOKEN = "wire test: a token of forty or more characters"


def _handshake(first: dict[str, Any]) -> Any:
    """A server that authenticates, then sends ``first`` as its welcome; returns what the client's handshake does."""
    server, client = socket.socketpair()
    salt = secrets.token_bytes(16)
    done = threading.Event()

    def serve() -> None:
        try:
            channel = server_handshake(server, stretch(TOKEN, salt), salt, 10)
            channel.send(first)
        finally:
            done.set()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        return client_handshake(client, TOKEN, "test-engine:1", 10)
    finally:
        done.wait(10)
        server.close()
        client.close()


def test_the_same_wire_is_welcomed() -> None:
    assert welcome() == {"welcome": True, "wire": WIRE, "hwsync": __version__}
    assert _handshake(welcome()) is not None


@pytest.mark.parametrize(
    "first",
    [
        {"welcome": True},  # an engine of an earlier release: no wire named
        {"welcome": True, "wire": WIRE + 1, "hwsync": "9.9.9"},  # a later one
    ],
    ids=["earlier", "later"],
)
def test_another_wire_is_refused_naming_both(first: dict[str, Any]) -> None:
    with pytest.raises(SyncError) as e:
        _handshake(first)
    msg = str(e.value)
    assert f"wire {first.get('wire', 1)}" in msg and f"(wire {WIRE})" in msg and "same hwsync release" in msg, msg
