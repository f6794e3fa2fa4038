"""The one place the simulation meets hpcelastic's decision code.

The simulation knows facts (who stepped, which checkpoint completed, which node died); this module
turns them into the real objects (:class:`JobState`, an :class:`EventLog` of ``events.py`` records,
:class:`History`, :class:`AttemptEnd`, :func:`decide`) and back. Fields a version of the decision code
lacks are left out (checked by name), so the same simulation runs today's code and the new.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hpcelastic import events
from hpcelastic.agent import messages
from hpcelastic.agent.job_state import JobState, Record, Send
from hpcelastic.agent.stop_step import StepRate
from hpcelastic.events import Event, EventLog
from hpcelastic.lifecycle import history as history_mod
from hpcelastic.lifecycle import policy
from hpcelastic.lifecycle.finalize import recorded_exit
from hpcelastic.reasons import Reason, Requeuer, SkipReason
from hpcelastic.record import ledger

Decide = Callable[[history_mod.History, policy.AttemptEnd, policy.Settings], policy.Decision]

__all__ = [
    "Action",
    "Decide",
    "EndFacts",
    "JobState",
    "Log",
    "Reason",
    "Send",
    "SkipReason",
    "StepRate",
    "conclude",
    "messages",
    "new_job_state",
    "recorded_exit",
]

Action = policy.Action


def _stops_spare_saves() -> bool:
    """Whether this version's agent stops workers without killing a save (issue 18 item 5): it sends the
    stop signal only to scripts that handle it, waits while a checkpoint file is open for writing, and
    stops a rank that ignores the stop at its stop step. Older agents' USR2 killed an unchanged script
    at once, and a script with heartbeat() but no should_stop() trained on until the grace period ended."""
    try:
        from hpcelastic.agent.workers import open_for_writing  # noqa: F401
    except ImportError:
        return False
    return True


STOPS_SPARE_SAVES = _stops_spare_saves()


#: The agents' rendezvous timeout (``--rdzv-timeout``).
RDZV_TIMEOUT_S = 600.0


def _accepts(fn: Callable[..., Any]) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


_ATTEMPT_END_FIELDS = frozenset(f.name for f in dataclasses.fields(policy.AttemptEnd))
_ATTEMPT_ENDED_ARGS = _accepts(events.attempt_ended)
_JOB_STATE_ARGS = _accepts(JobState.__init__)


class _Written(EventLog):
    """An :class:`EventLog` of records this module wrote (plain dicts with an ``event``): nothing to filter,
    and ``of`` answers from an index by event name (the same answer; History asks it a dozen times per
    decision, over a log that grows all week)."""

    def __init__(self, records: list[dict[str, Any]], index: Mapping[str, list[int]] | None = None) -> None:
        self._records = records  # type: ignore[assignment]
        self.damaged = 0
        self._index = index

    def of(self, *names: events.EventName, **match: Any) -> list[events.Record]:
        if self._index is None or not names:
            return super().of(*names, **match)
        at = [i for n in names for i in self._index.get(str(n), ())]
        if len(names) > 1:
            at.sort()
        records = self._records
        if not match:
            return [records[i] for i in at]
        want = {k: v.value if isinstance(v, enum.Enum) else v for k, v in match.items()}
        return [r for r in (records[i] for i in at) if all(r.get(k) == v for k, v in want.items())]


class Log:
    """The run's event log as ``RunDir.record`` writes it (``ts``, ``event``, ``host`` and the fields)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self._index: dict[str, list[int]] = {}

    def record(self, event: Event, ts: float, host: str = "sim") -> None:
        self._index.setdefault(event.name.value, []).append(len(self.records))
        self.records.append({"ts": ts, "event": event.name.value, "host": host, **event.fields})

    def view(self, start: int = 0) -> EventLog:
        """The log as its readers see it (from record ``start``: one attempt's tail)."""
        return _Written(self.records[start:]) if start else _Written(self.records, self._index)

    def attempt_started(
        self, ts: float, attempt: int, job_id: str, restarts: int, nodes: Sequence[str]
    ) -> None:
        self.record(
            events.attempt_started(attempt=attempt, job_id=job_id, restart_count_slurm=restarts, nodes=nodes),
            ts,
        )

    def published(self, ts: float, attempt: int, step: int) -> None:
        path = f"ckpt/step-{step}"
        self.record(
            events.checkpoint_published(path=path, step=step, attempt=attempt, rank=0, checkpoint_dir="ckpt"),
            ts,
        )

    def node_unhealthy(self, ts: float, node: str, reason: str) -> None:
        self.record(events.node_unhealthy(node=node, gpu="0", reason=reason), ts, host=node)

    def cancelled(self, ts: float, job_id: str) -> None:
        self.record(events.cancelled(job_id=job_id), ts)

    def apply(self, actions: Sequence[Any], ts: float) -> list[Send]:
        """Write the ``Record`` actions; return the ``Send`` ones for the simulation to deliver."""
        sends: list[Send] = []
        for a in actions:
            if isinstance(a, Record):
                self.record(a.event, ts)
            elif isinstance(a, Send):
                sends.append(a)
        return sends


@functools.cache
def fast(cls: type[JobState]) -> type[JobState]:
    """``cls`` with its set of live round nodes kept between calls (the same set, built once per change of
    round or membership instead of once per agent report: O(N) per round, not O(N^2), at 2,048 nodes).
    Without that private helper (a newer JobState), ``cls`` itself."""
    original = getattr(cls, "_alive_round_nodes", None)
    if original is None:
        return cls

    class Fast(cls):  # type: ignore[valid-type,misc]
        def _alive_round_nodes(self) -> set[int]:
            cached = self.__dict__.get("_sim_alive")
            nodes, members = self.round_nodes, len(self.members)
            if cached is None or cached[0] is not nodes or cached[1] != (members, len(nodes), self.round):
                cached = (nodes, (members, len(nodes), self.round), frozenset(original(self)))
                self.__dict__["_sim_alive"] = cached
            return cached[2]  # type: ignore[return-value]

    Fast.__name__ = Fast.__qualname__ = cls.__name__
    return Fast


def new_job_state(
    cls: type[JobState],
    hosts: Sequence[str],
    *,
    spares: int,
    max_restarts: int,
    now: Callable[[], float],
    attempt: int,
) -> JobState:
    """The coordinator's state for one attempt: ``--nodes N`` and ``spares`` hot spares (rounds run on N)."""
    ports = iter(range(20000, 10**9))
    kwargs: dict[str, Any] = {
        "hosts": hosts,
        "min_nodes": len(hosts) - spares,
        "round_size": len(hosts) - spares,
        "max_restarts": max_restarts,
        "master_addr": hosts[0],
        "new_port": lambda: next(ports),
        "rdzv_timeout": RDZV_TIMEOUT_S,
        "stop_timeout": 60.0,
        "now": now,
        "attempt": attempt,
        "fence_s": fence_s(),
    }
    return fast(cls)(**{k: v for k, v in kwargs.items() if k in _JOB_STATE_ARGS})


def fence_s() -> float:
    """The coordinator's fence after a silent loss, as the agent sets it (0 where the code has none)."""
    from hpcelastic.agent import bootstrap, runtime

    bound = getattr(bootstrap, "fence_bound", None)
    return float(bound(runtime.Timing())) if bound is not None else 0.0


#: The coordinator's state tells a silent loss apart (``JobState.lost(..., silent=True)``).
SILENT_LOSS = "silent" in inspect.signature(JobState.lost).parameters


@dataclass(frozen=True)
class EndFacts:
    """How an attempt ended, as its decider could know it."""

    attempt: int
    reason: Reason
    job_id: str
    ts: float
    bad_nodes: tuple[str, ...] = ()
    #: The decider's own node saw a heartbeat step this attempt.
    progressed: bool = False
    #: A complete checkpoint written during the attempt (published or not), as the decider finds it.
    new_checkpoint: str | None = None
    cancelled: bool = False
    slurm_requeued: bool = False
    #: The partition's nodes that could run the job now (not DOWN), and how many it needs.
    usable: frozenset[str] = frozenset()
    #: The partition's nodes that could run it now or once back up (none is drained in the simulation):
    #: what ``evidence.partition_capacity`` reads from sinfo.
    schedulable: frozenset[str] = frozenset()
    needed: int = 0


def coordinator_end(
    result: messages.Finish,
    stop: tuple[Reason, float, bool] | None,
    attempt: int,
    ts: float,
    progressed: bool,
    evidence: dict[str, Any],
) -> EndFacts:
    """The facts of an attempt the coordinator finished: Slurm's stop (its reason, kill time and whether it
    requeued), if one came, has the last word on anything but success."""
    reason, requeued = result.reason, False
    if stop is not None and result.reason is not Reason.SUCCEEDED:
        reason, _, requeued = stop
    return EndFacts(
        attempt,
        reason,
        "1000",
        ts,
        bad_nodes=tuple(result.bad_nodes),
        progressed=progressed,
        slurm_requeued=requeued,
        **evidence,
    )


def _attempt_end(facts: EndFacts, signature: str | None) -> policy.AttemptEnd:
    kwargs: dict[str, Any] = {
        "attempt": facts.attempt,
        "reason": facts.reason,
        "exit_code": facts.reason.exit_code,
        "job_id": facts.job_id,
        "bad_nodes": facts.bad_nodes,
        "progressed": facts.progressed,
        "signature": signature,
        "slurm_requeued": facts.slurm_requeued,
        "new_checkpoint": facts.new_checkpoint,
    }
    capacity = getattr(policy, "Capacity", None)
    if capacity is not None:
        kwargs["capacity"] = capacity(facts.schedulable, facts.needed)
    return policy.AttemptEnd(**{k: v for k, v in kwargs.items() if k in _ATTEMPT_END_FIELDS})


def conclude(log: Log, facts: EndFacts, settings: policy.Settings, decide: Decide) -> policy.Decision:
    """What ``Executor.conclude`` does, without Slurm: decide on the log, record the decision's events."""
    view = log.view()
    history = history_mod.History.from_log(view, facts.attempt, cancelled=facts.cancelled, now=facts.ts)
    signature = history_mod.root_cause_signature(history_mod.attempt_root_cause(view))
    end = _attempt_end(facts, signature)
    decision = decide(history, end, settings)
    ended: dict[str, Any] = {
        "attempt": end.attempt,
        "reason": end.reason,
        "exit_code": end.exit_code,
        "signature": end.signature,
        "progressed": decision.progressed,
        "bad_nodes": end.bad_nodes,
        "action": decision.action.value,
        "exclude": decision.exclude,
        "progress": getattr(decision, "progress", None),
    }
    log.record(events.attempt_ended(**{k: v for k, v in ended.items() if k in _ATTEMPT_ENDED_ARGS}), facts.ts)
    if decision.action is Action.SUCCEED:
        log.record(events.job_succeeded(attempt=end.attempt), facts.ts)
    elif decision.action is Action.SKIP:
        assert decision.skip is not None and decision.job_end is not None
        log.record(
            events.requeue_skipped(reason=decision.skip, attempt=end.attempt, detail=decision.message),
            facts.ts,
        )
        log.record(
            events.job_failed(exit_code=decision.exit_code, reason=decision.job_end, attempt=end.attempt),
            facts.ts,
        )
    else:
        by = Requeuer.SLURM if decision.slurm_requeued else Requeuer.HPCELASTIC
        log.record(
            events.requeued(
                job_id=facts.job_id,
                attempt=end.attempt + 1,
                reason=end.reason,
                exclude=decision.exclude,
                duration_s=0.1,
                note=None,
                by=by,
            ),
            facts.ts,
        )
    return decision


@dataclass(frozen=True)
class LedgerTotals:
    """The lost-time ledger of the week's log (``hpcelastic status``): allocated seconds, the sum of its
    segments inside attempts, and productive plus badput by phase."""

    allocated_s: float
    segments_s: float
    productive_plus_badput_s: float


def ledger_totals(log: Log, now: float) -> LedgerTotals:
    built = ledger.build_ledger(log.view(), now=now)
    outside = (ledger.Phase.PENDING, ledger.Phase.QUEUED)
    inside = sum(s.seconds for s in built.segments if s.phase not in outside)
    unknown = getattr(built, "unknown_s", 0.0)  # a ledger from before unknown redone work had none
    return LedgerTotals(
        built.allocated_s, inside, built.productive_s + unknown + sum(built.badput_by_phase.values())
    )


def settings(max_requeues: int) -> policy.Settings:
    return policy.Settings(policy.RequeueMode.REQUEUE, max_requeues)


def stop_step_report(rate: StepRate) -> tuple[int | None, float]:
    return rate.step, rate.rate
