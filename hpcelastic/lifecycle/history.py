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

    @property
    def budget_used(self) -> int:
        """Requeues counted against ``--max-requeues`` (failures and unhealthy nodes)."""
        return sum(n for c, n in self.requeues.items() if c.is_budgeted)

    @classmethod
    def from_log(cls, log: EventLog, attempt: int, *, cancelled: bool) -> History:
        """The history of ``attempt`` from the run's event log (read before its ``attempt_ended``)."""
        prev = log.last(events.ATTEMPT_ENDED, attempt=attempt - 1)
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
            bad_nodes=excluded_nodes(log),
            cancelled=cancelled,
        )


def _requeues(log: EventLog) -> list[Mapping[str, Any]]:
    return log.of(events.REQUEUED, events.RESUBMITTED)


def requeue_counts(log: EventLog) -> dict[RequeueCounter, int]:
    """How many times the run was brought back, per requeue counter."""
    counts = dict.fromkeys(RequeueCounter, 0)
    for r in _requeues(log):
        counts[(Reason.parse(r.get("reason")) or Reason.RESTARTS_EXHAUSTED).requeue_counter] += 1
    return counts


def excluded_nodes(log: EventLog) -> tuple[str, ...]:
    """Every node the run excluded when it was brought back, first exclusion first."""
    return tuple(dict.fromkeys(str(n) for r in _requeues(log) for n in r.get("exclude") or []))


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
