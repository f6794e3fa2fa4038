"""Failure detection that does not slow down with the job's size: every agent is watched by a peer.

At 16,384 agents a coordinator that hears every agent every 0.25 s spends more than a core on heartbeats
alone (``send``, ``recv`` and ``epoll`` cost about 6.5 us each in the kernel: bench/control_plane_load.py),
so a large job heartbeats the coordinator every ``nodes / HEARTBEATS_PER_S`` seconds (``runtime.Timing``)
and a silent node is found only after 2.5 of those intervals (23 s at 16,384). With the peer watch on, the
agents watch each other in a ring instead: each agent sends a beat (an authenticated datagram,
``liveness.BEAT``) to its watcher every 0.25 s and the watcher echoes it at once; the coordinator hears
nothing of it while all is well. A watcher that heard no beat for ``timeout`` seconds reports
:class:`~hpcelastic.agent.messages.PeerSilent`; the coordinator then probes that agent itself
(``liveness.py``) and declares it lost when it answered nothing for ``probe_timeout`` more. So a silent node
is found after ``timeout + probe_timeout`` (4.75 s) at any size, a watcher's report alone never loses a node
(the coordinator's own probes decide), and the coordinator's load is the slow heartbeats plus one message
per report.

Why a ring and not a tree: a tree's relays must forward every child's liveness to the coordinator (a digest
per relay per interval) and re-parent the children of a relay that dies; in the ring the coordinator hears
only exceptions, a dead watcher costs its one watchee a few probes until the next round, and no agent does
more than send one beat and echo one.

The fence (an agent's workers surely stop before its place is reused) holds on this path too. An agent runs
its workers only while two leases hold (``client.py``): the direct one (evidence that the coordinator heard
it, bounded as before by the slow heartbeats' timeout) and the fast one, renewed by its watcher's echoes,
the coordinator's echoes and probe answers, bounded by ``timeout + probe_timeout``. The coordinator acts on
a report only when the reporter is the one agent that may still echo that watchee (a former watcher vouches
until it has acknowledged its new assignment or is lost: :class:`WatchBook`) and the watchee has
acknowledged that its fast lease runs; it then counts the watchee silent since ``report - timeout`` at the
earliest. A watcher stops echoing once it has reported, until the coordinator re-arms it. Hence every echo
the watchee holds is of a beat sent before the time the coordinator counts from, and its fast lease ends no
later than the coordinator declares it lost.

Pure: times come from the caller's monotonic clock; the coordinator and the client do the I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from hpcelastic.agent.liveness import Liveness

#: Above this many nodes the peer watch is on by default (``runtime.Timing``): there the coordinator's
#: heartbeat interval grows past 0.25 s and with it the time to find a silent node.
PEER_WATCH_ABOVE = 500
#: The ring is rebuilt once every node has joined, or when none joined or left for this long.
RING_SETTLE_S = 0.5

#: ``(node rank, address, probe port)`` of a peer, or ``()`` for none.
PeerAddr = tuple[int, str, int] | tuple[()]


def ring(ranks: Iterable[int]) -> dict[int, int]:
    """Watchee -> watcher: each rank is watched by the next one up, the highest by the lowest (none when
    fewer than two)."""
    order = sorted(set(ranks))
    if len(order) < 2:
        return {}
    return {r: order[(k + 1) % len(order)] for k, r in enumerate(order)}


@dataclass(frozen=True)
class Assignment:
    """What one agent is told (``messages.Watch``): whom it watches and who watches it (-1: nobody)."""

    rank: int
    watchee: int
    watcher: int


@dataclass
class WatchedPeer:
    """A watcher's view of its watchee (``rank``, beats from ``addr``)."""

    rank: int
    addr: tuple[str, int]
    #: When its latest fresh beat arrived (the silence clock starts at the assignment).
    last_heard: float
    #: The highest beat counter accepted (the watchee's send time in microseconds): a replayed beat is older.
    last_counter: int = 0
    #: Reported silent: no echo and no further report until the coordinator re-arms this watch.
    reported: bool = False
    heard_since_report: bool = False
    told_heard: bool = False

    def beat(self, counter: int, now: float) -> bool:
        """A beat arrived: whether to echo it (fresh, and not reported since the last arming)."""
        if counter <= self.last_counter:
            return False
        self.last_counter = counter
        if self.reported:
            self.heard_since_report = True
            return False
        self.last_heard = now
        return True

    def report_due(self, now: float, timeout: float) -> float | None:
        """The silence to report (once per arming) when no beat came for ``timeout`` s; else None."""
        if self.reported or now - self.last_heard <= timeout:
            return None
        self.reported = True
        return now - self.last_heard

    def heard_again(self) -> bool:
        """True once when a beat came after the report (the coordinator may stop suspecting the watchee)."""
        if self.reported and self.heard_since_report and not self.told_heard:
            self.told_heard = True
            return True
        return False


@dataclass
class WatchBook:
    """The coordinator's side of the peer watch: the ring, what each agent was told and acknowledged, and the
    watchees it suspects on a report (their fast :class:`Liveness`)."""

    timeout: float
    probe_timeout: float
    epoch: int = 0
    #: Watchee -> watcher, the current ring.
    watcher_of: dict[int, int] = field(default_factory=dict)
    #: Agent -> the watchee it was last told / last acknowledged (-1: none).
    assigned: dict[int, int] = field(default_factory=dict)
    acked: dict[int, int] = field(default_factory=dict)
    #: Agents whose fast lease runs (they acknowledged a watcher).
    armed: set[int] = field(default_factory=set)
    #: Watchee -> the latest time an agent stopped vouching for it (acknowledged another watchee, or lost).
    vouch_end: dict[int, float] = field(default_factory=dict)
    #: Watchee -> its fast liveness, from an acted-on report until it is heard again.
    suspects: dict[int, Liveness] = field(default_factory=dict)
    #: Watchee -> when its report was acted on.
    reported_at: dict[int, float] = field(default_factory=dict)

    def plan(self, ranks: Iterable[int]) -> list[Assignment]:
        """The ring over ``ranks``; the assignments of the agents whose watchee or watcher changed."""
        members = set(ranks)
        new = ring(members)
        watchee_of = {w: r for r, w in new.items()}
        old_watchee = {w: r for r, w in self.watcher_of.items()}
        changed = [
            Assignment(a, watchee_of.get(a, -1), new.get(a, -1))
            for a in sorted(members)
            if watchee_of.get(a, -1) != old_watchee.get(a, -1)
            or new.get(a, -1) != self.watcher_of.get(a, -1)
            or a not in self.assigned
        ]
        self.watcher_of = new
        if changed:
            self.epoch += 1
        for a in changed:
            self.assigned[a.rank] = a.watchee
        return changed

    def current(self, rank: int) -> Assignment:
        """``rank``'s assignment in the current ring (sent again: it watches afresh)."""
        watchee = next((r for r, w in self.watcher_of.items() if w == rank), -1)
        return Assignment(rank, watchee, self.watcher_of.get(rank, -1))

    def acknowledged(self, rank: int, watchee: int, watcher: int, now: float) -> None:
        """``rank`` acknowledged an assignment: it watches ``watchee`` now (and stopped echoing its former
        one), and its fast lease runs when it has a ``watcher``."""
        old = self.acked.get(rank, -1)
        if old != watchee and old >= 0 and self.assigned.get(rank) != old:
            self.vouch_end[old] = max(self.vouch_end.get(old, now), now)
        self.acked[rank] = watchee
        if watcher >= 0:
            self.armed.add(rank)

    def vouchers(self, watchee: int) -> set[int]:
        """The agents that may still echo ``watchee``'s beats (told or acknowledged it)."""
        return {a for a, w in self.assigned.items() if w == watchee} | {
            a for a, w in self.acked.items() if w == watchee
        }

    def report(self, reporter: int, watchee: int, now: float, heard_floor: float) -> bool:
        """A watcher reports its watchee silent: whether it is now suspected (probe it). ``heard_floor``: the
        latest time the coordinator itself heard the watchee. Not acted on when another agent may still echo
        the watchee, or the watchee's fast lease is not known to run (the watcher is re-armed and reports
        again)."""
        if watchee in self.suspects:
            return False
        actionable = (
            self.watcher_of.get(watchee) == reporter
            and watchee in self.armed
            and self.vouchers(watchee) == {reporter}
            and self.acked.get(reporter) == watchee
        )
        if not actionable:
            return False
        since = max(now - self.timeout, heard_floor, self.vouch_end.get(watchee, heard_floor))
        self.suspects[watchee] = Liveness(self.timeout, self.probe_timeout, since, since)
        self.reported_at[watchee] = now
        return True

    def heard(self, watchee: int, at: float) -> bool:
        """The coordinator heard ``watchee`` (a frame or a probe answer) at ``at``: True when that ends a
        suspicion (then re-arm its watcher)."""
        alive = self.suspects.get(watchee)
        if alive is None:
            return False
        alive.heard(at)
        if at < self.reported_at[watchee]:
            return False
        self.clear(watchee)
        return True

    def clear(self, watchee: int) -> None:
        """Stop suspecting ``watchee`` (heard again, or gone)."""
        self.suspects.pop(watchee, None)
        self.reported_at.pop(watchee, None)

    def lost(self, now: float) -> list[int]:
        """The suspected watchees silent on every path past ``timeout + probe_timeout``."""
        bound = self.timeout + self.probe_timeout
        return [r for r, alive in self.suspects.items() if alive.silent_for(now) > bound]

    def probes_due(self, now: float) -> list[int]:
        """The suspected watchees to probe now."""
        return [r for r, alive in self.suspects.items() if alive.probe_due(now)]

    def gone(self, rank: int, now: float) -> None:
        """``rank`` left (lost or closed): it echoes nothing more; it is no longer watched."""
        for old in {self.assigned.pop(rank, -1), self.acked.pop(rank, -1)} - {-1}:
            self.vouch_end[old] = max(self.vouch_end.get(old, now), now)
        self.armed.discard(rank)
        self.vouch_end.pop(rank, None)
        self.clear(rank)
