"""Simulated agents for the control-plane load benchmark: many real protocol clients per process.

One process multiplexes many agent connections with ``selectors``: each does the real authenticated
handshake (``protocol.client_hello``/``client_welcome``) over its own TCP socket, heartbeats like
``CoordinatorClient`` and answers like ``Agent`` does (``round`` -> ``started``, ``stop`` ->
``stopped``), without workers. The driver steers the process through a pipe; every reply and
notification is a tuple. Times are ``time.time()`` so they compare with ``events.jsonl``.

With ``peer_watch`` the agents take part in the peer watch (``agent/peerwatch.py``) as ``CoordinatorClient``
does: each has a probe port (one UDP socket per process, datagrams told apart by node rank), acknowledges
its ``Watch`` and answers the coordinator's probes. Only the agents the driver names (``beat``) send beats,
and only their watchers watch: the beats never reach the coordinator, so its load is the same as with every
agent beating, which two cores could not carry in Python next to the coordinator.

An agent whose connection brings no challenge (closed by the coordinator's cap of unauthenticated
connections, refused, or silent for ``CHALLENGE_TIMEOUT``) connects again after ``RETRY_DELAY``, as
``CoordinatorClient.connect`` does.

Hand-written event loop: the point is thousands of clients in a few processes, which threads around
the blocking ``CoordinatorClient`` could not give on two cores. The real client's burst is measured
separately (:func:`real_clients_main`, a thread per client).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from hpcelastic.agent import liveness, messages, protocol
from hpcelastic.agent.client import CHALLENGE_TIMEOUT, RETRY_DELAY, CoordinatorClient, CoordinatorUnreachable
from hpcelastic.agent.peerwatch import WatchedPeer

LOOP_LIMIT_S = 600.0
#: Agents connect from this many loopback addresses (127.0.1.x), as from as many hosts: one address's
#: ephemeral ports (about 28,000) run out once 16,384 connections and their retries' TIME_WAITs hold them.
SOURCE_ADDRESSES = 128
_IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)


@dataclass(eq=False)
class SimAgent:
    """One simulated agent: its socket, handshake state and what it received when."""

    rank: int
    sock: socket.socket | None = None
    connect_at: float = 0.0
    retries: int = 0
    buf: protocol.FrameBuffer = field(default_factory=protocol.FrameBuffer)
    out: bytearray = field(default_factory=bytearray)
    writing: bool = False
    session: protocol.Session | None = None
    joined: bool = False
    round: int = -1
    reported_round: int = -1
    silent: bool = False
    gone: bool = False
    welcome_ts: float | None = None
    rounds: dict[int, float] = field(default_factory=dict)
    stops: dict[int, float] = field(default_factory=dict)
    finish: dict[str, Any] | None = None
    error: str | None = None
    #: The peer watch: whom it watches, where its watcher listens, its probes' key, its watchee's state.
    watchee: int = -1
    watcher_addr: tuple[str, int] | None = None
    probe_key: bytes = b""
    peer: WatchedPeer | None = None


class AgentSwarm:
    """The agents of one process and the event loop that serves them and the driver's pipe."""

    def __init__(
        self, port: int, secret: str, ranks: list[int], ctl: Connection, hb_interval: float, peer_watch: bool
    ) -> None:
        self.port, self.secret, self.ctl, self.hb_interval = port, secret, ctl, hb_interval
        self.agents = {r: SimAgent(r) for r in ranks}
        self.sel = selectors.DefaultSelector()
        self.sel.register(ctl.fileno(), selectors.EVENT_READ, None)
        self.peer_watch = peer_watch
        self.peer_key = liveness.peer_key(secret)
        #: Ranks whose beats are real (``beat``): their own agents send them, their watchers watch them.
        self.beating: set[int] = set()
        self.udp: socket.socket | None = None
        if peer_watch:
            self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.udp.bind(("", 0))  # every 127.0.1.x an agent connects from
            self.udp.setblocking(False)
            self.sel.register(self.udp, selectors.EVENT_READ, "udp")
        self.connect_ts: float | None = None
        self.announced: set[int] = set()
        #: Per round not yet announced: the live agents still waiting for its assignment.
        self.waiting: dict[int, set[int]] = {}
        #: Agents waiting to connect again, in the order they are due (one fixed delay keeps it sorted).
        self.retry_queue: collections.deque[tuple[float, SimAgent]] = collections.deque()
        self.running = True
        self.hb_sent = self.hb_received = 0
        self.handlers: messages.Handlers = {
            messages.Heartbeat: self._on_heartbeat,
            messages.Round: self._on_round,
            messages.Stop: self._on_stop,
            messages.Finish: self._on_finish,
            messages.Watch: self._on_watch,
        }

    # ---- driver commands --------------------------------------------------------------------
    def command(self, cmd: tuple[Any, ...]) -> None:
        """Run one command from the driver."""
        name = cmd[0]
        if name == "connect":
            self.connect_ts = time.time()
            for a in self.agents.values():
                self._connect(a)
        elif name == "fail":
            self._fail(self.agents[cmd[1]])
        elif name == "close":
            a = self.agents[cmd[1]]
            ts = time.time()
            self._close(a)
            self.ctl.send(("closed", a.rank, ts))
        elif name == "silence":
            a = self.agents[cmd[1]]
            a.silent, a.gone = True, True
            self._no_longer_waited_for(a)
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(a.sock)
            self.ctl.send(("silenced", a.rank, time.time()))
        elif name == "beat":
            self.beating.add(cmd[1])
            now = time.monotonic()
            for a in self.agents.values():
                if a.watchee == cmd[1] and a.peer is None:
                    a.peer = WatchedPeer(a.watchee, ("", 0), now)
            self.ctl.send(("beating", cmd[1], time.time()))
        elif name == "done":
            for a in self._live():
                self._send(a, messages.Done(a.round))
        elif name == "report":
            self.ctl.send(("report", self.report()))
        elif name == "counts":
            self.ctl.send(("counts", self.hb_sent, self.hb_received))
        elif name == "exit":
            self.running = False

    def report(self) -> dict[str, Any]:
        """What every agent of this process saw, for the driver's figures."""
        return {
            "connect_ts": self.connect_ts,
            "agents": {
                r: {
                    "welcome_ts": a.welcome_ts,
                    "rounds": a.rounds,
                    "stops": a.stops,
                    "finish": a.finish,
                    "error": a.error,
                    "gone": a.gone,
                    "retries": a.retries,
                }
                for r, a in self.agents.items()
            },
        }

    # ---- agent behaviour --------------------------------------------------------------------
    def _connect(self, a: SimAgent) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.IPPROTO_IP, _IP_BIND_ADDRESS_NO_PORT, 1)  # the port is picked at connect
        sock.bind((f"127.0.1.{1 + a.rank % SOURCE_ADDRESSES}", 0))
        a.gone, a.buf, a.out, a.writing = False, protocol.FrameBuffer(), bytearray(), False
        a.sock, a.connect_at = sock, time.monotonic()
        rc = sock.connect_ex(("127.0.0.1", self.port))
        if rc not in (0, errno.EINPROGRESS):
            self._retry(a)
            return
        self.sel.register(sock, selectors.EVENT_READ, a)

    def _retry(self, a: SimAgent) -> None:
        """No challenge on this connection (refused, closed by the coordinator's cap, or none in time):
        connect again after ``RETRY_DELAY``, as ``CoordinatorClient.connect`` does."""
        self._close(a)
        a.retries += 1
        self.retry_queue.append((time.monotonic() + RETRY_DELAY, a))

    def _connect_due(self) -> None:
        now = time.monotonic()
        while self.retry_queue and self.retry_queue[0][0] <= now:
            a = self.retry_queue.popleft()[1]
            if a.session is None and not a.silent:
                self._connect(a)

    def _retry_unserved(self) -> None:
        """Reconnect agents whose connection sent no challenge within ``CHALLENGE_TIMEOUT``."""
        now = time.monotonic()
        for a in self.agents.values():
            if a.sock is not None and a.session is None and now - a.connect_at > CHALLENGE_TIMEOUT:
                self._retry(a)

    def _fail(self, a: SimAgent) -> None:
        """A worker of this node crashed: report it, then report the node stopped (as ``Agent`` does)."""
        failure = {
            "round": a.round,
            "rank": 0,
            "local_rank": 0,
            "exitcode": 1,
            "signal": None,
            "error": "RuntimeError: simulated worker crash",
            "traceback": "",
            "ts": time.time(),
        }
        self._send(a, messages.Failed(a.round, (failure,)))
        self._send(a, messages.Stopped(a.round))
        a.reported_round = a.round
        self.ctl.send(("failed", a.rank, failure["ts"]))

    def _on_heartbeat(self, _msg: messages.Heartbeat, _a: SimAgent) -> None:
        self.hb_received += 1

    def _on_watch(self, msg: messages.Watch, a: SimAgent) -> None:
        a.watchee = msg.watchee[0] if msg.watchee else -1
        a.watcher_addr = (msg.watcher[1], msg.watcher[2]) if msg.watcher else None
        watches = a.watchee in self.beating
        a.peer = (
            WatchedPeer(a.watchee, ("", 0), time.monotonic(), a.peer.last_counter if a.peer else 0)
            if watches
            else None
        )
        self._send(a, messages.Watching(msg.epoch, a.watchee, msg.watcher[0] if msg.watcher else -1))

    def _beat(self) -> None:
        """The named agents beat to their watchers; their watchers report them when they fall silent."""
        assert self.udp is not None
        now = time.monotonic()
        for a in self.agents.values():
            if a.rank in self.beating and a.joined and not a.silent and a.watcher_addr is not None:
                beat = liveness.Probe(liveness.FROM_AGENT, liveness.BEAT, a.rank, int(now * 1e6))
                with contextlib.suppress(OSError):
                    self.udp.sendto(liveness.encode(beat, self.peer_key), a.watcher_addr)
            if (
                a.peer is not None
                and not a.gone
                and a.peer.report_due(now, liveness.HEARTBEAT_TIMEOUT) is not None
            ):
                self._send(a, messages.PeerSilent(a.peer.rank, round(now - a.peer.last_heard, 3)))

    def _datagrams(self) -> None:
        """Beats to echo, and the coordinator's probes to answer (for the agents that are not silent)."""
        assert self.udp is not None
        for _ in range(256):
            try:
                data, addr = self.udp.recvfrom(256)
            except (BlockingIOError, InterruptedError):
                return
            rank = liveness.node_rank_of(data)
            if rank is None:
                continue
            with contextlib.suppress(protocol.ProtocolError):
                probe = liveness.decode(data, self.peer_key)
                if probe.kind == liveness.BEAT:
                    for a in self.agents.values():
                        watching = a.peer is not None and a.peer.rank == rank and not a.silent
                        if watching and a.peer.beat(probe.counter, time.monotonic()):  # type: ignore[union-attr]
                            echo = liveness.encode(
                                dataclasses.replace(probe, kind=liveness.ECHO), self.peer_key
                            )
                            self.udp.sendto(echo, addr)
                continue
            a = self.agents.get(rank)
            if a is None or a.silent or not a.probe_key:
                continue
            with contextlib.suppress(protocol.ProtocolError, OSError):
                probe = liveness.decode(data, a.probe_key)
                if probe.sender == liveness.FROM_COORDINATOR and probe.kind == liveness.QUERY:
                    answer = dataclasses.replace(probe, sender=liveness.FROM_AGENT, kind=liveness.ANSWER)
                    self.udp.sendto(liveness.encode(answer, a.probe_key), addr)

    def _on_round(self, msg: messages.Round, a: SimAgent) -> None:
        now = time.time()
        a.round = msg.round
        a.rounds[a.round] = now
        self._send(a, messages.Started(a.round, now))
        self._maybe_announce(a.round)

    def _on_stop(self, msg: messages.Stop, a: SimAgent) -> None:
        a.stops.setdefault(msg.round, time.time())
        if msg.round == a.round and a.reported_round != a.round:
            a.reported_round = a.round
            self._send(a, messages.Stopped(a.round))

    def _on_finish(self, msg: messages.Finish, a: SimAgent) -> None:
        a.finish = {**messages.encode(msg), "ts": time.time()}
        self._close(a)

    def _live(self) -> list[SimAgent]:
        return [a for a in self.agents.values() if a.joined and not a.gone]

    def _maybe_announce(self, rnd: int) -> None:
        """Tell the driver once every live agent of this process has round ``rnd``'s assignment.

        The agents still waiting are kept per round: checking every agent on every assignment would
        cost O(agents) per message, O(agents²) per round.
        """
        if rnd in self.announced:
            return
        if rnd not in self.waiting:
            self.waiting[rnd] = {a.rank for a in self._live() if rnd not in a.rounds}
        self._announce_if_complete(rnd)

    def _no_longer_waited_for(self, a: SimAgent) -> None:
        """``a`` is gone: no round waits for it any more."""
        for rnd, waiting in list(self.waiting.items()):
            waiting.discard(a.rank)
            self._announce_if_complete(rnd)

    def _announce_if_complete(self, rnd: int) -> None:
        waiting = self.waiting[rnd]
        while waiting:
            first = next(iter(waiting))
            if rnd not in self.agents[first].rounds:
                return
            waiting.discard(first)
        if not waiting:
            del self.waiting[rnd]
            live = self._live()
            if live:
                self.announced.add(rnd)
                self.ctl.send(("round", rnd, max(a.rounds[rnd] for a in live)))

    # ---- I/O --------------------------------------------------------------------------------
    def _send(self, a: SimAgent, msg: messages.Message) -> None:
        if a.session is None or a.sock is None or a.gone:
            return
        a.out += a.session.encode(messages.encode(msg))
        self._flush(a)

    def _flush(self, a: SimAgent) -> None:
        assert a.sock is not None
        try:
            while a.out:
                del a.out[: a.sock.send(a.out)]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as e:
            self._lose(a, f"send failed: {e}")
            return
        if a.writing != bool(a.out):
            a.writing = bool(a.out)
            with contextlib.suppress(KeyError, ValueError):
                self.sel.modify(a.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if a.out else 0), a)

    def _readable(self, a: SimAgent) -> None:
        assert a.sock is not None
        try:
            data = a.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            if a.session is None:
                self._retry(a)
            else:
                self._lose(a, f"recv failed: {e}")
            return
        if not data:
            if a.session is None:
                self._retry(a)
            else:
                self._lose(a, "coordinator closed the connection")
            return
        try:
            for payload in a.buf.feed(data):
                if a.gone:
                    return
                if a.session is None:
                    probe_port = self.udp.getsockname()[1] if self.udp is not None else 0
                    hello = messages.Hello(
                        node_rank=a.rank, host=f"sim{a.rank}", nproc=1, pid=a.rank, probe_port=probe_port
                    )
                    a.session, frame = protocol.client_hello(self.secret, payload, messages.encode(hello))
                    a.probe_key = liveness.probe_key(a.session)
                    a.out += frame
                    self._flush(a)
                elif not a.joined:
                    protocol.client_welcome(a.session, payload)
                    a.joined, a.welcome_ts = True, time.time()
                else:
                    msg = messages.decode(messages.FROM_COORDINATOR, a.session.decode(payload))
                    if msg is not None:
                        messages.dispatch(self.handlers, msg, a)
        except (protocol.ProtocolError, messages.InvalidMessage) as e:
            self._lose(a, f"{type(e).__name__}: {e}")

    def _lose(self, a: SimAgent, why: str) -> None:
        if a.finish is None and not a.silent and a.error is None:
            a.error = why
        self._close(a)

    def _close(self, a: SimAgent) -> None:
        a.gone = True
        self._no_longer_waited_for(a)
        if a.sock is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(a.sock)
            a.sock.close()
            a.sock = None

    def _heartbeat(self) -> None:
        for a in self._live():
            if not a.silent:
                self._send(a, messages.Heartbeat())
                self.hb_sent += 1

    def run(self) -> None:
        """Serve until the driver says ``exit`` (or the loop's hard time limit passes)."""
        hard_stop = time.monotonic() + LOOP_LIMIT_S
        next_hb = time.monotonic() + self.hb_interval
        next_beat = time.monotonic() + liveness.HEARTBEAT_INTERVAL
        self.ctl.send(("ready",))
        while self.running and time.monotonic() < hard_stop:
            wake = min(next_hb, self.retry_queue[0][0]) if self.retry_queue else next_hb
            if self.peer_watch:
                wake = min(wake, next_beat)
            for key, mask in self.sel.select(timeout=max(0.0, wake - time.monotonic())):
                a = key.data
                if a is None:
                    self.command(self.ctl.recv())
                    continue
                if a == "udp":
                    self._datagrams()
                    continue
                if mask & selectors.EVENT_WRITE and not a.gone:
                    self._flush(a)
                if mask & selectors.EVENT_READ and not a.gone:
                    self._readable(a)
            self._connect_due()
            if time.monotonic() >= next_hb:
                next_hb = time.monotonic() + self.hb_interval
                self._heartbeat()
                self._retry_unserved()
            if self.peer_watch and time.monotonic() >= next_beat:
                next_beat = time.monotonic() + liveness.HEARTBEAT_INTERVAL
                self._beat()
        for a in self.agents.values():
            self._close(a)


def swarm_main(
    port: int, secret: str, ranks: list[int], ctl: Connection, hb_interval: float, peer_watch: bool = False
) -> None:
    """Process entry point: serve ``ranks`` as simulated agents of the coordinator at ``port``."""
    AgentSwarm(port, secret, ranks, ctl, hb_interval, peer_watch).run()


class _CountingClient(CoordinatorClient):
    """The real client, counting its connection attempts (each retry is one more)."""

    attempts = 0

    def _handshake(self, sock: socket.socket, hello: messages.Hello, deadline: float) -> messages.Welcome:
        self.attempts += 1
        return super()._handshake(sock, hello, deadline)


def real_clients_main(port: int, secret: str, ranks: list[int], timeout: float, ctl: Connection) -> None:
    """Process entry point: one thread per rank runs the real ``CoordinatorClient.connect`` on the driver's
    ``go``, then starts its heartbeats; reports ``rank -> (welcome time or None, connection attempts,
    error)``, and closes them all on ``exit``."""
    go = threading.Event()
    results: dict[int, tuple[float | None, int, str]] = {}
    clients: list[CoordinatorClient] = []

    def join(rank: int) -> None:
        client = _CountingClient("127.0.0.1", port, secret, on_message=lambda _m: None)
        clients.append(client)
        go.wait()
        try:
            client.connect(messages.Hello(node_rank=rank, host=f"sim{rank}", nproc=1, pid=rank), timeout)
        except CoordinatorUnreachable as e:
            results[rank] = (None, client.attempts, str(e))
        else:
            results[rank] = (time.time(), client.attempts, "")
            client.start()  # heartbeats, as an agent's: a silent member would be dropped before all joined

    threads = [threading.Thread(target=join, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    ctl.send(("ready",))
    if ctl.poll(LOOP_LIMIT_S) and ctl.recv()[0] == "go":
        go.set()
        for t in threads:
            t.join(timeout + CHALLENGE_TIMEOUT)
    ctl.send(("result", results))
    ctl.poll(LOOP_LIMIT_S)
    for client in clients:
        client.close()
