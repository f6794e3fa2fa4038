"""Failure detection with a second path (``agent/liveness.py``): pure rules, probe datagrams, and a real
coordinator with real clients whose TCP connections go through a proxy that can hold their bytes (what a
lossy link does to TCP: retransmissions back off and the stream stalls for seconds) while UDP still flows."""

from __future__ import annotations

import contextlib
import queue
import selectors
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcelastic.agent import liveness, messages, protocol
from hpcelastic.agent.client import CoordinatorClient
from hpcelastic.agent.runtime import HEARTBEATS_PER_S, Timing
from hpcelastic.events import EventName
from hpcelastic.rundir import RunDir
from tests.unit.test_coordinator_io import HOSTS, SECRET, loopback_coordinator

HB_INTERVAL, HB_TIMEOUT, PROBE_TIMEOUT = 0.2, 1.0, 1.0


# ---- pure ----------------------------------------------------------------------------------------
def test_silence_is_suspected_then_lost_only_past_both_timeouts() -> None:
    alive = liveness.Liveness.starting(0.0, timeout=2.0, probe_timeout=2.0)
    assert not alive.suspected(1.9) and not alive.probe_due(1.9)
    assert alive.suspected(2.1) and alive.probe_due(2.1)
    assert not alive.probe_due(2.1 + liveness.PROBE_INTERVAL / 2), "probes are PROBE_INTERVAL apart"
    assert alive.probe_due(2.1 + liveness.PROBE_INTERVAL)
    assert not alive.lost(3.9) and alive.lost(4.1)


def test_a_probe_answer_keeps_a_silent_stream_alive_up_to_its_cap() -> None:
    alive = liveness.Liveness.starting(0.0, timeout=2.0, probe_timeout=2.0)
    for t in range(3, 30):
        alive.heard(float(t))  # an answered probe every second, no frame
        assert not alive.lost(t + 0.5)
    alive.heard(31.0)
    assert alive.lost(31.0), "a stream silent past MAX_STREAM_SILENCE is lost whatever the probes say"


def test_probes_are_authenticated_and_bound_to_their_connection() -> None:
    key, other = b"k" * 32, b"o" * 32
    probe = liveness.Probe(liveness.FROM_AGENT, liveness.QUERY, 7, 3)
    data = liveness.encode(probe, key)
    assert len(data) == liveness.PROBE_SIZE and liveness.node_rank_of(data) == 7
    assert liveness.decode(data, key) == probe
    with pytest.raises(protocol.AuthError):
        liveness.decode(data, other)
    tampered = data[:-40] + bytes([data[-40] ^ 1]) + data[-39:]
    with pytest.raises(protocol.AuthError):
        liveness.decode(tampered, key)
    assert liveness.node_rank_of(b"GET / HTTP/1.1\r\n") is None


def test_fence_outlasts_the_agents_reaction_and_kill() -> None:
    assert liveness.fence_delay(3.0) > liveness.PROBE_INTERVAL + 3.0


# ---- a real coordinator, real clients, a TCP path that stalls ----------------------------------
class StallingProxy:
    """Forwards one TCP connection per accepted client; ``hold_up``/``hold_down`` keep the bytes of a
    direction (agent -> coordinator, coordinator -> agent) until released, as a stalled TCP stream does."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.hold_up = threading.Event()
        self.hold_down = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ, None)
        pending: dict[socket.socket, bytearray] = {}
        peer: dict[socket.socket, tuple[socket.socket, threading.Event]] = {}
        while not self._stop.is_set():
            for key, _ in sel.select(timeout=0.05):
                if key.data is None:
                    agent, _addr = self.listener.accept()
                    upstream = socket.create_connection(self.target)
                    peer[agent] = (upstream, self.hold_up)
                    peer[upstream] = (agent, self.hold_down)
                    for s in (agent, upstream):
                        pending[s] = bytearray()
                        sel.register(s, selectors.EVENT_READ, s)
                    continue
                src: socket.socket = key.data
                try:
                    data = src.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    self._stop.set()
                    break
                pending[src] += data
            for src, buf in pending.items():
                dst, hold = peer[src]
                if buf and not hold.is_set():
                    with contextlib.suppress(OSError):
                        dst.sendall(buf)
                    buf.clear()
        for s in peer:
            s.close()
        self.listener.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class Plane:
    """A coordinator; agent 0 connects directly, agent 1 through a :class:`StallingProxy`."""

    def __init__(self, rd: RunDir) -> None:
        self.coordinator = loopback_coordinator(
            rd, min_nodes=1, max_restarts=5, heartbeat_timeout=HB_TIMEOUT, probe_timeout=PROBE_TIMEOUT
        )
        self.coordinator.start()
        self.proxy = StallingProxy(("127.0.0.1", self.coordinator.port))
        self.inboxes: list[queue.SimpleQueue[messages.Message]] = []
        self.clients: list[CoordinatorClient] = []
        for rank, host in enumerate(HOSTS):
            inbox: queue.SimpleQueue[messages.Message] = queue.SimpleQueue()
            client = CoordinatorClient(
                "127.0.0.1",
                self.coordinator.port if rank == 0 else self.proxy.port,
                SECRET,
                on_message=inbox.put,
                heartbeat_interval=HB_INTERVAL,
                heartbeat_timeout=HB_TIMEOUT,
                probe_timeout=PROBE_TIMEOUT,
            )
            client.connect(messages.Hello(node_rank=rank, host=host, nproc=1), timeout=10)
            client.start()
            self.inboxes.append(inbox)
            self.clients.append(client)
        for rank in range(len(HOSTS)):
            self.expect(rank, messages.Round)

    def expect(self, rank: int, kind: type[messages.Message], timeout: float = 15) -> messages.Message:
        msg = self.inboxes[rank].get(timeout=timeout)
        assert isinstance(msg, kind), f"agent {rank} got {msg!r}, expected a {kind.__name__}"
        return msg

    def lost_events(self) -> list[dict[str, object]]:
        self.coordinator.events.flush(timeout=5)
        return [e for e in self.coordinator.run_dir.events() if e["event"] == EventName.NODE_LOST.value]

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.proxy.close()
        self.coordinator.stop(drain_timeout=2)


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[Plane]:
    p = Plane(RunDir(tmp_path))
    yield p
    p.close()


def test_a_stream_stalled_past_the_timeouts_is_no_loss_while_probes_are_answered(plane: Plane) -> None:
    bound = liveness.detection_bound(HB_TIMEOUT, PROBE_TIMEOUT)
    plane.proxy.hold_up.set()
    plane.proxy.hold_down.set()
    time.sleep(2 * bound)
    plane.proxy.hold_up.clear()
    plane.proxy.hold_down.clear()
    time.sleep(3 * HB_INTERVAL)
    assert plane.lost_events() == []
    assert plane.inboxes[1].empty(), "the agent kept its lease: no Lost"
    assert plane.clients[1].send(messages.Heartbeat(sent=time.monotonic()))


def test_a_silent_agent_without_probe_answers_is_lost_and_fences_itself_first(plane: Plane) -> None:
    """Only the coordinator -> agent direction works: the agent still hears heartbeats but none of its own
    is echoed, so its lease runs out, no later than the coordinator declares it lost."""
    discard = ("127.0.0.1", 9)  # its UDP path is gone too: probes both ways go where nobody answers
    plane.clients[1]._probe_addr = discard
    plane.coordinator._by_rank[1].probe_addr = discard
    plane.proxy.hold_up.set()
    plane.expect(1, messages.Lost, timeout=20)  # the lease ran out, or the coordinator's close came first
    agent_fenced = time.time()
    deadline = time.monotonic() + 10
    while not plane.lost_events() and time.monotonic() < deadline:
        time.sleep(0.05)
    (event,) = plane.lost_events()
    assert event["node_rank"] == 1 and "no answer to probes" in str(event["reason"])
    assert plane.inboxes[0].empty() or not isinstance(plane.inboxes[0].get_nowait(), messages.Lost)
    # The fence's premise: the agent's lease ends no later than the coordinator declares it lost (one
    # check interval of either side aside).
    assert agent_fenced <= float(event["ts"]) + 2 * liveness.PROBE_INTERVAL


def test_agents_ping_each_other_with_the_jobs_key_and_strangers_get_no_answer(plane: Plane) -> None:
    a, b = plane.clients
    b_port = b._probe_sock.getsockname()[1]
    assert a.unreachable([(1, "127.0.0.1", b_port)]) == ()
    assert a.unreachable([(1, "127.0.0.1", b_port), (7, "127.0.0.1", 9)]) == (7,)
    stranger = CoordinatorClient("127.0.0.1", 1, "x" * 64, on_message=lambda _m: None)
    try:
        assert stranger.unreachable([(1, "127.0.0.1", b_port)]) == (1,), "a ping without the job's key"
    finally:
        stranger.close()


def test_heartbeats_slow_down_above_a_thousand_nodes_unless_set() -> None:
    small, large = Timing.from_environ({}, nodes=3), Timing.from_environ({}, nodes=16384)
    assert (small.heartbeat_interval, small.heartbeat_timeout, small.detection_s) == (0.25, 2.0, 4.75)
    assert 16384 / large.heartbeat_interval <= HEARTBEATS_PER_S, "the coordinator's heartbeat budget"
    assert large.heartbeat_timeout >= 2 * large.heartbeat_interval
    environ = {"HPCELASTIC_HEARTBEAT_INTERVAL": "0.5", "HPCELASTIC_PROBE_TIMEOUT": "0"}
    fixed = Timing.from_environ(environ, nodes=16384)
    assert (fixed.heartbeat_interval, fixed.heartbeat_timeout, fixed.detection_s) == (0.5, 2.0, 2.0)


def test_a_stream_silent_past_its_cap_is_told_apart_from_silence_on_both_paths() -> None:
    alive = liveness.Liveness.starting(0.0, timeout=2.0, probe_timeout=2.75)
    assert alive.lost(5.0) and not alive.stream_broken(5.0)
    cap = liveness.MAX_STREAM_SILENCE
    alive.heard(cap)
    assert alive.lost(cap + 0.5) and alive.stream_broken(cap + 0.5)


def test_the_probe_thread_outlives_probes_sent_while_it_settles_answers() -> None:
    """The heartbeat thread records each probe it sends while the probe thread settles the coordinator's
    answers (dropping every older probe): with threads switching every microsecond, the probe thread once
    died of "dictionary changed size during iteration", and a node on a lossy link lost its second path."""
    client = CoordinatorClient("127.0.0.1", 9, SECRET, on_message=lambda _: None)
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("127.0.0.1", 0))
    answers = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client._probe_key, client._node_rank, client._probe_addr = b"k" * 32, 0, sink.getsockname()
    prober = threading.Thread(target=client._prober, name="probes-under-test", daemon=True)
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        prober.start()
        to_prober = ("127.0.0.1", client._probe_sock.getsockname()[1])
        for round_ in range(2000):  # ten probes sent for each one answered: the book grows to thousands
            for _ in range(10):
                client._send_probe(time.monotonic())  # what the heartbeat thread does
            answer = liveness.Probe(
                liveness.FROM_COORDINATOR, liveness.ANSWER, 0, round_ + 1, liveness.MEMBER
            )
            answers.sendto(liveness.encode(answer, client._probe_key), to_prober)
            assert prober.is_alive(), f"the probe thread died in round {round_}"
        deadline = time.monotonic() + 60
        while min(client._probes_sent) <= 2000:  # the last answer (again: a datagram may be dropped) settles
            assert prober.is_alive() and time.monotonic() < deadline, min(client._probes_sent)
            answers.sendto(liveness.encode(answer, client._probe_key), to_prober)
            time.sleep(0.1)
        assert len(client._probes_sent) == 18000 and prober.is_alive()
    finally:
        sys.setswitchinterval(before)
        client.close()
        sink.close()
        answers.close()


def test_control_connections_retransmit_at_least_every_second_on_both_ends(plane: Plane) -> None:
    """At 20 % loss on both links the doubling retransmission timeout once stalled healthy streams past the
    30 s cap 8 times an hour; both ends of every control connection cap it (``keep_stream_moving``)."""
    rto_max_ms, thin_linear = liveness._TCP_RTO_MAX_MS, liveness._TCP_THIN_LINEAR_TIMEOUTS
    agent_end = plane.clients[0]._sock
    assert agent_end is not None
    coordinator_end = plane.coordinator._by_rank[0].sock
    for sock in (agent_end, coordinator_end):
        assert sock.getsockopt(socket.IPPROTO_TCP, rto_max_ms) == liveness.STREAM_RTO_MAX_MS
        assert sock.getsockopt(socket.IPPROTO_TCP, thin_linear) == 1
