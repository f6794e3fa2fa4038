"""The local tier's data channel: checkpoint files between the agents of one job, over TCP.

Hand-written because the control plane (``agent/protocol.py``) carries small JSON messages only, and no
library offers an authenticated, pickle-free bulk copy a Python agent can host in a thread: this is that
protocol's handshake and frames for the headers, with the file bytes in between sent by ``sendfile`` (no
copy into Python on the sending side).

A connection: the server's challenge, the client's authenticated ``hello`` naming the operation (``put``
a part to the server, ``get`` a part from it) and the files (path relative to the local directory, size),
the server's authenticated answer, the files' bytes back to back, and a ``done`` frame with an
HMAC-SHA256 of each file under a key derived from the connection's session key. The keys come from the job
secret as the control plane's do (with a label of their own), so a stranger can neither send nor fetch a
file, and a replayed or altered byte fails its file's MAC; a part is moved into place only once every MAC
verified. Replicas are sent throttled to the tier's rate (:class:`Throttle`: training runs meanwhile),
restores at full speed (the round waits for them); the receiver checks its budget before it accepts a byte.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import mmap
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcelastic.agent import protocol

CHUNK = 4 << 20
CONNECT_TIMEOUT_S = 3.0
HANDSHAKE_TIMEOUT_S = 5.0
IO_TIMEOUT_S = 60.0
MAX_CONNECTIONS = 8
LABEL = b"hpcelastic/tier-data/1"


class ChannelError(Exception):
    """A transfer that did not happen: the peer refused (its reason), is unreachable, or a MAC failed."""


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


def safe_rel(rel: Any) -> str:
    """``rel`` if it is a plain relative path inside the local directory; :class:`ChannelError` otherwise."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\0" in rel:
        raise ChannelError(f"bad file name {rel!r}")
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ChannelError(f"bad file name {rel!r}")
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


def _file_mac(session: protocol.Session) -> hmac.HMAC:
    return hmac.new(session.derive("tier-file"), digestmod=hashlib.sha256)


def send_files(
    sock: socket.socket, files: Sequence[FileRef], session: protocol.Session, throttle: Throttle | None
) -> list[str]:
    """Send the files' bytes (``sendfile``); their MACs, in order."""
    macs = []
    for i, f in enumerate(files):
        mac = _file_mac(session)
        mac.update(i.to_bytes(8, "big"))
        with open(f.path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size != f.size:
                raise ChannelError(f"{f.rel} changed size while it was sent")
            if size:
                with mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ) as mm:
                    view = memoryview(mm)
                    for off in range(0, size, CHUNK):
                        n = min(CHUNK, size - off)
                        if throttle is not None:
                            throttle.take(n)
                        mac.update(view[off : off + n])
                        sock.sendfile(fh, off, n)
                    view.release()
        macs.append(mac.hexdigest())
    return macs


def recv_files(
    sock: socket.socket, files: Sequence[tuple[str, int]], dest: Path, session: protocol.Session
) -> list[str]:
    """Receive the files' bytes into ``dest``/rel; their MACs, in order."""
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    macs = []
    for i, (rel, size) in enumerate(files):
        mac = _file_mac(session)
        mac.update(i.to_bytes(8, "big"))
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            left = size
            while left:
                n = sock.recv_into(view[: min(CHUNK, left)])
                if not n:
                    raise ChannelError("the peer closed the connection mid-file")
                mac.update(view[:n])
                written = 0
                while written < n:
                    written += os.write(fd, view[written:n])
                left -= n
        finally:
            os.close(fd)
        macs.append(mac.hexdigest())
    return macs


def _check_macs(got: list[str], sent: Any) -> None:
    if not isinstance(sent, list) or len(sent) != len(got):
        raise ChannelError("the file MACs are missing")
    if not all(isinstance(s, str) and hmac.compare_digest(s, g) for s, g in zip(sent, got, strict=True)):
        raise ChannelError("a file failed its MAC (altered or replayed)")


def _file_list(value: Any) -> list[tuple[str, int]]:
    if not isinstance(value, list):
        raise ChannelError("no file list")
    out = []
    for item in value:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], int) and item[1] >= 0):
            raise ChannelError(f"bad file entry {item!r}")
        out.append((safe_rel(item[0]), item[1]))
    return out


# ---- client -----------------------------------------------------------------------------------------
def _connect(
    address: str, port: int, secret: str, hello: dict[str, Any]
) -> tuple[socket.socket, protocol.Session, dict[str, Any]]:
    try:
        sock = socket.create_connection((address, port), timeout=CONNECT_TIMEOUT_S)
    except OSError as e:
        raise ChannelError(f"cannot reach {address}:{port} ({e.strerror or e})") from None
    sock.settimeout(IO_TIMEOUT_S)
    try:
        session, reply = protocol.client_handshake(sock, data_secret(secret), hello)
    except (OSError, protocol.ProtocolError) as e:
        sock.close()
        raise ChannelError(f"{address}:{port} refused: {e}") from None
    if not reply.get("ok"):
        sock.close()
        raise ChannelError(str(reply.get("why") or "refused"))
    return sock, session, reply


def put(
    address: str,
    port: int,
    secret: str,
    name: str,
    position: str,
    files: Sequence[FileRef],
    throttle: Throttle,
) -> None:
    """Copy ``files`` (part ``position`` of checkpoint ``name``) to the agent at ``address:port``."""
    hello = {"op": "put", "name": name, "position": position, "files": [[f.rel, f.size] for f in files]}
    sock, session, _ = _connect(address, port, secret, hello)
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
) -> list[tuple[str, int]]:
    """Fetch part ``position`` of checkpoint ``name`` from the agent at ``address:port`` into ``dest``
    (files under their relative paths); ``reserve(bytes)`` may refuse it (its reason) before any byte."""
    sock, session, reply = _connect(address, port, secret, {"op": "get", "name": name, "position": position})
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
    """Serves ``put`` and ``get`` on a listening socket, one thread per connection (at most
    :data:`MAX_CONNECTIONS` at once)."""

    def __init__(self, secret: str, handlers: Handlers, throttle: Throttle) -> None:
        self._secret = data_secret(secret)
        self._handlers = handlers
        self._throttle = throttle
        self._sock = socket.create_server(("", 0), backlog=64)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
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

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                conn.close()  # the client retries or falls back to another copy
                continue
            threading.Thread(
                target=self._serve, args=(conn,), daemon=True, name="hpcelastic-tier-conn"
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        staging: Path | None = None
        try:
            with conn:
                conn.settimeout(HANDSHAKE_TIMEOUT_S)  # a stranger holds a slot for seconds, not a minute
                nonce = protocol.new_nonce()
                conn.sendall(
                    protocol.encode_plain({"t": "challenge", "nonce": nonce, "v": protocol.PROTOCOL_VERSION})
                )
                session, hello = protocol.server_accept_hello(
                    self._secret, nonce, protocol.recv_payload(conn)
                )
                conn.settimeout(IO_TIMEOUT_S)
                name, position = str(hello.get("name", "")), str(hello.get("position", ""))
                if hello.get("op") == "get":
                    self._serve_get(conn, session, name, position)
                elif hello.get("op") == "put":
                    staging = self._handlers.staging()
                    self._serve_put(conn, session, name, position, _file_list(hello.get("files")), staging)
        except (OSError, protocol.ProtocolError, ChannelError):
            pass  # a stranger, a peer gone or a failed MAC: nothing was taken into place
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
            self._slots.release()

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
        conn.sendall(session.encode({"t": "welcome", "ok": why is None, "why": why or ""}))
        if why is not None:
            return
        try:
            macs = recv_files(conn, files, staging, session)
            _check_macs(macs, session.decode(protocol.recv_payload(conn)).get("macs"))
            self._handlers.received(name, position, staging, files)
        except (ChannelError, OSError) as e:
            with contextlib.suppress(OSError):
                conn.sendall(session.encode({"t": "stored", "ok": False, "why": str(e)}))
            return
        finally:
            self._handlers.release(size)
        conn.sendall(session.encode({"t": "stored", "ok": True}))
