"""CoordinatorClient.connect against servers that accept a connection and then never serve it.

This is what an agent sees when thousands connect at once and the coordinator's accept queue
overflows: its connection looks established but no challenge ever comes.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from hpcelastic.agent import client, messages, protocol
from hpcelastic.agent.client import CoordinatorClient, CoordinatorUnreachable
from hpcelastic.reasons import RestartCause

SECRET = "k" * 64
HELLO = messages.Hello(node_rank=1, host="n1", nproc=1)


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    sock = socket.create_server(("127.0.0.1", 0))
    yield sock
    sock.close()


def _client(
    listener: socket.socket, on_message: Callable[[messages.Message], None] = lambda _m: None
) -> CoordinatorClient:
    return CoordinatorClient("127.0.0.1", listener.getsockname()[1], SECRET, on_message=on_message)


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
        conn.sendall(session.encode({"t": "welcome", "round": -1, "session": f"s{hello['node_rank']}"}))

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    c = _client(listener)
    welcome = c.connect(HELLO, timeout=10)
    server.join(5)
    assert welcome == messages.Welcome(round=-1, session="s1")
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


def test_malformed_message_from_the_coordinator_reports_it_lost(listener: socket.socket) -> None:
    """A known type with bad fields is a bad peer: the agent hears ``lost``, its main loop never sees it."""
    received: queue.SimpleQueue[messages.Message] = queue.SimpleQueue()

    def serve() -> None:
        conn = listener.accept()[0]
        conn.sendall(protocol.encode_plain({"t": "challenge", "nonce": "ef" * 16, "v": 1}))
        session, _hello = protocol.server_accept_hello(SECRET, "ef" * 16, protocol.recv_payload(conn))
        conn.sendall(session.encode({"t": "welcome", "round": -1, "session": "s"}))
        conn.sendall(session.encode({"t": "some-future-type"}))  # unknown: ignored
        conn.sendall(session.encode({"t": "stop", "round": 0, "reason": "worker_failed"}))
        conn.sendall(session.encode({"t": "round", "round": 1}))  # fields missing
        with contextlib.suppress(OSError):
            protocol.recv_payload(conn)  # until the client hangs up

    threading.Thread(target=serve, daemon=True).start()
    c = _client(listener, received.put)
    c.connect(HELLO, timeout=5)
    c.start()
    first, second = received.get(timeout=5), received.get(timeout=5)
    c.close()
    assert first == messages.Stop(0, RestartCause.WORKER_FAILED)
    assert isinstance(second, messages.Lost) and "malformed 'round' message" in second.reason
