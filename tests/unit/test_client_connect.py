"""CoordinatorClient.connect against servers that accept a connection and then never serve it.

This is what an agent sees when thousands connect at once and the coordinator's accept queue
overflows: its connection looks established but no challenge ever comes.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from hpcelastic.agent import client, protocol
from hpcelastic.agent.client import CoordinatorClient, CoordinatorUnreachable

SECRET = "k" * 64
HELLO = {"node_rank": 1, "host": "n1", "nproc": 1}


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    sock = socket.create_server(("127.0.0.1", 0))
    yield sock
    sock.close()


def _client(listener: socket.socket) -> CoordinatorClient:
    return CoordinatorClient("127.0.0.1", listener.getsockname()[1], SECRET, on_message=lambda _m: None)


def test_unserved_connection_is_retried_and_then_served(
    listener: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client, "CHALLENGE_TIMEOUT", 0.3)
    held: list[socket.socket] = []

    def serve() -> None:
        held.append(listener.accept()[0])  # accepted, never served
        conn = listener.accept()[0]
        held.append(conn)
        conn.sendall(protocol.encode_plain({"t": "challenge", "nonce": "ab" * 16, "v": 1}))
        session, hello = protocol.server_accept_hello(SECRET, "ab" * 16, protocol.recv_payload(conn))
        conn.sendall(session.encode({"t": "welcome", "round": -1, "node": hello["node_rank"]}))

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    c = _client(listener)
    welcome = c.connect(HELLO, timeout=10)
    server.join(5)
    assert welcome["t"] == "welcome" and welcome["node"] == 1
    assert len(held) == 2
    c.close()
    for s in held:
        s.close()


def test_never_served_ends_as_unreachable_not_a_socket_error(
    listener: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client, "CHALLENGE_TIMEOUT", 0.2)
    with pytest.raises(CoordinatorUnreachable, match="no challenge"):
        _client(listener).connect(HELLO, timeout=1.0)


def test_connection_closed_after_hello_is_unreachable(listener: socket.socket) -> None:
    def serve() -> None:
        conn = listener.accept()[0]
        conn.sendall(protocol.encode_plain({"t": "challenge", "nonce": "cd" * 16, "v": 1}))
        protocol.recv_payload(conn)
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    with pytest.raises(CoordinatorUnreachable, match="stopped answering during the handshake"):
        _client(listener).connect(HELLO, timeout=5)
