"""Nothing that answers on the coordinator's port without the job's secret ends a job early (issue 10, 4).

A forged unauthenticated refusal (zero MAC) or another program on the port is retried until the
rendezvous deadline; then the agent ends the attempt as ``coordinator_lost`` (exit 6, requeued within
the budget), never with exit 2, which ``finalize`` reads as a start-up failure and never requeues. A
port the user fixed with ``--rdzv-port`` that another program holds on the coordinator's node is
permanent for that node, so it is one line and exit 2 within seconds: not requeued in a loop. Real agents.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hpcelastic.agent import messages, protocol
from hpcelastic.agent.client import CoordinatorClient, CoordinatorUnreachable
from hpcelastic.errors import EXIT_COORDINATOR_LOST, EXIT_USAGE
from tests.faults.localjob import REPO

SECRET = "q" * 64
HELLO = messages.Hello(node_rank=1, host="n1", nproc=1)
FORGED_REFUSAL = protocol.encode_plain({"t": "error", "error": "go away", "auth": True})


def _forged_refusal(conn: socket.socket) -> None:
    conn.sendall(protocol.encode_plain({"t": "challenge", "nonce": "ab" * 16, "v": 1}))
    protocol.recv_payload(conn)
    conn.sendall(FORGED_REFUSAL)


def _http(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")


def _serve(listener: socket.socket, bad: Callable[[socket.socket], None], bad_count: int) -> None:
    """``bad_count`` connections get ``bad``, then one is served by a coordinator that knows the secret.

    The test may end (and its fixture close the listener) while this thread still waits in accept."""
    with listener, contextlib.suppress(OSError):
        for _ in range(bad_count):
            conn = listener.accept()[0]
            with conn:
                bad(conn)
        conn = listener.accept()[0]
        conn.sendall(protocol.encode_plain({"t": "challenge", "nonce": "cd" * 16, "v": 1}))
        session, _ = protocol.server_accept_hello(SECRET, "cd" * 16, protocol.recv_payload(conn))
        conn.sendall(session.encode({"t": "welcome", "round": -1, "session": "s"}))
        conn.recv(1)


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    sock = socket.create_server(("127.0.0.1", 0))
    yield sock
    sock.close()


@pytest.mark.parametrize("bad", [_forged_refusal, _http], ids=["forged-refusal", "other-program"])
def test_unauthenticated_answers_are_retried_until_the_coordinator_answers(listener, bad) -> None:
    port = listener.getsockname()[1]
    threading.Thread(target=_serve, args=(listener, bad, 3), daemon=True).start()
    client = CoordinatorClient("127.0.0.1", port, SECRET, on_message=lambda _m: None)
    assert client.connect(HELLO, timeout=20) == messages.Welcome(round=-1, session="s")
    client.close()


def _agent(tmp_path: Path, port: int, timeout: str = "3") -> subprocess.CompletedProcess[str]:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "secret").write_text(SECRET)
    (tmp_path / "train.py").write_text("print('trained')\n")
    env = {"HPCELASTIC_LOCAL_NODE_RANK": "1", "HPCELASTIC_LOCAL_NUM_NODES": "2", "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-m", "hpcelastic", "agent", "--run-dir", str(run)]
        + ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-timeout", timeout, "--", "train.py"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "PYTHONPATH": str(REPO)},
        cwd=tmp_path,
    )


@pytest.mark.parametrize("bad", [_forged_refusal, _http], ids=["forged-refusal", "other-program"])
def test_agent_facing_only_unauthenticated_answers_ends_as_coordinator_lost(tmp_path, listener, bad) -> None:
    port = listener.getsockname()[1]

    def serve_forever() -> None:
        while True:
            try:
                conn = listener.accept()[0]
            except OSError:
                return
            with conn, contextlib.suppress(OSError):
                bad(conn)

    threading.Thread(target=serve_forever, daemon=True).start()
    proc = _agent(tmp_path, port)
    assert proc.returncode == EXIT_COORDINATOR_LOST, proc.stderr
    assert "Traceback" not in proc.stderr
    expected = "secret" if bad is _forged_refusal else "is not this job's coordinator"
    assert expected in proc.stderr, proc.stderr


def test_coordinator_port_held_by_another_program_is_one_line_exit_2(tmp_path, listener) -> None:
    port = listener.getsockname()[1]
    run = tmp_path / "run"
    run.mkdir()
    (run / "secret").write_text(SECRET)
    (tmp_path / "train.py").write_text("print('trained')\n")
    proc = subprocess.run(
        [sys.executable, "-m", "hpcelastic", "agent", "--run-dir", str(run)]
        + ["--rdzv-port", str(port), "--", "train.py"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"HPCELASTIC_LOCAL_NODE_RANK": "0", "HPCELASTIC_LOCAL_NUM_NODES": "1", "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert len(lines) == 1 and "another program holds the port" in lines[0], proc.stderr
    assert "--rdzv-port" in lines[0], proc.stderr


def test_client_gives_up_at_the_deadline_with_what_it_saw(listener) -> None:
    port = listener.getsockname()[1]
    threading.Thread(target=_serve, args=(listener, _forged_refusal, 1000), daemon=True).start()
    client = CoordinatorClient("127.0.0.1", port, SECRET, on_message=lambda _m: None)
    with pytest.raises(CoordinatorUnreachable, match="could not prove it knows the job's secret"):
        client.connect(HELLO, timeout=1.5)
