"""The lost-time ledger of a run: where the allocated time went, incident by incident.

A pure function of the event log (:func:`build_ledger`); ``hpcelastic status`` prints it and
``hpcelastic report`` draws it. Definitions:

- **Allocated wall time**: the sum over attempts of attempt end - ``attempt_started``; an attempt ends
  with its last decision event (``attempt_ended`` and the ``requeued``/``resubmitted``/``job_*`` after
  it), a running one at ``now``. Time waiting in the queue is not allocated.
- Each attempt is cut into consecutive **segments**, one phase each; they add up to its wall time:
  ``startup`` (the first attempt, ``attempt_started`` to the first step), ``productive``,
  and per incident ``redone`` (training since the last checkpoint or the round's first step,
  whichever is later, lost at the failure: charged at the time it first took), ``detection``
  (failure to the coordinator knowing: first ``worker_failed``/``node_lost``), ``teardown`` (to
  ``root_cause``: every worker stopped; to the attempt end when the attempt ends), ``rendezvous``
  (to the next ``rendezvous``; after a requeue from ``attempt_started``) and ``restart`` (to the first
  step of the new round), and ``shutdown`` (the attempt's last step to its end, when its last round
  stopped without a failure and its ``last`` progress mark was written: the exit barrier and the
  processes' exit; before, this counted as productive). **Pending** (requeue to the next
  ``attempt_started``) lies between attempts.
- With torchft replica groups (``--replica-groups``) the groups' rounds of one start are one round of
  the job (a replica epoch, :mod:`hpcelastic.record.replica_lanes`): the job is productive while at least
  one group steps, a failure that restarts one group only is that group's (its lane, not a job
  incident), and time when no group steps is charged to the groups' incident. ``replica_groups`` holds
  each group's lane and the replica figures (replica-step efficiency, as torchft reports it).
- The failure time: a worker failure at its ``exit_ts``; a stall at ``exit_ts`` minus the stall
  timeout; a node loss at ``node_lost`` minus the heartbeat silence its reason names; a preemption or
  time limit at the first ``signal_received``.
- **Slow**: of the productive time, what running below the job's own pace cost (``slow_time`` events
  of the slow-node detector, hpcelastic/slow/: time x (1 - rate / baseline rate) over the windows judged
  slow, the latest per round) is badput of cause and phase ``slow``.
- **Badput** = allocated - productive, by cause (the incident kind, ``startup`` or ``slow``) and by phase.
  **Effective training time ratio** (ETTR, as Meta and ByteDance report it) = productive / allocated;
  ``ettr_wall`` also counts pending time in the denominator.
- Steps come from ``progress`` events (the coordinator writes them from the workers' heartbeats).
  In an attempt with progress events, a round without any never reached a step. In an attempt
  without any, a round's first step is estimated as ``workers_started.spawned_ts`` + the median init
  time measured in the other attempts (0 when nothing was measured); figures that rest on such an
  estimate are named in the incident's ``estimated`` and the segment's ``estimated``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from hpcelastic import events as ev
from hpcelastic.events import EventLog, Record
from hpcelastic.reasons import Named, Reason
from hpcelastic.record import replica_lanes as rl
from hpcelastic.record.fields import plain, silence_s, step_field, ts_of
from hpcelastic.tier.scan import step_of


class Phase(Named):
    """What a stretch of time was spent on."""

    PRODUCTIVE = "productive"
    STARTUP = "startup"
    REDONE = "redone"
    DETECTION = "detection"
    TEARDOWN = "teardown"
    RENDEZVOUS = "rendezvous"
    RESTART = "restart"
    PENDING = "pending"
    QUEUED = "queued"
    SHUTDOWN = "shutdown"
    DROPPED = "dropped"
    #: Training at less than the job's own pace (a slow node, or the whole job slowed): the time it lost.
    SLOW = "slow"
    #: Training before a failure when nothing tells how much of it the next round redid (neither
    #: productive nor badput: the ledger does not guess).
    UNKNOWN = "unknown"


#: The phases of an incident inside an allocation, in the order they happen (redone work comes first).
LOST_PHASES = (Phase.REDONE, Phase.DETECTION, Phase.TEARDOWN, Phase.RENDEZVOUS, Phase.RESTART)


class IncidentKind(Named):
    """What interrupted training: the cause that badput is totalled by."""

    WORKER_FAILURE = "worker_failure"
    NODE_LOSS = "node_loss"
    STALL = "stall"
    NODE_UNHEALTHY = "node_unhealthy"
    PREEMPTION = "preemption"
    TIME_LIMIT = "time_limit"
    COORDINATOR_LOST = "coordinator_lost"
    TOO_FEW_NODES = "too_few_nodes"
    STARTUP_FAILURE = "startup_failure"
    UNKNOWN = "unknown"


STARTUP_CAUSE = "startup"
SHUTDOWN_CAUSE = "shutdown"
_END_KIND = {
    Reason.PREEMPTED: IncidentKind.PREEMPTION,
    Reason.TIME_LIMIT: IncidentKind.TIME_LIMIT,
    Reason.NODE_UNHEALTHY: IncidentKind.NODE_UNHEALTHY,
    Reason.COORDINATOR_LOST: IncidentKind.COORDINATOR_LOST,
    Reason.TOO_FEW_NODES: IncidentKind.TOO_FEW_NODES,
    Reason.STARTUP_FAILURE: IncidentKind.STARTUP_FAILURE,
    Reason.RESTARTS_EXHAUSTED: IncidentKind.WORKER_FAILURE,
}
_DECISIONS = (
    ev.ATTEMPT_ENDED,
    ev.REQUEUED,
    ev.RESUBMITTED,
    ev.REQUEUE_FAILED,
    ev.REQUEUE_SKIPPED,
    ev.JOB_SUCCEEDED,
    ev.JOB_FAILED,
)


@dataclass(frozen=True)
class Segment:
    """``[t0, t1)`` spent on ``phase``; ``incident`` indexes :attr:`Ledger.incidents`."""

    t0: float
    t1: float
    phase: Phase
    cause: str
    attempt: int
    round: int | None = None
    incident: int | None = None
    estimated: bool = False

    @property
    def seconds(self) -> float:
        return self.t1 - self.t0


@dataclass
class Incident:
    """One interruption of training and the time it cost, split by phase (seconds)."""

    kind: IncidentKind
    cause: str
    attempt: int
    round: int | None
    t_fail: float
    detection_s: float = 0.0
    teardown_s: float = 0.0
    rendezvous_s: float = 0.0
    restart_to_first_step_s: float = 0.0
    redone_work_s: float = 0.0
    pending_s: float = 0.0
    estimated: list[str] = field(default_factory=list)
    recovery: str = "none"  # restart | requeue | none | in_progress
    redone_steps: int | None = None
    #: What the redone work rests on; None: unknown, see ``unknown_s``.
    redone_source: ResumeSource | None = None
    #: What the next round resumed from (``after step 24``, a checkpoint's path).
    resumed_from: str | None = None
    #: Training before the failure whose redone share nothing tells (drawn and counted as ``unknown``).
    unknown_s: float = 0.0

    @property
    def lost_s(self) -> float:
        """Allocated time lost (pending excluded)."""
        return (
            self.detection_s
            + self.teardown_s
            + self.rendezvous_s
            + self.restart_to_first_step_s
            + self.redone_work_s
        )


@dataclass(frozen=True)
class RoundSpan:
    round: int
    start: float
    first_step: float | None
    first_step_estimated: bool
    world_size: int | None


@dataclass(frozen=True)
class AttemptSpan:
    attempt: int
    job_id: str | None
    start: float
    end: float
    end_reason: str | None  # None while running or when no decision was recorded
    rounds: list[RoundSpan]

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint and when it was complete: published (handed to the next round), or only
    written by the script (found in the checkpoint directory, ``name``: an unchanged ``torch.save`` or DCP
    script publishes nothing). Only published ones enter the lost-time figures."""

    ts: float
    step: int | None
    attempt: int | None
    name: str | None = None
    published: bool = True


class ResumeSource(Named):
    """What an incident's redone work rests on (``Incident.redone_source``)."""

    HEARTBEATS = "heartbeats"  # the step the next round resumed after
    CHECKPOINT_OPENED = "checkpoint_opened"  # the checkpoint the next round read
    TIER_RESTORED = "tier_restored"  # the checkpoint the local tier placed for the next round (or none)
    CHECKPOINT_PUBLISHED = "checkpoint_published"  # the checkpoint handed to the next round
    NO_TRAINING = "no_training"  # the round failed before its first step: nothing to redo


@dataclass(frozen=True)
class Resumed:
    """What the round after a failure resumed from: a step (the failed round's steps after it were
    redone) or the time a checkpoint was complete (the failed round's training after it was redone)."""

    source: ResumeSource
    step: int | None = None
    completed_ts: float | None = None
    #: What it resumed from, for people: ``step 24``, ``checkpoint_19``.
    what: str = ""


def tier_completed(log: EventLog, name: str, before: float) -> tuple[float, int | None] | None:
    """When the local tier knew its checkpoint ``name`` complete job-wide, and its step: its newest
    ``tier_checkpoint`` at or before ``before``, else its ``tier_persisted`` less the persist's duration. The
    save itself ended up to a scan interval (0.5 s) earlier; a copy's mtime is later (a restore made it)."""
    done = [r for r in log.of(ev.TIER_CHECKPOINT, checkpoint=name) if (ts_of(r) or before + 1) <= before]
    if done:
        return float(done[-1]["ts"]), step_field(done[-1])
    kept = [r for r in log.of(ev.TIER_PERSISTED, checkpoint=name) if (ts_of(r) or before + 1) <= before]
    if kept:
        return float(kept[-1]["ts"]) - (ts_of(kept[-1], "duration_s") or 0.0), step_field(kept[-1])
    return None


def published_checkpoints(log: EventLog) -> list[Checkpoint]:
    """The published checkpoints, by when each was complete: a script's publish right after its save, the
    tier's persist (published by the commit, later) when the tier's checkpoint was complete job-wide."""
    persisted = {r.get("path"): r for r in log.of(ev.TIER_PERSISTED)}
    out = []
    for r in log.of(ev.CHECKPOINT_PUBLISHED):
        t = ts_of(r)
        if t is None:
            continue
        tier = persisted.get(r.get("path"))
        done = (
            tier_completed(log, str(tier.get("checkpoint")), ts_of(tier) or t) if tier is not None else None
        )
        out.append(Checkpoint(done[0] if done else t, step_field(r), r.get("attempt")))
    return sorted(out, key=lambda c: c.ts)


def written_only(log: EventLog, written: Sequence[tuple[str, float]]) -> list[Checkpoint]:
    """The checkpoints in ``written`` that no ``checkpoint_published`` or tier persist names, each in the
    attempt that was running when it was complete."""
    known = log.of(ev.CHECKPOINT_PUBLISHED, ev.TIER_PERSISTED)
    named = {Path(str(r["path"])).name for r in known if r.get("path")}
    named |= {str(r["checkpoint"]) for r in known if r.get("checkpoint")}
    starts = [(t, r.get("attempt")) for r in log.of(ev.ATTEMPT_STARTED) if (t := ts_of(r)) is not None]
    starts.sort(key=lambda s: s[0])
    out = []
    for name, done in written:
        if name in named:
            continue
        attempt = next((a for t, a in reversed(starts) if t <= done and isinstance(a, int)), None)
        out.append(Checkpoint(done, step_of(name), attempt, name, published=False))
    return out


def resumed_from_heartbeats(log: EventLog, sl: EventLog, rounds: frozenset[int]) -> Resumed | None:
    """The round's first reported step ``s``: it resumed from the state after step ``s - 1``
    (``heartbeat(step)`` is called once ``step`` is done, as the README's loop does)."""
    first = [p for p in sl.of(ev.PROGRESS) if p.get("round") in rounds and isinstance(p.get("step"), int)]
    if not first:
        return None
    step = min(first, key=lambda p: ts_of(p, "step_ts") or 0.0)["step"] - 1
    return Resumed(ResumeSource.HEARTBEATS, step=step, what=f"after step {step}")


def resumed_from_opened(log: EventLog, sl: EventLog, rounds: frozenset[int]) -> Resumed | None:
    """The checkpoint the round's workers read before its first step (``checkpoint_opened``), complete when
    its files were (their mtime), or when the local tier knew it complete if that is earlier: the file read
    may be a copy a restore made (a peer's part fetched, a persisted copy), whose mtime is the copy's. A
    checkpoint complete after the round began is no resume: the round saved it."""
    opened = next(
        (r for r in sl.of(ev.CHECKPOINT_OPENED) if r.get("round") in rounds and r.get("path")), None
    )
    if opened is None:
        return None
    path, mtime = str(opened["path"]), ts_of(opened, "completed_ts")
    tier = tier_completed(log, path, ts_of(opened) or float("inf"))
    if tier is None and mtime is None:
        return None
    completed = min(t for t in (mtime, tier[0] if tier else None) if t is not None)
    begun = [t for r in sl.of(ev.RENDEZVOUS) if r.get("round") in rounds and (t := ts_of(r)) is not None]
    if begun and completed >= min(begun):  # the round's own save, read by someone (the tier's scan)
        return None
    return Resumed(
        ResumeSource.CHECKPOINT_OPENED, step=tier[1] if tier else None, completed_ts=completed, what=path
    )


def resumed_from_restore(log: EventLog, sl: EventLog, rounds: frozenset[int]) -> Resumed | None:
    """The checkpoint the local tier restored for the round (``tier_restored``; weaker than the script's
    own read: the script may read another): when it was complete job-wide, else when the copy the tier
    restored from was published. The tier restoring nothing (``none``): the round trained from scratch."""
    restored = next((r for r in sl.of(ev.TIER_RESTORED) if r.get("round") in rounds), None)
    if restored is None:
        return None
    name = str(restored.get("checkpoint") or "")
    if restored.get("tier") == ev.RestoreTier.NONE or not name:
        return Resumed(ResumeSource.TIER_RESTORED, step=0, completed_ts=float("-inf"), what="nothing")
    at = ts_of(restored) or float("inf")
    done = tier_completed(log, name, at)
    if done is None:
        step = step_field(restored)
        found = [c.ts for c in published_checkpoints(log) if c.step == step and c.ts <= at]
        done = (found[-1], step) if step is not None and found else None
    if done is None:
        return None
    return Resumed(ResumeSource.TIER_RESTORED, step=done[1], completed_ts=done[0], what=name)


#: Evidence of what a round resumed from, strongest first; each reads the whole log and the round's
#: attempt. A new kind (a restore event naming its step, say) is one more function here.
RESUME_EVIDENCE = (resumed_from_heartbeats, resumed_from_opened, resumed_from_restore)


@dataclass
class Ledger:
    """Where a run's time went; ``to_json`` is what ``status --json`` carries under ``ledger``."""

    attempts: list[AttemptSpan]
    incidents: list[Incident]
    segments: list[Segment]
    checkpoints: list[Checkpoint]
    allocated_s: float
    productive_s: float
    unknown_s: float
    pending_s: float
    queued_s: float
    badput_by_cause: dict[str, float]
    badput_by_phase: dict[str, float]
    #: torchft replica groups: per-group timelines and the job's replica figures (None without groups).
    replica_groups: rl.ReplicaFigures | None
    steps_measured: bool
    init_estimate_s: float
    notes: list[str]

    @property
    def badput_s(self) -> float:
        return self.allocated_s - self.productive_s - self.unknown_s

    @property
    def ettr(self) -> float | None:
        """Effective training time ratio: productive / allocated (a lower bound while ``unknown_s`` > 0)."""
        return self.productive_s / self.allocated_s if self.allocated_s > 0 else None

    @property
    def ettr_upper(self) -> float | None:
        """The ratio if all training of unknown fate was kept: (productive + unknown) / allocated."""
        return (self.productive_s + self.unknown_s) / self.allocated_s if self.allocated_s > 0 else None

    @property
    def ettr_wall(self) -> float | None:
        """Productive / (allocated + pending after requeues)."""
        total = self.allocated_s + self.pending_s
        return self.productive_s / total if total > 0 else None

    def to_json(self) -> dict[str, Any]:
        out = plain(asdict(self))
        out["incidents"] = [
            {
                **plain(asdict(i)),
                "lost_s": i.lost_s,
                "redone_work_s": i.redone_work_s if i.redone_source else None,
            }
            for i in self.incidents
        ]
        out.update(
            badput_s=self.badput_s, ettr=self.ettr, ettr_upper=self.ettr_upper, ettr_wall=self.ettr_wall
        )
        out["replica_groups"] = self.replica_groups.to_json() if self.replica_groups is not None else None
        return out


def _failure_text(r: Record) -> str:
    lines = str(r.get("error") or "").strip().splitlines()
    last = f": {lines[-1]}" if lines else ""
    if r.get("rank") is None:
        return f"{r.get('node')}{last}"
    how = f"signal {r['signal']}" if r.get("signal") else f"exit code {r.get('exitcode')}"
    return f"rank {r.get('rank')} on {r.get('node')}, {how}{last}"


@dataclass
class _Failure:
    """An incident while it is being placed: when the coordinator knew, and when the workers had stopped."""

    incident: Incident
    detected: float
    stopped: float | None


#: Segments that lie outside an attempt's allocation.
_OUTSIDE = (Phase.PENDING, Phase.QUEUED)

_PHASE_FIELD = {
    Phase.DETECTION: "detection_s",
    Phase.TEARDOWN: "teardown_s",
    Phase.RENDEZVOUS: "rendezvous_s",
    Phase.RESTART: "restart_to_first_step_s",
    Phase.REDONE: "redone_work_s",
    Phase.PENDING: "pending_s",
    Phase.UNKNOWN: "unknown_s",
}


class _Builder:
    """Walks the attempts once, cutting each into consecutive segments (see the module docstring)."""

    def __init__(self, log: EventLog, now: float | None, written: Sequence[tuple[str, float]] = ()) -> None:
        self.log = log
        self.now = now
        self.segments: list[Segment] = []
        self.incidents: list[Incident] = []
        self.attempts: list[AttemptSpan] = []
        self.lanes: list[rl.GroupLane] = []
        self.epochs: list[tuple[rl.Epoch, list[rl.GroupLane], int | None, float]] = []
        self.cursor = self.limit = 0.0
        self.checkpoints = published_checkpoints(log)
        self.written = written_only(log, written)
        self.slices = self._slices()
        self.slice_rounds = [self._job_rounds(sl, rl.epochs(sl)) for sl in self.slices]
        self.steps_measured = bool(log.of(ev.PROGRESS))
        self.init_s = self._init_estimate()

    # ---- reading ----------------------------------------------------------------------------------
    def _slices(self) -> list[EventLog]:
        """The events of each attempt: from its ``attempt_started`` to the next one."""
        records = list(self.log)
        starts = [
            i for i, r in enumerate(records) if r["event"] == ev.ATTEMPT_STARTED and ts_of(r) is not None
        ]
        if not starts:
            return []
        ends = [*starts[1:], len(records)]
        return [EventLog(records[a:b]) for a, b in zip(starts, ends, strict=True)]

    @staticmethod
    def _marks(sl: EventLog, rounds: Any) -> list[float]:
        """The ``step_ts`` of the ``progress`` events of a round (an int) or of a set of rounds."""
        match = rounds if isinstance(rounds, frozenset) else frozenset([rounds])
        return [
            t
            for p in sl.of(ev.PROGRESS)
            if p.get("round") in match and (t := ts_of(p, "step_ts")) is not None
        ]

    @classmethod
    def _measured_first(cls, sl: EventLog, rnd: Any) -> float | None:
        times = cls._marks(sl, rnd)
        return min(times) if times else None

    @staticmethod
    def _job_rounds(sl: EventLog, epochs: list[rl.Epoch]) -> list[tuple[Record, frozenset[int]]]:
        """The job's rounds: each ``rendezvous``, except that a replica epoch is one round of the job."""
        rdzvs = [r for r in sl.of(ev.RENDEZVOUS) if isinstance(r.get("round"), int) and ts_of(r) is not None]
        in_epoch = {r: e for e in epochs for r in e.all_rounds}
        out: list[tuple[Record, frozenset[int]]] = []
        for r in rdzvs:
            e = in_epoch.get(r["round"])
            if e is None:
                out.append((r, frozenset([r["round"]])))
            elif not out or out[-1][1] != e.all_rounds:
                out.append((r, e.all_rounds))
        return out

    def _init_estimate(self) -> float:
        """Median time from ``workers_started`` to the first step, where both are known."""
        samples = []
        for sl in self.slices:
            for w in sl.of(ev.WORKERS_STARTED):
                first, spawned = self._measured_first(sl, w.get("round")), ts_of(w, "spawned_ts")
                if first is not None and spawned is not None and first >= spawned:
                    samples.append(first - spawned)
        return statistics.median(samples) if samples else 0.0

    def _first_step(
        self, sl: EventLog, rnd: int, rounds: frozenset[int], rd_ts: float, end: float
    ) -> tuple[float | None, bool]:
        """When the round reached its first step (None: never), and whether that is an estimate."""
        measured = self._measured_first(sl, rounds)
        if measured is not None:
            return min(max(measured, rd_ts), end), False
        if sl.of(ev.PROGRESS):  # heartbeats arrived in this attempt, and none in this round
            return None, False
        spawned = ts_of(sl.first(ev.WORKERS_STARTED, round=rnd), "spawned_ts")
        if spawned is None:
            return None, True
        # A round that read its checkpoint had not stepped before: training follows the load.
        opened = [
            t for r in sl.of(ev.CHECKPOINT_OPENED) if r.get("round") in rounds and (t := ts_of(r)) is not None
        ]
        first = max(spawned + self.init_s, rd_ts, *opened)
        return (first if first < end else None), True

    def _last_step(self, sl: EventLog, rounds: frozenset[int]) -> float | None:
        """The round's last step, when its ``last`` progress mark was written (the round stopped)."""
        if not any(
            p.get("round") in rounds and p.get("mark") == ev.ProgressMark.LAST for p in sl.of(ev.PROGRESS)
        ):
            return None
        return max(self._marks(sl, rounds))

    def _checkpoint_before(self, t: float) -> Checkpoint | None:
        found = [c for c in self.checkpoints if c.ts <= t]
        return found[-1] if found else None

    def _resumed(self, n: int, i: int, stop: float) -> Resumed | None:
        """What the job round after round ``i`` of attempt ``n`` resumed from (the next attempt's first
        round after a requeue); else the checkpoint published last before it started (or before ``stop``,
        the failed round's end, when none followed), which the agent hands to the next round."""
        later = [(n, j) for j in range(i + 1, len(self.slice_rounds[n]))]
        later += [(m, 0) for m in range(n + 1, len(self.slices)) if self.slice_rounds[m]][:1]
        if later:
            m, j = later[0]
            rd, rounds = self.slice_rounds[m][j]
            for evidence in RESUME_EVIDENCE:
                found = evidence(self.log, self.slices[m], rounds)
                if found is not None:
                    return found
            stop = float(rd["ts"])
        ckpt = self._checkpoint_before(stop)
        if ckpt is None:
            return None
        return Resumed(
            ResumeSource.CHECKPOINT_PUBLISHED, step=ckpt.step, completed_ts=ckpt.ts, what=f"step {ckpt.step}"
        )

    def _kept_until(
        self, resumed: Resumed, sl: EventLog, rounds: frozenset[int], first: float, t_fail: float
    ) -> tuple[float, int | None, bool] | None:
        """Where the failed round's kept training ends (the rest, to ``t_fail``, was redone), the steps
        redone, and whether that rests on the estimated first step; None when the evidence cannot be placed
        (a step, but no steps measured in the failed round)."""
        marks = sorted(
            [
                (p["step"], t)
                for p in sl.of(ev.PROGRESS)
                if p.get("round") in rounds
                and isinstance(p.get("step"), int)
                and (t := ts_of(p, "step_ts")) is not None
                and t <= t_fail
            ]
            # a checkpoint published in the round is a step reached by then, too
            + [(c.step, c.ts) for c in self.checkpoints if c.step is not None and first <= c.ts <= t_fail]
        )
        if resumed.completed_ts is not None:
            kept = min(max(resumed.completed_ts, first), t_fail)
            # the step reached at the failure is measured by heartbeats only (a checkpoint is a lower bound)
            beats = any(p.get("round") in rounds for p in sl.of(ev.PROGRESS))
            steps = None
            if marks and resumed.step is not None and beats:
                steps = max(0, marks[-1][0] - max(resumed.step, marks[0][0] - 1))
            return kept, steps, resumed.completed_ts <= first
        if resumed.step is None or not marks:
            return None
        k, (s0, _), (s_last, t_last) = resumed.step, marks[0], marks[-1]
        if k >= s_last:
            return t_last, 0, False
        if k < s0:
            return first, s_last - max(k, s0 - 1), False
        (a, ta), (b, tb) = max(m for m in marks if m[0] <= k), min(m for m in marks if m[0] > k)
        return ta + (tb - ta) * (k - a) / (b - a), s_last - k, False

    def _round_failure(
        self, sl: EventLog, rounds: frozenset[int], rd_ts: float, attempt: int, epoch: rl.Epoch | None = None
    ) -> _Failure | None:
        """The round's ``root_cause`` as an incident: worker failure, stall or node loss (in a replica
        epoch, only a job-wide one: a group's own root cause is in its lane)."""
        cause = next(
            (
                r
                for r in sl.of(ev.ROOT_CAUSE)
                if r.get("round") in rounds and (epoch is None or not rl.group_level(sl, r, epoch))
            ),
            None,
        )
        if cause is None:
            return None
        rnd = cause["round"]
        error = str(cause.get("error") or "")
        exit_ts = ts_of(cause, "exit_ts") or ts_of(cause) or rd_ts
        estimated: list[str] = []
        detected = sl.first(ev.WORKER_FAILED, round=rnd)
        if cause.get("rank") is None:  # a whole node: its agent went silent, closed or left
            kind = IncidentKind.NODE_UNHEALTHY if "unhealthy" in error else IncidentKind.NODE_LOSS
            lost = [r for r in sl.of(ev.NODE_LOST, node=cause.get("node")) if (ts_of(r) or 0.0) >= rd_ts]
            detected = lost[0] if lost else None
            silent = silence_s(str(detected.get("reason")) if detected else error)
            t_fail = (ts_of(detected) or exit_ts) - (silent or 0.0)
        elif error.startswith("stalled"):
            kind = IncidentKind.STALL
            silent = silence_s(error)
            t_fail = exit_ts - (silent or 0.0)
            if silent is None:
                estimated.append("detection_s")
        else:
            kind, t_fail = IncidentKind.WORKER_FAILURE, exit_ts
        inc = Incident(kind, _failure_text(cause), attempt, rnd, t_fail, estimated=estimated)
        return _Failure(inc, ts_of(detected) or ts_of(cause) or t_fail, ts_of(cause))

    def _end_failure(
        self, sl: EventLog, reason: Reason | None, attempt: int, rnd: int | None, since: float, end: float
    ) -> _Failure:
        """An attempt that ended badly without a root cause in its last round."""
        kind = _END_KIND.get(reason, IncidentKind.UNKNOWN) if reason else IncidentKind.UNKNOWN
        after = [r for r in sl if (ts_of(r) or 0.0) >= since]
        if kind in (IncidentKind.PREEMPTION, IncidentKind.TIME_LIMIT):
            first = next((r for r in after if r["event"] == ev.SIGNAL_RECEIVED), None)
            cause = f"{first.get('signal')} received: {reason}" if first else str(reason)
        else:
            first = next((r for r in after if r["event"] in (ev.NODE_LOST, ev.WORKER_FAILED)), None)
            what = (
                "attempt ended without a recorded decision" if reason is None else f"attempt ended: {reason}"
            )
            if first is not None:
                detail = _failure_text(first) if first["event"] == ev.WORKER_FAILED else first.get("reason")
                what += (
                    f" ({first.get('node')}: {detail})" if first["event"] == ev.NODE_LOST else f" ({detail})"
                )
            cause = what
        t_fail = ts_of(first)
        inc = Incident(kind, cause, attempt, rnd, t_fail if t_fail is not None else end)
        if t_fail is None:
            inc.estimated.append("t_fail")
        return _Failure(inc, inc.t_fail, None)

    # ---- writing segments ---------------------------------------------------------------------
    def emit(self, phase: Phase, until: float, attempt: int, rnd: int | None, cause: str, **kw: Any) -> None:
        """Charge ``[cursor, until)`` to ``phase``; times out of order (clock skew) are clamped."""
        until = min(max(until, self.cursor), self.limit)
        if until > self.cursor:
            self.segments.append(Segment(self.cursor, until, phase, cause, attempt, rnd, **kw))
        self.cursor = max(self.cursor, until)

    def charge(
        self, index: int | None, phase: Phase, until: float, attempt: int, rnd: int | None, est: bool = False
    ) -> None:
        """Charge to incident ``index``'s ``phase``, or to ``startup`` when no incident is recovering."""
        if index is None:
            self.emit(Phase.STARTUP, until, attempt, rnd, STARTUP_CAUSE, estimated=est)
        else:
            kind = str(self.incidents[index].kind)
            self.emit(phase, until, attempt, rnd, kind, incident=index, estimated=est)

    def _place_failure(
        self,
        f: _Failure,
        first: float | None,
        est: bool,
        sl: EventLog,
        stop: float,
        attempt: int,
        rounds: frozenset[int] = frozenset(),
        resumed: Resumed | None = None,
    ) -> int:
        """Productive, redone (or unknown), detection and teardown time of one failure; returns the
        incident's index. Redone work rests on ``resumed``: without it, the round's training before the
        failure is ``unknown``."""
        inc = f.incident
        self.incidents.append(inc)
        index = len(self.incidents) - 1
        if resumed is not None and resumed.completed_ts is not None:
            self._redo_since(index, resumed.completed_ts)
        redone_est = False
        if first is None or first >= inc.t_fail:  # no training in the round: nothing to redo
            inc.redone_source = resumed.source if resumed else ResumeSource.NO_TRAINING
        else:
            kept = (
                self._kept_until(resumed, sl, rounds or frozenset([inc.round]), first, inc.t_fail)
                if resumed
                else None
            )
            if kept is None:
                self.emit(
                    Phase.UNKNOWN,
                    inc.t_fail,
                    attempt,
                    inc.round,
                    str(inc.kind),
                    incident=index,
                    estimated=est,
                )
            else:
                until, inc.redone_steps, on_first = kept
                inc.redone_source = resumed.source if resumed else None
                inc.resumed_from = resumed.what or None if resumed else None
                self.emit(Phase.PRODUCTIVE, until, attempt, inc.round, "productive", estimated=est)
                redone_est = est and on_first
                if redone_est:
                    inc.estimated.append("redone_work_s")
        self.charge(index, Phase.REDONE, inc.t_fail, attempt, inc.round, redone_est)
        self.charge(index, Phase.DETECTION, f.detected, attempt, inc.round, "detection_s" in inc.estimated)
        self.charge(index, Phase.TEARDOWN, stop, attempt, inc.round)
        return index

    def _redo_since(self, index: int, since: float) -> None:
        """Training of earlier rounds after ``since`` counted productive so far is redone, too, when the next
        round resumed from an older state than they did (the tier restored an older checkpoint, or none)."""
        inc, out = self.incidents[index], []
        for seg in self.segments:
            if seg.phase is not Phase.PRODUCTIVE or seg.t1 <= since:
                out.append(seg)
                continue
            if seg.t0 < since:
                out.append(replace(seg, t1=since))
            out.append(
                replace(seg, t0=max(seg.t0, since), phase=Phase.REDONE, cause=str(inc.kind), incident=index)
            )
        self.segments = out

    # ---- one attempt ------------------------------------------------------------------------------
    def attempt(self, sl: EventLog, n: int, recovering: int | None) -> int | None:
        """Cut one attempt into segments; returns the incident the next allocation recovers from."""
        started, last = sl[0], n == len(self.slices) - 1
        attempt = started["attempt"] if isinstance(started.get("attempt"), int) else n
        a_start = float(started["ts"])
        ended = sl.last(ev.ATTEMPT_ENDED)
        reason = Reason.parse(ended.get("reason")) if ended else None
        decided = [t for r in sl.of(*_DECISIONS) if (t := ts_of(r)) is not None]
        seen = [t for r in sl if (t := ts_of(r)) is not None]
        if decided:
            a_end = max(decided)
        elif last and self.now is not None:
            a_end = max(self.now, *seen)
        else:
            a_end = max(seen)
        badly = reason not in (None, Reason.SUCCEEDED, Reason.CANCELLED) or (reason is None and not last)
        self.cursor, self.limit = a_start, a_end
        rounds: list[RoundSpan] = []
        epochs = rl.epochs(sl)
        job_rounds = self.slice_rounds[n]
        by_rounds = {e.all_rounds: e for e in epochs}
        stops: dict[frozenset[int], float] = {}  # a replica epoch -> the job's last step or its failure
        for i, (rd, members) in enumerate(job_rounds):
            rnd, rd_ts, final = rd["round"], float(rd["ts"]), i == len(job_rounds) - 1
            self.charge(recovering, Phase.RENDEZVOUS, rd_ts, attempt, rnd)
            f = self._round_failure(sl, members, rd_ts, attempt, by_rounds.get(members))
            if f is None and final and badly:
                # In a replica epoch, a group's failure that healed is not what ended the attempt.
                healed = [t for r in sl.of(ev.REPLICA_GROUP_HEALED) if (t := ts_of(r)) is not None]
                since = max([rd_ts, *healed]) if len(members) > 1 else rd_ts
                f = self._end_failure(sl, reason, attempt, rnd, since, a_end)
            round_end = min(f.incident.t_fail, a_end) if f else a_end
            first, est = self._first_step(sl, rnd, members, rd_ts, round_end)
            self.charge(recovering, Phase.RESTART, round_end if first is None else first, attempt, rnd, est)
            if recovering is not None and est and first is not None:
                self.incidents[recovering].estimated.append("restart_to_first_step_s")
            rounds.append(RoundSpan(rnd, rd_ts, first, est, rd.get("world_size")))
            if f is None:
                last_step = self._last_step(sl, members) if final and reason is not None else None
                if last_step is not None and first is not None:
                    self.emit(Phase.PRODUCTIVE, last_step, attempt, rnd, "productive", estimated=est)
                    self.emit(Phase.SHUTDOWN, a_end, attempt, rnd, SHUTDOWN_CAUSE)
                    stops[members] = max(last_step, first)
                else:
                    self.emit(Phase.PRODUCTIVE, a_end, attempt, rnd, "productive", estimated=est)
                recovering = None
                continue
            stops[members] = f.incident.t_fail
            stop = a_end if final and reason is not None else (f.stopped or a_end)
            resumed = self._resumed(n, i, stop)
            recovering = self._place_failure(f, first, est, sl, stop, attempt, members, resumed)
            if not final:
                self.incidents[recovering].recovery = "restart"
        if not job_rounds and badly:
            f = self._end_failure(sl, reason, attempt, None, a_start, a_end)
            self.charge(recovering, Phase.RENDEZVOUS, f.incident.t_fail, attempt, None)
            recovering = self._place_failure(f, None, False, sl, a_end, attempt, resumed=None)
        # A failure with no new round yet: the attempt is still recovering (or it never started training).
        self.charge(recovering, Phase.RENDEZVOUS, a_end, attempt, None)
        self._replica_lanes(sl, epochs, stops, attempt, a_end)
        self.attempts.append(
            AttemptSpan(
                attempt, started.get("job_id"), a_start, a_end, ended.get("reason") if ended else None, rounds
            )
        )
        return recovering

    # ---- replica groups -------------------------------------------------------------------------
    def _replica_lanes(
        self,
        sl: EventLog,
        epochs: list[rl.Epoch],
        stops: dict[frozenset[int], float],
        attempt: int,
        end: float,
    ) -> None:
        """Each replica group's lane; the job's productive time while no group stepped becomes badput."""
        for k, e in enumerate(epochs):
            e_end = epochs[k + 1].start if k + 1 < len(epochs) else end
            stop = min(stops.get(e.all_rounds, e_end), e_end)
            after = [
                rl.Span(max(x.t0, stop), min(x.t1, e_end), str(x.phase), x.cause, x.estimated)
                for x in self.segments
                if x.attempt == attempt and x.t1 > stop and x.t0 < e_end and x.phase not in _OUTSIDE
            ]
            lanes = rl.group_lanes(sl, e, e_end, attempt, after, stop)
            self.lanes += lanes
            self.epochs.append((e, lanes, rl.job_steps(sl, e), e_end))
            self._no_group_stepping(lanes, e.start, stop)

    def _no_group_stepping(self, lanes: list[rl.GroupLane], t0: float, t1: float) -> None:
        """Job productive time in ``[t0, t1)`` when no group stepped: charged to the groups' incident."""
        union: list[tuple[float, float]] = []
        for a, b in sorted((s.t0, s.t1) for lane in lanes for s in lane.spans if s.phase == "productive"):
            if union and a <= union[-1][1]:
                union[-1] = (union[-1][0], max(union[-1][1], b))
            else:
                union.append((a, b))
        if not union:  # no step was measured: nothing to compare with
            return
        out: list[Segment] = []
        for seg in self.segments:
            if seg.phase is not Phase.PRODUCTIVE or seg.t1 <= t0 or seg.t0 >= t1:
                out.append(seg)
                continue
            cursor, end = seg.t0, min(seg.t1, t1)
            for a, b in union:
                a, b = max(a, cursor), min(b, end)
                if b <= a:
                    continue
                if a > cursor:
                    out.append(self._gap(seg, cursor, a, lanes))
                out.append(replace(seg, t0=a, t1=b))
                cursor = b
            if cursor < end:
                out.append(self._gap(seg, cursor, end, lanes))
            if end < seg.t1:
                out.append(replace(seg, t0=end))
        self.segments = out

    @staticmethod
    def _gap(seg: Segment, a: float, b: float, lanes: list[rl.GroupLane]) -> Segment:
        spans = [s for lane in lanes for s in lane.spans if s.t0 <= a < s.t1 and s.incident is not None]
        phase, cause = (Phase(spans[0].phase), spans[0].cause) if spans else (Phase.RESTART, "unknown")
        return Segment(a, b, phase, cause, seg.attempt, seg.round)

    # ---- the whole log ------------------------------------------------------------------------
    def build(self) -> Ledger:
        recovering: int | None = None
        submitted = ts_of(self.log.first(ev.SUBMITTED))
        queued = 0.0
        if self.slices and submitted is not None:
            queued = max(0.0, float(self.slices[0][0]["ts"]) - submitted)
            if queued:
                self.segments.append(Segment(submitted, submitted + queued, Phase.QUEUED, "queued", -1))
        for n, sl in enumerate(self.slices):
            if n:
                self._pending(recovering, float(sl[0]["ts"]))
            recovering = self.attempt(sl, n, recovering)
        if recovering is not None and self.attempts:
            self._tail(recovering)
        return self._ledger(queued)

    def _pending(self, recovering: int | None, until: float) -> None:
        """From the previous attempt's requeue to this ``attempt_started``."""
        prev = self.attempts[-1]
        self.cursor, self.limit = prev.end, until
        if recovering is None:
            self.emit(Phase.PENDING, until, prev.attempt, None, str(IncidentKind.UNKNOWN))
            return
        self.incidents[recovering].recovery = "requeue"
        self.charge(recovering, Phase.PENDING, until, prev.attempt, None)

    def _tail(self, recovering: int) -> None:
        """After the last attempt: the job ended, or it waits for its next allocation."""
        inc, last = self.incidents[recovering], self.attempts[-1]
        finished = self.log.last(ev.JOB_SUCCEEDED, ev.JOB_FAILED, ev.CANCELLED)
        if finished is not None and (ts_of(finished) or 0.0) >= last.start:
            return
        inc.recovery = "in_progress"
        if last.end_reason is not None and self.now is not None:
            self.cursor, self.limit = last.end, self.now
            self.charge(recovering, Phase.PENDING, self.now, last.attempt, None)

    def _ledger(self, queued: float) -> Ledger:
        by_cause: dict[str, float] = {}
        by_phase: dict[str, float] = {}
        productive = allocated = pending = unknown = 0.0
        for s in self.segments:
            if s.incident is not None and s.phase in _PHASE_FIELD:
                inc = self.incidents[s.incident]
                name = _PHASE_FIELD[s.phase]
                setattr(inc, name, getattr(inc, name) + s.seconds)
            if s.phase is Phase.PENDING:
                pending += s.seconds
            if s.phase in (Phase.PENDING, Phase.QUEUED):
                continue
            allocated += s.seconds
            if s.phase is Phase.PRODUCTIVE:
                productive += s.seconds
                continue
            if s.phase is Phase.UNKNOWN:
                unknown += s.seconds
                continue
            by_cause[s.cause] = by_cause.get(s.cause, 0.0) + s.seconds
            by_phase[str(s.phase)] = by_phase.get(str(s.phase), 0.0) + s.seconds
        slow = min(productive, slow_time_s(self.log))
        if slow > 0:
            productive -= slow
            by_cause[str(Phase.SLOW)] = by_phase[str(Phase.SLOW)] = slow
        notes = []
        guessed = [a.attempt for a in self.attempts if any(r.first_step_estimated for r in a.rounds)]
        if guessed:
            notes.append(
                f"no progress events in attempt(s) {', '.join(map(str, guessed))} (the workers do not call "
                f"heartbeat()): first steps are estimated as workers_started + {self.init_s:.1f} s "
                "(the median init time measured in this run, else 0), or when the round read its checkpoint"
            )
        unplaced = ", ".join(f"#{i}" for i, inc in enumerate(self.incidents, 1) if inc.unknown_s > 0)
        if unplaced:
            notes.append(
                f"redone work unknown for incident(s) {unplaced}: no round followed yet, or it reported no "
                "step, read no checkpoint the agent saw and none was published; the training before the "
                "failure is counted as unknown, so the ratio is a range"
            )
        if self.epochs:
            notes.append(
                "replica groups: the progress events carry the job's steps, not each group's: a group's "
                "lane starts stepping at its own first step (replica_group_stepping; in older logs the "
                "job's first step) and after a restart when it healed (replica_group_healed), and ends "
                "at its failure or the job's last step"
            )
        for r in self.log.of(ev.TIER_PERSIST_MISSED):
            notes.append(
                f"attempt {r.get('attempt')}: the local checkpoint tier did not persist "
                f"{r.get('checkpoint')} (step {r.get('step')}) to the checkpoint directory: {r.get('why')}; "
                "a requeue resumes from the newest persisted one"
            )
        for inc in self.incidents:
            inc.estimated = list(dict.fromkeys(inc.estimated))
        return Ledger(
            attempts=self.attempts,
            incidents=self.incidents,
            segments=self.segments,
            checkpoints=sorted([*self.checkpoints, *self.written], key=lambda c: c.ts),
            allocated_s=allocated,
            productive_s=productive,
            unknown_s=unknown,
            pending_s=pending,
            queued_s=queued,
            badput_by_cause=by_cause,
            badput_by_phase=by_phase,
            replica_groups=rl.figures(self.epochs, allocated),
            steps_measured=self.steps_measured,
            init_estimate_s=self.init_s,
            notes=notes,
        )


def slow_time_s(log: EventLog) -> float:
    """The time lost to running slow: per round, its latest ``slow_time`` (each is the round's total)."""
    latest: dict[tuple[Any, Any], float] = {}
    for r in log.of(ev.SLOW_TIME):
        latest[(r.get("attempt"), r.get("round"))] = float(r.get("lost_s") or 0.0)
    return sum(latest.values())


def build_ledger(
    log: EventLog, now: float | None = None, written: Sequence[tuple[str, float]] = ()
) -> Ledger:
    """The run's lost-time ledger. ``now`` ends a running attempt (default: its newest event); ``written``:
    the complete checkpoints in the checkpoint directory and when each was complete
    (:func:`hpcelastic.lifecycle.evidence.written_checkpoints`), shown beside the published ones."""
    return _Builder(log, now, written).build()


def duration(seconds: float) -> str:
    """``1 h 02 min``, ``5 min 10 s``, ``12.3 s``."""
    s = max(0.0, seconds)
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def ratio_text(ledger: Ledger) -> str:
    """``91.5 %``, or ``52.0 % to 70.1 %`` while some training is of unknown fate; ``n/a`` before any."""
    if ledger.ettr is None:
        return "n/a"
    text = f"{100 * ledger.ettr:.1f} %"
    if ledger.unknown_s > 0 and ledger.ettr_upper is not None:
        text += f" to {100 * ledger.ettr_upper:.1f} %"
    return text


def ledger_lines(ledger: Ledger) -> list[str]:
    """The ledger as text, for ``hpcelastic status`` after the timeline."""
    if not ledger.attempts:
        return ["lost-time ledger: no attempt has started yet"]
    ratio = ratio_text(ledger)
    wall = f"{100 * ledger.ettr_wall:.1f} %" if ledger.ettr_wall is not None else "n/a"
    unknown = f", {duration(ledger.unknown_s)} of unknown fate" if ledger.unknown_s > 0 else ""
    lines = [
        f"effective training time ratio {ratio}: productive {duration(ledger.productive_s)}{unknown} of "
        f"{duration(ledger.allocated_s)} allocated; {wall} counting {duration(ledger.pending_s)} pending",
    ]
    if ledger.badput_by_cause:
        causes = sorted(ledger.badput_by_cause.items(), key=lambda kv: -kv[1])
        lines.append("badput by cause: " + ", ".join(f"{k} {duration(v)}" for k, v in causes))
    for i, inc in enumerate(ledger.incidents, 1):
        parts = [redone_text(inc)] + [
            f"{label} {'~' if name in inc.estimated else ''}{duration(getattr(inc, name))}"
            for label, name in (
                ("detection", "detection_s"),
                ("teardown", "teardown_s"),
                ("rendezvous", "rendezvous_s"),
                ("restart", "restart_to_first_step_s"),
            )
        ]
        where = f"attempt {inc.attempt}" + (f" round {inc.round}" if inc.round is not None else "")
        pending = f"; pending {duration(inc.pending_s)}" if inc.pending_s else ""
        lines.append(
            f"#{i} {inc.kind} ({where}): {inc.cause}; lost {duration(inc.lost_s)} = {', '.join(parts)}"
            f"{pending}; recovery: {inc.recovery}"
        )
    if ledger.replica_groups is not None:
        lines += _replica_lines(ledger.replica_groups, ledger.allocated_s)
    lines += [f"note: {n}" for n in ledger.notes]
    return lines


def redone_text(inc: Incident) -> str:
    """``redone 0.4 s (3 step(s), heartbeats)``, or ``redone unknown (12.0 s of training before the
    failure)``."""
    if inc.redone_source is None:
        return f"redone unknown ({duration(inc.unknown_s)} of training before the failure)"
    steps = f"{inc.redone_steps} step(s), " if inc.redone_steps is not None else ""
    mark = "~" if "redone_work_s" in inc.estimated else ""
    why = _SOURCE_TEXT[inc.redone_source].format(inc.resumed_from)
    return f"redone {mark}{duration(inc.redone_work_s)} ({steps}{why})"


#: How ``status`` names what the redone work rests on; ``{}`` is what the next round resumed from.
_SOURCE_TEXT = {
    ResumeSource.HEARTBEATS: "heartbeats: the next round resumed {}",
    ResumeSource.CHECKPOINT_OPENED: "the next round read checkpoint {}",
    ResumeSource.TIER_RESTORED: "the local tier restored {} for the next round",
    ResumeSource.CHECKPOINT_PUBLISHED: "the checkpoint published at {}",
    ResumeSource.NO_TRAINING: "no step before the failure",
}


def _replica_lines(rep: rl.ReplicaFigures, allocated_s: float) -> list[str]:
    """The replica groups' part of the ledger: the job's replica figures, then one line per group."""
    eff = rep.replica_step_efficiency
    steps = (
        f"replica-step efficiency {100 * eff:.1f} % ({rep.replica_steps_committed} of "
        f"{rep.replica_steps_possible} replica-steps committed)"
        if eff is not None
        else "replica-step efficiency n/a (no progress events)"
    )
    time_eff = rep.replica_time_efficiency
    share = f"{100 * time_eff:.1f} %" if time_eff is not None else "n/a"
    lines = [
        f"replica groups: {rep.groups}; {steps}",
        f"  groups stepping {share} of {rep.groups} x {duration(allocated_s)} allocated; the job counts as "
        f"productive while at least {rep.min_groups_stepping} group steps",
    ]
    for t in rep.per_group:
        parts = [f"productive {duration(t.productive_s)}", f"lost {duration(t.lost_s)}"]
        if t.restarts:
            parts.append(f"{t.restarts} restart(s)")
        parts.append(f"{'~' if t.steps_missed_estimated else ''}{t.steps_missed} step(s) missed")
        if t.dropped:
            parts.append(f"left out for {duration(t.dropped_s)}")
        lines.append(f"  group {t.group}: " + ", ".join(parts))
    for lane in rep.lanes:
        for inc in lane.incidents:
            back = (
                f"healed from group(s) {', '.join(map(str, inc.healed_from))}"
                if inc.healed_from
                else inc.recovery
            )
            where = f"attempt {inc.attempt} round {inc.round}"
            lines.append(
                f"  group {inc.group} {inc.kind} ({where}): {inc.cause}; lost "
                f"{duration(inc.lost_s)} = detection {duration(inc.detection_s)}, teardown "
                f"{duration(inc.teardown_s)}, rendezvous {duration(inc.rendezvous_s)}, restart and heal "
                f"{duration(inc.restart_to_heal_s)}; {back}"
            )
    return lines
