"""One simulated week, event by event, driving the real coordinator state and requeue policy.

The clock jumps from event to event (a heap). Within an attempt: agents join a real
:class:`~hpcelastic.agent.job_state.JobState`; its ``Send`` actions are delivered as the agents would
act on them (spawn, stop, report the stop step); workers train at the week's step time, saving a
checkpoint every ``ckpt_every`` steps. Faults, time limits, preemptions and a cancel interrupt them.
When the attempt ends, its decider's facts go through :mod:`hpcelastic.sim.adapter` to the real
history and policy, and Slurm brings the job back (or not) as the decision says.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hpcelastic.sim import adapter, model
from hpcelastic.sim.adapter import Action, EndFacts, JobState, Reason, messages
from hpcelastic.sim.invariants import Checker, Violation
from hpcelastic.sim.model import DETECTION_S, GPUS_PER_NODE, Fault, Script, Week

#: Weeks per task when weeks run in several processes.
CHUNK = 250
#: How long an agent takes to kill its workers (``RESTART_KILL_GRACE``) at most.
KILL_S = 3.0
#: How long an agent waits for workers that ignore the stop step (``--grace-period``).
STOP_GRACE_S = 60.0
#: Slurm's KillWait: the time between the step's SIGTERM and SIGKILL.
KILL_WAIT_S = 30.0
#: The step's SIGTERM reaches each process of it within this spread (slurmctld's messages fan out to the
#: slurmds, each signals its processes on its own time).
TERM_SPREAD_S = 0.5
#: After the SIGTERM: the agents' held departures have settled (``SIGNAL_SETTLE_S``) well before this.
TERM_SETTLED_S = 3.0
GPU_ERROR = "RuntimeError: CUDA error: uncorrectable ECC error encountered"
SOFTWARE_ERROR = "RuntimeError: DataLoader worker (pid 4242) exited unexpectedly"
STARTUP_ERROR = "ModuleNotFoundError: No module named 'not_a_module'"


def _traceback(error: str, where: str) -> str:
    return (
        "Traceback (most recent call last):\n"
        '  File "train.py", line 120, in <module>\n    main()\n'
        f'  File "train.py", line 88, in {where}\n    loss = step(batch)\n'
        f"{error}\n"
    )


@dataclass
class Hooks:
    """The decision code a week runs: the real one, or (in tests) a deliberately broken one."""

    decide: adapter.Decide = field(default_factory=lambda: adapter.policy.decide)
    job_state: type[JobState] = JobState
    #: ``finalize``'s look at the log: the exit code already decided for an attempt, or None.
    recorded_exit: Callable[[Any, int], int | None] = field(default_factory=lambda: adapter.recorded_exit)


@dataclass
class DecisionLog:
    """One decision as the invariants see it."""

    attempt: int
    ts: float
    action: str
    skip: str | None
    exclude: tuple[str, ...]
    advanced: bool
    trained: bool


@dataclass
class WeekResult:
    """How a simulated week went."""

    week: Week
    outcome: str
    allocated_s: float
    productive_s: float
    badput_s: dict[str, float]
    attempts: int
    final_step: int
    kept_step: int
    decisions: list[DecisionLog]
    violations: list[Violation]

    @property
    def work_done(self) -> float:
        """The share of the job's steps kept at the week's end (1.0: it finished)."""
        return 1.0 if self.outcome == "finished" else self.kept_step / self.week.total_steps

    @property
    def ettr(self) -> float:
        return self.productive_s / self.allocated_s if self.allocated_s > 0 else 0.0


class _Trainer:
    """The workers of one round: steps, saves every ``ckpt_every`` steps, a freeze when hung."""

    def __init__(self, sim: Sim, t_first: float, step0: int) -> None:
        self.sim, self.t, self.step = sim, t_first, step0
        self.first = (step0, t_first)
        self.save_until: float | None = None
        self.frozen = False
        self.stop_after: int | None = None  # the stop step: no further step
        self.final_save = True  # ... then a save (the worker API), unless one just saved that step
        self.saved_step = -1

    def milestone(self) -> float:
        """When the next save completes or the next checkpoint step (or the last step) is reached."""
        if self.frozen:
            return math.inf
        if self.save_until is not None:
            return self.save_until
        if self.stop_after is not None and self.step >= self.stop_after:
            return self.t
        return self.t + (self._target() - self.step) * self.sim.week.step_s

    def _target(self) -> int:
        w = self.sim.week
        target = min((self.step // w.ckpt_every + 1) * w.ckpt_every, w.total_steps)
        return target if self.stop_after is None else min(target, self.stop_after)

    def advance(self, t: float) -> None:
        """Train until ``t``, completing saves and reaching checkpoint steps on the way."""
        sim, w = self.sim, self.sim.week
        while not self.frozen:
            if self.save_until is not None:
                if self.save_until > t:
                    return
                self.t, self.save_until, self.saved_step = self.save_until, None, self.step
                sim.checkpoint(self.step, self.t)
                sim.span("train", self.t)
                continue
            if self.stop_after is not None and self.step >= self.stop_after:
                if self.final_save and self.saved_step != self.step:
                    self._save()
                    continue
                self.frozen = True  # stopped at the stop step (after its final save)
                sim.span("stopping", self.t)
                sim.stopped_at_stop_step()
                return
            target = self._target()
            if target <= self.step or self.t >= t:
                return
            reach = self.t + (target - self.step) * w.step_s
            if reach > t:
                n = int((t - self.t) / w.step_s)
                self._train(self.step + n, self.t + n * w.step_s)
                return
            self._train(target, reach)
            if target < w.total_steps and target % w.ckpt_every == 0:
                self._save()

    def _save(self) -> None:
        self.sim.span("save", self.t)
        self.save_until = self.t + model.save_length(self.sim.rng, self.sim.week)

    def _train(self, step: int, t: float) -> None:
        if step > self.step:
            self.sim.trained(self.step, step, self.t, t)
            self.step, self.t = step, t


class Sim:
    """One week: Slurm, the nodes, the job's attempts, the decisions."""

    def __init__(self, week: Week, hooks: Hooks | None = None, *, check: Checker | None = None) -> None:
        self.week = week
        self.week_end = model.WEEK_S
        self.hooks = hooks or Hooks()
        self.rng = random.Random(week.seed * 1_000_003 + 17)
        self.t = 0.0
        self.log = adapter.Log()
        self.partition = [f"n{i:04d}" for i in range(week.partition)]
        #: host -> (died, back): dead from ``died``, DOWN in Slurm after SlurmdTimeout, up at ``back``.
        self.dead: dict[str, tuple[float, float]] = {}
        self.faulty: set[str] = set()
        self.unhealthy: set[str] = set()
        self.evidence: dict[str, list[str]] = {}
        self.excluded: tuple[str, ...] = ()
        self.cancelled = False
        self.ckpt_step, self.top_step = 0, 0
        self.train_spans: list[list[float]] = []  # [t0, t1, s0, s1, redone fraction]
        self.spans: dict[str, float] = {}
        self.phase, self.phase_t = "pending", 0.0
        self.allocated = 0.0
        self.attempt = -1
        self.decisions: list[DecisionLog] = []
        self.outcome = "running"
        self.check = check or Checker()
        self._seq = itertools.count()
        # per attempt
        self.hosts: list[str] = []
        self.round_nodes: list[int] = []
        self.q: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self.st: JobState | None = None
        self.trainer: _Trainer | None = None
        self.round = -1
        self.attempt_log = 0
        self.attempt_start = 0.0
        self.attempt_steps: set[int] = set()
        self.attempt_ckpt_before = 0
        self.attempt_ckpt: int | None = None
        self.decider_saw_step = False
        self.stop: tuple[Reason, float, bool] | None = None  # reason, kill time, slurm requeued
        #: When the step's SIGTERM came, and whether the round was running or preempting then (no fault
        #: of its own in the way: see the ``step_stop_blames_nobody`` invariant).
        self.term_at: float | None = None
        self.term_clean = False
        self.term_left: set[int] = set()
        self.ended = False
        self.rate = adapter.StepRate()
        self.workers: dict[int, tuple[tuple[int, int], float]] = {}  # node index -> (round key, dead at)

    # ---- bookkeeping ----------------------------------------------------------------------------
    def span(self, phase: str, until: float) -> None:
        """Close the current phase at ``until`` (phases add up to the allocated time)."""
        if self.phase != "pending":
            self.spans[self.phase] = self.spans.get(self.phase, 0.0) + (until - self.phase_t)
        self.phase, self.phase_t = phase, until

    def trained(self, s0: int, s1: int, t0: float, t1: float) -> None:
        self.train_spans.append([t0, t1, s0, s1, 0.0])
        self.top_step = max(self.top_step, s1)
        self.attempt_steps.add(s1)
        if self.week.script is not Script.PLAIN:
            self.decider_saw_step = True

    def checkpoint(self, step: int, ts: float) -> None:
        """A save completed: published (API) or only in the checkpoint directory."""
        if step <= 0:
            return
        self.ckpt_step = max(self.ckpt_step, step)
        self.attempt_ckpt = step if self.attempt_ckpt is None else max(self.attempt_ckpt, step)
        if self.week.script is Script.API:
            self.log.published(ts, self.attempt, step)

    def resume(self) -> int:
        """The step training resumes from; the work after it is redone."""
        c = self.ckpt_step
        for span in self.train_spans:
            t0, t1, s0, s1, done = span
            if s1 > c and done < 1.0:
                span[4] = max(done, (s1 - max(s0, c)) / (s1 - s0))
        return c

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self.q, (t, next(self._seq), fn, args))

    # ---- the week -------------------------------------------------------------------------------
    def run(self) -> WeekResult:
        t = 0.0
        while t < model.WEEK_S and self.outcome == "running":
            if self.week.cancel_at is not None and self.week.cancel_at <= t:
                self.outcome = "cancelled"
                break
            hosts = self._allocate(t)
            if hosts is None:
                t = self._next_allocation(t)
                continue
            if self._is_dead(hosts[0], t):  # no batch script: Slurm finds the node DOWN and requeues the job
                t = self.dead[hosts[0]][0] + model.SLURMD_TIMEOUT_S + self.rng.uniform(60, 600)
                continue
            t = self._run_attempt(t, hosts)
            if self.outcome == "running":
                t += self.rng.uniform(60, 1800)  # pending in the queue
        return self._result()

    @property
    def needed(self) -> int:
        """The nodes the job asks Slurm for: the round's and the hot spares."""
        return self.week.nodes + self.week.spares

    def _is_dead(self, host: str, t: float, after: float = 0.0) -> bool:
        """``host`` is dead at ``t`` (and has been for ``after`` seconds)."""
        died, back = self.dead.get(host, (math.inf, 0.0))
        return died + after <= t < back

    def _usable(self, t: float) -> list[str]:
        """The partition's nodes Slurm would run a job on (a dead node is DOWN only after SlurmdTimeout)."""
        down = {h for h in self.dead if self._is_dead(h, t, model.SLURMD_TIMEOUT_S)}
        return [n for n in self.partition if n not in down] if down else list(self.partition)

    def _allocate(self, t: float) -> list[str] | None:
        free = [n for n in self._usable(t) if n not in self.excluded]
        need = self.needed
        return free[:need] if len(free) >= need else None

    def _next_allocation(self, t: float) -> float:
        """Wait for a DOWN node to come back; unschedulable when exclusions alone forbid it."""
        if len(self.partition) - len(self.excluded) < self.needed:
            self.outcome = "unschedulable"
            return model.WEEK_S
        back = [u for _, u in self.dead.values() if u > t]
        return min(back) if back else model.WEEK_S

    def _run_attempt(self, t0: float, hosts: list[str]) -> float:
        self.attempt += 1
        self.hosts, self.q, self.round, self.ended, self.round_nodes = hosts, [], -1, False, []
        self.attempt_start, self.attempt_steps, self.attempt_ckpt = t0, set(), None
        self.attempt_ckpt_before = self.ckpt_step
        self.decider_saw_step, self.stop, self.trainer, self.workers = False, None, None, {}
        self.term_at, self.term_clean, self.term_left = None, False, set()
        self.t = t0
        self.phase, self.phase_t = "startup", t0
        self.attempt_log = len(self.log.records)
        self.log.attempt_started(t0, self.attempt, "1000", self.attempt, hosts)
        self.st = adapter.new_job_state(
            self.hooks.job_state,
            hosts,
            spares=self.week.spares,
            max_restarts=self.week.max_restarts,
            now=lambda: self.t,
            attempt=self.attempt,
        )
        self.at(t0 + 5.0, self._agents_up)
        self.at(t0 + adapter.RDZV_TIMEOUT_S + 0.1, self._call, "tick")  # a dead node's agent never joins
        self._schedule_fault(t0)
        self._schedule_blip(t0)
        limit = t0 + self.week.time_limit_s
        self.at(limit - self.week.signal_lead_s, self._signal, Reason.TIME_LIMIT, limit, False)
        if self.week.preempt_per_day > 0:
            tp = t0 + self.rng.expovariate(self.week.preempt_per_day / model.DAY_S)
            self.at(tp, self._signal, Reason.PREEMPTED, tp + self.week.preempt_grace_s, True)
        if self.week.cancel_at is not None and self.week.cancel_at >= t0:
            self.at(self.week.cancel_at, self._cancel)
        while not self.ended:
            tq = self.q[0][0] if self.q else math.inf
            tm = self.trainer.milestone() if self.trainer is not None else math.inf
            tn = min(tq, tm, model.WEEK_S)
            self._advance(tn)
            if self.ended:
                break
            if tn >= model.WEEK_S:
                self._week_over()
                break
            if tm <= tq:
                self._milestone()
                continue
            _, _, fn, args = heapq.heappop(self.q)
            fn(*args)
        self.allocated += self.t - t0
        self.check.after_attempt(self, t0, self.t)
        return self.t

    def _advance(self, t: float) -> None:
        self.t = max(self.t, t)
        tr = self.trainer
        if tr is None:
            return
        before = tr.step
        tr.advance(t)
        if tr.step != before and self.st is not None and self.week.script is not Script.PLAIN:
            self.rate.beat(self.round, tr.step, tr.t)
            self._apply(self.st.progress(0, self.round, tr.step, tr.t, self.week.nodes * GPUS_PER_NODE))

    def _milestone(self) -> None:
        tr = self.trainer
        if tr is not None and tr.step >= self.week.total_steps and tr.save_until is None:
            self.span("shutdown", self.t)
            self.trainer = None
            for n in self.round_nodes:
                self._call("workers_done", n, self.round)

    # ---- the coordinator ------------------------------------------------------------------------
    def _call(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Deliver an agent's report to the coordinator's state (``JobState.<method>``) and act on it."""
        st = self.st
        if st is None or self.ended:
            return
        actions = getattr(st, method)(*args, **kwargs)
        if actions:
            self._apply(actions)
        elif st.result is not None:
            self._coordinator_decides(st.result)
        if getattr(st, "round_due", False) and method != "tick":
            # A fenced restart: the real coordinator ticks every 0.1 s; the week ticks once, at the fence.
            self.at(max(self.t, st.fence_until), self._call, "tick")

    def _apply(self, actions: list[Any]) -> None:
        st = self.st
        if st is None:
            return
        rounds: list[tuple[int, messages.Round]] = []
        for send in self.log.apply(actions, self.t):
            msg = send.message
            if isinstance(msg, messages.Round):
                rounds.append((send.node_rank, msg))
            elif isinstance(msg, messages.Stop):
                self._stop_node(send.node_rank, msg.round)
            elif isinstance(msg, messages.Preempt):
                self._preempted_node(send.node_rank, msg.round)
            elif isinstance(msg, messages.StopAt):
                self._stop_at(send.node_rank, msg)
        if rounds:
            self._start_round(rounds)
        if st.result is not None and not self.ended:
            self._coordinator_decides(st.result)

    def _agents_up(self) -> None:
        for i, host in enumerate(self.hosts):
            if self.st is None or self.ended:
                return
            if self._is_dead(host, self.t):
                continue
            if host in self.unhealthy:
                self.log.node_unhealthy(self.t, host, "GPU 0 failed its health check")
                self._call("left", i, "node unhealthy: GPU 0", unhealthy=True)
            else:
                self._call("join", i, host, GPUS_PER_NODE)

    def _start_round(self, rounds: list[tuple[int, messages.Round]]) -> None:
        """Every node of the new round kills what is left of its old workers and spawns new ones."""
        r = rounds[0][1].round
        self.round, self.round_nodes = r, [n for n, _ in rounds]
        self.trainer = None
        if self.phase != "startup":
            self.span("restart", self.t)
        spawn = self.t + 10.0
        for n, _ in rounds:
            self.workers.pop(n, None)
        self.check.round_spawn(self, (self.attempt, r), [n for n, _ in rounds], self.t)
        for n, _ in rounds:
            self.workers[n] = ((self.attempt, r), math.inf)
        self.at(spawn, self._spawned, r, [n for n, _ in rounds])

    def _spawned(self, r: int, nodes: list[int]) -> None:
        if r != self.round or self.st is None:
            return
        for n in nodes:
            self._call("started_workers", n, r, self.t)
        init = self.week.startup_s if r == 0 else self.week.restart_s
        self.at(self.t + init, self._first_step, r)

    def _first_step(self, r: int) -> None:
        if r != self.round or self.ended or self.st is None or self.st.phase.value != "running":
            return
        if self.week.startup_bug:
            self._worker_fails(0, self._failure(0, 1, None, STARTUP_ERROR, "<module>"))
            return
        self.span("train", self.t)
        self.trainer = _Trainer(self, self.t, self.resume())
        self.rate = adapter.StepRate()
        if self.week.script is not Script.PLAIN:
            self.rate.beat(r, self.trainer.step, self.t)

    def _stop_node(self, n: int, r: int) -> None:
        """An agent stops its workers (a restart): they are gone a moment later."""
        self._kill_training()
        gone = n in self.workers and self.workers[n][1] <= self.t  # dead already: only reaped
        done = self.t + (0.05 if gone else self.rng.uniform(0.2, KILL_S))
        self._dead_at(n, done)
        self.at(done, self._stopped, n, r)

    def _stopped(self, n: int, r: int) -> None:
        if n not in self.term_left:  # an agent that left on the step's SIGTERM reports nothing more
            self._call("workers_stopped", n, r, [])

    def _dead_at(self, n: int, t: float) -> None:
        if n in self.workers:
            self.workers[n] = (self.workers[n][0], t)

    def _halt(self, tr: _Trainer, phase: str) -> None:
        """Training stops now: the step in flight is lost."""
        tr.advance(self.t)
        if self.phase == "train":
            self.span("partial_step", tr.t)
        self.span(phase, self.t)

    def _kill_training(self) -> None:
        """The workers die now: a step in flight is lost, a save in flight is torn."""
        tr = self.trainer
        if tr is not None:
            self.trainer = None
            self._halt(tr, "stopping")
        elif self.phase not in ("stopping", "shutdown"):
            self.span("stopping", self.t)

    # ---- stop signals (time limit, preemption) ----------------------------------------------------
    def _signal(self, reason: Reason, kill: float, requeued: bool) -> None:
        if self.ended or self.stop is not None:
            return
        self.stop = (reason, kill, requeued)
        self.at(kill, self._step_term)
        if kill <= self.t or self.st is None:
            return
        self.log.record(adapter.events.signal_received(signal="USR2", node_rank=0), self.t)
        self._call("preempt", 0, "USR2")

    def _preempted_node(self, n: int, r: int) -> None:
        """An agent got ``Preempt``: it reports its step and rate; without training it just stops."""
        if n not in self.round_nodes:
            return  # a hot spare: no workers
        if self.trainer is None or r != self.round:
            self._dead_at(n, self.t)
            self.at(self.t + 0.5, self._stopped, n, r)
            return
        plain = self.week.script is Script.PLAIN
        if plain and not adapter.STOPS_SPARE_SAVES:  # USR2's default action kills an unchanged script
            self._stop_node(n, r)
            return
        if plain and n == 0:  # not sent the signal; stopped once no save is in flight
            self.trainer.advance(self.t)
            self.trainer.stop_after, self.trainer.final_save = self.trainer.step, False
        step, rate = adapter.stop_step_report(self.rate) if not plain else (None, 0.0)
        self.at(self.t + 0.05, self._call, "step_report", n, r, step, rate)

    def _stop_at(self, n: int, msg: messages.StopAt) -> None:
        tr = self.trainer
        if tr is None or msg.round != self.round:
            return
        if self.week.script is Script.PLAIN or msg.step is None:
            return
        if self.week.script is Script.API or adapter.STOPS_SPARE_SAVES:
            if n == 0:  # every rank stops after the stop step (see stopped_at_stop_step)
                tr.advance(self.t)
                tr.stop_after = max(msg.step, tr.step)
                tr.final_save = self.week.script is Script.API  # heartbeat() only: stopped there, no save
        else:  # heartbeat() without should_stop(): the agent kills it after the grace period
            self.at(self.t + STOP_GRACE_S, self._stop_node_now, n, msg.round)

    def stopped_at_stop_step(self) -> None:
        """Every rank stopped after the stop step and saved: the agents see their workers exit."""
        for n in self.round_nodes:
            self.at(self.t + 0.5, self._stop_node_now, n, self.round)

    def _stop_node_now(self, n: int, r: int) -> None:
        if r == self.round:
            self._stop_node(n, r)

    def _step_term(self) -> None:
        """Slurm ends the step: its SIGTERM reaches every process, each node's on its slurmd's own time, so
        a worker may die of it before any agent hears it. Faults no longer strike (the invariant's window)."""
        if self.ended or self.stop is None:
            return
        self.term_at = self.t
        self.term_clean = self.st is not None and self.st.phase.value in ("running", "preempting")
        for n, host in enumerate(self.hosts):
            if self._is_dead(host, self.t):
                continue
            if n in self.round_nodes:
                self.at(
                    self.t + self.rng.uniform(0.0, TERM_SPREAD_S), self._term_kills_workers, n, self.round
                )
            self.at(self.t + self.rng.uniform(0.0, TERM_SPREAD_S), self._term_reaches_agent, n)
        self.at(self.t + TERM_SETTLED_S - 0.5, self._call, "tick")  # the real coordinator ticks every 0.1 s
        self.at(self.t + TERM_SETTLED_S, self._killed)

    def _term_kills_workers(self, n: int, r: int) -> None:
        """Node ``n``'s workers die of the step's SIGTERM; its agent reports it unless it already left."""
        if r != self.round or n not in self.workers or self.workers[n][1] <= self.t:
            return
        self._dead_at(n, self.t)
        self._kill_training()
        if n not in self.term_left:
            self._call("worker_failed", n, r, [self._failure(n, None, "SIGTERM", "killed by SIGTERM", "")])

    def _term_reaches_agent(self, n: int) -> None:
        """Node ``n``'s agent gets the step's SIGTERM: it leaves (signalled) and stops its workers."""
        self.term_left.add(n)
        self._call("left", n, "agent received SIGTERM", signalled_at=self.t)

    def _killed(self) -> None:
        """Slurm's kill: every process of the step dies; the batch script's ``finalize`` decides."""
        if self.ended or self.stop is None:
            return
        reason, _, requeued = self.stop
        self._kill_training()
        self._end(EndFacts(self.attempt, reason, "1000", self.t, slurm_requeued=requeued, **self._evidence()))

    def _cancel(self) -> None:
        """``scancel``: the job is killed at once and never runs again."""
        self.cancelled = True
        if self.ended:
            return
        self._kill_training()
        self.log.cancelled(self.t, "1000")
        self._end(
            EndFacts(self.attempt, Reason.PREEMPTED, "1000", self.t, cancelled=True, **self._evidence())
        )

    # ---- faults ---------------------------------------------------------------------------------
    def _schedule_fault(self, t: float) -> None:
        w = self.week
        bad = sum(1 for h in self.hosts if h in self.faulty)
        rate = w.fault_rate_per_node_s * (len(self.hosts) + (model.BAD_NODE_FACTOR - 1) * bad)
        self.at(t + self.rng.expovariate(rate), self._fault)

    def _schedule_blip(self, t: float) -> None:
        rate = self.week.blips_per_node_day * len(self.hosts) / model.DAY_S
        if rate > 0:
            self.at(t + self.rng.expovariate(rate), self._blip)

    def _blip(self) -> None:
        """A short network drop at any node, the coordinator's included."""
        if self.ended or self.term_at is not None:
            return
        self._schedule_blip(self.t)
        n = self.rng.randrange(len(self.hosts))
        if self._is_dead(self.hosts[n], self.t):
            return
        self.evidence.setdefault(self.hosts[n], []).append("network blip")
        if self.rng.uniform(2.0, 6.0) > DETECTION_S:
            self._node_gone(n, self.t, dead=False)

    def _fault(self) -> None:
        if self.ended or self.term_at is not None:
            return
        self._schedule_fault(self.t)
        weights = [model.BAD_NODE_FACTOR if h in self.faulty else 1.0 for h in self.hosts]
        n = self.rng.choices(range(len(self.hosts)), weights)[0]
        host = self.hosts[n]
        kind = model.draw_fault(self.rng)
        if self._is_dead(host, self.t):
            return
        self.evidence.setdefault(host, []).append(kind.value)
        if kind is Fault.HOST:
            self.dead[host] = (self.t, self.t + model.SLURMD_TIMEOUT_S + model.repair_s(self.rng))
            self._node_gone(n, self.t, dead=True)
            return
        if kind is Fault.NETWORK:
            drop = model.network_drop_s(self.rng)
            if drop > DETECTION_S:
                self._node_gone(n, self.t, dead=False)
            return
        if (
            self.trainer is None
            or self.st is None
            or self.st.phase.value != "running"
            or n not in self.round_nodes
        ):
            return  # not training, or a hot spare: a worker fault needs workers
        if kind is Fault.GPU:
            self.faulty.add(host)
            if self.rng.random() < 0.4:
                self.unhealthy.add(host)
            self._worker_fails(n, self._failure(n, 1, None, GPU_ERROR, "train_step"))
        elif kind is Fault.SOFTWARE:
            self._worker_fails(n, self._failure(n, 1, None, SOFTWARE_ERROR, "train_step"))
        elif kind is Fault.OOM:
            self._worker_fails(n, self._failure(n, -9, "SIGKILL", "killed by SIGKILL", ""))
        elif kind is Fault.HANG:
            self._halt(self.trainer, "hung")
            self.trainer.frozen = True
            if self.week.stall_timeout_s is not None:
                f = self._failure(
                    n,
                    None,
                    None,
                    f"stalled: hung at all_reduce; no progress for {self.week.stall_timeout_s:g} s",
                    "",
                )
                self.at(self.t + self.week.stall_timeout_s, self._hang_found, self.round, n, f)

    def _hang_found(self, r: int, n: int, failure: dict[str, Any]) -> None:
        if r == self.round and not self.ended:
            failure["ts"] = self.t
            self._worker_fails(n, failure)

    def _failure(
        self, n: int, exitcode: int | None, signal: str | None, error: str, where: str
    ) -> dict[str, Any]:
        local = self.rng.randrange(GPUS_PER_NODE)
        tb = _traceback(error, where) if where else ""
        return {
            "round": self.round,
            "rank": self.round_nodes.index(n) * GPUS_PER_NODE + local if n in self.round_nodes else None,
            "local_rank": local,
            "exitcode": exitcode,
            "signal": signal,
            "error": error,
            "ts": self.t,
            "traceback": tb,
        }

    def _worker_fails(self, n: int, failure: dict[str, Any]) -> None:
        """A worker on node ``n`` died; a GPU node's agent then fails its health check and leaves."""
        self._kill_training()
        self._call("worker_failed", n, self.round, [failure])
        host = self.hosts[n]
        if host in self.unhealthy and not self.ended and self.st is not None:
            self.log.node_unhealthy(self.t, host, "GPU failed its health check after an ECC error")
            self._dead_at(n, self.t + 1.0)
            self._call("left", n, "node unhealthy: GPU 0", unhealthy=True)

    def _node_gone(self, n: int, t: float, *, dead: bool) -> None:
        """Node ``n`` died or its network dropped: lost to the others after the detection bound; its agent,
        cut off as long, ends its lease by then and kills its workers."""
        if n in self.round_nodes:
            self._kill_training()
        self._dead_at(n, t if dead else t + DETECTION_S + self.rng.uniform(0.2, KILL_S))
        self.at(t + DETECTION_S, self._silent, n, dead)

    def _silent(self, n: int, dead: bool) -> None:
        if self.ended or self.st is None:
            return
        reason = f"no heartbeat or probe answer for more than {DETECTION_S:g} s"
        if n != 0:
            self._lost_silent(n, reason)
            return
        if dead:  # the coordinator's node died with the batch shell: a survivor decides
            self._end(
                EndFacts(
                    self.attempt,
                    Reason.NODE_UNHEALTHY,
                    "1000",
                    self.t,
                    bad_nodes=(self.hosts[0],),
                    progressed=self.decider_saw_step,
                    **self._evidence(),
                )
            )
            return
        for m in range(1, len(self.hosts)):  # the coordinator's own network: it hears nobody
            self._lost_silent(m, reason)

    def _lost_silent(self, n: int, reason: str) -> None:
        """The coordinator loses agent ``n`` by silence (its next round waits for the fence)."""
        self._call("lost", n, reason, **({"silent": True} if adapter.SILENT_LOSS else {}))

    # ---- the end of an attempt --------------------------------------------------------------------
    def _finalize(self) -> None:
        """The step is over: the batch script's ``finalize`` decides unless a decision is recorded."""
        if self.hooks.recorded_exit(self.log.view(self.attempt_log), self.attempt) is None:
            self._decide(EndFacts(self.attempt, Reason.COORDINATOR_LOST, "1000", self.t, **self._evidence()))

    def _coordinator_decides(self, result: messages.Finish) -> None:
        self._end(
            adapter.coordinator_end(
                result, self.stop, self.attempt, self.t, self.decider_saw_step, self._evidence()
            )
        )
        self._finalize()

    def _evidence(self) -> dict[str, Any]:
        ckpt = self.attempt_ckpt
        return {
            "new_checkpoint": f"step-{ckpt}" if ckpt is not None else None,
            "usable": frozenset(self._usable(self.t)),
            "schedulable": frozenset(self.partition),
            "needed": self.needed,
        }

    def _end(self, facts: EndFacts) -> None:
        """One decision for the attempt, then Slurm does what it says."""
        self.ended = True
        self._kill_training()
        if self.trainer is None and self.phase not in ("stopping",):
            self.span("stopping", self.t)
        self.span("pending", self.t)
        self.st = None
        self._decide(facts)

    def _decide(self, facts: EndFacts) -> None:
        decision = adapter.conclude(
            self.log, facts, adapter.settings(self.week.max_requeues), self.hooks.decide
        )
        # Durable progress: a checkpoint beyond every earlier one (steps past the earlier attempts' are
        # lost again if no checkpoint keeps them: a job preempted more often than it saves never advances).
        advanced = self.attempt_ckpt is not None and self.attempt_ckpt > self.attempt_ckpt_before
        rec = DecisionLog(
            self.attempt,
            self.t,
            decision.action.value,
            decision.skip.value if decision.skip is not None else None,
            tuple(decision.exclude),
            advanced,
            bool(self.attempt_steps),
        )
        self.decisions.append(rec)
        self.check.after_decision(self, rec, facts)
        if decision.action is Action.SUCCEED:
            self.outcome = "finished"
        elif decision.action is Action.SKIP:
            self.outcome = "cancelled" if self.cancelled else f"abandoned:{rec.skip}"
        else:
            released = set(decision.release)
            self.excluded = tuple(n for n in decision.exclude if n not in released)
            if self.cancelled:  # Slurm cannot requeue a cancelled job; the executor resubmits it
                self.outcome = "came_back_after_cancel"

    def _week_over(self) -> None:
        self._kill_training()
        self.span("pending", self.t)
        self.ended = True

    def _result(self) -> WeekResult:
        final = self.ckpt_step if self.outcome != "finished" else self.week.total_steps
        productive = 0.0
        redone = 0.0
        for t0, t1, s0, s1, done in self.train_spans:
            d = t1 - t0
            lost = (
                done
                if self.outcome in ("finished", "running")
                else max(done, (s1 - max(s0, final)) / (s1 - s0) if s1 > final else 0.0)
            )
            productive += d * (1 - lost)
            redone += d * lost
        badput = {k: v for k, v in self.spans.items() if k != "train"}
        badput["redone"] = redone
        res = WeekResult(
            self.week,
            self.outcome,
            self.allocated,
            productive,
            badput,
            self.attempt + 1,
            self.top_step,
            self.ckpt_step,
            self.decisions,
            self.check.violations,
        )
        self.check.after_week(self, res)
        return res


def run_week(week: Week, hooks: Hooks | None = None) -> WeekResult:
    return Sim(week, hooks).run()


def _run_seeds(seeds: range, nodes: int | None) -> list[WeekResult]:
    return [run_week(model.draw_week(seed, nodes)) for seed in seeds]


def run_weeks(first: int, count: int, *, nodes: int | None = None, jobs: int = 1) -> list[WeekResult]:
    """The weeks of seeds ``first`` .. ``first + count - 1``, in ``jobs`` processes (the same results)."""
    if jobs <= 1 or count < 2 * CHUNK:
        return _run_seeds(range(first, first + count), nodes)
    chunks = [range(k, min(k + CHUNK, first + count)) for k in range(first, first + count, CHUNK)]
    with ProcessPoolExecutor(jobs) as pool:
        return [r for part in pool.map(_run_seeds, chunks, [nodes] * len(chunks)) for r in part]
