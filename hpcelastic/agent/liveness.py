"""Failure detection on a lossy network: a silent peer is probed on a second path before it is lost.

The control connection is TCP: after a lost segment TCP retransmits with a doubling timeout, so at a few
percent loss a healthy connection can be silent for seconds, and a cut link looks the same for that long.
So silence on the stream only makes a peer *suspected*: both sides then send authenticated UDP probes
(:data:`PROBE_INTERVAL` apart; datagrams are not held behind a lost segment) and the peer is *lost* only when
neither path brought anything for ``timeout + probe_timeout`` seconds (:class:`Liveness`). A dead process
closes its connection and is lost at once; a cut link is lost after ``timeout + probe_timeout``; a lossy
link is not lost while any probe gets through. A stream silent for :data:`MAX_STREAM_SILENCE` is lost even
while probes are answered (the connection itself is broken and nothing can be sent on it).

When a hang is declared, agents also ping their neighbours in the round (:data:`PING`, keyed by the job's
secret): a node the others cannot reach, or that cannot reach them, is what an asymmetric partition looks like
to a collective that just waits (``hangs.localize``).

Probes are hand-written datagrams (no library frames authenticated UDP for us): 52 bytes,
``magic | sender | kind | node rank | counter | flags | HMAC-SHA256``, keyed by the connection's session
key (:func:`probe_key`), so only the two ends of that connection can make one; counters only grow, so a
replayed probe proves nothing.

The agent's lease (fencing): an agent counts only what proves the coordinator *heard it* (the coordinator
echoes each agent heartbeat at once with its send time; it answers the agent's probes while the agent is a
member) and stops its workers when that is ``timeout + probe_timeout`` old. The coordinator heard that
heartbeat or probe no earlier than it was sent, so the agent's lease ends no later than the coordinator
declares it lost: :func:`fence_delay` later its workers are gone.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import socket
import struct
from dataclasses import dataclass

from hpcelastic.agent.protocol import AuthError, ProtocolError, Session

#: The defaults (``runtime.Timing`` and the client and coordinator take them from here): heartbeats every
#: 0.25 s; silence for 2 s makes a peer suspected; probing with no answer for 2.75 s more loses it. 4.75 s in
#: all: a link cut for good is acted on within 5 s, and one back after 3 s (plus up to 1 s for ARP to resolve
#: again, one heartbeat interval of lag) is heard again in time.
HEARTBEAT_INTERVAL = 0.25
HEARTBEAT_TIMEOUT = 2.0
PROBE_TIMEOUT = 2.75
#: Seconds between probes while a peer is suspected (a link back is heard within this of resolving ARP).
PROBE_INTERVAL = 0.1
#: A connection whose stream stays silent this long is lost even while its probes are answered.
MAX_STREAM_SILENCE = 30.0
#: Added to a fence for the agent's reaction and the kill taking effect.
FENCE_MARGIN = 0.5
#: The control connection's retransmission timeout never backs off past this (``TCP_RTO_MAX_MS``, Linux 6.15;
#: 120 s by default): at 20 % loss on both links a segment is lost with its retransmissions 5-7 times in a row
#: often enough that the doubling timeout stalled healthy streams past ``MAX_STREAM_SILENCE`` 8 times an hour
#: (bench/network_detection.py); capped, a stall that long needs about 30 losses in a row.
STREAM_RTO_MAX_MS = 1000
#: ``linux/tcp.h``; Python has no names for them. ``TCP_THIN_LINEAR_TIMEOUTS`` (2.6.34): the first six
#: retransmissions of a thin stream keep the base timeout, where older kernels lack the cap.
_TCP_RTO_MAX_MS = 44
_TCP_THIN_LINEAR_TIMEOUTS = 16

MAGIC = b"HPCP"
FROM_COORDINATOR, FROM_AGENT = b"S", b"C"
QUERY, ANSWER = b"Q", b"A"
#: Agent to agent, keyed by :func:`peer_key`: can this node reach that one (a hang's network evidence)?
PING, PONG = b"P", b"R"
#: How long, and how often, an agent pings its peers when asked (``reachable``).
PING_WINDOW = 1.0
#: Agent to agent, keyed by :func:`peer_key`: the peer watch's beat and its watcher's echo (``peerwatch.py``);
#: the counter is the beat's send time on the watchee's clock, in microseconds.
BEAT, ECHO = b"B", b"E"
PING_TRIES = 5
#: ``flags`` bit of a coordinator's answer: the agent is still a member of the job.
MEMBER = 1
_HEAD = struct.Struct("!4sccIQB")
_MAC_LEN = 32
PROBE_SIZE = _HEAD.size + _MAC_LEN


@dataclass(frozen=True)
class Probe:
    """One probe datagram: ``sender`` and ``kind`` are one of the byte constants above."""

    sender: bytes
    kind: bytes
    node_rank: int
    counter: int
    flags: int = 0


def probe_key(session: Session) -> bytes:
    """The key of a connection's probes, derived from its session key."""
    return session.derive("probe")


def peer_key(secret: str) -> bytes:
    """The job-wide key of the pings between agents (every agent has the job's secret)."""
    return hmac.new(secret.encode(), b"hpcelastic/peer-probe", hashlib.sha256).digest()


def encode(probe: Probe, key: bytes) -> bytes:
    """The datagram of ``probe``."""
    head = _HEAD.pack(MAGIC, probe.sender, probe.kind, probe.node_rank, probe.counter, probe.flags)
    return head + hmac.new(key, head, hashlib.sha256).digest()


def node_rank_of(data: bytes) -> int | None:
    """The node rank a datagram claims (untrusted: it picks the key to check it with); None if no probe."""
    if len(data) != PROBE_SIZE or not data.startswith(MAGIC):
        return None
    return _HEAD.unpack_from(data)[3]


def decode(data: bytes, key: bytes) -> Probe:
    """Verify and parse a datagram; :class:`ProtocolError` (:class:`AuthError`) when it is no valid probe."""
    if len(data) != PROBE_SIZE or not data.startswith(MAGIC):
        raise ProtocolError("not a probe")
    head, mac = data[: _HEAD.size], data[_HEAD.size :]
    if not hmac.compare_digest(mac, hmac.new(key, head, hashlib.sha256).digest()):
        raise AuthError("probe failed authentication")
    _magic, sender, kind, node_rank, counter, flags = _HEAD.unpack(head)
    if sender not in (FROM_COORDINATOR, FROM_AGENT) or kind not in (QUERY, ANSWER, PING, PONG, BEAT, ECHO):
        raise ProtocolError("unknown probe kind")
    return Probe(sender, kind, node_rank, counter, flags)


@dataclass
class Liveness:
    """What one side knows of its peer's liveness (pure; times from the caller's monotonic clock).

    ``heard`` marks evidence (a frame or a probe answer, or on the agent a confirmation that the coordinator
    heard it); ``stream`` marks frames only.
    """

    timeout: float
    probe_timeout: float
    last_alive: float
    last_stream: float
    next_probe: float = 0.0

    @classmethod
    def starting(cls, now: float, timeout: float, probe_timeout: float) -> Liveness:
        return cls(timeout, probe_timeout, now, now)

    def heard(self, at: float) -> None:
        """Evidence that the peer was alive and reachable at ``at``."""
        self.last_alive = max(self.last_alive, at)

    def stream_heard(self, at: float) -> None:
        """A frame arrived on the connection at ``at``."""
        self.heard(at)
        self.last_stream = max(self.last_stream, at)

    def silent_for(self, now: float) -> float:
        return now - self.last_alive

    def suspected(self, now: float) -> bool:
        """Silent past the timeout: probe it."""
        return self.silent_for(now) > self.timeout

    def lost(self, now: float) -> bool:
        """Silent on both paths for ``timeout + probe_timeout``, or its stream for ``MAX_STREAM_SILENCE``."""
        return self.silent_for(now) > self.timeout + self.probe_timeout or now - self.last_stream > max(
            MAX_STREAM_SILENCE, self.timeout + self.probe_timeout
        )

    def stream_broken(self, now: float) -> bool:
        """Lost because the stream stayed silent past its cap although probes were answered."""
        return self.lost(now) and self.silent_for(now) <= self.timeout + self.probe_timeout

    def probe_due(self, now: float) -> bool:
        """Suspected and a probe is due now (then the next one is :data:`PROBE_INTERVAL` later)."""
        if not self.suspected(now) or now < self.next_probe:
            return False
        self.next_probe = now + PROBE_INTERVAL
        return True


def keep_stream_moving(sock: socket.socket) -> None:
    """Tune a control connection so that loss stalls it for about a second at most, not for minutes:
    retransmissions at least every :data:`STREAM_RTO_MAX_MS`, linear timeouts where the kernel has no cap."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, _TCP_THIN_LINEAR_TIMEOUTS, 1)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, _TCP_RTO_MAX_MS, STREAM_RTO_MAX_MS)


def detection_bound(timeout: float, probe_timeout: float) -> float:
    """Seconds of silence on both paths after which a peer is lost."""
    return timeout + probe_timeout


def fence_delay(kill_grace: float) -> float:
    """How long after the coordinator declared a silent agent lost that agent's workers may still run: its
    lease has ended by then; it notices within one probe interval and stops its workers (TERM, KILL after
    ``kill_grace``)."""
    return PROBE_INTERVAL + kill_grace + FENCE_MARGIN
