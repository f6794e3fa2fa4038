"""Control-plane authentication against a real coordinator on loopback: no secret, wrong secret, replay."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from hpcelastic.agent import protocol
from hpcelastic.agent.coordinator import Coordinator, PortReservation
from hpcelastic.agent.job_state import JobState
from hpcelastic.env.base import listen
from hpcelastic.rundir import RunDir

SECRET = "s3cret-" + "a" * 57


@pytest.fixture
def coordinator(tmp_path) -> Iterator[Coordinator]:
    ports = PortReservation()
    state = JobState(
        hosts=["n0", "n1"],
        min_nodes=2,
        max_restarts=1,
        master_addr="127.0.0.1",
        new_port=ports.new_port,
        rdzv_timeout=30,
    )
    coord = Coordinator(listen("127.0.0.1", 0), SECRET, state, RunDir(tmp_path))
    coord.start()
    yield coord
    coord.stop(drain_timeout=0)
    ports.release()


def _connect(coord: Coordinator) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", coord.port), timeout=5)
    return sock


def test_frames_round_trip_and_reject_tampering() -> None:
    key = protocol.session_key(SECRET, "sn", "cn")
    client, server = protocol.Session(key, is_server=False), protocol.Session(key, is_server=True)
    frame = client.encode({"t": "hb", "x": [1, 2]})
    [payload] = protocol.FrameBuffer().feed(frame)
    assert server.decode(payload) == {"t": "hb", "x": [1, 2]}
    tampered = bytearray(client.encode({"t": "hb", "x": 1}))
    tampered[-2] ^= 1
    with pytest.raises(protocol.ProtocolError):
        server.decode(protocol.FrameBuffer().feed(bytes(tampered))[0])


def test_replayed_and_reflected_frames_are_rejected() -> None:
    key = protocol.session_key(SECRET, "sn", "cn")
    client, server = protocol.Session(key, is_server=False), protocol.Session(key, is_server=True)
    payload = protocol.FrameBuffer().feed(client.encode({"t": "started", "round": 0}))[0]
    server.decode(payload)
    with pytest.raises(protocol.AuthError):
        server.decode(payload)  # same frame again: wrong sequence number
    reflected = protocol.FrameBuffer().feed(server.encode({"t": "stop"}))[0]
    with pytest.raises(protocol.AuthError):
        protocol.Session(key, is_server=True).decode(reflected)  # server frame fed back to a server


def test_oversized_frame_is_a_protocol_error() -> None:
    header = (protocol.MAX_FRAME + 1).to_bytes(4, "big")
    with pytest.raises(protocol.ProtocolError):
        protocol.FrameBuffer().feed(header + b"x" * 10)


def test_correct_secret_joins(coordinator: Coordinator) -> None:
    sock = _connect(coordinator)
    _session, welcome = protocol.client_handshake(sock, SECRET, {"node_rank": 1, "host": "n1", "nproc": 1})
    assert welcome["t"] == "welcome"
    assert coordinator.state.members[1].host == "n1"
    sock.close()


def test_wrong_secret_is_rejected(coordinator: Coordinator) -> None:
    sock = _connect(coordinator)
    with pytest.raises(protocol.AuthError, match="secret"):
        protocol.client_handshake(sock, "not-the-secret", {"node_rank": 1, "host": "n1", "nproc": 1})
    sock.close()
    assert coordinator.state.members == {}


def test_peer_without_secret_sending_plain_json_is_rejected(coordinator: Coordinator) -> None:
    sock = _connect(coordinator)
    protocol.decode_plain(protocol.recv_payload(sock))  # the challenge
    sock.sendall(
        protocol.encode_plain({"t": "hello", "nonce": "00", "node_rank": 1, "host": "x", "nproc": 1})
    )
    reply = protocol.decode_plain(protocol.recv_payload(sock))
    assert reply["t"] == "error" and reply["auth"] is True
    assert sock.recv(1) == b""  # and the connection is closed
    assert coordinator.state.members == {}


def test_hello_replayed_on_a_new_connection_is_rejected(coordinator: Coordinator) -> None:
    first = _connect(coordinator)
    recorded: list[bytes] = []
    real_sendall = first.sendall

    class Recorder:
        def __getattr__(self, name):
            return getattr(first, name)

        def sendall(self, data: bytes) -> None:
            recorded.append(data)
            real_sendall(data)

    protocol.client_handshake(Recorder(), SECRET, {"node_rank": 1, "host": "n1", "nproc": 1})  # type: ignore[arg-type]
    second = _connect(coordinator)
    protocol.recv_payload(second)  # a fresh challenge with a new nonce
    second.sendall(recorded[0])  # the captured, valid hello of the first connection
    reply = protocol.decode_plain(protocol.recv_payload(second))
    assert reply["t"] == "error" and reply["auth"] is True
    first.close()
    second.close()


def test_duplicate_node_rank_is_refused(coordinator: Coordinator) -> None:
    a = _connect(coordinator)
    protocol.client_handshake(a, SECRET, {"node_rank": 1, "host": "n1", "nproc": 1})
    b = _connect(coordinator)
    with pytest.raises(protocol.ProtocolError, match="already joined"):
        protocol.client_handshake(b, SECRET, {"node_rank": 1, "host": "n1", "nproc": 1})
    a.close()
    b.close()
