"""What the requeue policy needs to know about a run's past, read from its event log (pure, no I/O)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hpcelastic import events
from hpcelastic.events import EventLog
from hpcelastic.lifecycle.progress import AttemptProgress, trained
from hpcelastic.reasons import Reason, RequeueCounter

#: ``attempt_ended.action`` when the job is brought back (``policy.Action.BRING_BACK``).
BRING_BACK = "bring_back"
#: A node found bad is excluded for this long after its first failure, twice as long after each
#: further one, at most ``NODE_COOLDOWN_MAX_S`` (Horovod's blacklist cooldown works the same way).
NODE_COOLDOWN_MIN_S = 600.0
NODE_COOLDOWN_MAX_S = 4 * 3600.0


@dataclass(frozen=True)
class PreviousEnd:
    """How the attempt before this one ended: its root cause's signature, and whether it trained."""

    signature: str | None
    progressed: bool


@dataclass(frozen=True)
class History:
    """The run's past as the policy sees it when ``attempt`` ends."""

    attempt: int
    previous: PreviousEnd | None = None
    ended: Mapping[int, Reason | None] = field(default_factory=dict)
    #: Every attempt's evidence of progress, this one's included (see :mod:`~hpcelastic.lifecycle.progress`).
    attempts: Mapping[int, AttemptProgress] = field(default_factory=dict)
    requeues: Mapping[RequeueCounter, int] = field(default_factory=dict)
    bad_nodes: tuple[str, ...] = ()
    cancelled: bool = False
    #: Nodes the run excluded before whose cooldown is over: the next attempt may use them again.
    released_nodes: tuple[str, ...] = ()

    @property
    def budget_used(self) -> int:
        """Requeues counted against ``--max-requeues`` (failures and unhealthy nodes)."""
        return sum(n for c, n in self.requeues.items() if c.is_budgeted)

    @classmethod
    def from_log(cls, log: EventLog, attempt: int, *, cancelled: bool, now: float | None = None) -> History:
        """The history of ``attempt`` from the run's event log (read before its ``attempt_ended``).

        ``now`` (epoch seconds) ends the cooldown of excluded nodes; None keeps every one excluded.
        """
        prev = log.last(events.ATTEMPT_ENDED, attempt=attempt - 1)
        excluded = excluded_nodes(log)
        bad = excluded if now is None else nodes_cooling_down(node_failures(log), now)
        progress = attempts_progress(log, now)
        return cls(
            attempt=attempt,
            previous=(
                PreviousEnd(prev.get("signature"), trained(progress, attempt - 1))
                if prev is not None
                else None
            ),
            ended={
                r["attempt"]: Reason.parse(r.get("reason"))
                for r in log.of(events.ATTEMPT_ENDED)
                if isinstance(r.get("attempt"), int)
            },
            attempts=progress,
            requeues=requeue_counts(log),
            bad_nodes=bad,
            cancelled=cancelled,
            released_nodes=tuple(n for n in excluded if n not in bad),
        )


def attempts_progress(log: EventLog, now: float | None = None) -> dict[int, AttemptProgress]:
    """Each attempt's evidence of progress: its highest step (the coordinator's ``progress`` events),
    a published checkpoint, how long its workers ran (from its first ``workers_started`` to its
    ``attempt_ended``, or ``now`` while it runs) and what its decider recorded."""
    top: dict[int, int] = {}
    for r in log.of(events.PROGRESS):
        k, step = r.get("attempt"), r.get("step")
        if isinstance(k, int) and isinstance(step, int):
            top[k] = max(step, top.get(k, step))
    published = log.published_attempts()
    started: dict[int, float] = {}
    ended: dict[int, float] = {}
    decided: dict[int, tuple[str | None, bool]] = {}
    attempt: int | None = None
    for r in log:
        name = r["event"]
        if name == events.ATTEMPT_STARTED and isinstance(r.get("attempt"), int):
            attempt = r["attempt"]
        elif name == events.WORKERS_STARTED and attempt is not None:
            started.setdefault(attempt, float(r.get("spawned_ts") or r.get("ts") or 0.0))
        elif name == events.ATTEMPT_ENDED and isinstance(r.get("attempt"), int):
            ended[r["attempt"]] = float(r.get("ts") or 0.0)
            decided[r["attempt"]] = (r.get("progress"), bool(r.get("progressed")))
    last_ts = float(log[-1].get("ts") or 0.0) if len(log) else 0.0
    out: dict[int, AttemptProgress] = {}
    for k in {*top, *published, *started, *decided}:
        end_ts = ended.get(k, last_ts if now is None else now)
        why, did_train = decided.get(k, (None, False))
        out[k] = AttemptProgress(
            top_step=top.get(k),
            published=k in published,
            trained_s=max(0.0, end_ts - started[k]) if k in started else 0.0,
            advanced=str(why) if why else None,
            trained=did_train,
        )
    return out


def _requeues(log: EventLog) -> list[Mapping[str, Any]]:
    return log.of(events.REQUEUED, events.RESUBMITTED)


def _brought_back(log: EventLog) -> list[Mapping[str, Any]]:
    """One record per time the run was brought back, counted when it was decided.

    The ``attempt_ended`` event says ``action: bring_back`` before Slurm is asked, so a decider
    killed during ``scontrol`` still spent the requeue. Logs written before that field count
    their ``requeued``/``resubmitted`` events (attempt K+1 for the end of attempt K).
    """
    decided = [r for r in log.of(events.ATTEMPT_ENDED) if r.get("action") == BRING_BACK]
    attempts = {r.get("attempt") for r in decided}
    older = [
        r for r in _requeues(log) if not (isinstance(r.get("attempt"), int) and r["attempt"] - 1 in attempts)
    ]
    return decided + older


def requeue_counts(log: EventLog) -> dict[RequeueCounter, int]:
    """How many times the run was brought back, per requeue counter."""
    counts = dict.fromkeys(RequeueCounter, 0)
    for r in _brought_back(log):
        counts[(Reason.parse(r.get("reason")) or Reason.RESTARTS_EXHAUSTED).requeue_counter] += 1
    return counts


def excluded_nodes(log: EventLog) -> tuple[str, ...]:
    """Every node the run excluded when it was brought back, first exclusion first."""
    return tuple(dict.fromkeys(str(n) for r in _brought_back(log) for n in r.get("exclude") or []))


@dataclass(frozen=True)
class NodeFailures:
    """How often a node was found bad, when last, and whether a health check failed on it."""

    count: int
    last_ts: float
    unhealthy: bool = False


def node_failures(log: EventLog) -> dict[str, NodeFailures]:
    """Every node an attempt ended with as bad (``attempt_ended.bad_nodes``), or that the run excluded.

    A node named by a ``node_unhealthy`` event failed its health check: it stays excluded for good.
    """
    out: dict[str, NodeFailures] = {}
    for r in log.of(events.ATTEMPT_ENDED):
        for n in r.get("bad_nodes") or []:
            old = out.get(str(n))
            out[str(n)] = NodeFailures((old.count if old else 0) + 1, float(r.get("ts") or 0))
    for r in _brought_back(log):  # logs without bad_nodes: an exclusion is one failure
        for n in r.get("exclude") or []:
            out.setdefault(str(n), NodeFailures(1, float(r.get("ts") or 0)))
    for r in log.of(events.NODE_UNHEALTHY):
        n = str(r.get("node"))
        old = out.get(n, NodeFailures(0, float(r.get("ts") or 0)))
        out[n] = NodeFailures(old.count, old.last_ts, unhealthy=True)
    return out


def node_cooldown_s(failures: int) -> float:
    """How long a node stays excluded after its ``failures``-th failure: doubling, capped (as Horovod)."""
    return min(NODE_COOLDOWN_MIN_S * 2 ** max(0, failures - 1), NODE_COOLDOWN_MAX_S)


def nodes_cooling_down(failures: Mapping[str, NodeFailures], now: float) -> tuple[str, ...]:
    """The nodes still excluded at ``now``: unhealthy ones, and those within their cooldown."""
    return tuple(
        n
        for n, f in failures.items()
        if (f.unhealthy or now < f.last_ts + node_cooldown_s(f.count)) and (f.count or f.unhealthy)
    )


def attempt_root_cause(log: EventLog) -> Mapping[str, Any] | None:
    """The newest ``root_cause`` event of the current attempt (since the last ``attempt_started``)."""
    return log.since_last(events.ATTEMPT_STARTED).last(events.ROOT_CAUSE)


def root_cause_signature(root_cause: Mapping[str, Any] | None) -> str | None:
    """A short hash naming what failed, so that two attempts match only when they failed the same way.

    It tells apart what differs: the kind (a node lost, a signal such as an OOM kill, an exception
    with its frames, an exit code), and for a node lost or a signal the host it happened on (two
    nodes dying, or OOM kills on two hosts, are not one bug). An exception is named by its frames and
    its last line, not its host (every rank of a broken script fails the same way). Numbers,
    addresses, ports and pids are masked.
    """
    if not root_cause:
        return None
    error = str(root_cause.get("error") or "").strip()
    tb_lines = [ln.strip() for ln in str(root_cause.get("traceback") or "").splitlines() if ln.strip()]
    node = str(root_cause.get("node") or "")
    if error.startswith("node lost"):
        key = f"node_lost|{node}"
    elif root_cause.get("signal"):
        key = f"signal|{root_cause.get('signal')}|{node}"
    elif tb_lines:
        calls = [ln for ln in tb_lines if ln.startswith("File ")]
        frames = [_mask(ln.split(", line ")[0] + ln.split(", in ")[-1]) for ln in calls]
        key = f"exception|{root_cause.get('exitcode')}|{'/'.join(frames)}|{_mask(tb_lines[-1])}"
    else:
        key = f"exit|{root_cause.get('exitcode')}|{_mask(error)}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _mask(text: str) -> str:
    """``text`` with addresses and numbers replaced (they differ between two runs of the same failure)."""
    return re.sub(r"\d+", "N", re.sub(r"0x[0-9a-fA-F]+", "0x_", text))
