"""The peer watch (``agent/peerwatch.py``): agents watch each other in a ring so that a silent node is found
as fast in a 16,384-node job as in a small one. The pure rules (who may still vouch for an agent, when a
report is acted on), each shown to matter by breaking it; then a real coordinator with real clients on
loopback whose direct heartbeats are far too slow to find anything in time."""

from __future__ import annotations

import dataclasses
import queue
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcelastic.agent import liveness, messages
from hpcelastic.agent.client import CoordinatorClient
from hpcelastic.agent.coordinator import Coordinator
from hpcelastic.agent.job_state import JobState
from hpcelastic.agent.peerwatch import Assignment, WatchBook, WatchedPeer, ring
from hpcelastic.agent.runtime import Timing
from hpcelastic.events import EventName
from hpcelastic.rundir import RunDir

SECRET = "p" * 64
HOSTS = ("n0", "n1", "n2", "n3")
#: Direct heartbeats as a 16,384-node job has them, and slower: nothing is found through them in a test.
HB_INTERVAL, HB_TIMEOUT = 60.0, 150.0
BEAT_TIMEOUT, PROBE_TIMEOUT = 1.0, 1.0
DISCARD = ("127.0.0.1", 9)


# ---- pure ----------------------------------------------------------------------------------------
def test_the_ring_watches_every_rank_by_the_next_one_up() -> None:
    assert ring([5, 0, 3]) == {0: 3, 3: 5, 5: 0}
    assert ring([4]) == {} and ring([]) == {}


def armed_book(ranks: tuple[int, ...] = (0, 1, 2, 3)) -> WatchBook:
    book = WatchBook(BEAT_TIMEOUT, PROBE_TIMEOUT)
    for a in book.plan(ranks):
        book.acknowledged(a.rank, a.watchee, a.watcher, 0.0)
    return book


def test_a_report_by_the_only_voucher_makes_its_watchee_suspected_then_lost() -> None:
    book = armed_book()
    assert book.watcher_of[2] == 3
    assert not book.report(1, 2, 10.0, heard_floor=0.0), "only the watchee's watcher is believed"
    assert book.report(3, 2, 10.0, heard_floor=0.0)
    assert not book.lost(10.0 + PROBE_TIMEOUT - 0.05) and book.lost(10.0 + PROBE_TIMEOUT + 0.05) == [2]
    assert book.probes_due(10.01) == [2]


def test_evidence_after_the_report_ends_the_suspicion_and_the_watcher_watches_afresh() -> None:
    book = armed_book()
    book.report(3, 2, 10.0, heard_floor=0.0)
    assert not book.heard(2, 9.5), "evidence older than the report extends it but does not clear it"
    assert book.suspects[2].silent_for(10.0) == pytest.approx(0.5)
    assert book.heard(2, 10.2) and book.suspects == {}
    assert book.current(3) == Assignment(3, 2, 0)


def former_watcher_case(book: WatchBook) -> WatchBook:
    """Node 2 watched node 0; node 1 joins between them and now watches node 0 (acknowledged at 5.0),
    while node 2 has not yet acknowledged that it watches node 1 instead (it does at 7.0)."""
    for a in book.plan((0, 2, 3)):
        book.acknowledged(a.rank, a.watchee, a.watcher, 0.0)
    book.plan((0, 1, 2, 3))
    book.acknowledged(1, 0, 2, 5.0)
    return book


def test_a_former_watcher_vouches_until_it_acknowledges_its_new_watchee() -> None:
    book = former_watcher_case(WatchBook(BEAT_TIMEOUT, PROBE_TIMEOUT))
    assert book.watcher_of[0] == 1 and book.vouchers(0) == {1, 2}, "node 2 may still echo node 0"
    assert not book.report(1, 0, 6.0, heard_floor=0.0)
    book.acknowledged(2, 1, 3, 7.0)
    assert book.vouchers(0) == {1}
    assert book.report(1, 0, 7.5, heard_floor=0.0)
    assert book.suspects[0].last_alive == 7.0, "silent since node 2 stopped echoing, not report - timeout"


def unarmed_case(book: WatchBook) -> WatchBook:
    """Nodes 0 and 1 watch each other; node 1 never acknowledged its watcher (its fast lease does not run)."""
    for a in book.plan((0, 1)):
        if a.rank == 0:
            book.acknowledged(0, a.watchee, a.watcher, 0.0)
    return book


def test_a_watchee_whose_fast_lease_is_not_known_to_run_is_never_acted_on() -> None:
    book = unarmed_case(WatchBook(BEAT_TIMEOUT, PROBE_TIMEOUT))
    assert not book.report(0, 1, 5.0, heard_floor=0.0), "node 1 runs on its direct lease only"


class ForgetsFormerVouchers(WatchBook):
    def vouchers(self, watchee: int) -> set[int]:
        return {a for a, w in self.assigned.items() if w == watchee}


class IgnoresArming(WatchBook):
    def report(self, reporter: int, watchee: int, now: float, heard_floor: float) -> bool:
        self.armed.add(watchee)
        return super().report(reporter, watchee, now, heard_floor)


def test_each_rule_of_the_book_is_what_keeps_the_fence() -> None:
    """Taken out, each rule lets a report count an agent silent from before the last echo it may hold."""
    broken = former_watcher_case(ForgetsFormerVouchers(BEAT_TIMEOUT, PROBE_TIMEOUT))
    assert broken.report(1, 0, 6.0, heard_floor=0.0)
    assert broken.suspects[0].last_alive < 7.0, "node 2 may echo node 0 until 7.0: its lease outlives this"
    unarmed = unarmed_case(IgnoresArming(BEAT_TIMEOUT, PROBE_TIMEOUT))
    assert unarmed.report(0, 1, 5.0, heard_floor=0.0), "node 1's workers run on its direct lease: no fence"


def test_a_lost_agent_stops_vouching_and_leaves_the_ring() -> None:
    book = armed_book()
    book.gone(3, 9.0)
    assert book.vouchers(2) == set() and book.vouch_end[2] == 9.0
    changes = {a.rank: a for a in book.plan((0, 1, 2))}
    assert changes[2] == Assignment(2, 1, 0) and changes[0] == Assignment(0, 2, 1)


def test_a_watcher_echoes_fresh_beats_only_and_none_after_its_report() -> None:
    peer = WatchedPeer(2, ("127.0.0.1", 1), last_heard=0.0)
    assert peer.beat(100, 0.1) and not peer.beat(100, 0.2) and not peer.beat(50, 0.3), "a replay is stale"
    assert peer.report_due(1.0, BEAT_TIMEOUT) is None
    assert peer.report_due(1.2, BEAT_TIMEOUT) == pytest.approx(1.1)
    assert peer.report_due(5.0, BEAT_TIMEOUT) is None, "reported once per arming"
    assert not peer.beat(200, 5.1), "no echo after the report: the coordinator counts from it"
    assert peer.heard_again() and not peer.heard_again()


def test_above_five_hundred_nodes_the_agents_watch_each_other() -> None:
    assert not Timing.for_nodes(3).peer_watch and Timing.for_nodes(16384).peer_watch
    large = Timing.from_environ({}, nodes=16384)
    assert large.peer_watch and large.detection_s == pytest.approx(
        liveness.HEARTBEAT_TIMEOUT + large.probe_timeout
    )
    assert Timing.from_environ({"HPCELASTIC_PEER_WATCH": "1"}, nodes=3).peer_watch
    assert not Timing.from_environ({"HPCELASTIC_PEER_WATCH": "0"}, nodes=16384).peer_watch


# ---- real coordinator, real clients --------------------------------------------------------------
class Ring:
    """A coordinator with the peer watch and one client per host; direct heartbeats every minute."""

    def __init__(self, rd: RunDir) -> None:
        state = JobState(
            hosts=HOSTS,
            min_nodes=1,
            max_restarts=5,
            master_addr="127.0.0.1",
            new_port=lambda: 29500,
            rdzv_timeout=20,
        )
        self.coordinator = Coordinator(
            socket.create_server(("127.0.0.1", 0)),
            SECRET,
            state,
            rd,
            heartbeat_timeout=HB_TIMEOUT,
            probe_timeout=PROBE_TIMEOUT,
            peer_watch=True,
            beat_timeout=BEAT_TIMEOUT,
        )
        self.coordinator.events.retry_delay = 0.05
        self.coordinator.start()
        self.inboxes: list[queue.SimpleQueue[messages.Message]] = []
        self.clients: list[CoordinatorClient] = []
        for rank, host in enumerate(HOSTS):
            inbox: queue.SimpleQueue[messages.Message] = queue.SimpleQueue()
            client = CoordinatorClient(
                "127.0.0.1",
                self.coordinator.port,
                SECRET,
                on_message=inbox.put,
                heartbeat_interval=HB_INTERVAL,
                heartbeat_timeout=HB_TIMEOUT,
                probe_timeout=PROBE_TIMEOUT,
                beat_timeout=BEAT_TIMEOUT,
            )
            client.connect(messages.Hello(node_rank=rank, host=host, nproc=1), timeout=10)
            client.start()
            self.inboxes.append(inbox)
            self.clients.append(client)
        book = self.coordinator._watch
        assert book is not None
        self.book = book
        deadline = time.monotonic() + 10
        while len(book.armed) < len(HOSTS) or any(book.acked.get(r) != w for w, r in book.watcher_of.items()):
            assert time.monotonic() < deadline, "every agent acknowledges its assignment"
            time.sleep(0.05)

    def lost_events(self) -> list[dict[str, object]]:
        self.coordinator.events.flush(timeout=5)
        return [e for e in self.coordinator.run_dir.events() if e["event"] == EventName.NODE_LOST.value]

    def wait_lost(self, timeout: float) -> dict[str, object]:
        deadline = time.monotonic() + timeout
        while not (events := self.lost_events()):
            assert time.monotonic() < deadline, f"no node_lost within {timeout} s"
            time.sleep(0.05)
        (event,) = events
        return event

    def lost_messages(self, rank: int) -> list[messages.Message]:
        out = []
        while not self.inboxes[rank].empty():
            msg = self.inboxes[rank].get_nowait()
            if isinstance(msg, messages.Lost):
                out.append(msg)
        return out

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.coordinator.stop(drain_timeout=2)


@pytest.fixture
def ring_plane(tmp_path: Path) -> Iterator[Ring]:
    r = Ring(RunDir(tmp_path))
    yield r
    r.close()


def test_healthy_agents_beat_to_their_watchers_and_nobody_is_lost(ring_plane: Ring) -> None:
    time.sleep(4 * (BEAT_TIMEOUT + PROBE_TIMEOUT))
    assert ring_plane.lost_events() == []
    assert all(ring_plane.lost_messages(r) == [] for r in range(len(HOSTS))), "no lease ran out"
    fast = [c.fast_lease for c in ring_plane.clients]
    assert all(f is not None and f.silent_for(time.monotonic()) < BEAT_TIMEOUT for f in fast)


def test_a_silent_node_is_found_by_its_watcher_long_before_the_heartbeats_would(ring_plane: Ring) -> None:
    """Node 2 hangs whole: its threads stop, its connection stays open (no FIN), nothing answers."""
    silenced = time.time()
    ring_plane.clients[2]._closed.set()
    event = ring_plane.wait_lost(timeout=3 * (BEAT_TIMEOUT + PROBE_TIMEOUT) + 2)
    assert event["node_rank"] == 2 and "its watcher (node 3)" in str(event["reason"])
    took = float(event["ts"]) - silenced
    assert BEAT_TIMEOUT + PROBE_TIMEOUT - 0.1 <= took <= BEAT_TIMEOUT + PROBE_TIMEOUT + 1.0


def test_a_node_cut_off_fences_itself_no_later_than_it_is_declared_lost(ring_plane: Ring) -> None:
    """Node 1's datagrams go nowhere (its beats, its probes) and the coordinator's probes to it too; its
    TCP connection still works, but its direct heartbeats come once a minute: the fast lease must end it."""
    client = ring_plane.clients[1]
    client._watcher_addr = DISCARD
    client._probe_addr = DISCARD
    ring_plane.coordinator._by_rank[1].probe_addr = DISCARD
    cut = time.time()
    deadline = time.monotonic() + 3 * (BEAT_TIMEOUT + PROBE_TIMEOUT) + 2
    while not (lost := ring_plane.lost_messages(1)):
        assert time.monotonic() < deadline, "the cut node never fenced itself"
        time.sleep(0.02)
    fenced = time.time()
    assert "watcher nor the coordinator" in lost[0].reason  # type: ignore[attr-defined]
    event = ring_plane.wait_lost(timeout=5)
    assert event["node_rank"] == 1
    assert fenced <= float(event["ts"]) + 2 * liveness.PROBE_INTERVAL, "the fence's premise"
    assert float(event["ts"]) - cut <= BEAT_TIMEOUT + PROBE_TIMEOUT + 1.0


def test_a_watcher_that_dies_costs_its_watchee_nothing_and_the_ring_closes_over_it(ring_plane: Ring) -> None:
    """Node 3 (node 2's watcher) exits: its connection closes, it is lost at once; node 2 probes the
    coordinator until the ring is rebuilt, then beats to node 0."""
    ring_plane.clients[3].close()
    event = ring_plane.wait_lost(timeout=5)
    assert event["node_rank"] == 3
    deadline = time.monotonic() + 5
    while ring_plane.book.watcher_of.get(2) != 0 or ring_plane.book.acked.get(0) != 2:
        assert time.monotonic() < deadline, "the ring is rebuilt over the survivors"
        time.sleep(0.05)
    time.sleep(3 * (BEAT_TIMEOUT + PROBE_TIMEOUT))
    assert [e["node_rank"] for e in ring_plane.lost_events()] == [3], "node 2 kept its place"
    assert ring_plane.lost_messages(2) == []
    assert ring_plane.clients[2]._watcher_addr is not None
    assert dataclasses.astuple(ring_plane.book.current(2)) == (2, 1, 0)
