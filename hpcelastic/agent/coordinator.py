"""The control-plane server hosted by the group-rank-0 agent.

One thread runs a ``selectors`` loop (epoll) over the listening socket and every agent connection,
so a thousand agents cost a thousand idle sockets and nothing else. Each connection is authenticated
(see ``protocol.py``) before it may join. Events are pushed: every report from an agent is handed to
:class:`~hpcelastic.agent.job_state.JobState`, and its decisions go out at once, one message per
agent, so control traffic per event is O(nodes). Each agent heartbeat is echoed at once (the agent's lease:
``liveness.py``); an agent silent for ``heartbeat_timeout`` is suspected and probed over UDP, and lost only
when it answered no probe either for ``probe_timeout`` more (frames already received are read first); a
closed connection is seen immediately. With the peer watch (``peerwatch.py``: large jobs) the agents watch
each other in a ring the coordinator assigns; a watcher's report makes its watchee suspected and probed the
same way, so a silent node is found as fast at 16,384 agents as at 3 while the heartbeats stay slow.

Strangers cost little: at most :data:`MAX_PREAUTH` unauthenticated connections, or one per node of a
larger job (what its own agents need at once anyway), frames of at most
:data:`MAX_PREAUTH_FRAME` bytes before authentication, and a listener that backs off when ``accept``
runs out of descriptors. Events are written by an
:class:`~hpcelastic.agent.event_writer.EventWriter` thread, so a slow or failing filesystem never
delays a heartbeat nor ends the control plane.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import ipaddress
import os
import resource
import secrets
import selectors
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from hpcelastic.agent import liveness, messages, protocol
from hpcelastic.agent.console import write_line
from hpcelastic.agent.event_writer import EventWriter
from hpcelastic.agent.job_state import Action, JobState, Phase, Record, SaveStacks, Say, Send
from hpcelastic.agent.peerwatch import RING_SETTLE_S, Assignment, WatchBook
from hpcelastic.events import EventName
from hpcelastic.hangs.store import write_stacks
from hpcelastic.rundir import RunDir
from hpcelastic.slow.watch import SlowWatch, WatchOut
from hpcelastic.tier.book import TierBook

HANDSHAKE_TIMEOUT = 10.0
TICK = 0.25
#: How often silent agents are looked for: a lost node is seen at most this long after the heartbeat timeout.
LIVENESS_CHECK_S = 0.1
#: The longest a round waits for the local tier's answers about a checkpoint completed just before the
#: workers stopped (:meth:`TierBook.settling`).
TIER_SETTLE_S = 3.0
#: How often the slow-node watch closes its windows and decides (hpcelastic/slow/watch.py).
SLOW_TICK_S = 1.0
#: Connections not yet authenticated, at most (or the job's node count, if larger: a burst of every agent at
#: once must not overflow the kernel's backlog, whose drops cost an agent a SYN retransmission, 1 s); while
#: that many are open the listener rests and more wait in the backlog (one closed would cost a retry).
MAX_PREAUTH = 512
#: The largest frame before authentication (a hello is far smaller): bounds what strangers make us buffer.
MAX_PREAUTH_FRAME = 8192
#: The listener's backlog at least (``env.base.listen``'s); a larger job gets one slot per node.
LISTEN_BACKLOG = 4096
#: Pause of the listener when ``accept`` fails for lack of descriptors or memory, doubled up to the maximum.
ACCEPT_BACKOFF = 0.05
MAX_ACCEPT_BACKOFF = 1.0
_ACCEPT_RESOURCE_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: How many neighbours a hung node pings (``DumpStacks.peers``): a ring of node ranks, half on each side.
PING_NEIGHBOURS = 8
#: An answer counts only to one of the last this many probes sent to that agent.
RECENT_PROBES = 16
#: The events an agent may have the coordinator write for it.
AGENT_EVENTS = frozenset({EventName.SIGNAL_RECEIVED, EventName.NODE_UNHEALTHY, EventName.CHECKPOINT_OPENED})


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    nonce: str
    since: float
    buf: protocol.FrameBuffer = field(default_factory=lambda: protocol.FrameBuffer(MAX_PREAUTH_FRAME))
    out: bytearray = field(default_factory=bytearray)
    session: protocol.Session | None = None
    node_rank: int | None = None
    last_recv: float = 0.0
    closing: bool = False
    #: Set when the agent joins: its liveness on both paths, where its probes go, their key and counters.
    alive: liveness.Liveness | None = None
    probe_addr: tuple[str, int] | None = None
    probe_key: bytes = b""
    probes_out: int = 0
    probe_answered: int = 0
    probe_from_counter: int = 0
    #: Whether the selector watches this connection for writability (changed only when that changes).
    writing: bool = False


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
        heartbeat_timeout: float = liveness.HEARTBEAT_TIMEOUT,
        probe_timeout: float = liveness.PROBE_TIMEOUT,
        tier: TierBook | None = None,
        slow: SlowWatch | None = None,
        peer_watch: bool = False,
        beat_timeout: float = liveness.HEARTBEAT_TIMEOUT,
    ) -> None:
        self.state = state
        #: The peer watch's ring and reports (``peerwatch.py``), None when it is off.
        self._watch = WatchBook(beat_timeout, probe_timeout) if peer_watch else None
        self._ring_dirty = False
        #: When an agent last joined or left (the ring waits for a burst to settle).
        self._ring_changed = 0.0
        #: The slow-node watch (hpcelastic/slow/), None when detection is off.
        self.slow = slow
        #: The local checkpoint tier's book (hpcelastic/tier/book.py), None when the job has no tier.
        self.tier = tier
        #: Round messages held while the tier settles (node rank, message), and until when at most.
        self._held_rounds: list[tuple[int, messages.Round]] = []
        self._hold_rounds_until: float | None = None
        self.run_dir = run_dir
        #: Event writes leave this thread: a slow or failing filesystem never delays heartbeats.
        self.events = EventWriter(run_dir)
        self._listener = listener
        self._secret = secret
        self._hb_timeout = heartbeat_timeout
        self._probe_timeout = probe_timeout
        #: Liveness probes (``liveness.py``), on the listener's address.
        self._probes = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._probes.bind((listener.getsockname()[0], 0))
        self._probes.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._conns: dict[int, _Conn] = {}
        self._by_rank: dict[int, _Conn] = {}
        #: Connections that have not authenticated yet (oldest first).
        self._preauth: dict[int, _Conn] = {}
        self._max_preauth = max(MAX_PREAUTH, len(state.hosts))
        #: Joined connections, heard from longest ago first: the liveness check reads the expired only.
        self._by_last_recv: collections.OrderedDict[int, _Conn] = collections.OrderedDict()
        self._listening = False
        self._accept_backoff = ACCEPT_BACKOFF
        self._accept_paused_until: float | None = None
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
            messages.StallReport: self._on_stall_report,
            messages.StacksReport: self._on_stacks_report,
            messages.Progress: self._on_progress,
            messages.StepReport: self._on_step_report,
            messages.Saving: self._on_saving,
            messages.Heartbeat: self._on_heartbeat,
            messages.TierHave: self._on_tier_have,
            messages.TierFlush: self._on_tier_flush,
            messages.SlowSample: self._on_slow_sample,
            messages.SpeedCheck: self._on_speed_check,
            messages.Watching: self._on_watching,
            messages.PeerSilent: self._on_peer_silent,
            messages.PeerHeard: self._on_peer_heard,
        }

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    def start(self) -> None:
        """Start serving in a background thread."""
        raise_fd_limit()
        # Room in the kernel's accept queue for every agent at once (capped at net.core.somaxconn): a
        # connection that overflows it waits for the SYN retransmission, 1 s then 3 s.
        self._listener.listen(max(LISTEN_BACKLOG, len(self.state.hosts)))
        self._listener.setblocking(False)
        self._update_listening()
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._sel.register(self._probes, selectors.EVENT_READ, "probe")
        self._thread.start()

    def stop(self, drain_timeout: float = 5.0) -> None:
        """Stop after the agents have disconnected (at most ``drain_timeout`` s), then close everything."""
        deadline = time.monotonic() + drain_timeout
        while self._by_rank and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.02)
        self._stop.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            os.close(self._wake_r)
            os.close(self._wake_w)
        self.events.close(timeout=drain_timeout)

    # ---- loop -------------------------------------------------------------------------------
    def _run(self) -> None:
        next_check = next_slow = time.monotonic()
        try:
            while not self._stop.is_set():
                wait = min(TICK, max(0.0, next_check - time.monotonic()))
                for key, mask in self._sel.select(timeout=wait):
                    if key.data is None:
                        self._accept()
                    elif key.data == "wake":
                        os.read(self._wake_r, 64)
                    elif key.data == "probe":
                        self._on_probes()
                    else:
                        self._service(key.data, mask)
                now = time.monotonic()
                if self._accept_paused_until is not None and now >= self._accept_paused_until:
                    self._accept_paused_until = None
                    self._update_listening()
                if now >= next_check:
                    next_check = now + LIVENESS_CHECK_S
                    self._drop_silent(now)
                if self._ring_dirty and self._ring_due(now):
                    self._replan(now)
                self._apply(self.state.tick())
                self._release_rounds(now)
                if self.slow is not None and now >= next_slow:
                    next_slow = now + SLOW_TICK_S
                    self._slow_tick()
        except Exception:
            # A bug: say so once; the agents see their connections close and end as coordinator_lost.
            print("hpcelastic: internal error in the coordinator (please report it):", file=sys.stderr)
            traceback.print_exc()
        finally:
            for conn in list(self._conns.values()):
                with contextlib.suppress(Exception):
                    self._drop(conn, None)
            self._sel.close()
            self._listener.close()
            self._probes.close()

    def _update_listening(self) -> None:
        """Watch the listener while a slot for an unauthenticated connection is free and no backoff runs."""
        listen = len(self._preauth) < self._max_preauth and self._accept_paused_until is None
        if listen == self._listening:
            return
        self._listening = listen
        if listen:
            self._sel.register(self._listener, selectors.EVENT_READ, None)
        else:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(self._listener)

    def _accept(self) -> None:
        while len(self._preauth) < self._max_preauth:
            try:
                sock, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                if e.errno in _ACCEPT_RESOURCE_ERRORS:
                    self._pause_accept()
                break
            self._accept_backoff = ACCEPT_BACKOFF
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            liveness.keep_stream_moving(sock)
            conn = _Conn(sock=sock, nonce=protocol.new_nonce(), since=time.monotonic())
            conn.last_recv = conn.since
            self._conns[sock.fileno()] = conn
            self._preauth[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)
            challenge = messages.Challenge(conn.nonce, protocol.PROTOCOL_VERSION)
            self._write(conn, protocol.encode_plain(messages.encode(challenge)))
        self._update_listening()

    def _pause_accept(self) -> None:
        """Out of descriptors (or memory): free the oldest stranger's and stop accepting for a while.

        The listener stays readable while the backlog is full, so retrying at once would spin.
        """
        oldest = next(iter(self._preauth.values()), None)
        if oldest is not None:
            self._drop(oldest, None)
        self._accept_paused_until = time.monotonic() + self._accept_backoff
        self._accept_backoff = min(MAX_ACCEPT_BACKOFF, 2 * self._accept_backoff)
        self._update_listening()

    def _service(self, conn: _Conn, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(conn)
        if not mask & selectors.EVENT_READ or conn.closing:
            return
        try:
            data = conn.sock.recv(65536 if conn.session is not None else MAX_PREAUTH_FRAME)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn, "connection closed (agent exited or node down)")
            return
        conn.last_recv = time.monotonic()
        if conn.alive is not None:
            conn.alive.stream_heard(conn.last_recv)
            self._by_last_recv.move_to_end(conn.sock.fileno())
            self._heard(conn, conn.last_recv)
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
        conn.buf.max_frame = protocol.MAX_FRAME
        self._preauth.pop(conn.sock.fileno(), None)
        self._update_listening()
        self._by_last_recv[conn.sock.fileno()] = conn
        conn.node_rank = hello.node_rank
        conn.alive = liveness.Liveness.starting(conn.last_recv, self._hb_timeout, self._probe_timeout)
        if hello.probe_port:
            conn.probe_addr = (conn.sock.getpeername()[0], hello.probe_port)
        conn.probe_key = liveness.probe_key(session)
        self._by_rank[hello.node_rank] = conn
        if self.tier is not None:
            self.tier.join(hello.node_rank, hello.host, self._reachable(conn), hello.data_port)
        actions = self.state.join(hello.node_rank, hello.host, hello.nproc)
        self._send(conn, messages.Welcome(self.state.round, self.session, self._probes.getsockname()[1]))
        self._ring_dirty, self._ring_changed = self._watch is not None, time.monotonic()
        self._apply(actions)

    def _handle(self, conn: _Conn, msg: messages.Message | None) -> None:
        """One message from the joined agent on ``conn`` (None: a type this coordinator does not know)."""
        if msg is not None:
            messages.dispatch(self._handlers, msg, conn)

    def _on_heartbeat(self, msg: messages.Heartbeat, conn: _Conn) -> None:
        """Echo it at once: the agent's lease runs from the send time of its latest heartbeat echoed."""
        self._send(conn, messages.Heartbeat(echo=msg.sent))

    # ---- the peer watch (peerwatch.py) -------------------------------------------------------------
    def _ring_due(self, now: float) -> bool:
        """Every node has joined, or none joined or left for ``RING_SETTLE_S``: a burst of joins costs one
        ring, not one per rebuild (each would reassign almost every agent)."""
        return len(self._by_rank) == len(self.state.hosts) or now - self._ring_changed >= RING_SETTLE_S

    def _replan(self, now: float) -> None:
        """Rebuild the ring over the joined agents; tell those whose watchee or watcher changed."""
        assert self._watch is not None
        self._ring_dirty = False
        ranks = [r for r, c in self._by_rank.items() if c.probe_addr is not None]
        for a in self._watch.plan(ranks):
            self._tell_watch(a)

    def _tell_watch(self, a: Assignment) -> None:
        conn = self._by_rank.get(a.rank)
        if conn is None or self._watch is None:
            return
        self._send(
            conn, messages.Watch(self._watch.epoch, self._peer_addr(a.watchee), self._peer_addr(a.watcher))
        )

    def _peer_addr(self, rank: int) -> tuple[int, str, int] | tuple[()]:
        conn = self._by_rank.get(rank)
        if conn is None or conn.probe_addr is None:
            return ()
        return (rank, conn.probe_addr[0], conn.probe_addr[1])

    def _heard(self, conn: _Conn, at: float) -> None:
        """Evidence of ``conn``'s agent: ends its suspicion on a watcher's report (then its watcher watches
        afresh)."""
        watch = self._watch
        rank = conn.node_rank
        if watch is not None and watch.suspects and rank is not None and watch.heard(rank, at):
            self._tell_watch(watch.current(watch.watcher_of.get(rank, -1)))

    def _on_watching(self, msg: messages.Watching, conn: _Conn) -> None:
        if self._watch is not None:
            self._watch.acknowledged(_rank(conn), msg.watchee, msg.watcher, time.monotonic())

    def _on_peer_silent(self, msg: messages.PeerSilent, conn: _Conn) -> None:
        """A watcher heard no beat from its watchee: probe the watchee (lost if it answers none), unless
        another agent may still echo it; then the watcher watches afresh and reports again."""
        watch, watchee = self._watch, self._by_rank.get(msg.node_rank)
        if watch is None or watchee is None or watchee.alive is None or msg.node_rank in watch.suspects:
            return
        if not watch.report(_rank(conn), msg.node_rank, time.monotonic(), watchee.alive.last_alive):
            self._tell_watch(watch.current(_rank(conn)))

    def _on_peer_heard(self, msg: messages.PeerHeard, conn: _Conn) -> None:
        """A watcher hears its watchee again: stop suspecting it, and the watcher watches afresh."""
        watch = self._watch
        if watch is None:
            return
        if watch.watcher_of.get(msg.node_rank) == _rank(conn):
            watch.clear(msg.node_rank)
        self._tell_watch(watch.current(_rank(conn)))

    def _on_started(self, msg: messages.Started, conn: _Conn) -> None:
        self._apply(self.state.started_workers(_rank(conn), msg.round, msg.ts, msg.spawn, msg.spawn_reason))

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
            self.events.record(msg.event, host=member.host if member else "")

    def _on_progress(self, msg: messages.Progress, conn: _Conn) -> None:
        self._apply(self.state.progress(_rank(conn), msg.round, msg.step, msg.ts, msg.ranks))
        if self.slow is not None and msg.round == self.slow.round:
            self.slow.progress(self._host(conn), msg.step, msg.ts)

    def _on_step_report(self, msg: messages.StepReport, conn: _Conn) -> None:
        self._apply(self.state.step_report(_rank(conn), msg.round, msg.step, msg.rate))

    def _on_saving(self, msg: messages.Saving, conn: _Conn) -> None:
        self._apply(self.state.saving(_rank(conn), msg.round, msg.saving, msg.idle_s))

    def _on_stall_report(self, msg: messages.StallReport, conn: _Conn) -> None:
        self._apply(self.state.stall_report(_rank(conn), msg))

    def _on_stacks_report(self, msg: messages.StacksReport, conn: _Conn) -> None:
        self._apply(self.state.stacks_report(_rank(conn), msg))

    def _on_tier_have(self, msg: messages.TierHave, conn: _Conn) -> None:
        if self.tier is not None:
            self._apply(self.tier.have(_rank(conn), msg))

    def _on_tier_flush(self, msg: messages.TierFlush, conn: _Conn) -> None:
        if self.tier is not None:
            self._apply(self.tier.flush(_rank(conn)))

    def _on_slow_sample(self, msg: messages.SlowSample, conn: _Conn) -> None:
        if self.slow is not None:
            self.slow.report(self._host(conn), msg, time.time())

    def _on_speed_check(self, msg: messages.SpeedCheck, conn: _Conn) -> None:
        if self.slow is not None:
            self.slow.speed_check(self._host(conn), msg.speed)

    def _host(self, conn: _Conn) -> str:
        member = self.state.members.get(_rank(conn))
        return member.host if member is not None else f"node-rank-{_rank(conn)}"

    def _slow_tick(self) -> None:
        """Feed the slow-node watch the round it runs in, close its windows, carry out its orders."""
        assert self.slow is not None
        state, now = self.state, time.time()
        if state.phase is Phase.RUNNING and state.round != self.slow.round and state.round_nodes:
            members = state.members
            nodes = tuple(members[n].host for n in state.round_nodes if n in members)
            spares = tuple(members[n].host for n in sorted(members) if n not in state.round_nodes)
            world = sum(members[n].nproc for n in state.round_nodes if n in members)
            self._slow_out(self.slow.round_started(state.attempt, state.round, now, world, nodes, spares))
        self._slow_out(self.slow.tick(now))

    def _slow_out(self, out: WatchOut) -> None:
        for event in out.events:
            self.events.record(event)
        for host in out.exclude:
            self.state.slow_node(host)
        for host, reason in out.retire:
            rank = next((n for n, m in self.state.members.items() if m.host == host), None)
            conn = self._by_rank.get(rank) if rank is not None else None
            if conn is not None:
                write_line(f"hpcelastic: {host} is slow; it leaves the job ({reason})")
                self._send(conn, messages.Retire(self.slow.round if self.slow else -1, reason))

    def _on_leave(self, msg: messages.Leave, conn: _Conn) -> None:
        rank = _rank(conn)
        self._drop(conn, None)
        self._apply(self.state.left(rank, msg.reason, unhealthy=msg.unhealthy, signalled_at=msg.signalled_at))

    # ---- output -----------------------------------------------------------------------------
    def _apply(self, actions: list[Action]) -> None:
        for a in actions:
            match a:
                case Send(node_rank, message):
                    conn = self._by_rank.get(node_rank)
                    if conn is not None:
                        if isinstance(message, messages.DumpStacks):
                            message = dataclasses.replace(message, peers=self._neighbours(node_rank))
                        if isinstance(message, messages.Round) and self.tier is not None:
                            self._round_with_restore(node_rank, message)
                            continue
                        self._send(conn, message)
                case Record(event):
                    self.events.record(event)
                case Say(text):
                    write_line(f"hpcelastic: {text}")
                case SaveStacks():
                    threading.Thread(target=self._save_stacks, args=(a,), name="hpcelastic-stacks").start()
        if self.state.phase is Phase.FINISHED:
            if self.slow is not None:  # the last round's time lost to running slow, before anyone reads
                for event in self.slow.flush(time.time()):
                    self.events.record(event)
            self.finished.set()

    def _round_with_restore(self, node_rank: int, message: messages.Round, hold: bool = True) -> None:
        """A round's message, after its node's restore plan; a job-wide round is held while the tier settles
        (a checkpoint the workers completed just before they stopped is still being answered for), at most
        :data:`TIER_SETTLE_S` (a replica group's restart restores nothing from the tier); ``hold`` False:
        its wait is over, settled or not."""
        assert self.tier is not None
        if hold and not self._held_rounds and not message.num_replica_groups and self.tier.settling():
            self._hold_rounds_until = time.monotonic() + TIER_SETTLE_S
        if self._hold_rounds_until is not None:
            self._held_rounds.append((node_rank, message))
            return
        conn = self._by_rank.get(node_rank)
        if conn is not None:
            for restore in self.tier.restore_plan(node_rank, message):
                self._send(conn, restore)
            self._send(conn, message)

    def _release_rounds(self, now: float) -> None:
        """Send the rounds held for the tier once it settled or the wait is over."""
        if self._hold_rounds_until is None or self.tier is None:
            return
        if self.tier.settling() and now < self._hold_rounds_until:
            return
        held, self._held_rounds, self._hold_rounds_until = self._held_rounds, [], None
        for node_rank, message in held:
            self._round_with_restore(node_rank, message, hold=False)

    def _reachable(self, conn: _Conn) -> str:
        """The address other nodes reach ``conn``'s agent at: its connection's, or the job's published one for
        the coordinator's own agent (connected over loopback)."""
        with contextlib.suppress(OSError):
            host = conn.sock.getpeername()[0]
            if not ipaddress.ip_address(host).is_loopback:
                return str(host)
        return self.state.master_addr

    def _neighbours(self, node_rank: int) -> tuple[tuple[int, str, int], ...]:
        """Up to :data:`PING_NEIGHBOURS` joined agents nearest ``node_rank`` (in a ring of node ranks) and
        where their probes go: the peers a hung node pings. The coordinator's own agent reached it over
        loopback; the others reach its node at the job's published address."""
        ranks = sorted(r for r, c in self._by_rank.items() if c.probe_addr is not None)
        if node_rank not in ranks or len(ranks) < 2:
            return ()
        i = ranks.index(node_rank)
        half = PING_NEIGHBOURS // 2
        near = dict.fromkeys(ranks[(i + d) % len(ranks)] for d in range(-half, half + 1) if d)
        out = []
        for rank in near:
            if rank == node_rank:
                continue
            host, port = self._by_rank[rank].probe_addr  # type: ignore[misc]
            if ipaddress.ip_address(host).is_loopback:
                host = self.state.master_addr
            out.append((rank, host, port))
        return tuple(out)

    def _save_stacks(self, a: SaveStacks) -> None:
        """Write a hang's stacks file (off the coordinator thread: the filesystem may be slow)."""
        try:
            path = write_stacks(
                self.run_dir.path, a.attempt, a.round, a.stacks, a.localization, info_by_rank=a.info
            )
        except OSError as e:
            text = f"could not write the stacks of round {a.round}: {e}"
        else:
            text = f"hang: {a.localization.summary()}; all stacks in {path}"
        write_line(f"hpcelastic: {text}")

    def _drop_silent(self, now: float) -> None:
        """Drop connections stuck in the handshake; probe suspected agents; drop the lost ones.

        Both tables are ordered oldest first (by arrival, by last frame), so only the connections past
        their timeout and one more are read: a suspect's stream is silent longer than the timeout.
        """
        for conn in list(self._preauth.values()):
            if now - conn.since <= HANDSHAKE_TIMEOUT:
                break
            self._drop(conn, None)
        stream_silent = []
        for conn in self._by_last_recv.values():
            if now - conn.last_recv <= self._hb_timeout:
                break
            stream_silent.append(conn)
        lost: list[tuple[_Conn, str]] = []
        for conn in stream_silent:
            if conn.alive is None or not conn.alive.suspected(now):
                continue
            self._service(conn, selectors.EVENT_READ)  # frames that arrived while this loop was busy
            now = time.monotonic()
            if conn.closing or not conn.alive.suspected(now):
                continue
            if conn.alive.stream_broken(now):
                why = f"no frame for {now - conn.last_recv:.1f} s, only probe answers (connection broken)"
                lost.append((conn, why))
            elif conn.alive.lost(now):
                why = (
                    f"no heartbeat for {now - conn.last_recv:.1f} s and no answer to probes in the last "
                    f"{self._probe_timeout:g} s (node hung or unreachable)"
                )
                lost.append((conn, why))
            elif conn.alive.probe_due(now):
                self._probe(conn)
        if self._watch is not None and self._watch.suspects:
            lost += self._watched_lost(now)
        # The whole pass's losses count together, even if a decision comes in the middle of reporting them.
        self.state.silent_now([c.node_rank for c, _ in lost if c.node_rank is not None])
        for conn, why in lost:
            self._drop(conn, why, silent=True)
        self.state.silent_now(())

    def _watched_lost(self, now: float) -> list[tuple[_Conn, str]]:
        """Probe the agents a watcher reported silent; those that answered nothing in time are lost."""
        watch = self._watch
        assert watch is not None
        lost = []
        for rank in watch.lost(now):
            conn = self._by_rank.get(rank)
            if conn is None:
                watch.clear(rank)
                continue
            self._service(conn, selectors.EVENT_READ)  # frames that arrived while this loop was busy
            if conn.closing or rank not in watch.lost(time.monotonic()):
                continue
            watcher = watch.watcher_of.get(rank, -1)
            why = (
                f"its watcher (node {watcher}) heard no beat and the coordinator no frame for "
                f"{watch.suspects[rank].silent_for(now):.1f} s, and no answer to probes in the last "
                f"{self._probe_timeout:g} s (node hung or unreachable)"
            )
            lost.append((conn, why))
        for rank in watch.probes_due(now):
            conn = self._by_rank.get(rank)
            if conn is not None:
                self._probe(conn)
        return lost

    def _probe(self, conn: _Conn) -> None:
        if conn.probe_addr is None:
            return
        conn.probes_out += 1
        probe = liveness.Probe(liveness.FROM_COORDINATOR, liveness.QUERY, _rank(conn), conn.probes_out)
        with contextlib.suppress(OSError):
            self._probes.sendto(liveness.encode(probe, conn.probe_key), conn.probe_addr)

    def _on_probes(self, budget: int = 256) -> None:
        """Datagrams on the probe socket: answers to our probes and the agents' probes (answered while the
        agent is a member). Anything that does not verify with its node's key is ignored."""
        for _ in range(budget):
            try:
                data, addr = self._probes.recvfrom(256)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            rank = liveness.node_rank_of(data)
            conn = self._by_rank.get(rank) if rank is not None else None
            if conn is None or conn.alive is None:
                continue
            try:
                probe = liveness.decode(data, conn.probe_key)
            except protocol.ProtocolError:
                continue
            if probe.sender != liveness.FROM_AGENT:
                continue
            now = time.monotonic()
            if probe.kind == liveness.ANSWER:
                # Only an answer to one of the last few probes, once: an old answer replayed proves nothing.
                recent = conn.probes_out - RECENT_PROBES < probe.counter <= conn.probes_out
                if recent and probe.counter > conn.probe_answered:
                    conn.probe_answered = probe.counter
                    conn.alive.heard(now)
                    self._heard(conn, now)
            elif probe.counter > conn.probe_from_counter:
                conn.probe_from_counter = probe.counter
                conn.alive.heard(now)
                self._heard(conn, now)
                answer = dataclasses.replace(
                    probe, sender=liveness.FROM_COORDINATOR, kind=liveness.ANSWER, flags=liveness.MEMBER
                )
                with contextlib.suppress(OSError):
                    self._probes.sendto(liveness.encode(answer, conn.probe_key), addr)

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
        if conn.writing != bool(conn.out):
            conn.writing = bool(conn.out)
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.writing else 0)
            with contextlib.suppress(KeyError, ValueError):
                self._sel.modify(conn.sock, events, conn)

    def _reject(self, conn: _Conn, error: str, *, auth: bool = False) -> None:
        # Best effort and never blocking: a peer that does not read cannot stall this loop.
        with contextlib.suppress(OSError):
            conn.sock.send(protocol.encode_plain(messages.encode(messages.Refusal(error, auth))))
        self._drop(conn, error)

    def _drop(self, conn: _Conn, reason: str | None, *, silent: bool = False) -> None:
        """Close a connection; a joined agent lost this way is reported as ``node_lost`` (``silent``: it
        went quiet, its workers may still run)."""
        if conn.closing:
            return
        conn.closing = True
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn.sock)
        self._conns.pop(conn.sock.fileno(), None)
        self._by_last_recv.pop(conn.sock.fileno(), None)
        if self._preauth.pop(conn.sock.fileno(), None) is not None:
            self._update_listening()
        if conn.node_rank is not None and self._by_rank.get(conn.node_rank) is conn:
            del self._by_rank[conn.node_rank]
            if self._watch is not None:
                self._watch.gone(conn.node_rank, time.monotonic())
                self._ring_dirty, self._ring_changed = True, time.monotonic()
            if self.tier is not None:  # its copies are gone with it
                self._apply(self.tier.lost(conn.node_rank))
            if reason is not None:  # decided (and its events queued) before the peer sees the close
                self._apply(self.state.lost(conn.node_rank, reason, silent=silent))
        with contextlib.suppress(OSError):
            conn.sock.close()
