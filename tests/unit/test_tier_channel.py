"""The local tier's data channel (hpcelastic/tier/channel.py) against hostile and unlucky peers, on real
sockets and a real DataServer: what a peer names is checked before any handler sees it, a reservation is
always given back, a file rewritten while it is sent fails the copy (never a signal), a restore's fan-in
waits for a slot and tries again, and a part's declared files are bounded."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hpcelastic.agent import protocol
from hpcelastic.tier import channel

SECRET = "s3cret"
MB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


class Agent:
    """A data server's agent: serves the parts in ``held``, takes puts into ``root``/replicas, and records
    every handler call and the room it has reserved. ``reserve`` and ``part_files`` set ``entered`` and wait
    for ``gate`` (open unless cleared)."""

    def __init__(self, root: Path, budget: int = 1 << 30, secret: str = SECRET) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.budget = budget
        self.held: dict[tuple[str, str], list[channel.FileRef]] = {}
        self.calls: list[str] = []
        self.received: list[tuple[str, str, list[tuple[str, int]]]] = []
        self.reserved = 0
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()
        self._lock = threading.Lock()
        self._count = 0
        handlers = channel.Handlers(self.part_files, self.reserve, self.release, self.staging, self.take)
        self.server = channel.DataServer(secret, handlers, channel.Throttle(1 << 30))

    def part_files(self, name: str, position: str) -> list[channel.FileRef] | None:
        self._call("part_files")
        self.entered.set()
        self.gate.wait(10)
        return self.held.get((name, position))

    def reserve(self, name: str, position: str, size: int) -> str | None:
        self._call("reserve")
        self.entered.set()
        self.gate.wait(10)
        with self._lock:
            if self.reserved + size > self.budget:
                return f"{size} bytes do not fit"
            self.reserved += size
        return None

    def release(self, size: int) -> None:
        with self._lock:
            self.reserved -= size

    def staging(self) -> Path:
        self._call("staging")
        with self._lock:
            self._count += 1
            path = self.root / f"staging-{self._count}"
        path.mkdir()
        return path

    def take(self, name: str, position: str, staging: Path, files: list[tuple[str, int]]) -> None:
        self._call("received")
        for rel, _ in files:
            target = self.root / "replicas" / position / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / rel, target)
        self.received.append((name, position, files))

    def _call(self, name: str) -> None:
        with self._lock:
            self.calls.append(name)

    def stagings(self) -> list[Path]:
        return sorted(self.root.glob("staging-*"))


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Callable[..., Agent]]:
    made: list[Agent] = []

    def make(name: str = "peer", **kw: Any) -> Agent:
        made.append(Agent(tmp_path / name, **kw))
        return made[-1]

    yield make
    for a in made:
        a.server.close()


class Front:
    """A TCP front for ``port`` that resets its first ``drop`` connections and forwards the others: it
    counts the connections a client makes."""

    def __init__(self, port: int, drop: int) -> None:
        self.upstream = port
        self.drop = drop
        self.count = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def close(self) -> None:
        self.sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.count += 1
            if self.count <= self.drop:
                reset(conn)
                continue
            up = socket.create_connection(("127.0.0.1", self.upstream))
            threading.Thread(target=_forward, args=(conn, up), daemon=True).start()


def _forward(a: socket.socket, b: socket.socket) -> None:
    pumps = [threading.Thread(target=_pump, args=pair) for pair in ((a, b), (b, a))]
    for t in pumps:
        t.start()
    for t in pumps:
        t.join()
    a.close()
    b.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(1 << 16):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


def reset(sock: socket.socket) -> None:
    """Close ``sock`` with a reset, as a peer that vanished."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def ask(port: int, hello: dict[str, Any]) -> dict[str, Any]:
    """A hand-made client's hello, and the server's answer to it."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        _, reply = protocol.client_handshake(s, channel.data_secret(SECRET), hello)
    return reply


def wait_for(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.01)
    return check()


def a_part(root: Path, sizes: tuple[int, ...] = (4 * MB + 3, 10)) -> list[channel.FileRef]:
    d = root / "live" / "step-5"
    d.mkdir(parents=True)
    refs = []
    for i, size in enumerate(sizes):
        (d / f"f{i}").write_bytes(os.urandom(size))
        refs.append(channel.FileRef(f"step-5/f{i}", d / f"f{i}", size))
    return refs


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- 1. what a peer names -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("op", "name", "position"),
    [
        ("put", "../escape", "0"),
        ("put", "a/b", "0"),
        ("put", ".", "0"),
        ("get", "..", "0"),
        ("put", "x\0y", "0"),
        ("put", "", "0"),
        ("put", "n" * 256, "0"),
        ("put", 5, "0"),
        ("put", "step-5", "../../x"),
        ("get", "step-5", "0/.."),
        ("get", "step-5", "1:"),
        ("get", "step-5", "1:2:3"),
        ("get", "step-5", "\u0663"),  # a digit, but not 0-9
        ("get", "step-5", "1\n"),
        ("get", "step-5", None),
    ],
)
def test_a_bad_name_or_position_is_refused_before_any_handler(
    agent: Callable[..., Agent], op: str, name: Any, position: Any
) -> None:
    """The server refuses it with its reason: no handler called, no staging made, nothing written."""
    a = agent()
    hello = {"op": op, "name": name, "position": position, "files": [["f", 1]]}
    reply = ask(a.server.port, hello)
    assert not reply["ok"] and reply["why"].startswith("bad ")
    assert a.calls == [] and list(a.root.iterdir()) == []


def test_names_and_positions_are_checked_on_the_client_too() -> None:
    """Well-formed ones pass; a bad one fails put and get before they connect (port 1 has no server)."""
    for good in ("step-5", "step-000300.pt", "last.ckpt", "n" * 255):
        assert channel.safe_name(good) == good
    for good in ("0", "12", "1:3"):
        assert channel.safe_position(good) == good
    with pytest.raises(channel.ChannelError, match="bad checkpoint name"):
        channel.get("127.0.0.1", 1, SECRET, "../x", "0", Path("/nonexistent"), lambda n: None)
    with pytest.raises(channel.ChannelError, match="bad part position"):
        channel.put("127.0.0.1", 1, SECRET, "step-5", "../0", [], channel.Throttle(MB))
    with pytest.raises(channel.ChannelError, match="bad file name"):
        channel.safe_rel("a/" + "n" * 256)


# ---- 2. a reservation is always given back --------------------------------------------------------
@pytest.mark.parametrize("when", ["before the welcome", "after the welcome"])
def test_a_put_reset_after_its_reservation_gives_the_room_back(
    agent: Callable[..., Agent], when: str
) -> None:
    """The client resets the connection once the server reserved room for its part, before the server's
    welcome is sent (the welcome's send fails) or after it (before the first byte): the room comes back,
    nothing is taken, the staging goes."""
    a = agent()
    if when == "before the welcome":
        a.gate.clear()  # reserve() waits until the client is gone
    hello = {"op": "put", "name": "step-5", "position": "0", "files": [["step-5/f0", 3 * MB]]}
    s = socket.create_connection(("127.0.0.1", a.server.port), timeout=10)
    session, frame = protocol.client_hello(channel.data_secret(SECRET), protocol.recv_payload(s), hello)
    s.sendall(frame)
    if when == "after the welcome":
        assert protocol.client_welcome(session, protocol.recv_payload(s))["ok"]
    assert a.entered.wait(10) and a.calls[-1] == "reserve"
    reset(s)
    time.sleep(0.1)
    a.gate.set()
    assert wait_for(lambda: a.reserved == 0 and a.stagings() == []), f"{a.reserved} bytes still reserved"
    assert a.received == []


# ---- 3. a file rewritten while it is sent -----------------------------------------------------------
SENDER = """
import sys
from pathlib import Path
from hpcelastic.tier import channel
port, path = int(sys.argv[1]), Path(sys.argv[2])
ref = channel.FileRef(path.name, path, path.stat().st_size)
try:
    channel.put("127.0.0.1", port, sys.argv[3], path.name, "0", [ref], channel.Throttle(channel.CHUNK))
except channel.ChannelError as e:
    print(e)
"""


def test_a_file_rewritten_while_it_is_sent_fails_the_copy_without_a_signal(
    agent: Callable[..., Agent], tmp_path: Path
) -> None:
    """The script saves ``last.ckpt`` again (truncated first, then written) while the agent sends it,
    throttled to one chunk a second, in a process of its own (a SIGBUS there must not end the tests): the
    sender reports the change and lives, the receiver never takes the file, its staging and room go."""
    a = agent()
    ckpt = tmp_path / "last.ckpt"
    ckpt.write_bytes(os.urandom(4 * channel.CHUNK))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    sender = subprocess.Popen(
        [sys.executable, "-c", SENDER, str(a.server.port), str(ckpt), SECRET],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        arrived = a.root / "staging-1" / "last.ckpt"
        assert wait_for(lambda: arrived.exists() and arrived.stat().st_size > 0, 20), "nothing arrived"
        with open(ckpt, "wb"):  # torch.save: truncate, then write the new checkpoint
            time.sleep(1.5)  # the sender's next chunk is due meanwhile
        ckpt.write_bytes(os.urandom(4 * channel.CHUNK))
        out, err = sender.communicate(timeout=30)
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait()
    assert sender.returncode == 0, f"the sender died (exit {sender.returncode}): {err[-2000:]}"
    assert "last.ckpt changed while it was sent" in out
    assert wait_for(lambda: a.stagings() == [] and a.reserved == 0)
    assert a.received == [] and "received" not in a.calls


def test_a_hard_link_made_while_a_file_is_sent_does_not_fail_it(
    agent: Callable[..., Agent], tmp_path: Path
) -> None:
    """A restore hard-links a replica into place while a peer may be fetching it: that moves the file's
    ctime, not its bytes, so the copy goes through."""
    a = agent()
    files = a_part(tmp_path, (3 * channel.CHUNK,))
    errors: list[Exception] = []

    def send() -> None:
        try:
            channel.put("127.0.0.1", a.server.port, SECRET, "step-5", "0", files, channel.Throttle(8 * MB))
        except channel.ChannelError as e:
            errors.append(e)

    t = threading.Thread(target=send)
    t.start()
    arrived = a.root / "staging-1" / "step-5" / "f0"
    assert wait_for(lambda: arrived.exists() and arrived.stat().st_size > 0)
    os.link(files[0].path, tmp_path / "linked")
    t.join(30)
    assert errors == [] and len(a.received) == 1
    assert digest(a.root / "replicas" / "0" / "step-5" / "f0") == digest(files[0].path)


# ---- 4. a restore's fan-in ----------------------------------------------------------------------------
def test_forty_concurrent_gets_of_one_part_all_succeed(agent: Callable[..., Agent], tmp_path: Path) -> None:
    """Every node of a 40-node restore fetches the same part at once from its one holder (which serves
    MAX_CONNECTIONS at a time): every fetch completes and verifies."""
    a = agent()
    files = a_part(tmp_path)
    a.held[("step-5", "0")] = files
    want = {f.rel: digest(f.path) for f in files}
    start = threading.Barrier(40)
    results: dict[int, Any] = {}

    def fetch(i: int) -> None:
        start.wait()
        dest = tmp_path / f"node-{i}"
        try:
            got = channel.get("127.0.0.1", a.server.port, SECRET, "step-5", "0", dest, lambda n: None)
            results[i] = {rel: digest(dest / rel) for rel, _ in got}
        except channel.ChannelError as e:
            results[i] = e

    threads = [threading.Thread(target=fetch, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    failed = {i: r for i, r in results.items() if r != want}
    assert len(results) == 40 and failed == {}


def test_a_connection_over_the_cap_waits_for_a_slot_but_not_forever(
    agent: Callable[..., Agent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the one slot held, a second connection gets no challenge yet and is not closed; it is closed
    once it waited QUEUE_WAIT_S (its client tries again)."""
    monkeypatch.setattr(channel, "MAX_CONNECTIONS", 1)
    monkeypatch.setattr(channel, "QUEUE_WAIT_S", 0.5)
    monkeypatch.setattr(channel, "SWEEP_S", 0.1)
    a = agent()
    a.gate.clear()
    holder = threading.Thread(
        target=ask, args=(a.server.port, {"op": "get", "name": "step-5", "position": "0"})
    )
    holder.start()
    assert a.entered.wait(10)
    with socket.create_connection(("127.0.0.1", a.server.port), timeout=5) as s:
        s.settimeout(0.3)
        with pytest.raises(TimeoutError):
            s.recv(1)  # waiting: neither served nor closed
        s.settimeout(5)
        t0 = time.monotonic()
        assert s.recv(1) == b""  # closed unserved once it waited its time
        assert time.monotonic() - t0 < 2
    a.gate.set()
    holder.join(10)


def test_a_connection_dropped_before_an_answer_is_tried_again(
    agent: Callable[..., Agent], tmp_path: Path
) -> None:
    """The first two connections of a get and of a put are reset before the server answered: the third
    goes through (connections counted at a front)."""
    a = agent()
    files = a_part(tmp_path)
    a.held[("step-5", "0")] = files
    front = Front(a.server.port, drop=2)
    got = channel.get("127.0.0.1", front.port, SECRET, "step-5", "0", tmp_path / "got", lambda n: None)
    assert front.count == 3 and [rel for rel, _ in got] == [f.rel for f in files]
    front.count = 0
    channel.put("127.0.0.1", front.port, SECRET, "step-5", "1", files, channel.Throttle(1 << 30))
    assert front.count == 3 and len(a.received) == 1
    front.close()


def test_a_full_queue_closes_and_the_client_comes_back(
    agent: Callable[..., Agent], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One slot and no room to wait: the second get is closed while the first holds the slot, and its
    retries get it served once the slot is free."""
    monkeypatch.setattr(channel, "MAX_CONNECTIONS", 1)
    monkeypatch.setattr(channel, "MAX_WAITING", 0)
    a = agent()
    a.held[("step-5", "0")] = a_part(tmp_path)
    a.gate.clear()
    first = threading.Thread(
        target=channel.get,
        args=("127.0.0.1", a.server.port, SECRET, "step-5", "0", tmp_path / "first", lambda n: None),
    )
    first.start()
    assert a.entered.wait(10)
    threading.Timer(0.5, a.gate.set).start()
    got = channel.get("127.0.0.1", a.server.port, SECRET, "step-5", "0", tmp_path / "second", lambda n: None)
    first.join(10)
    assert len(got) == 2 and (tmp_path / "first" / "step-5" / "f0").exists()


@pytest.mark.parametrize("refusal", ["no copy", "do not fit", "auth"])
def test_a_stated_refusal_is_not_tried_again(
    agent: Callable[..., Agent], tmp_path: Path, refusal: str
) -> None:
    """No copy here, no room, a wrong secret: each is final after one connection."""
    a = agent(budget=MB, secret="other" if refusal == "auth" else SECRET)
    front = Front(a.server.port, drop=0)
    with pytest.raises(channel.ChannelError, match=refusal):
        if refusal == "do not fit":
            channel.put(
                "127.0.0.1", front.port, SECRET, "step-5", "0", a_part(tmp_path), channel.Throttle(MB)
            )
        else:
            channel.get("127.0.0.1", front.port, SECRET, "step-5", "0", tmp_path / "x", lambda n: None)
    assert front.count == 1
    front.close()


def test_tries_stop_at_their_bound(agent: Callable[..., Agent], tmp_path: Path) -> None:
    """A peer that never answers: ``attempts`` connections, or none started after ``within_s``."""
    a = agent()
    front = Front(a.server.port, drop=1000)
    dest = tmp_path / "x"
    with pytest.raises(channel.Unanswered, match="3 tries"):
        channel.get("127.0.0.1", front.port, SECRET, "step-5", "0", dest, lambda n: None, attempts=3)
    assert front.count == 3
    front.count = 0
    t0 = time.monotonic()
    with pytest.raises(channel.Unanswered):
        channel.get(
            "127.0.0.1", front.port, SECRET, "step-5", "0", dest, lambda n: None, attempts=100, within_s=0.3
        )
    assert time.monotonic() - t0 < 2 and 1 <= front.count < 10
    front.close()


# ---- 5. a part's declared files are bounded ---------------------------------------------------------
HOSTILE_LISTS = {
    "too many files": [["a", 0]] * (channel.MAX_FILES + 1),
    "a file over the bound": [["a", channel.MAX_PART_BYTES + 1]],
    "a total over the bound": [["a", channel.MAX_PART_BYTES // 2 + 1], ["b", channel.MAX_PART_BYTES // 2]],
    "a negative size": [["a", -1]],
    "a size that is not an integer": [["a", 1.5]],
    "a boolean size": [["a", True]],
    "a path outside": [["../a", 1]],
    "a file twice": [["a", 1], ["a", 1]],
    "no list": "a",
}


@pytest.mark.parametrize("files", HOSTILE_LISTS.values(), ids=HOSTILE_LISTS.keys())
def test_a_hostile_file_list_is_refused_before_room_is_reserved(
    agent: Callable[..., Agent], files: Any
) -> None:
    """A put declaring it: refused with the reason, no handler called, nothing written."""
    a = agent()
    reply = ask(a.server.port, {"op": "put", "name": "step-5", "position": "0", "files": files})
    assert not reply["ok"] and reply["why"]
    assert a.calls == [] and list(a.root.iterdir()) == []


@pytest.mark.parametrize(
    "declared",
    [
        [("step-5/f0", 2 << 40)],
        [("step-5/f0", 3), ("step-5/f1", channel.MAX_PART_BYTES)],
        [("../evil", 3)],
        [("step-5/f0", 3), ("step-5/f0", 3)],
    ],
    ids=["a file over the bound", "a total over the bound", "a path outside", "a file twice"],
)
def test_get_refuses_a_hostile_file_list_before_reserving(
    agent: Callable[..., Agent], tmp_path: Path, declared: list[tuple[str, int]]
) -> None:
    """A peer whose answer to a get declares it: the fetch fails before ``reserve`` and writes nothing."""
    a = agent()
    small = tmp_path / "small"
    small.write_bytes(b"abc")
    a.held[("step-5", "0")] = [channel.FileRef(rel, small, size) for rel, size in declared]
    asked: list[int] = []
    dest = tmp_path / "dest"
    with pytest.raises(channel.ChannelError):
        channel.get("127.0.0.1", a.server.port, SECRET, "step-5", "0", dest, lambda n: asked.append(n))
    assert asked == [] and not dest.exists() and not (tmp_path / "evil").exists()


def test_each_file_is_tagged_under_a_key_of_its_own_on_each_connection(tmp_path: Path) -> None:
    """Poly1305 keys are one-time: the same bytes as another file of the part, or on another connection,
    get another tag, so a file moved to another place or replayed from another transfer fails its tag."""
    path = tmp_path / "a"
    path.write_bytes(os.urandom(3 * MB))
    same = [channel.FileRef("a", path, 3 * MB), channel.FileRef("b", path, 3 * MB)]

    def tags(key: bytes) -> list[str]:
        a, b = socket.socketpair()
        with a, b:
            drain = threading.Thread(target=_drain, args=(b,))
            drain.start()
            got = channel.send_files(a, same, protocol.Session(key, is_server=True), None)
            a.close()
            drain.join()
        return got

    first = tags(b"k" * 32)
    assert first[0] != first[1]  # the same bytes at another place in the part
    assert tags(b"j" * 32)[0] != first[0]  # the same file on another connection
    assert tags(b"k" * 32) == first  # and the tag is the bytes' and the key's alone


def _drain(sock: socket.socket) -> None:
    buf = bytearray(MB)
    while sock.recv_into(buf):
        pass
