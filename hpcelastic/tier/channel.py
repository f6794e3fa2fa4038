"""The local tier's data channel: checkpoint files between the agents of one job, over TCP.

Hand-written because the control plane (``agent/protocol.py``) carries small JSON messages only, and no
library offers an authenticated, pickle-free bulk copy a Python agent can host in a thread: this is that
protocol's handshake and frames for the headers, with the file bytes in between.

A connection: the server's challenge, the client's authenticated ``hello`` naming the operation (``put`` a
part to the server, ``get`` a part from it), the checkpoint, the part's position and, for a put, the files
(path relative to the local directory, size), the server's authenticated answer, the files' bytes back to
back, and a ``done`` frame with a Poly1305 tag of each file under a one-time key of its own, derived from the
connection's session key and the file's place in the part (the cryptography package's Poly1305, run over each
chunk as it passes: about 9 GB/s a core here against HMAC-SHA256's 1.2 GB/s with the CPU's SHA instructions,
less without them; a 1 GB restore took 1.32 s with HMAC-SHA256, 0.91 s now: bench/tier_channel.py). The keys
come from the job secret as the control plane's do (with a label of their own) and every connection's are
fresh (both sides' nonces), so a stranger can neither send nor fetch a file, no one-time key serves twice, and
a replayed or altered byte fails its file's tag; a part is moved into place only once every tag verified. What
a peer names is checked before any handler sees it or a byte is reserved: a checkpoint is one plain path
component, a position ``N`` or ``G:R``, a file a relative path inside the directory, and a part at most
:data:`MAX_FILES` files and :data:`MAX_PART_BYTES` bytes.

The sender reads each file into one reused buffer, MACs those bytes and sends them; never a memory map, which
kills the agent with SIGBUS when the script truncates the file to save it again. A file that changes while
it is sent (a short read, or another size or mtime afterwards) fails the copy, so the receiver never takes
it into place. Replicas are sent throttled to the tier's rate (:class:`Throttle`: training runs meanwhile),
restores at full speed (the round waits for them); the receiver checks its budget before it accepts a byte.

After a failure every node fetches its parts at the same moment: the server serves :data:`MAX_CONNECTIONS`
at once and keeps up to :data:`MAX_WAITING` more waiting for a slot, oldest first (each at most
:data:`QUEUE_WAIT_S`), and a client tries again when the connection is refused, closed or reset before the
peer answered (:data:`ATTEMPTS` tries within :data:`RETRY_WITHIN_S`, with backoff and jitter). A refusal
the peer stated (no room, no copy here, a wrong secret) is final.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import random
import re
import shutil
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.poly1305 import Poly1305

from hpcelastic.agent import protocol

CHUNK = 4 << 20
CONNECT_TIMEOUT_S = 3.0
HANDSHAKE_TIMEOUT_S = 5.0
IO_TIMEOUT_S = 60.0
MAX_CONNECTIONS = 8
#: Connections over :data:`MAX_CONNECTIONS` wait for a slot, oldest first: at most this many, each this long
#: (a restore of many nodes fans in on each part's holder); more are closed, and their clients try again.
MAX_WAITING = 256
QUEUE_WAIT_S = 120.0
#: How often the listener wakes to close the connections that waited too long.
SWEEP_S = 1.0
#: A connection refused, closed or reset before the peer answered: at most this many tries, none started
#: later than this after the first, the waits between them doubling from BACKOFF_S (at most BACKOFF_MAX_S),
#: each a random half to whole of that (so that the nodes of a restore do not come back in step).
ATTEMPTS = 6
RETRY_WITHIN_S = 30.0
BACKOFF_S = 0.25
BACKOFF_MAX_S = 8.0
#: What a peer may name: a path component's and a relative path's length, a part's files and bytes.
MAX_NAME_BYTES = 255
MAX_REL_CHARS = 4096
MAX_FILES = 100_000
MAX_PART_BYTES = 1 << 40
#: Version 2: files tagged with Poly1305 (version 1: HMAC-SHA256), so agents of either never mix.
LABEL = b"hpcelastic/tier-data/2"
_POSITION = re.compile(r"[0-9]{1,9}(?::[0-9]{1,9})?")


class ChannelError(Exception):
    """A transfer that did not happen: the peer refused (its reason), is unreachable, or a MAC failed."""


class Unanswered(ChannelError):
    """The peer refused, closed or reset the connection before it answered: worth another try."""


@dataclass(frozen=True)
class FileRef:
    """One file of a part: its path relative to the local directory, where it is, its size."""

    rel: str
    path: Path
    size: int


def data_secret(secret: str) -> str:
    """The data channel's secret, derived from the job secret (a frame of one protocol is never valid in
    the other)."""
    return hmac.new(secret.encode(), LABEL, hashlib.sha256).hexdigest()


def _shown(value: Any) -> str:
    """A peer's value for a message: its repr, cut short (an answer's frame stays small)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _plain(part: str) -> bool:
    """Whether ``part`` is one plain path component: not empty, ``.`` or ``..``, no ``/`` or NUL, not long."""
    if part in ("", ".", "..") or "/" in part or "\0" in part:
        return False
    try:
        return len(os.fsencode(part)) <= MAX_NAME_BYTES
    except UnicodeError:
        return False


def safe_name(name: Any) -> str:
    """``name`` if it is a checkpoint's name, one plain path component; :class:`ChannelError` otherwise."""
    if not isinstance(name, str) or not _plain(name):
        raise ChannelError(f"bad checkpoint name {_shown(name)}")
    return name


def safe_position(position: Any) -> str:
    """``position`` if it is a part's position (``N``, or ``G:R`` with replica groups); :class:`ChannelError`
    otherwise."""
    if not isinstance(position, str) or not _POSITION.fullmatch(position):
        raise ChannelError(f"bad part position {_shown(position)}")
    return position


def safe_rel(rel: Any) -> str:
    """``rel`` if it is a plain relative path inside the local directory; :class:`ChannelError` otherwise."""
    if not isinstance(rel, str) or len(rel) > MAX_REL_CHARS or not all(_plain(p) for p in rel.split("/")):
        raise ChannelError(f"bad file name {_shown(rel)}")
    return rel


class Throttle:
    """At most ``rate`` bytes a second on average for the background sends of this agent (a token bucket of
    one second's worth); held (:meth:`hold`) while a restore runs, which has the node's bandwidth first."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._lock = threading.Lock()
        self._tokens = rate
        self._t = time.monotonic()
        self._open = threading.Event()
        self._open.set()

    def take(self, n: int) -> None:
        self._open.wait()
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.rate, self._tokens + (now - self._t) * self.rate)
            self._t = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Background sends wait while the block runs."""
        self._open.clear()
        try:
            yield
        finally:
            self._open.set()


def _file_mac(session: protocol.Session, index: int) -> Poly1305:
    """File ``index``'s one-time authenticator on this connection (its key used for that file only)."""
    return Poly1305(session.derive(f"tier-file/{index}"))


def send_files(
    sock: socket.socket, files: Sequence[FileRef], session: protocol.Session, throttle: Throttle | None
) -> list[str]:
    """Send the files' bytes, read into one reused buffer (a file mapped into memory and truncated meanwhile
    would be a SIGBUS), each chunk MACed and sent; their MACs, in order. :class:`ChannelError` if a file
    changed while it was sent: the connection is then dropped mid-part, so the receiver never takes it."""
    buf = memoryview(bytearray(CHUNK))
    macs = []
    for i, f in enumerate(files):
        mac = _file_mac(session, i)
        fd = os.open(f.path, os.O_RDONLY)
        try:
            before = _stamp(fd)
            if before[0] != f.size:
                raise ChannelError(f"{f.rel} changed while it was sent")
            for off in range(0, f.size, CHUNK):
                n = min(CHUNK, f.size - off)
                if throttle is not None:
                    throttle.take(n)
                chunk = _read(fd, buf[:n], off, f.rel)
                mac.update(chunk)
                sock.sendall(chunk)
            if _stamp(fd) != before:
                raise ChannelError(f"{f.rel} changed while it was sent")
        finally:
            os.close(fd)
        macs.append(mac.finalize().hex())
    return macs


def _stamp(fd: int) -> tuple[int, int]:
    """A file's size and mtime: a write moves them. Not its ctime, which a hard link or a rename moves too
    (a restore links the replica a peer may be fetching at that moment)."""
    st = os.fstat(fd)
    return st.st_size, st.st_mtime_ns


def _read(fd: int, view: memoryview, offset: int, rel: str) -> memoryview:
    """``view`` filled from ``offset`` of the file; :class:`ChannelError` if the file ends before."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise ChannelError(f"{rel} changed while it was sent")
        got += n
    return view


def recv_files(
    sock: socket.socket, files: Sequence[tuple[str, int]], dest: Path, session: protocol.Session
) -> list[str]:
    """Receive the files' bytes into ``dest``/rel; their MACs, in order. Each chunk is filled whole before it
    is MACed and written (one call each per chunk, not per segment the socket hands over)."""
    view = memoryview(bytearray(CHUNK))
    macs = []
    for i, (rel, size) in enumerate(files):
        mac = _file_mac(session, i)
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            left = size
            while left:
                chunk = _recv_chunk(sock, view[: min(CHUNK, left)])
                mac.update(chunk)
                written = 0
                while written < len(chunk):
                    written += os.write(fd, chunk[written:])
                left -= len(chunk)
        finally:
            os.close(fd)
        macs.append(mac.finalize().hex())
    return macs


def _recv_chunk(sock: socket.socket, view: memoryview) -> memoryview:
    """``view`` filled from the socket; :class:`ChannelError` if the peer closes it before."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ChannelError("the peer closed the connection mid-file")
        got += n
    return view


def _check_macs(got: list[str], sent: Any) -> None:
    if not isinstance(sent, list) or len(sent) != len(got):
        raise ChannelError("the file MACs are missing")
    if not all(isinstance(s, str) and hmac.compare_digest(s, g) for s, g in zip(sent, got, strict=True)):
        raise ChannelError("a file failed its MAC (altered or replayed)")


def _file_list(value: Any) -> list[tuple[str, int]]:
    """A peer's list of a part's files, checked: each a relative path inside the directory, once, and the
    count and sizes within bounds (before anything is reserved for them)."""
    if not isinstance(value, list):
        raise ChannelError("no file list")
    if len(value) > MAX_FILES:
        raise ChannelError(f"a part of {len(value)} files (at most {MAX_FILES})")
    out: list[tuple[str, int]] = []
    seen: set[str] = set()
    for item in value:
        if not (isinstance(item, list) and len(item) == 2 and type(item[1]) is int and item[1] >= 0):
            raise ChannelError(f"bad file entry {_shown(item)}")
        rel, size = safe_rel(item[0]), item[1]
        if rel in seen:
            raise ChannelError(f"{rel} is listed twice")
        seen.add(rel)
        out.append((rel, size))
    total = sum(size for _, size in out)
    if total > MAX_PART_BYTES:
        raise ChannelError(f"a part of {total} bytes (at most {MAX_PART_BYTES})")
    return out


# ---- client -----------------------------------------------------------------------------------------
def _connect(
    address: str, port: int, secret: str, hello: dict[str, Any], attempts: int, within_s: float
) -> tuple[socket.socket, protocol.Session, dict[str, Any]]:
    """A connection the peer accepted, tried again while it goes unanswered (``attempts`` tries at most,
    none started ``within_s`` after the first)."""
    deadline = time.monotonic() + within_s
    attempt = 1
    while True:
        try:
            return _connect_once(address, port, secret, hello)
        except Unanswered as e:
            left = deadline - time.monotonic()
            if attempt >= attempts or left <= 0:
                raise Unanswered(f"{e}; {attempt} tries" if attempt > 1 else str(e)) from None
            time.sleep(min(left, _backoff(attempt)))
            attempt += 1


def _backoff(attempt: int) -> float:
    """The wait after try ``attempt``: doubling, jittered."""
    return min(BACKOFF_MAX_S, BACKOFF_S * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)


def _connect_once(
    address: str, port: int, secret: str, hello: dict[str, Any]
) -> tuple[socket.socket, protocol.Session, dict[str, Any]]:
    try:
        sock = socket.create_connection((address, port), timeout=CONNECT_TIMEOUT_S)
    except OSError as e:
        raise Unanswered(f"cannot reach {address}:{port} ({e.strerror or e})") from None
    sock.settimeout(QUEUE_WAIT_S + HANDSHAKE_TIMEOUT_S)  # the server may keep it waiting for a slot
    try:
        session, reply = protocol.client_handshake(sock, data_secret(secret), hello)
    except OSError as e:
        sock.close()
        raise Unanswered(f"{address}:{port} dropped the connection ({e.strerror or e})") from None
    except protocol.ProtocolError as e:
        sock.close()
        raise ChannelError(f"{address}:{port} refused: {e}") from None
    if not reply.get("ok"):
        sock.close()
        raise ChannelError(str(reply.get("why") or "refused"))
    sock.settimeout(IO_TIMEOUT_S)
    return sock, session, reply


def put(
    address: str,
    port: int,
    secret: str,
    name: str,
    position: str,
    files: Sequence[FileRef],
    throttle: Throttle,
    *,
    attempts: int = ATTEMPTS,
    within_s: float = RETRY_WITHIN_S,
) -> None:
    """Copy ``files`` (part ``position`` of checkpoint ``name``) to the agent at ``address:port``; a
    connection unanswered is tried again, ``attempts`` times at most, none started after ``within_s``."""
    hello = {
        "op": "put",
        "name": safe_name(name),
        "position": safe_position(position),
        "files": [[f.rel, f.size] for f in files],
    }
    sock, session, _ = _connect(address, port, secret, hello, attempts, within_s)
    with sock:
        try:
            macs = send_files(sock, files, session, throttle)
            sock.sendall(session.encode({"t": "done", "macs": macs}))
            answer = session.decode(protocol.recv_payload(sock))
        except (OSError, protocol.ProtocolError) as e:
            raise ChannelError(f"copy to {address}:{port} failed: {e}") from None
    if not answer.get("ok"):
        raise ChannelError(str(answer.get("why") or "not stored"))


def get(
    address: str,
    port: int,
    secret: str,
    name: str,
    position: str,
    dest: Path,
    reserve: Callable[[int], str | None],
    *,
    attempts: int = ATTEMPTS,
    within_s: float = RETRY_WITHIN_S,
) -> list[tuple[str, int]]:
    """Fetch part ``position`` of checkpoint ``name`` from the agent at ``address:port`` into ``dest``
    (files under their relative paths); ``reserve(bytes)`` may refuse it (its reason) before any byte. A
    connection unanswered is tried again, ``attempts`` times at most, none started after ``within_s``."""
    hello = {"op": "get", "name": safe_name(name), "position": safe_position(position)}
    sock, session, reply = _connect(address, port, secret, hello, attempts, within_s)
    with sock:
        try:
            files = _file_list(reply.get("files"))
            why = reserve(sum(size for _, size in files))
            if why:
                raise ChannelError(why)
            sock.sendall(session.encode({"t": "go"}))
            macs = recv_files(sock, files, dest, session)
            _check_macs(macs, session.decode(protocol.recv_payload(sock)).get("macs"))
        except (OSError, protocol.ProtocolError) as e:
            raise ChannelError(f"fetch from {address}:{port} failed: {e}") from None
    return files


# ---- server -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Handlers:
    """What the server asks its agent: the files of a part it holds; room for an incoming part (None, or
    why not), given back with ``release`` once the part is in place or failed; a fresh staging directory;
    and to take a received part into place."""

    part_files: Callable[[str, str], list[FileRef] | None]
    reserve: Callable[[str, str, int], str | None]
    release: Callable[[int], None]
    staging: Callable[[], Path]
    received: Callable[[str, str, Path, list[tuple[str, int]]], None]


class DataServer:
    """Serves ``put`` and ``get`` on a listening socket, one thread per connection: at most
    :data:`MAX_CONNECTIONS` at once, up to :data:`MAX_WAITING` more waiting for a slot."""

    def __init__(self, secret: str, handlers: Handlers, throttle: Throttle) -> None:
        self._secret = data_secret(secret)
        self._handlers = handlers
        self._throttle = throttle
        self._sock = socket.create_server(("", 0), backlog=MAX_WAITING)
        self._sock.settimeout(SWEEP_S)
        self._lock = threading.Lock()
        self._busy = 0
        #: Connections waiting for a slot, oldest first, with the time they are closed unserved.
        self._waiting: deque[tuple[socket.socket, float]] = deque()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="hpcelastic-tier-data", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._lock:
            waiting = [conn for conn, _ in self._waiting]
            self._waiting.clear()
        for conn in waiting:
            conn.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                self._dispatch()
                continue
            except OSError:
                return
            self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        """Serve ``conn`` now, or have it wait for a slot; with too many waiting, close it (the client tries
        again later)."""
        with self._lock:
            now = self._busy < MAX_CONNECTIONS and not self._closed.is_set()
            if now:
                self._busy += 1
            elif len(self._waiting) < MAX_WAITING and not self._closed.is_set():
                self._waiting.append((conn, time.monotonic() + QUEUE_WAIT_S))
                return
        if now:
            self._start(conn)
        else:
            conn.close()

    def _dispatch(self) -> None:
        """Give the free slots to the connections waiting longest; close those that waited too long."""
        start, expired = [], []
        with self._lock:
            now = time.monotonic()
            while self._waiting and self._waiting[0][1] <= now:
                expired.append(self._waiting.popleft()[0])
            while self._waiting and self._busy < MAX_CONNECTIONS:
                start.append(self._waiting.popleft()[0])
                self._busy += 1
        for conn in expired:
            conn.close()
        for conn in start:
            self._start(conn)

    def _start(self, conn: socket.socket) -> None:
        threading.Thread(target=self._run, args=(conn,), daemon=True, name="hpcelastic-tier-conn").start()

    def _run(self, conn: socket.socket) -> None:
        try:
            self._serve(conn)
        finally:
            with self._lock:
                self._busy -= 1
            self._dispatch()

    def _serve(self, conn: socket.socket) -> None:
        staging: Path | None = None
        try:
            with conn:
                session, hello = self._handshake(conn)
                conn.settimeout(IO_TIMEOUT_S)
                try:
                    op, name, position = _request(hello)
                    files = _file_list(hello.get("files")) if op == "put" else []
                except ChannelError as e:  # before any handler sees a name or a byte is reserved
                    conn.sendall(session.encode({"t": "welcome", "ok": False, "why": str(e)}))
                    return
                if op == "get":
                    self._serve_get(conn, session, name, position)
                else:
                    staging = self._handlers.staging()
                    self._serve_put(conn, session, name, position, files, staging)
        except (OSError, protocol.ProtocolError, ChannelError):
            pass  # a stranger, a peer gone or a failed MAC: nothing was taken into place
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)

    def _handshake(self, conn: socket.socket) -> tuple[protocol.Session, dict[str, Any]]:
        """The client's authenticated ``hello``; a wrong secret is answered (so the client does not try
        again) and raised."""
        conn.settimeout(HANDSHAKE_TIMEOUT_S)  # a stranger holds a slot for seconds, not a minute
        nonce = protocol.new_nonce()
        conn.sendall(
            protocol.encode_plain({"t": "challenge", "nonce": nonce, "v": protocol.PROTOCOL_VERSION})
        )
        payload = protocol.recv_payload(conn)
        try:
            return protocol.server_accept_hello(self._secret, nonce, payload)
        except protocol.ProtocolError as e:
            auth = isinstance(e, protocol.AuthError)
            conn.sendall(protocol.encode_plain({"t": "error", "error": str(e), "auth": auth}))
            raise

    def _serve_get(self, conn: socket.socket, session: protocol.Session, name: str, position: str) -> None:
        files = self._handlers.part_files(name, position)
        if files is None:
            conn.sendall(
                session.encode(
                    {"t": "welcome", "ok": False, "why": f"no copy of {name} part {position} here"}
                )
            )
            return
        conn.sendall(session.encode({"t": "welcome", "ok": True, "files": [[f.rel, f.size] for f in files]}))
        if session.decode(protocol.recv_payload(conn)).get("t") != "go":
            return
        # A restore: the round waits for it and no training runs meanwhile, so it is not throttled.
        macs = send_files(conn, files, session, None)
        conn.sendall(session.encode({"t": "done", "macs": macs}))

    def _serve_put(
        self,
        conn: socket.socket,
        session: protocol.Session,
        name: str,
        position: str,
        files: list[tuple[str, int]],
        staging: Path,
    ) -> None:
        size = sum(n for _, n in files)
        why = self._handlers.reserve(name, position, size)
        if why is not None:
            conn.sendall(session.encode({"t": "welcome", "ok": False, "why": why}))
            return
        try:  # from here on the room is given back whatever happens (the peer may be gone already)
            conn.sendall(session.encode({"t": "welcome", "ok": True, "why": ""}))
            why = self._receive(conn, session, name, position, files, staging)
        finally:
            self._handlers.release(size)
        conn.sendall(session.encode({"t": "stored", "ok": why is None, "why": why or ""}))

    def _receive(
        self,
        conn: socket.socket,
        session: protocol.Session,
        name: str,
        position: str,
        files: list[tuple[str, int]],
        staging: Path,
    ) -> str | None:
        """The part into ``staging`` and, every MAC verified, into place; None, or why it was not."""
        try:
            macs = recv_files(conn, files, staging, session)
            _check_macs(macs, session.decode(protocol.recv_payload(conn)).get("macs"))
            self._handlers.received(name, position, staging, files)
        except (ChannelError, OSError) as e:
            return str(e)
        return None


def _request(hello: dict[str, Any]) -> tuple[str, str, str]:
    """The operation, checkpoint and part position a ``hello`` asks for, checked."""
    op = hello.get("op")
    if op not in ("get", "put"):
        raise ChannelError(f"unknown operation {_shown(op)}")
    return str(op), safe_name(hello.get("name")), safe_position(hello.get("position"))
