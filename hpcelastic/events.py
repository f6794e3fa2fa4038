"""The run's event vocabulary: every event name, one typed constructor per event, and the queries
every reader of ``events.jsonl`` uses.

Writers build an :class:`Event` with a constructor below and hand it to ``RunDir.record``; readers
wrap the parsed lines in an :class:`EventLog` and ask it (``log.last(ROOT_CAUSE, attempt=k)``)
instead of scanning the list with filters of their own. The fields of each event are documented
in docs/ARCHITECTURE.md ("Events"), which must list the same names as :class:`EventName`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hpcelastic.reasons import JobEnd, Named, Reason, Requeuer, RestartCause, SkipReason

Record = Mapping[str, Any]


class EventName(Named):
    """Every event ``events.jsonl`` can hold."""

    SUBMITTED = "submitted"
    RESUBMITTED = "resubmitted"
    ATTEMPT_STARTED = "attempt_started"
    RENDEZVOUS = "rendezvous"
    WORKERS_STARTED = "workers_started"
    WORKER_FAILED = "worker_failed"
    ROOT_CAUSE = "root_cause"
    NODE_LOST = "node_lost"
    NODE_UNHEALTHY = "node_unhealthy"
    RESTARTING = "restarting"
    SIGNAL_RECEIVED = "signal_received"
    CHECKPOINT_PUBLISHED = "checkpoint_published"
    CHECKPOINT_REJECTED = "checkpoint_rejected"
    CHECKPOINT_MISSING = "checkpoint_missing"
    HANDOFF_CORRUPT = "handoff_corrupt"
    ATTEMPT_ENDED = "attempt_ended"
    REQUEUED = "requeued"
    REQUEUE_FAILED = "requeue_failed"
    REQUEUE_SKIPPED = "requeue_skipped"
    JOB_SUCCEEDED = "job_succeeded"
    JOB_FAILED = "job_failed"
    CANCELLED = "cancelled"
    PROGRESS = "progress"
    REPLICA_GROUP_RESTARTING = "replica_group_restarting"
    REPLICA_GROUP_HEALED = "replica_group_healed"
    REPLICA_GROUP_STEPPING = "replica_group_stepping"
    REPLICA_GROUP_DROPPED = "replica_group_dropped"
    STOP_IGNORED = "stop_ignored"
    CHECKPOINT_OPENED = "checkpoint_opened"
    AGENT_STOPPED = "agent_stopped"
    TIER_CHECKPOINT = "tier_checkpoint"
    TIER_REPLICATED = "tier_replicated"
    TIER_PERSISTED = "tier_persisted"
    TIER_PERSIST_MISSED = "tier_persist_missed"
    TIER_RESTORED = "tier_restored"
    TIER_REFUSED = "tier_refused"
    TIER_UNJUDGED = "tier_unjudged"
    TIER_SET_ASIDE = "tier_set_aside"
    NODE_SLOW = "node_slow"
    JOB_SLOW = "job_slow"
    SLOW_TIME = "slow_time"


SUBMITTED = EventName.SUBMITTED
RESUBMITTED = EventName.RESUBMITTED
ATTEMPT_STARTED = EventName.ATTEMPT_STARTED
RENDEZVOUS = EventName.RENDEZVOUS
WORKERS_STARTED = EventName.WORKERS_STARTED
WORKER_FAILED = EventName.WORKER_FAILED
ROOT_CAUSE = EventName.ROOT_CAUSE
NODE_LOST = EventName.NODE_LOST
NODE_UNHEALTHY = EventName.NODE_UNHEALTHY
RESTARTING = EventName.RESTARTING
SIGNAL_RECEIVED = EventName.SIGNAL_RECEIVED
CHECKPOINT_PUBLISHED = EventName.CHECKPOINT_PUBLISHED
CHECKPOINT_REJECTED = EventName.CHECKPOINT_REJECTED
CHECKPOINT_MISSING = EventName.CHECKPOINT_MISSING
HANDOFF_CORRUPT = EventName.HANDOFF_CORRUPT
ATTEMPT_ENDED = EventName.ATTEMPT_ENDED
REQUEUED = EventName.REQUEUED
REQUEUE_FAILED = EventName.REQUEUE_FAILED
REQUEUE_SKIPPED = EventName.REQUEUE_SKIPPED
JOB_SUCCEEDED = EventName.JOB_SUCCEEDED
JOB_FAILED = EventName.JOB_FAILED
CANCELLED = EventName.CANCELLED
PROGRESS = EventName.PROGRESS
REPLICA_GROUP_RESTARTING = EventName.REPLICA_GROUP_RESTARTING
REPLICA_GROUP_HEALED = EventName.REPLICA_GROUP_HEALED
REPLICA_GROUP_STEPPING = EventName.REPLICA_GROUP_STEPPING
REPLICA_GROUP_DROPPED = EventName.REPLICA_GROUP_DROPPED
STOP_IGNORED = EventName.STOP_IGNORED
CHECKPOINT_OPENED = EventName.CHECKPOINT_OPENED
AGENT_STOPPED = EventName.AGENT_STOPPED
TIER_CHECKPOINT = EventName.TIER_CHECKPOINT
TIER_REPLICATED = EventName.TIER_REPLICATED
TIER_PERSISTED = EventName.TIER_PERSISTED
TIER_PERSIST_MISSED = EventName.TIER_PERSIST_MISSED
TIER_RESTORED = EventName.TIER_RESTORED
TIER_REFUSED = EventName.TIER_REFUSED
TIER_UNJUDGED = EventName.TIER_UNJUDGED
TIER_SET_ASIDE = EventName.TIER_SET_ASIDE
NODE_SLOW = EventName.NODE_SLOW
JOB_SLOW = EventName.JOB_SLOW
SLOW_TIME = EventName.SLOW_TIME

#: The fields of a worker failure, shared by ``worker_failed`` and ``root_cause``.
FAILURE_FIELDS = ("round", "rank", "local_rank", "node_rank", "node", "exitcode", "signal", "error")
#: Events that bring a job id into the run (first submission, then resubmissions).
JOB_ID_EVENTS = (SUBMITTED, RESUBMITTED)


@dataclass(frozen=True)
class Event:
    """One event to record: its name and its fields (``ts`` and ``host`` are added when written)."""

    name: EventName
    fields: dict[str, Any] = field(default_factory=dict)


def _plain(value: Any) -> Any:
    """Enums as their strings, so that the written line holds plain JSON values."""
    return value.value if isinstance(value, enum.Enum) else value


def _event(name: EventName, **fields: Any) -> Event:
    return Event(name, {k: _plain(v) for k, v in fields.items()})


# ---- submission -------------------------------------------------------------------------------
def submitted(*, job_id: str, backend: str, nodes: str, script: str) -> Event:
    return _event(SUBMITTED, job_id=job_id, backend=backend, nodes=nodes, script=script)


def resubmitted(
    *,
    job_id: str,
    previous_job_id: str,
    exclude: Sequence[str],
    reason: Reason,
    attempt: int,
    duration_s: float,
) -> Event:
    return _event(
        RESUBMITTED,
        job_id=job_id,
        previous_job_id=previous_job_id,
        dependency=f"afterany:{previous_job_id}",
        exclude=list(exclude),
        reason=reason,
        attempt=attempt,
        duration_s=duration_s,
    )


def cancelled(*, job_id: str, signal: str | None = None) -> Event:
    """``signal``: the user stopped ``hpcelastic run`` with it (Ctrl-C is SIGINT); None for a cancel."""
    return _event(CANCELLED, job_id=job_id, **({"signal": signal} if signal else {}))


# ---- one attempt ------------------------------------------------------------------------------
def attempt_started(*, attempt: int, job_id: str, restart_count_slurm: int, nodes: Sequence[str]) -> Event:
    return _event(
        ATTEMPT_STARTED,
        attempt=attempt,
        job_id=job_id,
        restart_count_slurm=restart_count_slurm,
        nodes=list(nodes),
    )


def rendezvous(
    *,
    round: int,
    hosts: Sequence[str],
    world_size: int,
    master_addr: str,
    master_port: int,
    restart_count: int,
) -> Event:
    return _event(
        RENDEZVOUS,
        round=round,
        hosts=list(hosts),
        world_size=world_size,
        master_addr=master_addr,
        master_port=master_port,
        restart_count=restart_count,
    )


def workers_started(
    *,
    round: int,
    world_size: int,
    spawned_ts: float,
    spawn: str = "cold",
    cold_reasons: Mapping[str, str] | None = None,
) -> Event:
    """``spawn``: "warm", "cold" or "mixed" over the nodes; ``cold_reasons``: node rank -> why cold."""
    return _event(
        WORKERS_STARTED,
        round=round,
        world_size=world_size,
        spawned_ts=spawned_ts,
        spawn=spawn,
        cold_reasons=dict(cold_reasons or {}),
    )


def worker_failed(failure: Mapping[str, Any], *, exit_ts: float | None) -> Event:
    """A worker failure as the agents report it (the keys of :data:`FAILURE_FIELDS`)."""
    return _event(WORKER_FAILED, **{k: failure.get(k) for k in FAILURE_FIELDS}, exit_ts=exit_ts)


def root_cause(failure: Mapping[str, Any], *, traceback: str, exit_ts: float | None) -> Event:
    """The first failure of a round, job-wide: the fields of ``worker_failed`` and the traceback."""
    return _event(
        ROOT_CAUSE, **{k: failure.get(k) for k in FAILURE_FIELDS}, traceback=traceback, exit_ts=exit_ts
    )


def node_lost(*, node_rank: int, node: str, reason: str) -> Event:
    return _event(NODE_LOST, node_rank=node_rank, node=node, reason=reason)


def agent_stopped(*, node_rank: int, node: str, reason: str) -> Event:
    """An agent left on a signal that stopped every agent of the step with it (Slurm's cancel, preemption or
    time limit; Ctrl-C or TERM to ``hpcelastic run``): the job was stopped, no node was lost."""
    return _event(AGENT_STOPPED, node_rank=node_rank, node=node, reason=reason)


def node_unhealthy(*, node: str, gpu: str, reason: str) -> Event:
    return _event(NODE_UNHEALTHY, node=node, gpu=gpu, reason=reason)


def restarting(*, round: int, restart_count: int, max_restarts: int, reason: RestartCause) -> Event:
    return _event(
        RESTARTING, round=round, restart_count=restart_count, max_restarts=max_restarts, reason=reason
    )


# ---- torchft replica groups (hpcelastic.agent.replicas) --------------------------------------------
def replica_group_restarting(
    *,
    group: int,
    round: int,
    nodes: Sequence[str],
    group_restarts: int,
    max_restarts: int,
    reason: RestartCause,
    last_step: int | None,
) -> Event:
    """Only replica group ``group`` restarts (on ``nodes``); the other groups keep stepping."""
    return _event(
        REPLICA_GROUP_RESTARTING,
        group=group,
        round=round,
        nodes=list(nodes),
        group_restarts=group_restarts,
        max_restarts=max_restarts,
        reason=reason,
        last_step=last_step,
    )


def replica_group_stepping(*, group: int, round: int, step: int, step_ts: float) -> Event:
    """A replica group's first step (taken at ``step_ts``, the reporting node's clock, as ``progress``'s)
    after every group started together (an attempt's start, or a job-wide restart): the ledger counts the
    group productive from there, not from the job's first step."""
    return _event(REPLICA_GROUP_STEPPING, group=group, round=round, step=step, step_ts=step_ts)


def replica_group_healed(
    *, group: int, step: int, peers: Sequence[int], steps_missed: int | None, down_s: float
) -> Event:
    """A restarted group stepped again at ``step``: torchft healed it from a live peer group."""
    return _event(
        REPLICA_GROUP_HEALED,
        group=group,
        step=step,
        peers=list(peers),
        steps_missed=steps_missed,
        down_s=down_s,
    )


def replica_group_dropped(*, group: int, reason: str, remaining: int, min_groups: int) -> Event:
    """Replica group ``group`` is left out for the rest of the attempt (no nodes or no restarts left)."""
    return _event(
        REPLICA_GROUP_DROPPED, group=group, reason=reason, remaining=remaining, min_groups=min_groups
    )


def signal_received(*, signal: str, node_rank: int) -> Event:
    return _event(SIGNAL_RECEIVED, signal=signal, node_rank=node_rank)


# ---- checkpoints and the handoff record -------------------------------------------------------
def checkpoint_published(*, path: str, step: int, attempt: int, rank: int, checkpoint_dir: str) -> Event:
    return _event(
        CHECKPOINT_PUBLISHED, path=path, step=step, attempt=attempt, rank=rank, checkpoint_dir=checkpoint_dir
    )


def checkpoint_opened(
    *,
    attempt: int,
    round: int,
    node_rank: int,
    path: str,
    file: str,
    completed_ts: float | None,
    newest: str | None,
) -> Event:
    """A worker of ``round`` opened ``file`` of checkpoint ``path`` (both relative to the checkpoint dir)
    for reading before the round's first step: what the round resumed from, seen by its agent (an
    unchanged script publishes nothing). ``completed_ts``: when that checkpoint was complete (its newest
    file's mtime; a DCP directory's ``.metadata``); ``newest``: the newest complete checkpoint there then."""
    return _event(
        CHECKPOINT_OPENED,
        attempt=attempt,
        round=round,
        node_rank=node_rank,
        path=path,
        file=file,
        completed_ts=completed_ts,
        newest=newest,
    )


def checkpoint_rejected(*, path: str, step: int, attempt: int, rank: int, why: str) -> Event:
    return _event(CHECKPOINT_REJECTED, path=path, step=step, attempt=attempt, rank=rank, why=why)


def checkpoint_missing(*, path: str, fallback: str | None) -> Event:
    return _event(CHECKPOINT_MISSING, path=path, fallback=fallback)


def handoff_corrupt(*, error: str, recovered_attempt: int, recovered_checkpoint: str | None) -> Event:
    return _event(
        HANDOFF_CORRUPT,
        error=error,
        recovered_attempt=recovered_attempt,
        recovered_checkpoint=recovered_checkpoint,
    )


# ---- the end of an attempt and of the job -----------------------------------------------------
def attempt_ended(
    *,
    attempt: int,
    reason: Reason,
    exit_code: int,
    signature: str | None,
    progressed: bool,
    bad_nodes: Sequence[str] = (),
    action: str | None = None,
    exclude: Sequence[str] = (),
    progress: str | None = None,
) -> Event:
    """``action`` is the policy's verdict (``bring_back`` counts the requeue before Slurm is asked);
    ``exclude`` the nodes the next attempt avoids; ``progressed``: the attempt trained; ``progress``:
    why it advanced the job (None: it did not), see ``lifecycle/progress.py``."""
    return _event(
        ATTEMPT_ENDED,
        attempt=attempt,
        reason=reason,
        exit_code=exit_code,
        signature=signature,
        progressed=progressed,
        progress=progress,
        bad_nodes=list(bad_nodes),
        action=action,
        exclude=list(exclude),
    )


def requeued(
    *,
    job_id: str,
    attempt: int,
    reason: Reason,
    exclude: Sequence[str],
    duration_s: float,
    note: str | None,
    by: Requeuer = Requeuer.HPCELASTIC,
    hold_s: int | None = None,
) -> Event:
    """The job is queued again with the same id; ``by``: who requeued it (Slurm: hpcelastic did not);
    ``hold_s``: how long Slurm holds it before it may start (cred_expire + 1 s), when known."""
    return _event(
        REQUEUED,
        job_id=job_id,
        attempt=attempt,
        reason=reason,
        exclude=list(exclude),
        duration_s=duration_s,
        note=note,
        by=by,
        hold_s=hold_s,
    )


def requeue_failed(*, error: str, fallback: str, job_id: str, attempt: int) -> Event:
    return _event(REQUEUE_FAILED, error=error, fallback=fallback, job_id=job_id, attempt=attempt)


def requeue_skipped(*, reason: SkipReason, attempt: int, detail: str) -> Event:
    return _event(REQUEUE_SKIPPED, reason=reason, attempt=attempt, detail=detail)


def job_succeeded(*, attempt: int) -> Event:
    return _event(
        JOB_SUCCEEDED, exit_code=Reason.SUCCEEDED.exit_code, reason=Reason.SUCCEEDED, attempt=attempt
    )


def job_failed(*, exit_code: int, reason: Reason | JobEnd, attempt: int) -> Event:
    return _event(JOB_FAILED, exit_code=exit_code, reason=reason, attempt=attempt)


# ---- reading ----------------------------------------------------------------------------------
class EventLog(Sequence[Record]):
    """The parsed event log, oldest first, with the queries its readers need.

    Only JSON objects with a string ``event`` are kept, so readers can index fields without checks
    of their own; ``damaged`` counts the lines that were skipped.
    """

    def __init__(self, records: Iterable[Any], damaged: int = 0) -> None:
        kept = [r for r in records if isinstance(r, Mapping) and isinstance(r.get("event"), str)]
        self._records: list[Record] = kept
        self.damaged = damaged

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: Any) -> Any:
        return self._records[index]

    def __iter__(self) -> Iterator[Record]:
        return iter(self._records)

    def of(self, *names: EventName, **match: Any) -> list[Record]:
        """The events named ``names`` (all events when none) whose fields equal ``match``, oldest first."""
        wanted = {str(n) for n in names}
        return [
            r
            for r in self._records
            if (not wanted or r["event"] in wanted) and all(r.get(k) == _plain(v) for k, v in match.items())
        ]

    def first(self, *names: EventName, **match: Any) -> Record | None:
        found = self.of(*names, **match)
        return found[0] if found else None

    def last(self, *names: EventName, **match: Any) -> Record | None:
        found = self.of(*names, **match)
        return found[-1] if found else None

    def since_last(self, name: EventName) -> EventLog:
        """The events after the newest ``name`` event (all of them when there is none)."""
        for i in range(len(self._records) - 1, -1, -1):
            if self._records[i]["event"] == str(name):
                return EventLog(self._records[i + 1 :])
        return EventLog(self._records)

    def job_ids(self) -> list[str]:
        """The run's Slurm job ids in submission order (first submission, then resubmissions)."""
        ids: list[str] = []
        for r in self.of(*JOB_ID_EVENTS):
            jid = r.get("job_id")
            if jid and str(jid) not in ids:
                ids.append(str(jid))
        return ids

    def ended_reason(self, attempt: int) -> Reason | None:
        """How ``attempt`` ended, from its ``attempt_ended`` event."""
        ended = self.last(ATTEMPT_ENDED, attempt=attempt)
        return Reason.parse(ended.get("reason")) if ended else None

    def published_attempts(self) -> set[int]:
        """The attempts in which a checkpoint was published."""
        return {r["attempt"] for r in self.of(CHECKPOINT_PUBLISHED) if isinstance(r.get("attempt"), int)}


# ---- training progress (appended for the lost-time ledger, hpcelastic/record/ledger.py) -------------
class ProgressMark(Named):
    """Which kind of ``progress`` event: the round's first step, a periodic mark, or the round's last."""

    FIRST = "first"
    PERIODIC = "periodic"
    LAST = "last"


#: The least time between two ``periodic`` progress marks of a round (keeps ``events.jsonl`` small).
PROGRESS_INTERVAL_S = 60.0


def progress(*, attempt: int, round: int, step: int, step_ts: float, mark: ProgressMark, ranks: int) -> Event:
    """Training progress from the workers' heartbeats, written by the coordinator.

    ``step``: the highest step any rank of the round reported so far; ``step_ts``: when that
    heartbeat reached the node's agent (a local datagram: the worker's time within milliseconds);
    ``ranks``: how many ranks have reported a step in this round. ``first``
    as soon as the round's first heartbeat arrives, ``periodic`` at most once per
    :data:`PROGRESS_INTERVAL_S`, ``last`` once when the round stops (failure, preemption or the end),
    if it saw a step (also when a periodic mark already named that step).
    """
    return _event(PROGRESS, attempt=attempt, round=round, step=step, step_ts=step_ts, mark=mark, ranks=ranks)


# ---- the stop signal: a rank that trains past the job's stop step -------------------------------
def stop_ignored(*, attempt: int, round: int, rank: int, node_rank: int, step: int, stop_step: int) -> Event:
    """Rank ``rank`` reported ``step``, past the job's ``stop_step``, after the stop reached it: it calls
    ``heartbeat()`` but not ``should_stop()``. Its agent stopped it (SIGTERM to its tree) as soon as it
    held no checkpoint file open for writing; the steps after ``stop_step`` are lost."""
    return _event(
        STOP_IGNORED,
        attempt=attempt,
        round=round,
        rank=rank,
        node_rank=node_rank,
        step=step,
        stop_step=stop_step,
    )


# ---- the local checkpoint tier (hpcelastic/tier/) -----------------------------------------------
class RestoreTier(Named):
    """Where a node's restore came from, nearest first: its own memory (``local``), a peer node's copy
    (``peer``), the checkpoint directory on the shared filesystem (``persisted``); ``none``: nothing
    complete to restore (the directory is cleared of torn files and the script starts from scratch)."""

    LOCAL = "local"
    PEER = "peer"
    PERSISTED = "persisted"
    NONE = "none"


def _rounded(value: float) -> float:
    """Seconds, shares and rates as events carry them: three decimals."""
    return round(float(value), 3)


def tier_checkpoint(
    *, attempt: int, round: int, checkpoint: str, step: int | None, size: int, parts: int
) -> Event:
    """``checkpoint`` is complete on every node of ``round``: ``size`` bytes, ``parts`` nodes' files."""
    return _event(
        TIER_CHECKPOINT,
        attempt=attempt,
        round=round,
        checkpoint=checkpoint,
        step=step,
        size=size,
        parts=parts,
    )


def tier_replicated(
    *, attempt: int, checkpoint: str, step: int | None, replicas: int, duration_s: float
) -> Event:
    """Every node's files of ``checkpoint`` have ``replicas`` copies on other nodes, ``duration_s`` after it
    was complete: a node's death loses none of it, and older local copies may go."""
    return _event(
        TIER_REPLICATED,
        attempt=attempt,
        checkpoint=checkpoint,
        step=step,
        replicas=replicas,
        duration_s=_rounded(duration_s),
    )


def tier_persisted(
    *, attempt: int, checkpoint: str, step: int | None, path: str, size: int, duration_s: float, stop: bool
) -> Event:
    """Every node's files of ``checkpoint`` reached the checkpoint directory (``path``, published in the
    handoff), ``duration_s`` after it was complete; ``stop``: at a stop signal or the end of the workers."""
    return _event(
        TIER_PERSISTED,
        attempt=attempt,
        checkpoint=checkpoint,
        step=step,
        path=path,
        size=size,
        duration_s=_rounded(duration_s),
        stop=stop,
    )


def tier_persist_missed(*, attempt: int, checkpoint: str, step: int | None, why: str) -> Event:
    """The job's last checkpoint could not be persisted before the attempt ended (``why``)."""
    return _event(TIER_PERSIST_MISSED, attempt=attempt, checkpoint=checkpoint, step=step, why=why)


def tier_restored(
    *,
    attempt: int,
    round: int,
    node: str,
    node_rank: int,
    checkpoint: str,
    step: int | None,
    tier: RestoreTier,
    peers: Sequence[str],
    size: int,
    duration_s: float,
) -> Event:
    """Before ``round``'s workers started, ``node`` restored ``checkpoint`` from ``tier`` (the farthest
    source of its parts; ``peers``: the nodes it fetched from), ``size`` bytes copied, in ``duration_s``."""
    return _event(
        TIER_RESTORED,
        attempt=attempt,
        round=round,
        node=node,
        node_rank=node_rank,
        checkpoint=checkpoint,
        step=step,
        tier=tier,
        peers=list(peers),
        size=size,
        duration_s=_rounded(duration_s),
    )


def tier_refused(*, attempt: int, node: str, checkpoint: str, size: int, budget: int, why: str) -> Event:
    """A copy of ``checkpoint`` (``size`` bytes) did not fit ``node``'s tier (``budget`` bytes): ``why``."""
    return _event(
        TIER_REFUSED, attempt=attempt, node=node, checkpoint=checkpoint, size=size, budget=budget, why=why
    )


def tier_unjudged(*, attempt: int, node: str, checkpoint: str, why: str, saved_to: str = "") -> Event:
    """The tier could not tell whether ``node``'s files of ``checkpoint`` are a complete save (``why``): it
    neither replicated nor published them, and left them where the script put them (``saved_to``: where
    they were copied, as they are, before the node's tier went away)."""
    return _event(
        TIER_UNJUDGED, attempt=attempt, node=node, checkpoint=checkpoint, why=why, saved_to=saved_to
    )


def tier_set_aside(*, attempt: int, node: str, checkpoint: str, why: str, path: str) -> Event:
    """A save proven torn (``why``) was moved out of the script's sight on ``node``, to ``path``; it is
    removed once a newer checkpoint is complete and replicated."""
    return _event(TIER_SET_ASIDE, attempt=attempt, node=node, checkpoint=checkpoint, why=why, path=path)


# ---- slow nodes (hpcelastic/slow/) ---------------------------------------------------------------
def node_slow(
    *,
    attempt: int,
    round: int,
    node: str,
    rank: int | None,
    kind: str,
    slowdown: float,
    action: str,
    why: str,
    spare: str | None = None,
) -> Event:
    """A node holds the job back (``kind``: compute, network, input or gpu; ``slowdown``: the share of the
    job's pace it costs) and what is done about it (``action``: report, exclude, swap with ``spare``)."""
    return _event(
        NODE_SLOW,
        attempt=attempt,
        round=round,
        node=node,
        rank=rank,
        kind=kind,
        slowdown=_rounded(slowdown),
        action=action,
        why=why,
        spare=spare,
    )


def job_slow(*, attempt: int, round: int, slowdown: float, why: str) -> Event:
    """The job runs ``slowdown`` below its own pace and no node stands out (job-wide)."""
    return _event(JOB_SLOW, attempt=attempt, round=round, slowdown=_rounded(slowdown), why=why)


def slow_time(*, attempt: int, round: int, lost_s: float, baseline_rate: float | None) -> Event:
    """The round's time lost to running slow so far (cumulative: the latest of a round holds): time x
    (1 - rate / baseline rate) over the windows judged slow; ``baseline_rate``: the job's pace, steps/s."""
    rate = None if baseline_rate is None else _rounded(baseline_rate)
    return _event(SLOW_TIME, attempt=attempt, round=round, lost_s=_rounded(lost_s), baseline_rate=rate)
