"""Security of the control plane and of the run directory.

* A real coordinator on 127.0.0.1 (the one the rank-0 agent hosts) and raw TCP clients: without the
  job secret, with a wrong one, replaying frames captured from an authenticated session (on a new
  connection and on the same one), reflecting the server's frames, and sending pickles. Each attack
  is rejected and the job state (members, phase, round, restarts, event log) is unchanged.
* The source: no pickle import and no pickling mpi4py call on the agent's network path.
* A real ``hpcelastic run --nodes 2 --nproc-per-node 1`` job and a real (held, then cancelled)
  ``hpcelastic submit``: the secret is only in ``<run>/secret`` (0600, in a 0700 run directory), never
  in another file, in ``status``/``logs`` output, on a command line or in a worker's environment.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import hmac
import json
import os
import pickle
import socket
import stat
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from hpcelastic.agent import protocol
from hpcelastic.agent.coordinator import MAX_PREAUTH_FRAME, Coordinator, PortReservation
from hpcelastic.agent.job_state import JobState
from hpcelastic.env.base import listen
from hpcelastic.rundir import RunDir
from tests.faults.localjob import EXAMPLE, REPO
from tests.slurm_utils import leaked_processes

SECRET = "f00d" * 16
HOSTS = ["n0", "n1", "n2"]  # nodes 0 and 1 join; node 2 is the free seat every attacker claims


class Tap:
    """A connected socket that keeps a copy of every byte it sends and receives."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sent: list[bytes] = []
        self.received = bytearray()

    def sendall(self, data: bytes) -> None:
        self.sent.append(bytes(data))
        self.sock.sendall(data)

    def recv(self, n: int) -> bytes:
        data = self.sock.recv(n)
        self.received += data
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


@dataclass
class Plane:
    """A coordinator with nodes 0 and 1 joined over captured, authenticated sessions."""

    coord: Coordinator
    run_dir: RunDir
    taps: dict[int, Tap]
    sessions: dict[int, protocol.Session]

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.coord.port), timeout=5)

    def state(self) -> dict[str, Any]:
        self.coord.events.flush(timeout=5)  # the coordinator writes events from a thread of its own
        st = self.coord.state
        return {
            "members": sorted(st.members),
            "phase": st.phase,
            "round": st.round,
            "restart_count": st.restart_count,
            "events": list(self.run_dir.events()),
        }

    def events(self, name: str) -> list[dict[str, Any]]:
        self.coord.events.flush(timeout=5)
        return [e for e in self.run_dir.events() if e["event"] == name]


def wait_for(what: str, predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


SIGNAL_EVENT = {"t": "event", "event": "signal_received", "fields": {"signal": "SIGUSR2", "node_rank": 1}}


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[Plane]:
    ports = PortReservation()
    state = JobState(
        hosts=HOSTS,
        min_nodes=3,
        max_restarts=2,
        master_addr="127.0.0.1",
        new_port=ports.new_port,
        rdzv_timeout=60,
    )
    run_dir = RunDir(tmp_path)
    # Long heartbeat timeout: the raw test clients do not heartbeat, and must not be dropped for it.
    coord = Coordinator(listen("127.0.0.1", 0), SECRET, state, run_dir, heartbeat_timeout=60)
    coord.start()
    p = Plane(coord, run_dir, {}, {})
    for rank in (0, 1):
        tap = Tap(p.connect())
        session, welcome = protocol.client_handshake(
            tap, SECRET, {"node_rank": rank, "host": HOSTS[rank], "nproc": 1}
        )
        assert welcome["t"] == "welcome"
        p.taps[rank], p.sessions[rank] = tap, session
    # One state-changing message from node 1 (an agent event is written whatever the phase).
    p.taps[1].sendall(p.sessions[1].encode(SIGNAL_EVENT))
    wait_for("the signal_received event", lambda: len(p.events("signal_received")) == 1)
    assert p.state()["members"] == [0, 1] and p.state()["phase"] == "rendezvous"
    yield p
    for tap in p.taps.values():
        tap.sock.close()
    coord.stop(drain_timeout=0)
    ports.release()


def rejection(sock: socket.socket) -> dict[str, Any]:
    """The coordinator's plain error frame; the connection must be closed right after it."""
    reply = protocol.decode_plain(protocol.recv_payload(sock))
    assert reply["t"] == "error", reply
    assert sock.recv(1) == b"", "the coordinator kept a rejected connection open"
    sock.close()
    return reply


def raw_frame(body: bytes, mac: bytes = bytes(protocol.MAC_LEN)) -> bytes:
    return struct.pack("!I", len(mac) + len(body)) + mac + body


class CreatesFileWhenUnpickled:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


# ---- control plane --------------------------------------------------------------------------------


def test_client_without_the_secret_is_rejected(plane: Plane) -> None:
    before = plane.state()
    sock = plane.connect()
    challenge = protocol.decode_plain(protocol.recv_payload(sock))
    assert challenge["t"] == "challenge"
    hello = {"t": "hello", "nonce": "00" * 16, "node_rank": 2, "host": "n2", "nproc": 1}
    sock.sendall(protocol.encode_plain(hello))  # unauthenticated: a MAC of zeros
    assert rejection(sock)["auth"] is True
    assert plane.state() == before


def test_client_with_a_wrong_secret_is_rejected(plane: Plane) -> None:
    before = plane.state()
    sock = plane.connect()
    with pytest.raises(protocol.AuthError, match="secret"):
        protocol.client_handshake(sock, "0" * 64, {"node_rank": 2, "host": "n2", "nproc": 1})
    assert sock.recv(1) == b""
    sock.close()
    assert plane.state() == before


def test_captured_session_replayed_on_a_new_connection_is_rejected(plane: Plane) -> None:
    before = plane.state()
    sock = plane.connect()
    protocol.recv_payload(sock)  # a fresh challenge: its nonce makes a new session key
    sock.sendall(b"".join(plane.taps[1].sent))  # node 1's real hello and event frames, byte for byte
    assert rejection(sock)["auth"] is True
    assert plane.state() == before
    assert len(plane.events("signal_received")) == 1


def test_authenticated_frame_replayed_without_a_handshake_is_rejected(plane: Plane) -> None:
    before = plane.state()
    sock = plane.connect()
    protocol.recv_payload(sock)
    sock.sendall(plane.taps[1].sent[1])  # the captured event frame as the first frame
    assert "not a hello" in rejection(sock)["error"]
    assert plane.state() == before


def test_server_frame_reflected_back_on_its_connection_is_rejected(plane: Plane) -> None:
    """The coordinator's frame number 1 to node 0, sent back as node 0's frame number 1.

    Sequence number and session key are right; only the direction differs, and that is enough.
    """
    tap, session = plane.taps[0], plane.sessions[0]
    assert len(tap.sent) == 1  # node 0 sent frame 0 (hello): 1 comes next
    third = Tap(plane.connect())  # node 2 joins with the secret: the round starts, node 0 gets frame 1
    protocol.client_handshake(third, SECRET, {"node_rank": 2, "host": HOSTS[2], "nproc": 1})
    frame = protocol.recv_payload(tap)
    assert session.decode(frame)["t"] == "round"  # decode checks the MAC
    tap.sendall(struct.pack("!I", len(frame)) + frame)
    assert rejection(tap.sock)["auth"] is True
    assert len(plane.events("signal_received")) == 1
    wait_for("node 0 dropped", lambda: 0 not in plane.state()["members"])
    third.sock.close()


def test_frame_replayed_on_the_same_connection_is_rejected(plane: Plane) -> None:
    """The replay has no effect; the connection it came in on is closed as tampered with."""
    members_before = plane.state()["members"]
    tap = plane.taps[1]
    tap.sendall(tap.sent[1])  # the event frame again, with its old sequence number
    assert rejection(tap.sock)["auth"] is True
    assert len(plane.events("signal_received")) == 1  # not written a second time
    [lost] = plane.events("node_lost")
    assert lost["node_rank"] == 1 and "authentication failed" in lost["reason"]
    assert plane.state()["members"] == [m for m in members_before if m != 1]
    assert plane.state()["phase"] == "rendezvous" and plane.state()["round"] == -1


def test_malformed_message_from_an_authenticated_agent_is_rejected(plane: Plane) -> None:
    """A type the coordinator does not know is ignored; a known one with bad fields closes the connection."""
    tap, session = plane.taps[1], plane.sessions[1]
    tap.sendall(session.encode({"t": "some-future-type", "x": 1}))
    tap.sendall(session.encode({"t": "failed", "round": 0, "failures": ["not an object"]}))
    reply = rejection(tap.sock)
    assert reply["auth"] is False and "malformed 'failed' message" in reply["error"]
    [lost] = plane.events("node_lost")
    assert lost["node_rank"] == 1 and "malformed" in lost["reason"]
    assert plane.state()["phase"] == "rendezvous" and plane.state()["round"] == -1


def test_pickle_is_never_unpickled_even_from_an_authenticated_client(plane: Plane, tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(CreatesFileWhenUnpickled(marker))
    before = plane.state()
    # 1. as the first frame of a new connection
    sock = plane.connect()
    protocol.recv_payload(sock)
    sock.sendall(raw_frame(payload))
    assert "not JSON" in rejection(sock)["error"]
    assert plane.state() == before
    # 2. on node 1's authenticated connection, with a valid MAC over the pickle (protocol.py's format:
    #    HMAC(session key, direction byte + u64 sequence number + body)); only the body is wrong.
    tap = plane.taps[1]
    server_nonce = protocol.decode_plain(protocol.FrameBuffer().feed(bytes(tap.received))[0])["nonce"]
    client_nonce = json.loads(tap.sent[0][4 + protocol.MAC_LEN :])["nonce"]
    key = protocol.session_key(SECRET, server_nonce, client_nonce)
    mac = hmac.new(key, b"C" + struct.pack("!Q", len(tap.sent)) + payload, hashlib.sha256).digest()
    tap.sendall(raw_frame(payload, mac))
    reply = rejection(tap.sock)
    assert reply["auth"] is False and "not JSON" in reply["error"]  # the MAC held; the body was refused
    assert not marker.exists(), "a pickle was unpickled"
    assert len(plane.events("signal_received")) == 1


GARBAGE_BEFORE_AUTH = {
    "json-nested-200000-deep": raw_frame(b"[" * 200_000),
    "not-utf8": raw_frame(b"\xff\xfe{}"),
    "json-array": raw_frame(b'["hello"]'),
    "nonce-not-a-string": raw_frame(b'{"t": "hello", "nonce": 5, "node_rank": 2}'),
    "no-type": raw_frame(b'{"nonce": "00"}'),
    "length-over-limit": struct.pack("!I", protocol.MAX_FRAME + 1) + b"x" * 64,
    "shorter-than-its-mac": struct.pack("!I", 4) + b"abcd",
}


@pytest.mark.parametrize("frame", GARBAGE_BEFORE_AUTH.values(), ids=list(GARBAGE_BEFORE_AUTH))
def test_garbage_before_authentication_is_rejected_and_the_coordinator_serves_on(
    plane: Plane, frame: bytes
) -> None:
    before = plane.state()
    sock = plane.connect()
    protocol.recv_payload(sock)
    sock.sendall(frame)
    if len(frame) > MAX_PREAUTH_FRAME:
        # Not read at all (a stranger's frame is never buffered beyond the limit): the refusal is best
        # effort, as the coordinator closes with the frame unread, which may reset the connection.
        with contextlib.suppress(ConnectionResetError):
            rejection(sock)
    else:
        assert rejection(sock)["auth"] is False
    assert plane.state() == before
    # Still serving: the right secret joins node 2, which completes the rendezvous.
    sock = plane.connect()
    protocol.client_handshake(sock, SECRET, {"node_rank": 2, "host": "n2", "nproc": 1})
    wait_for("round 0", lambda: plane.state()["round"] == 0)
    sock.close()


# ---- source ---------------------------------------------------------------------------------------

PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "jsonpickle"}
# mpi4py's lower-case communication methods pickle their argument; the buffer methods (Bcast, ...) do not.
PICKLING_MPI_CALLS = {
    "bcast",
    "allgather",
    "gather",
    "scatter",
    "allreduce",
    "alltoall",
    "sendrecv",
    "isend",
    "irecv",
}
NETWORK_PATH = ("hpcelastic/agent", "hpcelastic/env")


def pickle_uses(source: str) -> list[str]:
    """Imports of pickling modules and pickling mpi4py calls in ``source``, as ``line: what``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        found += [f"{node.lineno}: import {n}" for n in names if n.split(".")[0] in PICKLE_MODULES]
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in PICKLING_MPI_CALLS
        ):
            found.append(f"{node.lineno}: .{node.func.attr}()")
    return found


def test_the_pickle_detector_detects() -> None:
    sample = (
        "import pickle\nfrom cloudpickle import dumps\nimport os\ncomm.bcast(x)\ncomm.Bcast([b, MPI.BYTE])\n"
    )
    assert pickle_uses(sample) == ["1: import pickle", "2: import cloudpickle", "4: .bcast()"]


def test_no_pickle_on_the_agent_network_path() -> None:
    files = sorted(f for d in NETWORK_PATH for f in (REPO / d).rglob("*.py"))
    assert len(files) >= 10
    offenders = {str(f.relative_to(REPO)): uses for f in files if (uses := pickle_uses(f.read_text()))}
    assert offenders == {}


# ---- a real job: where the secret goes ------------------------------------------------------------


def _cli_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPCELASTIC_", "SLURM_", "OMPI_", "PMI"))}
    env.update(
        HOME=str(tmp_path / "home"),
        XDG_STATE_HOME=str(tmp_path / "state"),
        XDG_CONFIG_HOME=str(tmp_path / "config"),
        PYTHONPATH=str(REPO),
    )
    return env


def hpcelastic(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "hpcelastic", *args],
        cwd=tmp_path,
        env=_cli_env(tmp_path),
        capture_output=True,
        timeout=60,
    )


def assert_private_tree(run: Path, secret: str, script_written: tuple[Path, ...] = ()) -> None:
    """0700/0600 throughout, the secret only in ``secret``.

    Files the training script writes itself (its checkpoints) get the user's umask, which hpcelastic
    leaves alone; they are checked to lie in a user-only directory instead.
    """
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    assert stat.S_IMODE((run / "secret").stat().st_mode) == 0o600
    assert (run / "secret").read_text().strip() == secret
    checked = 0
    for dirpath, dirnames, filenames in os.walk(run):
        for name in dirnames:
            assert stat.S_IMODE((Path(dirpath) / name).lstat().st_mode) & 0o077 == 0, f"{dirpath}/{name}"
        for name in filenames:
            path = Path(dirpath) / name
            if path.is_symlink():  # a link's own mode means nothing; what it points to is checked
                assert path.resolve().is_relative_to(run), f"{path} points out of the run directory"
                continue
            if path in script_written:
                assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
            else:
                mode = stat.S_IMODE(path.lstat().st_mode)
                assert mode & 0o077 == 0, f"{path} is mode {mode:o}"
            if name != "secret":
                assert secret.encode() not in path.read_bytes(), f"the secret is in {path}"
            checked += 1
    assert checked >= 5


def _processes_of(run: Path) -> dict[str, list[tuple[list[str], dict[str, str]]]]:
    """Command lines and environments of the run's agents and workers (live processes only)."""
    out: dict[str, list[tuple[list[str], dict[str, str]]]] = {"agents": [], "workers": [], "other": []}
    for p in leaked_processes(run):
        try:
            cmdline, environ = p.cmdline(), p.environ()
        except psutil.NoSuchProcess:
            continue
        kind = "workers" if "RANK" in environ else "agents" if "agent" in cmdline else "other"
        out[kind].append((cmdline, environ))
    return out


def test_secret_stays_in_the_secret_file_through_a_real_local_job(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out, err = (tmp_path / "run.out").open("wb"), (tmp_path / "run.err").open("wb")
    cmd = ["run", "--nodes", "2", "--nproc-per-node", "1", "--run-dir", str(run), "--"]
    train = [str(EXAMPLE), "--steps", "8", "--step-time", "0.4", "--out", str(tmp_path / "final.json")]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "hpcelastic", *cmd, *train],
        cwd=tmp_path,
        env=_cli_env(tmp_path),
        stdout=out,
        stderr=err,
    )
    try:
        wait_for("the secret", lambda: (run / "secret").exists(), timeout=30)
        secret = (run / "secret").read_text().strip()
        assert len(secret) >= 32
        seen: dict[str, list[tuple[list[str], dict[str, str]]]] = {}

        def both_workers_running() -> bool:
            seen.update(_processes_of(run))
            return len(seen["workers"]) == 2 and len(seen["agents"]) == 2

        wait_for("2 agents and 2 workers", both_workers_running, timeout=60)
        own = psutil.Process(launcher.pid)
        for cmdline, environ in [
            *seen["agents"],
            *seen["workers"],
            *seen["other"],
            (own.cmdline(), own.environ()),
        ]:
            assert secret not in " ".join(cmdline)
            assert all(secret not in v for v in environ.values()), "the secret is in a process environment"
        for _cmdline, environ in seen["workers"]:
            assert environ["HPCELASTIC_RUN_DIR"] == str(run) and "HPCELASTIC_SECRET" not in environ
        assert launcher.wait(timeout=120) == 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        out.close()
        err.close()
    outputs = {
        "hpcelastic run stdout": (tmp_path / "run.out").read_bytes(),
        "hpcelastic run stderr": (tmp_path / "run.err").read_bytes(),
    }
    for args in (
        ("status", str(run)),
        ("status", "--json", str(run)),
        ("logs", str(run)),
        ("logs", "--rank", "1", str(run)),
    ):
        proc = hpcelastic(tmp_path, *args)
        assert proc.returncode == 0, proc.stderr
        outputs[" ".join(args[:-1])] = proc.stdout + proc.stderr
    assert b"final checksum" in outputs["logs"]  # the outputs checked are the real ones
    for what, text in outputs.items():
        assert secret.encode() not in text, f"the secret is in the output of {what}"
    assert_private_tree(run, secret, script_written=(run / "checkpoints" / "ddp_train.pt",))
    assert (run / "logs" / "attempt-0" / "rank-1.log").exists()


@pytest.mark.parametrize("backend", ["sbatch", "submitit"])
def test_submitted_run_directory_is_private_and_holds_the_secret_once(tmp_path: Path, backend: str) -> None:
    """A real submission, held so it never runs, then cancelled."""
    (tmp_path / "train.py").write_text("print('never runs')\n")
    name = f"hpce-sec-{uuid.uuid4().hex[:10]}"
    run = tmp_path / "run"
    submit = hpcelastic(
        tmp_path,
        "submit",
        "--json",
        "--job-name",
        name,
        "--time",
        "5",
        "--run-dir",
        str(run),
        "--sbatch-arg=--hold",
        "--backend",
        backend,
        "train.py",
    )
    job_id = json.loads(submit.stdout)["job_id"] if submit.returncode == 0 else None
    try:
        assert submit.returncode == 0, submit.stderr
        secret = (run / "secret").read_text().strip()
        shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, timeout=30)
        assert name.encode() in shown.stdout
        status = hpcelastic(tmp_path, "status", "--json", job_id)
        assert status.returncode == 0 and json.loads(status.stdout)
        for what, text in (
            ("sbatch", submit.stdout + submit.stderr),
            ("scontrol", shown.stdout),
            ("status", status.stdout + status.stderr),
        ):
            assert secret.encode() not in text, f"the secret is in the output of {what}"
    finally:
        if job_id:
            subprocess.run(["scancel", job_id], capture_output=True, check=False)
    assert_private_tree(run, secret)
    assert {p.name for p in run.iterdir()} >= {
        "secret",
        "meta.json",
        "job.sbatch",
        "config.yaml",
        RunDir(run).events_path.name,
    }
    index = tmp_path / "state" / "hpcelastic" / "index.jsonl"
    assert stat.S_IMODE(index.stat().st_mode) == 0o600 and stat.S_IMODE(index.parent.stat().st_mode) == 0o700
