"""The control-plane server hosted by the group-rank-0 agent.

One thread runs a ``selectors`` loop (epoll) over the listening socket and every agent connection,
so a thousand agents cost a thousand idle sockets and nothing else. Each connection is authenticated
(see ``protocol.py``) before it may join. Events are pushed: every report from an agent is handed to
:class:`~hpcelastic.agent.job_state.JobState`, and its decisions go out at once, one message per
agent, so control traffic per event is O(nodes). Heartbeats both ways detect a silent node within
``heartbeat_timeout`` seconds; a closed connection is seen immediately.
"""

from __future__ import annotations

import contextlib
import os
import resource
import secrets
import selectors
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

from hpcelastic.agent import messages, protocol
from hpcelastic.agent.job_state import Action, JobState, Phase, Record, Say, Send
from hpcelastic.events import EventName
from hpcelastic.rundir import RunDir

HANDSHAKE_TIMEOUT = 10.0
TICK = 0.25
#: The events an agent may have the coordinator write for it.
AGENT_EVENTS = frozenset({EventName.SIGNAL_RECEIVED, EventName.NODE_UNHEALTHY})


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    nonce: str
    since: float
    buf: protocol.FrameBuffer = field(default_factory=protocol.FrameBuffer)
    out: bytearray = field(default_factory=bytearray)
    session: protocol.Session | None = None
    node_rank: int | None = None
    last_recv: float = 0.0
    closing: bool = False


def _rank(conn: _Conn) -> int:
    """The node rank of a joined agent's connection."""
    assert conn.node_rank is not None
    return conn.node_rank


class PortReservation:
    """Fresh ``MASTER_PORT`` values without a check-then-use race.

    The port is bound with ``SO_REUSEADDR`` but never listened on, and held until the next round:
    no other process can take it, while the rank-0 worker's TCPStore (which also sets
    ``SO_REUSEADDR``) can still bind and listen on it.
    """

    def __init__(self) -> None:
        self._sock: socket.socket | None = None

    def new_port(self) -> int:
        """Release the previous round's port and reserve a new one."""
        self.release()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("", 0))
        self._sock = sock
        return sock.getsockname()[1]

    def release(self) -> None:
        """Give the current port back."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def raise_fd_limit() -> None:
    """Lift the soft open-files limit to the hard one, so 1024+ agents fit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(
                resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard)
            )


class Coordinator:
    """Serves one job attempt's agents on ``listener`` until :meth:`stop`."""

    def __init__(
        self,
        listener: socket.socket,
        secret: str,
        state: JobState,
        run_dir: RunDir,
        *,
        heartbeat_interval: float = 0.5,
        heartbeat_timeout: float = 2.0,
    ) -> None:
        self.state = state
        self.run_dir = run_dir
        self._listener = listener
        self._secret = secret
        self._hb_interval = heartbeat_interval
        self._hb_timeout = heartbeat_timeout
        self._sel = selectors.DefaultSelector()
        self._conns: dict[int, _Conn] = {}
        self._by_rank: dict[int, _Conn] = {}
        self._wake_r, self._wake_w = os.pipe()
        self._stop = threading.Event()
        self.finished = threading.Event()
        self.session = secrets.token_hex(8)
        self._thread = threading.Thread(target=self._run, name="hpcelastic-coordinator", daemon=True)
        self._handlers: messages.Handlers = {
            messages.Started: self._on_started,
            messages.Failed: self._on_failed,
            messages.Stopped: self._on_stopped,
            messages.Done: self._on_done,
            messages.PreemptSignal: self._on_preempt,
            messages.AgentEvent: self._on_event,
            messages.Leave: self._on_leave,
        }

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    def start(self) -> None:
        """Start serving in a background thread."""
        raise_fd_limit()
        self._listener.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread.start()

    def stop(self, drain_timeout: float = 5.0) -> None:
        """Stop after the agents have disconnected (at most ``drain_timeout`` s), then close everything."""
        deadline = time.monotonic() + drain_timeout
        while self._by_rank and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.02)
        self._stop.set()
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)

    # ---- loop -------------------------------------------------------------------------------
    def _run(self) -> None:
        next_hb = time.monotonic()
        try:
            while not self._stop.is_set():
                for key, mask in self._sel.select(timeout=TICK):
                    if key.data is None:
                        self._accept()
                    elif key.data == "wake":
                        os.read(self._wake_r, 64)
                    else:
                        self._service(key.data, mask)
                now = time.monotonic()
                if now >= next_hb:
                    next_hb = now + self._hb_interval
                    self._heartbeats(now)
                self._apply(self.state.tick())
        finally:
            for conn in list(self._conns.values()):
                self._drop(conn, None)
            self._sel.close()
            self._listener.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _accept(self) -> None:
        while True:
            try:
                sock, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock=sock, nonce=protocol.new_nonce(), since=time.monotonic())
            conn.last_recv = conn.since
            self._conns[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)
            challenge = messages.Challenge(conn.nonce, protocol.PROTOCOL_VERSION)
            self._write(conn, protocol.encode_plain(messages.encode(challenge)))

    def _service(self, conn: _Conn, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(conn)
        if not mask & selectors.EVENT_READ or conn.closing:
            return
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn, "connection closed (agent exited or node down)")
            return
        conn.last_recv = time.monotonic()
        try:
            for payload in conn.buf.feed(data):
                if conn.session is None:
                    self._handshake(conn, payload)
                else:
                    self._handle(conn, messages.decode(messages.FROM_AGENT, conn.session.decode(payload)))
                if conn.closing:
                    return
        except protocol.AuthError:
            self._reject(conn, "authentication failed: the agent does not have this job's secret", auth=True)
        except protocol.ProtocolError as e:
            self._reject(conn, f"protocol error: {e}")
        except messages.InvalidMessage as e:
            self._reject(conn, str(e))
        except (KeyError, TypeError, ValueError) as e:
            self._reject(conn, f"malformed message: {e!r}")

    def _handshake(self, conn: _Conn, payload: bytes) -> None:
        session, wire = protocol.server_accept_hello(self._secret, conn.nonce, payload)
        error = self.state.join_error(wire.get("node_rank"))
        if error:
            self._reject(conn, error)
            return
        hello = messages.Hello.from_wire(wire)
        conn.session = session
        conn.node_rank = hello.node_rank
        self._by_rank[hello.node_rank] = conn
        actions = self.state.join(hello.node_rank, hello.host, hello.nproc)
        self._send(conn, messages.Welcome(self.state.round, self.session))
        self._apply(actions)

    def _handle(self, conn: _Conn, msg: messages.Message | None) -> None:
        """One message from the joined agent on ``conn`` (None: a type this coordinator does not know)."""
        if msg is not None:
            messages.dispatch(self._handlers, msg, conn)

    def _on_started(self, msg: messages.Started, conn: _Conn) -> None:
        self._apply(self.state.started_workers(_rank(conn), msg.round, msg.ts))

    def _on_failed(self, msg: messages.Failed, conn: _Conn) -> None:
        self._apply(self.state.worker_failed(_rank(conn), msg.round, msg.failures))

    def _on_stopped(self, msg: messages.Stopped, conn: _Conn) -> None:
        self._apply(self.state.workers_stopped(_rank(conn), msg.round, msg.failures))

    def _on_done(self, msg: messages.Done, conn: _Conn) -> None:
        self._apply(self.state.workers_done(_rank(conn), msg.round))

    def _on_preempt(self, msg: messages.PreemptSignal, conn: _Conn) -> None:
        self._apply(self.state.preempt(_rank(conn), msg.signal))

    def _on_event(self, msg: messages.AgentEvent, conn: _Conn) -> None:
        if msg.event.name in AGENT_EVENTS:
            member = self.state.members.get(_rank(conn))
            self.run_dir.record(msg.event, host=member.host if member else "")

    def _on_leave(self, msg: messages.Leave, conn: _Conn) -> None:
        rank = _rank(conn)
        self._drop(conn, None)
        self._apply(self.state.lost(rank, msg.reason, unhealthy=msg.unhealthy))

    # ---- output -----------------------------------------------------------------------------
    def _apply(self, actions: list[Action]) -> None:
        for a in actions:
            match a:
                case Send(node_rank, message):
                    conn = self._by_rank.get(node_rank)
                    if conn is not None:
                        self._send(conn, message)
                case Record(event):
                    self.run_dir.record(event)
                case Say(text):
                    print(f"hpcelastic: {text}", file=sys.stderr, flush=True)
        if self.state.phase is Phase.FINISHED:
            self.finished.set()

    def _heartbeats(self, now: float) -> None:
        for conn in list(self._conns.values()):
            if conn.session is None:
                if now - conn.since > HANDSHAKE_TIMEOUT:
                    self._drop(conn, None)
                continue
            if now - conn.last_recv > self._hb_timeout:
                self._drop(conn, f"no heartbeat for {now - conn.last_recv:.1f} s (node hung or unreachable)")
                continue
            self._send(conn, messages.Heartbeat())

    def _send(self, conn: _Conn, msg: messages.Message) -> None:
        assert conn.session is not None
        self._write(conn, conn.session.encode(messages.encode(msg)))

    def _write(self, conn: _Conn, frame: bytes) -> None:
        if conn.closing:
            return
        conn.out += frame
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            while conn.out:
                sent = conn.sock.send(conn.out)
                del conn.out[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(conn, "connection reset")
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.modify(conn.sock, events, conn)

    def _reject(self, conn: _Conn, error: str, *, auth: bool = False) -> None:
        with contextlib.suppress(OSError):
            conn.sock.setblocking(True)
            conn.sock.settimeout(1.0)
            conn.sock.sendall(protocol.encode_plain(messages.encode(messages.Refusal(error, auth))))
        self._drop(conn, error)

    def _drop(self, conn: _Conn, reason: str | None) -> None:
        """Close a connection; a joined agent lost this way is reported as ``node_lost``."""
        if conn.closing:
            return
        conn.closing = True
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn.sock)
        self._conns.pop(conn.sock.fileno(), None)
        with contextlib.suppress(OSError):
            conn.sock.close()
        if conn.node_rank is not None and self._by_rank.get(conn.node_rank) is conn:
            del self._by_rank[conn.node_rank]
            if reason is not None:
                self._apply(self.state.lost(conn.node_rank, reason))
