"""What happened to a run: a timeline from its event log plus the current Slurm state.

Cheap by design: the event log is one local file, and Slurm is asked once (one ``squeue`` for
every job id the run ever had), however many attempts there were. Whether the run still lives comes
from Slurm (its latest job not ended) or, for ``hpcelastic run``, from its recorded processes: a dead
run's time stops at its newest event.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from hpcelastic import events
from hpcelastic.errors import EXIT_CODE_MEANINGS, SlurmError
from hpcelastic.events import EventLog, EventName
from hpcelastic.jobs import slurm
from hpcelastic.lifecycle.evidence import written_checkpoints
from hpcelastic.reasons import JobEnd, Reason
from hpcelastic.record.ledger import Ledger, build_ledger, ledger_lines
from hpcelastic.rundir import RunDir


@dataclass(frozen=True)
class Row:
    """One line of the timeline."""

    ts: float
    what: str
    details: str
    event: str


@dataclass
class Status:
    """Everything ``hpcelastic status`` shows; ``--json`` prints exactly this."""

    run_dir: str
    job_ids: list[str]
    latest_job_id: str | None
    attempt: int | None
    outcome: str
    checkpoint: dict[str, Any] | None
    slurm: dict[str, dict[str, str]]
    slurm_error: str | None
    timeline: list[Row] = field(default_factory=list)
    #: Lines of the event log that were skipped because they are not event objects.
    damaged_events: int = 0
    #: Where the run's time went (``hpcelastic/record/ledger.py``); ``--json`` carries its ``to_json()``.
    ledger: Ledger | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["timeline"] = [{**asdict(r), "time": format_ts(r.ts)} for r in self.timeline]
        out["ledger"] = self.ledger.to_json() if self.ledger is not None else None
        return out


def format_ts(ts: float) -> str:
    """Local time as ``YYYY-mm-dd HH:MM:SS``."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _exit(code: Any) -> str:
    meaning = EXIT_CODE_MEANINGS.get(code) if isinstance(code, int) else None
    return f"exit {code}" + (f": {meaning}" if meaning else "")


def _failure(e: Mapping[str, Any]) -> str:
    error = str(e.get("error") or "").strip().splitlines()
    if e.get("rank") is None:  # a whole node failed (agent lost), not one worker
        return f"node {e.get('node')}" + (f": {error[-1]}" if error else "")
    where = f"rank {e.get('rank')} on {e.get('node')}"
    if e.get("signal") is None and e.get("exitcode") is None and error:  # still running: a hang or stall
        return f"{where}: {error[-1]}"
    how = f"signal {e['signal']}" if e.get("signal") else f"exit code {e.get('exitcode')}"
    return f"{where}, {how}" + (f": {error[-1]}" if error else "")


def _stopped(e: Mapping[str, Any]) -> bool:
    """A job end that is a stop signal's (preemption, time limit) that nothing brought back (no Slurm job),
    not a failure."""
    reason = Reason.parse(e.get("reason"))
    return reason is not None and reason.is_stop


def _nodes(names: Any) -> str:
    return ",".join(names) if isinstance(names, list) and names else "none"


_RENDER: dict[EventName, Callable[[Mapping[str, Any]], tuple[str, str] | None]] = {
    events.SUBMITTED: lambda e: (
        "submitted",
        f"job {e.get('job_id')} ({e.get('backend', 'sbatch')}, nodes {e.get('nodes')})",
    ),
    events.ATTEMPT_STARTED: lambda e: (
        f"attempt {e.get('attempt')} started",
        f"job {e.get('job_id')} on {_nodes(e.get('nodes'))} (restart count {e.get('restart_count_slurm')})",
    ),
    events.RENDEZVOUS: lambda e: (
        f"rendezvous round {e.get('round')}",
        f"world size {e.get('world_size')} on {_nodes(e.get('hosts'))}",
    ),
    events.ROOT_CAUSE: lambda e: ("failure (root cause)", _failure(e)),
    events.NODE_LOST: lambda e: ("node lost", f"{e.get('node')}: {e.get('reason')}"),
    events.NODE_UNHEALTHY: lambda e: (
        "node unhealthy",
        f"{e.get('node')} GPU {e.get('gpu')}: {e.get('reason')}",
    ),
    events.RESTARTING: lambda e: (
        "restarting",
        f"restart {e.get('restart_count')} of {e.get('max_restarts')}: {e.get('reason')}",
    ),
    events.REPLICA_GROUP_RESTARTING: lambda e: (
        f"replica group {e.get('group')} restarting",
        f"restart {e.get('group_restarts')} of {e.get('max_restarts')} on {_nodes(e.get('nodes'))}: "
        f"{e.get('reason')} after step {e.get('last_step')}; the other groups go on",
    ),
    events.REPLICA_GROUP_HEALED: lambda e: (
        f"replica group {e.get('group')} back",
        f"stepping again at step {e.get('step')}, "
        + (
            f"healed from group(s) {','.join(map(str, e['peers']))}; {e.get('steps_missed')} step(s) missed"
            if e.get("peers")
            else "no peer was running: resumed from its checkpoint"
        )
        + f"; {e.get('down_s')} s out",
    ),
    events.REPLICA_GROUP_DROPPED: lambda e: (
        f"replica group {e.get('group')} left out",
        f"{e.get('reason')}; {e.get('remaining')} group(s) remain (minimum {e.get('min_groups')})",
    ),
    events.SIGNAL_RECEIVED: lambda e: ("signal received", f"{e.get('signal')} on node {e.get('node_rank')}"),
    events.ATTEMPT_ENDED: lambda e: (
        f"attempt {e.get('attempt')} ended",
        f"{e.get('reason')} ({_exit(e.get('exit_code'))})"
        + (f"; progress: {e['progress']}" if e.get("progress") else ""),
    ),
    events.STOP_IGNORED: lambda e: (
        "stop ignored",
        f"rank {e.get('rank')} trained on to step {e.get('step')} past the stop step {e.get('stop_step')}: "
        "it calls heartbeat() but not should_stop(); stopped by its agent",
    ),
    events.REQUEUED: lambda e: (
        f"requeued as attempt {e.get('attempt')}",
        f"{e.get('reason')}; job {e.get('job_id')}; excluded nodes {_nodes(e.get('exclude'))}"
        + (f"; took {e['duration_s']:.2f} s" if isinstance(e.get("duration_s"), (int, float)) else "")
        + ("; requeued by Slurm itself" if e.get("by") == "slurm" else ""),
    ),
    events.RESUBMITTED: lambda e: (
        f"resubmitted as attempt {e.get('attempt')}",
        f"{e.get('reason')}; new job {e.get('job_id')} after {e.get('previous_job_id')}; "
        f"excluded nodes {_nodes(e.get('exclude'))}",
    ),
    events.REQUEUE_FAILED: lambda e: ("requeue failed", f"{e.get('error')} (fallback: {e.get('fallback')})"),
    events.REQUEUE_SKIPPED: lambda e: ("not requeued", str(e.get("detail") or e.get("reason"))),
    events.JOB_SUCCEEDED: lambda e: ("job succeeded", _exit(e.get("exit_code"))),
    events.JOB_FAILED: lambda e: (
        ("job stopped", f"{e.get('reason')}: nothing requeued it; run it again to resume from its checkpoint")
        if _stopped(e)
        else ("job failed", f"{e.get('reason')} ({_exit(e.get('exit_code'))})")
    ),
    events.CANCELLED: lambda e: (
        ("stopped by the user", f"{e['signal']} to hpcelastic run")
        if e.get("signal")
        else ("cancelled", f"job {e.get('job_id')} by the user")
    ),
    events.HANDOFF_CORRUPT: lambda e: (
        "handoff record rebuilt",
        f"{e.get('error')}; recovered checkpoint {e.get('recovered_checkpoint')}",
    ),
    events.CHECKPOINT_MISSING: lambda e: (
        "checkpoint missing",
        f"{e.get('path')}; using {e.get('fallback')}",
    ),
    events.CHECKPOINT_REJECTED: lambda e: ("checkpoint rejected", f"{e.get('path')}: {e.get('why')}"),
    events.TIER_PERSISTED: lambda e: (
        ("last checkpoint persisted", f"{e.get('checkpoint')} (step {e.get('step')}) to {e.get('path')}")
        if e.get("stop")
        else None
    ),
    events.TIER_PERSIST_MISSED: lambda e: (
        "checkpoint NOT persisted",
        f"{e.get('checkpoint')} (step {e.get('step')}): {e.get('why')}",
    ),
    events.TIER_REFUSED: lambda e: ("local checkpoint tier full", str(e.get("why"))),
    events.TIER_UNJUDGED: lambda e: (
        "checkpoint not judged",
        f"{e.get('checkpoint')} on {e.get('node')}: {e.get('why')}; left as written"
        + (f", copied to {e.get('saved_to')}" if e.get("saved_to") else ""),
    ),
    events.TIER_SET_ASIDE: lambda e: (
        "torn save set aside",
        f"{e.get('checkpoint')} on {e.get('node')}: {e.get('why')}",
    ),
    events.NODE_SLOW: lambda e: (
        _SLOW_ACTION.get(str(e.get("action")), "node slow"),
        f"{e.get('node')}"
        + (f" (rank {e.get('rank')})" if e.get("rank") is not None else "")
        + f", {e.get('kind')}: {e.get('why')}",
    ),
    events.JOB_SLOW: lambda e: ("job slow (job-wide)", str(e.get("why"))),
}
_SLOW_ACTION = {
    "report": "node slow",
    "exclude": "slow node excluded at the next requeue",
    "swap": "slow node replaced by a spare",
}
#: Events with no row: each agent the step's stop stopped (one row per node of a large job) is the stop's.
_QUIET = {
    events.WORKERS_STARTED,
    events.WORKER_FAILED,
    events.PROGRESS,
    events.AGENT_STOPPED,
    events.CHECKPOINT_OPENED,
    events.TIER_CHECKPOINT,
    events.TIER_REPLICATED,
    events.SLOW_TIME,
}
_KNOWN = {str(n) for n in EventName}


def _checkpoint_rows(batch: Sequence[Mapping[str, Any]]) -> Row:
    last = batch[-1]
    if len(batch) == 1:
        return Row(
            last["ts"], "checkpoint published", f"step {last.get('step')}: {last.get('path')}", last["event"]
        )
    steps = f"steps {batch[0].get('step')}..{last.get('step')}"
    return Row(
        last["ts"],
        f"{len(batch)} checkpoints published",
        f"{steps}, latest {last.get('path')}",
        last["event"],
    )


def _restore_row(batch: Sequence[Mapping[str, Any]]) -> Row:
    """One round's restores (one ``tier_restored`` per node): which checkpoint, and where each node got it."""
    first = batch[0]
    if not first.get("checkpoint"):
        return Row(
            first["ts"],
            f"round {first.get('round')}: nothing to restore",
            "no complete checkpoint in the local tier: the workers start from scratch",
            first["event"],
        )
    where = []
    for e in batch:
        peers = f" (from node {','.join(e['peers'])})" if e.get("peers") else ""
        where.append(f"{e.get('node')} from {e.get('tier')}{peers} in {e.get('duration_s')} s")
    return Row(
        first["ts"],
        f"round {first.get('round')} restored",
        f"{first.get('checkpoint')} (step {first.get('step')}): " + "; ".join(where),
        first["event"],
    )


#: How an agent that got a stop from the user leaves (agent/loop.py): the user's stop, not a lost node.
_LEFT_ON_SIGNAL = re.compile(r"agent received SIG(INT|TERM|HUP)\b")


def _shown(e: Mapping[str, Any], cancelled: bool) -> bool:
    """Whether event ``e`` gets a row: a cancelled run's agents leaving on its signal are the cancel's."""
    if e.get("event") in _QUIET:
        return False
    return not (
        cancelled and e.get("event") == events.NODE_LOST and _LEFT_ON_SIGNAL.match(str(e.get("reason")))
    )


def _requeued_by_slurm_first(started: Mapping[str, Any], before: Mapping[str, Any] | None) -> Row | None:
    """A row for an attempt that Slurm queued itself, before hpcelastic ended the one ``before`` it (a node
    failure it acted on first): the same job id again, its restart count higher, and no requeue recorded."""
    if before is None or started.get("job_id") != before.get("job_id"):
        return None
    old, new = before.get("restart_count_slurm"), started.get("restart_count_slurm")
    if not (isinstance(old, int) and isinstance(new, int) and new > old):
        return None
    return Row(
        float(started.get("ts", 0)),
        f"requeued as attempt {started.get('attempt')}",
        f"job {started.get('job_id')} requeued by Slurm itself (restart count {old} -> {new}) before "
        f"hpcelastic ended attempt {before.get('attempt')}",
        str(events.REQUEUED),
    )


def timeline(log: Sequence[Mapping[str, Any]]) -> list[Row]:
    """The events as rows; consecutive checkpoint publications collapse into one row."""
    cancelled = any(e.get("event") == events.CANCELLED for e in log)
    brought_back = {e.get("attempt") for e in log if e.get("event") in (events.REQUEUED, events.RESUBMITTED)}
    last_started: Mapping[str, Any] | None = None
    rows: list[Row] = []
    batch: list[Mapping[str, Any]] = []
    restores: list[Mapping[str, Any]] = []
    for e in log:
        kind = e.get("event")
        if kind == events.TIER_RESTORED:
            if restores and (restores[0].get("attempt"), restores[0].get("round")) != (
                e.get("attempt"),
                e.get("round"),
            ):
                rows.append(_restore_row(restores))
                restores = []
            restores.append(e)
            continue
        if restores:
            rows.append(_restore_row(restores))
            restores = []
        if kind == events.CHECKPOINT_PUBLISHED:
            batch.append(e)
            continue
        if batch:
            rows.append(_checkpoint_rows(batch))
            batch = []
        if not _shown(e, cancelled):
            continue
        if kind == events.ATTEMPT_STARTED:
            slurm_first = (
                None if e.get("attempt") in brought_back else _requeued_by_slurm_first(e, last_started)
            )
            if slurm_first is not None:
                rows.append(slurm_first)
            last_started = e
        render = _RENDER.get(EventName(kind)) if kind in _KNOWN else None
        shown = (
            render(e)
            if render
            else (str(kind), ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("ts", "event", "host")))
        )
        if shown is not None:
            rows.append(Row(float(e.get("ts", 0)), shown[0], shown[1], str(kind)))
    if batch:
        rows.append(_checkpoint_rows(batch))
    if restores:
        rows.append(_restore_row(restores))
    return rows


def _outcome(log: EventLog, latest: slurm.JobState | None, local_alive: bool | None) -> str:
    """The run's outcome from its decisions, else its latest Slurm job, else (``hpcelastic run``)
    whether its processes live."""
    e = log.last(
        events.JOB_SUCCEEDED, events.JOB_FAILED, events.CANCELLED, events.REQUEUED, events.RESUBMITTED
    )
    if e is not None and e["event"] == events.JOB_SUCCEEDED:
        return "succeeded"
    if e is not None and e["event"] == events.JOB_FAILED and _stopped(e):
        return f"stopped ({e.get('reason')}); not requeued: run it again to resume"
    if (
        e is not None
        and e["event"] == events.JOB_FAILED
        and e.get("reason")
        not in (
            JobEnd.CANCELLED,
            Reason.CANCELLED,
        )
    ):
        return f"failed ({e.get('reason')})"
    if e is not None and e["event"] in (events.JOB_FAILED, events.CANCELLED):
        stop = log.last(events.CANCELLED)
        return f"stopped by the user ({stop['signal']})" if stop and stop.get("signal") else "cancelled"
    if latest is None:
        return {True: "running", False: "killed: its processes are gone and it recorded no end"}.get(
            local_alive, "unknown"
        )
    if latest.state == "CANCELLED":  # scancelled by hand (pending, or before any decision)
        return "cancelled"
    if latest.state in slurm.ENDED_STATES:
        return f"ended ({latest.state.lower()})"
    return latest.state.lower()


def _alive(
    rd: RunDir, job_ids: Sequence[str], states: Mapping[str, slurm.JobState], error: str | None
) -> bool | None:
    """Whether the run still lives (None: cannot tell): its latest Slurm job has not ended, or, for
    ``hpcelastic run``, one of its recorded processes still runs."""
    if job_ids:
        if error is not None:
            return None
        latest = states.get(job_ids[-1])
        return latest is not None and latest.state not in slurm.ENDED_STATES
    from hpcelastic.agent.launcher import read_processes

    local = read_processes(rd)
    return local.alive() if local is not None else None


def build_status(
    rd: RunDir, query: Callable[[Sequence[str]], Mapping[str, slurm.JobState]] = slurm.query_states
) -> Status:
    """Read the run's events and ask Slurm once about all of its job ids."""
    log = rd.events()
    job_ids = log.job_ids()
    latest = job_ids[-1] if job_ids else None
    states: Mapping[str, slurm.JobState] = {}
    error = None
    if job_ids:
        try:
            states = query(job_ids)
        except SlurmError as e:
            error = str(e)
    alive = _alive(rd, job_ids, states, error)
    attempts = [e["attempt"] for e in log.of(events.ATTEMPT_STARTED) if isinstance(e.get("attempt"), int)]
    published = log.last(events.CHECKPOINT_PUBLISHED)
    checkpoint = {k: published.get(k) for k in ("path", "step", "attempt", "rank")} if published else None
    checkpoint_dir = rd.checkpoint_dir()
    written = written_checkpoints(checkpoint_dir)  # what an unchanged script saved, published or not
    # A dead run's time stops at its newest event.
    ledger = build_ledger(log, now=None if alive is False else time.time(), written=written)
    unpublished = [c for c in ledger.checkpoints if not c.published]
    if checkpoint is not None:
        checkpoint["published"] = True
    elif unpublished:
        c = unpublished[-1]
        path = str(checkpoint_dir / c.name) if c.name else None
        checkpoint = {"path": path, "step": c.step, "attempt": c.attempt, "completed_ts": c.ts}
        checkpoint["published"] = False
    return Status(
        run_dir=str(rd.path),
        job_ids=job_ids,
        latest_job_id=latest,
        attempt=max(attempts) if attempts else None,
        outcome=_outcome(log, states.get(latest) if latest else None, None if job_ids else alive),
        checkpoint=checkpoint,
        slurm={jid: {"state": s.state, "reason": s.reason, "nodes": s.nodes} for jid, s in states.items()},
        slurm_error=error,
        timeline=timeline(log),
        damaged_events=log.damaged,
        ledger=ledger,
    )


def _checkpoint_line(ckpt: Mapping[str, Any] | None) -> str:
    """The newest checkpoint: published, or found complete in the checkpoint directory."""
    if not ckpt:
        return "none (none published, none complete in the checkpoint directory)"
    step = f"step {ckpt['step']}: " if ckpt.get("step") is not None else ""
    if ckpt.get("published", True):
        return f"{step}{ckpt.get('path')}"
    when = format_ts(float(ckpt["completed_ts"])) if ckpt.get("completed_ts") else "?"
    return f"{step}{ckpt.get('path')} (written by the script at {when}; not published)"


def render_text(st: Status) -> str:
    """The human view: a short header, then one line per timeline row."""
    cur = st.slurm.get(st.latest_job_id or "")
    if cur:
        slurm_line = f"{cur['state']}" + (f" ({cur['reason']})" if cur["reason"] not in ("None", "") else "")
        slurm_line += f" on {cur['nodes']}" if cur["nodes"] else ""
    elif st.slurm_error:
        slurm_line = f"unknown: {st.slurm_error}"
    else:
        slurm_line = "no longer known to Slurm (finished)" if st.latest_job_id else "never submitted"
    ckpt = st.checkpoint
    lines = [
        f"run         {st.run_dir}",
        f"job         {st.latest_job_id or '-'}"
        + (f" (all: {', '.join(st.job_ids)})" if len(st.job_ids) > 1 else ""),
        f"slurm       {slurm_line}",
        f"attempt     {st.attempt if st.attempt is not None else '-'}",
        f"outcome     {st.outcome}",
        "checkpoint  " + _checkpoint_line(ckpt),
        "",
    ]
    width = max((len(r.what) for r in st.timeline), default=10)
    for r in st.timeline:
        lines.append(f"{format_ts(r.ts)}  {r.what:<{width}}  {r.details}")
    if not st.timeline:
        lines.append("(no events yet)")
    if st.ledger is not None:
        lines += ["", "where the time went:", *(f"  {line}" for line in ledger_lines(st.ledger))]
    return "\n".join(lines)
