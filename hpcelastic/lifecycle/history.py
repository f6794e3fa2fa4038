"""What the requeue policy needs to know about a run's past, read from its event log (pure, no I/O)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hpcelastic import events
from hpcelastic.events import EventLog
from hpcelastic.reasons import Reason, RequeueCounter

#: ``attempt_ended.action`` when the job is brought back (``policy.Action.BRING_BACK``).
BRING_BACK = "bring_back"
#: A node found bad is excluded for this long after its first failure, twice as long after each
#: further one, at most ``NODE_COOLDOWN_MAX_S`` (Horovod's blacklist cooldown works the same way).
NODE_COOLDOWN_MIN_S = 600.0
NODE_COOLDOWN_MAX_S = 4 * 3600.0


@dataclass(frozen=True)
class PreviousEnd:
    """How the attempt before this one ended (its ``attempt_ended`` event)."""

    signature: str | None
    progressed: bool


@dataclass(frozen=True)
class History:
    """The run's past as the policy sees it when ``attempt`` ends."""

    attempt: int
    previous: PreviousEnd | None = None
    published_in_attempt: bool = False
    ended: Mapping[int, Reason | None] = field(default_factory=dict)
    published: frozenset[int] = frozenset()
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
        return cls(
            attempt=attempt,
            previous=(
                PreviousEnd(prev.get("signature"), bool(prev.get("progressed"))) if prev is not None else None
            ),
            published_in_attempt=attempt in log.published_attempts(),
            ended={
                r["attempt"]: Reason.parse(r.get("reason"))
                for r in log.of(events.ATTEMPT_ENDED)
                if isinstance(r.get("attempt"), int)
            },
            published=frozenset(log.published_attempts()),
            requeues=requeue_counts(log),
            bad_nodes=bad,
            cancelled=cancelled,
            released_nodes=tuple(n for n in excluded if n not in bad),
        )


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
    """A short hash naming a failure independently of hosts, ports, pids and addresses.

    Built from the exit code, the signal and the last line of the error (or traceback); two
    attempts that die the same way at start-up get the same signature.
    """
    if not root_cause:
        return None
    text = str(root_cause.get("error") or "").strip()
    if not text:
        lines = [ln for ln in str(root_cause.get("traceback") or "").splitlines() if ln.strip()]
        text = lines[-1].strip() if lines else ""
    text = re.sub(r"0x[0-9a-fA-F]+", "0x_", text)
    text = re.sub(r"\d+", "N", text)
    key = f"{root_cause.get('exitcode')}|{root_cause.get('signal')}|{text}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]
