"""The lost-time ledger of torchft replica groups: one timeline per group, and the job's replica figures.

Pure functions of one attempt's events, used by :mod:`hpcelastic.record.ledger`. With ``--replica-groups R``
the coordinator opens the first R rounds in one go (R ``rendezvous`` events, one per group, in group
order; a group without nodes has a ``replica_group_dropped`` instead): that burst starts an **epoch**,
and every later ``replica_group_restarting`` names the group of the round it opens. A job-wide restart
(``restarting``) starts a new epoch. Definitions, per group and epoch (they add up to the epoch's time):

- ``startup``: epoch start to the group's first step (``replica_group_stepping``; in logs from before that
  event, the job's first ``progress`` step stands for every group's);
- ``productive``: the group steps, from its first step (after a restart: ``replica_group_healed``)
  to its failure (a worker's ``exit_ts``; a lost node's ``node_lost`` minus the silence it names),
  or to the job's last step;
- ``detection`` (to its ``worker_failed``/``node_lost``), ``teardown`` (to ``replica_group_restarting``
  or ``replica_group_dropped``), ``rendezvous`` (to the new round's ``rendezvous``) and ``restart``
  (to ``replica_group_healed``: restarted and healed from a peer);
- ``dropped``: left out, to the end of the epoch;
- after the job's last step or the job's own failure, a group's lane follows the job's timeline
  (``shutdown``, or the job incident's phases).

Job figures: **replica-step efficiency** = replica-steps committed / possible, as torchft reports it:
possible = R x the steps the job committed in the epoch (its last ``progress`` step - its first + 1),
committed = possible - the steps each group missed (``replica_group_healed.steps_missed``; for a group
dropped or still restarting at the end, the job's steps after its failure, estimated from the
``progress`` marks). **Replica time efficiency** = the groups' productive time / (R x the epochs' time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from hpcelastic import events as ev
from hpcelastic.events import EventLog, Record
from hpcelastic.record.fields import plain, silence_s, ts_of

#: Rendezvous events of one start burst are written within this many seconds of each other.
_BURST_S = 1.0


@dataclass
class Epoch:
    """The replica groups of one start (or job-wide restart) inside an attempt."""

    start: float
    groups: int
    #: group -> its rounds in order: (round, rendezvous ts, hosts)
    rounds: dict[int, list[tuple[int, float, list[str]]]] = field(default_factory=dict)
    dropped_at_start: list[int] = field(default_factory=list)

    @property
    def all_rounds(self) -> frozenset[int]:
        return frozenset(r for rs in self.rounds.values() for r, _, _ in rs)


def epochs(sl: EventLog) -> list[Epoch]:
    """The replica epochs of one attempt's events (empty for a run without replica groups)."""
    restarted = {r["round"]: r for r in sl.of(ev.REPLICA_GROUP_RESTARTING) if isinstance(r.get("round"), int)}
    found: list[Epoch] = []
    burst: list[Record] = []
    records = [r for r in sl if r["event"] in (ev.RENDEZVOUS, ev.RESTARTING, ev.REPLICA_GROUP_DROPPED)]

    def close() -> None:
        if len(burst) >= 2 or (burst and any(r["event"] == ev.REPLICA_GROUP_DROPPED for r in burst)):
            rdzv = [r for r in burst if r["event"] == ev.RENDEZVOUS]
            drops = [int(r["group"]) for r in burst if r["event"] == ev.REPLICA_GROUP_DROPPED]
            if len(rdzv) >= 2 or (rdzv and drops):
                e = Epoch(float(rdzv[0]["ts"]), len(rdzv) + len(drops), dropped_at_start=drops)
                free = [g for g in range(e.groups) if g not in drops]
                for g, r in zip(free, rdzv, strict=False):
                    e.rounds[g] = [(int(r["round"]), float(r["ts"]), list(r.get("hosts") or []))]
                found.append(e)
        burst.clear()

    for r in records:
        t = ts_of(r)
        if t is None:
            continue
        if r["event"] == ev.RENDEZVOUS and isinstance(r.get("round"), int) and r["round"] in restarted:
            close()
            g = restarted[r["round"]].get("group")
            if found and isinstance(g, int):
                found[-1].rounds.setdefault(g, []).append((r["round"], t, list(r.get("hosts") or [])))
            continue
        if r["event"] == ev.RESTARTING:
            close()
            continue
        if burst and (t - (ts_of(burst[0]) or t) > _BURST_S):
            close()
        # a group dropped in the same decision as the burst belongs to it
        if burst or (r["event"] == ev.RENDEZVOUS and isinstance(r.get("round"), int)):
            burst.append(r)
    close()
    return found


def group_level(sl: EventLog, cause: Record, epoch: Epoch) -> bool:
    """Whether a ``root_cause`` in the epoch stopped only its group: the group restarts or is left out
    after it, before any job-wide restart or decision (a group hang writes one; see ``agent/replicas.py``)."""
    owner = next(
        (g for g, rs in epoch.rounds.items() if any(r == cause.get("round") for r, _, _ in rs)), None
    )
    records = list(sl)
    at = next((i for i, r in enumerate(records) if r is cause), None)
    if owner is None or at is None:
        return False
    for r in records[at + 1 :]:
        if r["event"] in (ev.RESTARTING, ev.ATTEMPT_ENDED, ev.ROOT_CAUSE):
            return False
        if r["event"] in (ev.REPLICA_GROUP_RESTARTING, ev.REPLICA_GROUP_DROPPED) and r.get("group") == owner:
            return True
    return False


@dataclass(frozen=True)
class Span:
    """``[t0, t1)`` of a group lane; ``incident`` indexes :attr:`GroupLane.incidents`."""

    t0: float
    t1: float
    phase: str
    cause: str
    estimated: bool = False
    incident: int | None = None


@dataclass
class GroupIncident:
    """One failure of one replica group: it stopped and restarted (or was left out) alone."""

    group: int
    attempt: int
    round: int
    kind: str
    cause: str
    t_fail: float
    detection_s: float = 0.0
    teardown_s: float = 0.0
    rendezvous_s: float = 0.0
    restart_to_heal_s: float = 0.0
    steps_missed: int | None = None
    steps_missed_estimated: bool = False
    healed_from: list[int] = field(default_factory=list)
    recovery: str = "in_progress"  # healed | dropped | in_progress

    @property
    def lost_s(self) -> float:
        return self.detection_s + self.teardown_s + self.rendezvous_s + self.restart_to_heal_s


@dataclass
class GroupLane:
    """One group's timeline in one epoch."""

    group: int
    attempt: int
    start: float
    end: float
    spans: list[Span] = field(default_factory=list)
    incidents: list[GroupIncident] = field(default_factory=list)

    def seconds(self, phase: str) -> float:
        return sum(s.t1 - s.t0 for s in self.spans if s.phase == phase)


_INC_FIELD = {
    "detection": "detection_s",
    "teardown": "teardown_s",
    "rendezvous": "rendezvous_s",
    "restart": "restart_to_heal_s",
}


def _failure_of(
    sl: EventLog, rnd: int, hosts: Sequence[str], t0: float, t1: float
) -> tuple[str, str, float, float] | None:
    """The first failure of a group round in ``[t0, t1]``: (kind, cause, t_fail, detected)."""
    failed = [r for r in sl.of(ev.WORKER_FAILED, round=rnd) if ts_of(r) is not None]
    lost = [r for r in sl.of(ev.NODE_LOST) if r.get("node") in hosts and t0 <= (ts_of(r) or 0.0) <= t1]
    options: list[tuple[str, str, float, float]] = []
    if failed:
        first = min(failed, key=lambda r: ts_of(r, "exit_ts") or ts_of(r) or 0.0)
        error = str(first.get("error") or "")
        how = f"signal {first['signal']}" if first.get("signal") else f"exit code {first.get('exitcode')}"
        lines = error.strip().splitlines()
        cause = f"rank {first.get('rank')} on {first.get('node')}, {how}" + (
            f": {lines[-1]}" if lines else ""
        )
        detected = min(ts_of(r) or 0.0 for r in failed)
        t_fail = ts_of(first, "exit_ts") or detected
        if error.startswith("stalled"):  # a hang: dated back by the silence it names
            options.append(("stall", error, t_fail - (silence_s(error) or 0.0), detected))
        else:
            options.append(("worker_failure", cause, t_fail, detected))
    if lost:
        first = lost[0]
        seen = ts_of(first) or t0
        t_fail = seen - (silence_s(str(first.get("reason") or "")) or 0.0)
        options.append(("node_loss", f"{first.get('node')}: {first.get('reason')}", t_fail, seen))
    return min(options, key=lambda o: o[2]) if options else None


def _step_at(marks: list[tuple[float, int]], t: float) -> float | None:
    """The job's step at time ``t``, interpolated between ``progress`` marks (None before the first)."""
    before = [m for m in marks if m[0] <= t]
    after = [m for m in marks if m[0] > t]
    if not before:
        return None
    ta, sa = before[-1]
    if not after:
        return float(sa)
    tb, sb = after[0]
    return sa + (sb - sa) * (t - ta) / (tb - ta) if tb > ta else float(sa)


class _Writer:
    """Cuts one lane into consecutive spans."""

    def __init__(self, lane: GroupLane) -> None:
        self.lane, self.cursor = lane, lane.start

    def emit(
        self, phase: str, until: float, cause: str, *, incident: int | None = None, est: bool = False
    ) -> None:
        until = min(max(until, self.cursor), self.lane.end)
        if until > self.cursor:
            self.lane.spans.append(Span(self.cursor, until, phase, cause, est, incident))
        self.cursor = until


def _marks(sl: EventLog, rounds: frozenset[int]) -> list[tuple[float, int]]:
    return sorted(
        (t, int(p["step"]))
        for p in sl.of(ev.PROGRESS)
        if p.get("round") in rounds
        and (t := ts_of(p, "step_ts")) is not None
        and isinstance(p.get("step"), int)
    )


def group_lanes(
    sl: EventLog, epoch: Epoch, end: float, attempt: int, job_spans: Sequence[Span], job_stop: float
) -> list[GroupLane]:
    """Each group's lane in ``[epoch.start, end)``; from ``job_stop`` (the job's last step or its own
    failure) on, a lane follows ``job_spans`` (the job's segments after ``job_stop``)."""
    marks = _marks(sl, epoch.all_rounds)
    first_step = marks[0][0] if marks else None
    # Each group's own first step (replica_group_stepping); logs from before that event: the job's first.
    own_first = {
        r["round"]: ts_of(r, "step_ts")
        for r in sl.of(ev.REPLICA_GROUP_STEPPING)
        if r.get("round") in epoch.all_rounds
    }
    healed = sl.of(ev.REPLICA_GROUP_HEALED)
    stops = [r for r in sl.of(ev.REPLICA_GROUP_RESTARTING, ev.REPLICA_GROUP_DROPPED) if ts_of(r) is not None]
    lanes = []
    for g in range(epoch.groups):
        lane = GroupLane(g, attempt, epoch.start, end)
        lanes.append(lane)
        w = _Writer(lane)
        mine = [] if g in epoch.dropped_at_start else epoch.rounds.get(g, [])
        left_out = g in epoch.dropped_at_start
        for k, (rnd, rd_ts, hosts) in enumerate(mine):
            until_next = mine[k + 1][1] if k + 1 < len(mine) else end
            nxt = min(until_next, job_stop)
            stepping: float | None = own_first.get(rnd) if own_first else first_step
            if stepping is not None and stepping > nxt:
                stepping = None
            # A failure before the job's stop may be detected after it (a node lost by silence): look to the
            # group's next round.
            fail = _failure_of(sl, rnd, hosts, rd_ts, until_next)
            if k == 0:
                until = min(stepping if stepping is not None else nxt, nxt, fail[2] if fail else nxt)
                w.emit("startup", until, "startup")
            else:
                i = len(lane.incidents) - 1
                inc = lane.incidents[i]
                w.emit("rendezvous", rd_ts, inc.kind, incident=i)
                back = next(
                    (h for h in healed if h.get("group") == g and (ts_of(h) or 0.0) >= rd_ts - 1e-6), None
                )
                stepping = ts_of(back) if back is not None and (ts_of(back) or end) <= nxt else None
                w.emit("restart", stepping if stepping is not None else nxt, inc.kind, incident=i)
                if back is not None and stepping is not None:
                    inc.recovery = "healed"
                    inc.healed_from = [p for p in back.get("peers") or [] if isinstance(p, int)]
                    missed = back.get("steps_missed")
                    inc.steps_missed = missed if isinstance(missed, int) else None
            if fail is None or fail[2] >= job_stop:
                if stepping is not None:
                    w.emit("productive", job_stop, "productive")
                break
            kind, cause, t_fail, detected = fail
            if stepping is not None:
                w.emit("productive", t_fail, "productive")
            lane.incidents.append(GroupIncident(g, attempt, rnd, kind, cause, t_fail))
            i = len(lane.incidents) - 1
            w.emit("detection", detected, kind, incident=i)
            stop = next(
                (r for r in stops if r.get("group") == g and t_fail - 1e-6 <= (ts_of(r) or 0.0) <= end), None
            )
            w.emit("teardown", (ts_of(stop) or nxt) if stop is not None else nxt, kind, incident=i)
            if stop is not None and stop["event"] == ev.REPLICA_GROUP_DROPPED:
                lane.incidents[i].recovery = "dropped"
                left_out = True
                break
        if left_out:
            w.emit("dropped", end, "dropped")
        for s in job_spans:  # after the job's last step or its own failure, the lane follows the job
            if s.t1 > w.cursor:
                lane.spans.append(Span(max(s.t0, w.cursor), s.t1, s.phase, s.cause, s.estimated))
                w.cursor = s.t1
        w.emit("shutdown", end, "shutdown")
        _account(lane, marks)
    return lanes


def _account(lane: GroupLane, marks: list[tuple[float, int]]) -> None:
    """Sum each incident's phases; estimate the steps missed where no heal recorded them."""
    for s in lane.spans:
        if s.incident is not None and s.phase in _INC_FIELD:
            inc = lane.incidents[s.incident]
            setattr(inc, _INC_FIELD[s.phase], getattr(inc, _INC_FIELD[s.phase]) + s.t1 - s.t0)
    for inc in lane.incidents:
        if inc.steps_missed is not None or not marks:
            continue
        at = _step_at(marks, inc.t_fail)
        back = next((s.t0 for s in lane.spans if s.phase == "productive" and s.t0 > inc.t_fail), None)
        until = _step_at(marks, back) if back is not None else float(marks[-1][1])
        if at is not None and until is not None:
            inc.steps_missed, inc.steps_missed_estimated = max(0, round(until - at)), True


def job_steps(sl: EventLog, epoch: Epoch) -> int | None:
    """Steps the job committed in the epoch: its last ``progress`` step - its first + 1."""
    marks = _marks(sl, epoch.all_rounds)
    steps = [s for _, s in marks]
    return max(steps) - min(steps) + 1 if steps else None


@dataclass
class GroupTotals:
    """One group's time over the whole run (seconds) and its failures."""

    group: int
    productive_s: float = 0.0
    startup_s: float = 0.0
    lost_s: float = 0.0
    shutdown_s: float = 0.0
    dropped_s: float = 0.0
    job_s: float = 0.0  # the job's own incidents (a job-wide restart or a bad end)
    restarts: int = 0
    steps_missed: int = 0
    steps_missed_estimated: bool = False
    dropped: bool = False


@dataclass
class ReplicaFigures:
    """The job's replica figures (see the module docstring)."""

    groups: int
    replica_steps_committed: int | None
    replica_steps_possible: int | None
    replica_time_efficiency: float | None
    per_group: list[GroupTotals]
    lanes: list[GroupLane]
    #: The job is productive while at least this many groups step (torchft commits a step with any quorum).
    min_groups_stepping: int = 1

    @property
    def replica_step_efficiency(self) -> float | None:
        if not self.replica_steps_possible or self.replica_steps_committed is None:
            return None
        return self.replica_steps_committed / self.replica_steps_possible

    def to_json(self) -> dict[str, Any]:
        out = plain(asdict(self))
        out["replica_step_efficiency"] = self.replica_step_efficiency
        for lane, data in zip(self.lanes, out["lanes"], strict=True):
            for inc, d in zip(lane.incidents, data["incidents"], strict=True):
                d["lost_s"] = inc.lost_s
        return out


_LOST = ("detection", "teardown", "rendezvous", "restart")


def figures(
    epochs: Sequence[tuple[Epoch, list[GroupLane], int | None, float]], allocated_s: float
) -> ReplicaFigures | None:
    """The run's replica figures from its epochs: (epoch, its lanes, the job's steps in it, its end)."""
    if not epochs:
        return None
    groups = max(e.groups for e, _, _, _ in epochs)
    totals = {g: GroupTotals(g) for g in range(groups)}
    possible = committed = 0
    measured = False
    for e, lanes, steps, _end in epochs:
        for lane in lanes:
            t = totals[lane.group]
            for s in lane.spans:
                d = s.t1 - s.t0
                if s.incident is not None and s.phase in _LOST:
                    t.lost_s += d
                elif s.phase in ("productive", "startup", "shutdown", "dropped"):
                    setattr(t, f"{s.phase}_s", getattr(t, f"{s.phase}_s") + d)
                else:
                    t.job_s += d
            t.restarts += sum(1 for i in lane.incidents if i.recovery != "dropped")
            t.dropped = (
                t.dropped
                or lane.group in e.dropped_at_start
                or any(i.recovery == "dropped" for i in lane.incidents)
            )
            missed = sum(i.steps_missed or 0 for i in lane.incidents)
            t.steps_missed += missed
            t.steps_missed_estimated |= any(i.steps_missed_estimated for i in lane.incidents)
            if steps is not None:
                committed -= min(missed, steps) if lane.group not in e.dropped_at_start else steps
        if steps is not None:
            measured = True
            possible += e.groups * steps
            committed += e.groups * steps
    productive = sum(t.productive_s for t in totals.values())
    return ReplicaFigures(
        groups=groups,
        replica_steps_committed=committed if measured else None,
        replica_steps_possible=possible if measured else None,
        replica_time_efficiency=productive / (groups * allocated_s) if allocated_s > 0 else None,
        per_group=list(totals.values()),
        lanes=[lane for _, lanes, _, _ in epochs for lane in lanes],
    )
