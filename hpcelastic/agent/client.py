"""The agent's side of the control plane: one authenticated connection to the coordinator.

A reader thread hands every message to a callback as it arrives (events are pushed, never polled);
a heartbeat thread sends a heartbeat every ``heartbeat_interval`` and watches the agent's lease: the
coordinator echoes each heartbeat it received, and when none was echoed for ``heartbeat_timeout`` the
agent probes the coordinator over UDP (``liveness.py``); with no answer either for ``probe_timeout``
more it reports the coordinator lost (the agent then stops its workers: the fence). A probe thread
answers the coordinator's probes. All keep running while the agent's main thread is busy stopping
workers. When the coordinator assigns a peer watch (``peerwatch.py``: large jobs) the heartbeat thread also
beats to this agent's watcher and reports its own watchee when it falls silent, the probe thread echoes the
watchee's beats, and the agent's workers run only while a second, fast lease holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence

from hpcelastic.agent import liveness, messages, protocol
from hpcelastic.agent.peerwatch import WatchedPeer

RETRY_DELAY = 0.1
CHALLENGE_TIMEOUT = 5.0
#: ``struct tcp_info`` (linux/tcp.h): 8 bytes of flags, then 32-bit fields; ``tcpi_rtt`` (microseconds)
#: is the 16th of them. Python has no parser for it: the offset is the kernel's stable ABI since 2.6.
TCPI_RTT_OFFSET = 8 + 15 * 4
TCP_INFO_SIZE = 104


class _NoChallenge(Exception):
    """The coordinator never sent its challenge on this connection: connect again."""


class CoordinatorUnreachable(Exception):
    """The coordinator did not accept a connection before the deadline."""


def _not_served(host: str, port: int, e: protocol.ProtocolError) -> str:
    """What to say about an answer on the coordinator's port that is no welcome (nothing in it is trusted)."""
    if isinstance(e, protocol.AuthError):
        return (
            f"the program at {host}:{port} rejected this agent or could not prove it knows the job's secret "
            f"({e}); every node must read the same secret (<run>/secret or $HPCELASTIC_SECRET)"
        )
    return f"the program at {host}:{port} is not this job's coordinator or refused this agent ({e})"


class CoordinatorClient:
    """Connects, authenticates, then delivers messages to ``on_message`` from its own thread."""

    def __init__(
        self,
        host: str,
        port: int,
        secret: str,
        *,
        on_message: Callable[[messages.Message], None],
        heartbeat_interval: float = liveness.HEARTBEAT_INTERVAL,
        heartbeat_timeout: float = liveness.HEARTBEAT_TIMEOUT,
        probe_timeout: float = liveness.PROBE_TIMEOUT,
        beat_interval: float = liveness.HEARTBEAT_INTERVAL,
        beat_timeout: float = liveness.HEARTBEAT_TIMEOUT,
    ) -> None:
        self.host, self.port = host, port
        self._secret = secret
        self._on_message = on_message
        self._hb_interval = heartbeat_interval
        self._hb_timeout = heartbeat_timeout
        self._probe_timeout = probe_timeout
        self._sock: socket.socket | None = None
        self._session: protocol.Session | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        #: The lease: evidence that the coordinator heard this agent (``liveness.py``).
        self.lease = liveness.Liveness.starting(time.monotonic(), heartbeat_timeout, probe_timeout)
        #: The latest heartbeat's round trip to the coordinator and back (s; None: none yet).
        self.rtt_s: float | None = None
        self._probe_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._probe_sock.bind(("", 0))
        self._probe_sock.settimeout(0.5)  # here, not in the thread: the client may close before it runs
        self._probe_addr: tuple[str, int] | None = None
        self._probe_key = b""
        self._probe_counter = 0
        self._probe_seen = 0
        #: Send times of this agent's probes not yet answered, by counter; the heartbeat thread adds, the
        #: probe thread takes away: both under ``_probes_lock``.
        self._probes_sent: dict[int, float] = {}
        self._probes_lock = threading.Lock()
        self._node_rank = -1
        self._peer_key = liveness.peer_key(secret)
        #: The peer watch (``peerwatch.py``), once the coordinator assigns one: beats every ``beat_interval``
        #: to the watcher; the watchee is reported after ``beat_timeout`` without a beat. ``fast_lease``: the
        #: second lease, renewed by the watcher's echoes as well; it never ends once armed.
        self._beat_interval = beat_interval
        self._beat_timeout = beat_timeout
        self.fast_lease: liveness.Liveness | None = None
        self._watched: WatchedPeer | None = None
        self._watcher_addr: tuple[str, int] | None = None
        self._watch_lock = threading.Lock()
        #: Peer-watch reports not yet sent (the heartbeat thread never waits on the connection).
        self._reports: list[messages.Message] = []

    def connect(self, hello: messages.Hello, timeout: float) -> messages.Welcome:
        """Connect (retrying until ``timeout``) and authenticate; returns the welcome message.

        Raises :class:`CoordinatorUnreachable` only. A refusal or any answer that is not this job's
        coordinator (another program on the port, a forged unauthenticated error frame) is retried
        until ``timeout``: unauthenticated input never ends an agent sooner than an unreachable port.
        """
        deadline = time.monotonic() + timeout
        hello = dataclasses.replace(hello, probe_port=self._probe_sock.getsockname()[1])
        self._node_rank = hello.node_rank
        last_error = "no attempt"
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=max(0.5, min(5.0, timeout)))
            except OSError as e:
                last_error = e.strerror or str(e)
            else:
                try:
                    return self._handshake(sock, hello, deadline)
                except _NoChallenge:
                    last_error = f"no challenge within {CHALLENGE_TIMEOUT:g} s of connecting"
                except protocol.ProtocolError as e:
                    last_error = _not_served(self.host, self.port, e)
            if time.monotonic() + RETRY_DELAY >= deadline:
                raise CoordinatorUnreachable(
                    f"cannot reach the coordinator at {self.host}:{self.port} within {timeout:g} s "
                    f"({last_error})"
                )
            time.sleep(RETRY_DELAY)

    def _handshake(self, sock: socket.socket, hello: messages.Hello, deadline: float) -> messages.Welcome:
        """Authenticate on a fresh connection; keeps it as this client's connection on success.

        A connection the coordinator never serves (its accept queue overflowed while thousands of
        agents connected at once: the kernel may then drop the connection after our side saw it
        established) sends no challenge; :class:`_NoChallenge` lets ``connect`` retry. Once our
        hello is sent the node may have joined, so a silent or closed connection after that is
        :class:`CoordinatorUnreachable`, not a retry.
        """
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            liveness.keep_stream_moving(sock)
            sock.settimeout(max(0.1, min(CHALLENGE_TIMEOUT, deadline - time.monotonic())))
            try:
                challenge = protocol.recv_payload(sock)
            except OSError:
                raise _NoChallenge from None
            sock.settimeout(max(1.0, deadline - time.monotonic()))
            session, hello_frame = protocol.client_hello(self._secret, challenge, messages.encode(hello))
            hello_sent = time.monotonic()
            sock.sendall(hello_frame)
            welcome = messages.Welcome.from_wire(
                protocol.client_welcome(session, protocol.recv_payload(sock))
            )
            # A write gives up after this long (a hung coordinator cannot block the agent); a read that
            # times out is retried: whether a silent coordinator is lost is the lease's decision.
            sock.settimeout(self._hb_timeout + 1.0)
        except OSError as e:
            sock.close()
            raise CoordinatorUnreachable(
                f"the coordinator at {self.host}:{self.port} stopped answering during the handshake "
                f"({e.strerror or e or type(e).__name__})"
            ) from None
        except (protocol.ProtocolError, _NoChallenge):
            sock.close()
            raise
        self._sock, self._session = sock, session
        self.lease = liveness.Liveness.starting(hello_sent, self._hb_timeout, self._probe_timeout)
        if welcome.probe_port:
            self._probe_addr = (sock.getpeername()[0], welcome.probe_port)
            self._probe_key = liveness.probe_key(session)
        return welcome

    def start(self) -> None:
        """Start the reader and heartbeat threads."""
        threading.Thread(target=self._reader, name="hpcelastic-client-reader", daemon=True).start()
        threading.Thread(target=self._heartbeat, name="hpcelastic-client-heartbeat", daemon=True).start()
        if self._probe_addr is not None:
            threading.Thread(target=self._prober, name="hpcelastic-client-probes", daemon=True).start()

    def link_rtt_s(self) -> float | None:
        """The kernel's smoothed round trip of the connection to the coordinator (TCP_INFO ``tcpi_rtt``): the
        node's link as the slow-node detector sees it (``slow/``). Unlike a heartbeat's round trip it does not
        grow when this agent waits for a CPU (the kernel acknowledges segments itself). None: not known."""
        sock = self._sock
        if sock is None:
            return None
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_SIZE)
        except OSError:
            return None
        if len(info) < TCPI_RTT_OFFSET + 4:
            return None
        return int.from_bytes(info[TCPI_RTT_OFFSET : TCPI_RTT_OFFSET + 4], sys.byteorder) / 1e6

    def send(self, msg: messages.Message, *, wait: bool = True) -> bool:
        """Send one message; False when the connection is gone (the loss is reported separately) or, without
        ``wait``, when another send is under way (a heartbeat never waits behind a large message)."""
        if self._sock is None or self._session is None or self._closed.is_set():
            return False
        if not self._lock.acquire(blocking=wait):
            return False
        try:
            self._sock.sendall(self._session.encode(messages.encode(msg)))
        except OSError:
            return False
        finally:
            self._lock.release()
        return True

    def close(self) -> None:
        """Close the connection; no loss is reported after this."""
        self._closed.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        self._probe_sock.close()

    def _lost(self, reason: str) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._on_message(messages.Lost(reason))

    def _reader(self) -> None:
        assert self._sock is not None and self._session is not None
        frames = protocol.FrameBuffer()
        try:
            while not self._closed.is_set():
                try:
                    data = self._sock.recv(65536)
                except TimeoutError:
                    continue  # a silent stream is the lease's business (heartbeat thread), not a loss
                if not data:
                    raise ConnectionError("closed")
                for payload in frames.feed(data):
                    msg = messages.decode(messages.FROM_COORDINATOR, self._session.decode(payload))
                    if isinstance(msg, messages.Heartbeat):
                        if msg.echo is not None:
                            self.lease.stream_heard(msg.echo)
                            if self.fast_lease is not None:
                                self.fast_lease.heard(msg.echo)
                            self.rtt_s = time.monotonic() - msg.echo
                    elif isinstance(msg, messages.Watch):
                        self._on_watch(msg)
                    elif msg is not None:
                        self._on_message(msg)
        except (OSError, ConnectionError):
            self._lost("connection to the coordinator closed")
        except protocol.ProtocolError as e:
            self._lost(f"bad frame from the coordinator: {e}")
        except messages.InvalidMessage as e:
            self._lost(f"bad message from the coordinator: {e}")

    def _on_watch(self, msg: messages.Watch) -> None:
        """A peer-watch assignment (again: watch afresh). The fast lease starts here, before the
        acknowledgment the coordinator waits for is sent, and never ends once armed."""
        now = time.monotonic()
        with self._watch_lock:
            if msg.watchee:
                rank, host, port = msg.watchee
                old = self._watched
                counter = old.last_counter if old is not None and old.rank == rank else 0
                self._watched = WatchedPeer(rank, (host, port), now, counter)
            else:
                self._watched = None
            self._watcher_addr = (msg.watcher[1], msg.watcher[2]) if msg.watcher else None
            if msg.watcher and self.fast_lease is None:
                self.fast_lease = liveness.Liveness.starting(now, self._beat_timeout, self._probe_timeout)
        self.send(
            messages.Watching(
                msg.epoch, msg.watchee[0] if msg.watchee else -1, msg.watcher[0] if msg.watcher else -1
            )
        )

    def _lease_lost(self, now: float) -> str | None:
        """Why this agent's lease ended (None: it holds): the direct one, or the peer watch's fast one."""
        if self.lease.lost(now):
            if self.lease.stream_broken(now):
                quiet = now - self.lease.last_stream
                return f"no echo from the coordinator for {quiet:.1f} s, only probe answers: broken"
            silent = self.lease.silent_for(now)
            return (
                f"the coordinator has not confirmed hearing this agent for {silent:.1f} s "
                "(no heartbeat echoed, no probe answered)"
            )
        fast = self.fast_lease
        if fast is not None and fast.silent_for(now) > fast.timeout + fast.probe_timeout:
            return (
                f"neither this agent's watcher nor the coordinator confirmed hearing it for "
                f"{fast.silent_for(now):.1f} s (no beat echoed, no probe answered)"
            )
        return None

    def _watch_duties(self, now: float) -> None:
        """Beat to the watcher; report the watchee silent, or heard again; send what is pending."""
        with self._watch_lock:
            watched, watcher = self._watched, self._watcher_addr
            if watched is not None:
                silence = watched.report_due(now, self._beat_timeout)
                if silence is not None:
                    self._reports.append(messages.PeerSilent(watched.rank, round(silence, 3)))
                if watched.heard_again():
                    self._reports.append(messages.PeerHeard(watched.rank))
        if watcher is not None:
            beat = liveness.Probe(liveness.FROM_AGENT, liveness.BEAT, self._node_rank, int(now * 1e6))
            with contextlib.suppress(OSError):
                self._probe_sock.sendto(liveness.encode(beat, self._peer_key), watcher)
        while self._reports and self.send(self._reports[0], wait=False):
            self._reports.pop(0)

    def _heartbeat(self) -> None:
        next_beat = next_peer_beat = time.monotonic()
        while not self._closed.is_set():
            now = time.monotonic()
            why = self._lease_lost(now)
            if why is not None:
                self._lost(why)
                return
            fast = self.fast_lease
            direct_due = self.lease.probe_due(now)
            if (fast is not None and fast.probe_due(now)) or direct_due:
                self._send_probe(now)
            if now >= next_beat:
                next_beat = now + self._hb_interval
                self.send(messages.Heartbeat(sent=now), wait=False)
            if now >= next_peer_beat:
                next_peer_beat = now + self._beat_interval
                self._watch_duties(now)
            wake = min(next_beat, next_peer_beat) - time.monotonic()
            self._closed.wait(min(liveness.PROBE_INTERVAL, max(0.0, wake)))

    def _from_peer(self, data: bytes, addr: tuple[str, int]) -> None:
        """Another agent of the job: a ping (can it reach this node: answer), its watchee's beat (echo it
        while watching it), or this agent's watcher's echo (renews the fast lease)."""
        try:
            probe = liveness.decode(data, self._peer_key)
        except protocol.ProtocolError:
            return  # not ours: nothing unauthenticated counts
        reply = None
        if probe.kind == liveness.PING:
            reply = dataclasses.replace(probe, kind=liveness.PONG)
        elif probe.kind == liveness.BEAT:
            with self._watch_lock:
                watched = self._watched
                fresh = watched is not None and watched.rank == probe.node_rank
                if fresh and watched.beat(probe.counter, time.monotonic()):  # type: ignore[union-attr]
                    reply = dataclasses.replace(probe, kind=liveness.ECHO)
        elif probe.kind == liveness.ECHO and probe.node_rank == self._node_rank:
            fast, sent = self.fast_lease, probe.counter / 1e6
            if fast is not None and sent <= time.monotonic():
                fast.heard(sent)
        if reply is not None and not self._closed.is_set():
            with contextlib.suppress(OSError):
                self._probe_sock.sendto(liveness.encode(reply, self._peer_key), addr)

    def unreachable(self, peers: Sequence[tuple[int, str, int]]) -> tuple[int, ...]:
        """Of ``peers`` (node rank, address, probe port), those that answered none of
        :data:`liveness.PING_TRIES` pings within :data:`liveness.PING_WINDOW` seconds."""
        if not peers:
            return ()
        answered: set[int] = set()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            deadline = time.monotonic() + liveness.PING_WINDOW
            next_ping, tries = 0.0, 0
            while len(answered) < len(peers) and (now := time.monotonic()) < deadline:
                if now >= next_ping and tries < liveness.PING_TRIES:
                    tries += 1
                    next_ping = now + liveness.PING_WINDOW / liveness.PING_TRIES
                    for rank, host, port in peers:
                        if rank not in answered:
                            ping = liveness.Probe(liveness.FROM_AGENT, liveness.PING, rank, tries)
                            with contextlib.suppress(OSError):
                                sock.sendto(liveness.encode(ping, self._peer_key), (host, port))
                sock.settimeout(max(0.01, min(next_ping, deadline) - now))
                try:
                    data = sock.recv(256)
                    pong = liveness.decode(data, self._peer_key)
                except (OSError, protocol.ProtocolError):
                    continue
                if pong.kind == liveness.PONG:
                    answered.add(pong.node_rank)
        return tuple(rank for rank, _, _ in peers if rank not in answered)

    def _send_probe(self, now: float) -> None:
        if self._probe_addr is None:
            return
        with self._probes_lock:
            self._probe_counter += 1
            counter = self._probe_counter
            self._probes_sent[counter] = now
        probe = liveness.Probe(liveness.FROM_AGENT, liveness.QUERY, self._node_rank, counter)
        with contextlib.suppress(OSError):
            self._probe_sock.sendto(liveness.encode(probe, self._probe_key), self._probe_addr)

    def _probe_answered(self, counter: int, member: bool) -> float | None:
        """When this agent sent its probe ``counter``, now answered (None: not sent, or answered before);
        an answer as a member also settles every older probe."""
        with self._probes_lock:
            sent = self._probes_sent.pop(counter, None)
            if sent is not None and member:
                self._probes_sent = {c: t for c, t in self._probes_sent.items() if c > counter}
            return sent

    def _prober(self) -> None:
        """Answer the coordinator's probes; take its answers to ours as renewals of the lease."""
        while not self._closed.is_set():
            try:
                data, addr = self._probe_sock.recvfrom(256)
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                probe = liveness.decode(data, self._probe_key)
            except protocol.ProtocolError:
                self._from_peer(data, addr)
                continue
            if probe.sender != liveness.FROM_COORDINATOR or probe.node_rank != self._node_rank:
                continue
            if probe.kind == liveness.ANSWER:
                member = bool(probe.flags & liveness.MEMBER)
                sent = self._probe_answered(probe.counter, member)
                if sent is not None and member:
                    self.lease.heard(sent)
                    if self.fast_lease is not None:
                        self.fast_lease.heard(sent)
            elif probe.counter > self._probe_seen:
                self._probe_seen = probe.counter
                answer = dataclasses.replace(probe, sender=liveness.FROM_AGENT, kind=liveness.ANSWER)
                with contextlib.suppress(OSError):
                    self._probe_sock.sendto(liveness.encode(answer, self._probe_key), addr)
