"""Perform the requeue policy's decision: the events, ``scontrol requeue``, ``sbatch``, with retries.

One decision per attempt (``RunDir.claim_once``), taken by the group-rank-0 agent or, when no agent
could, by ``hpcelastic finalize`` in the batch script. ``requeue`` mode keeps the job id
(``scontrol requeue``, then ``scontrol update`` ExcNodeList); ``resubmit`` mode, and the fallback when
requeue is impossible, submits ``<run>/job.sbatch`` again with ``--dependency=afterany:<job>`` and
the bad nodes in ``--exclude``. Every step is an event in the run directory and a line on stderr.
Every Slurm command goes through :mod:`hpcelastic.jobs.slurm`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from hpcelastic import events, handoff
from hpcelastic.env import slurm as slurm_env
from hpcelastic.errors import SlurmError
from hpcelastic.jobs import slurm
from hpcelastic.lifecycle import policy
from hpcelastic.lifecycle.cancel import is_cancelled, mark_cancelled
from hpcelastic.lifecycle.classify import Stop, requeued_by_slurm, slurm_ending
from hpcelastic.lifecycle.history import History
from hpcelastic.lifecycle.policy import Action, AttemptEnd, Decision, RequeueMode, Settings
from hpcelastic.reasons import JobEnd, Named, Reason, Requeuer
from hpcelastic.record.runindex import record_job
from hpcelastic.rundir import RunDir

DEFAULT_RETRY_DELAYS_S = (0.5, 1.0, 2.0, 4.0)
#: How long past SlurmdTimeout a requeue waits for Slurm to mark a dead node of a GRES job DOWN.
DOWN_WAIT_EXTRA_S = 30.0
T = TypeVar("T")


class Result(Named):
    """What ending the attempt did."""

    NOT_NEEDED = "not_needed"  # the job succeeded
    REQUEUED = "requeued"  # same job id, next attempt queued
    RESUBMITTED = "resubmitted"  # new job id, next attempt queued
    SKIPPED = "skipped"  # not brought back (the message says why)
    FAILED = "failed"  # requeue and resubmit both failed
    ALREADY_DECIDED = "already_decided"  # another process decided this attempt


@dataclass(frozen=True)
class Outcome:
    """The result of :meth:`Executor.conclude`; ``exit_code`` is what the caller exits with."""

    action: Result
    reason: Reason | JobEnd
    exit_code: int
    attempt: int
    next_attempt: int | None = None
    job_id: str | None = None
    message: str = ""
    duration_s: float | None = None


@contextlib.contextmanager
def term_deferred() -> Iterator[None]:
    """Hold a SIGTERM back until the decision is recorded, then deliver it.

    ``scontrol requeue`` from inside the job makes Slurm signal this very process; with the
    default disposition it would die between the requeue and its event. Only possible (and
    only done) in the main thread when nobody else handles SIGTERM.
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL
    ):
        yield
        return
    received: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if received:
            os.kill(os.getpid(), signal.SIGTERM)


def say(message: str) -> None:
    """One line on stderr."""
    print(f"hpcelastic: {message}", file=sys.stderr, flush=True)


def _nodes_note(exclude: Sequence[str]) -> str:
    return f" excluding {','.join(exclude)}" if exclude else ""


class Executor:
    """Claims the decision of an attempt, asks :func:`policy.decide` and carries it out."""

    def __init__(
        self,
        *,
        retry_delays_s: Sequence[float] = DEFAULT_RETRY_DELAYS_S,
        say: Callable[[str], None] = say,
    ) -> None:
        self.retry_delays_s = tuple(retry_delays_s)
        self.say = say

    def conclude(self, rd: RunDir, end: AttemptEnd, settings: Settings) -> Outcome:
        """Record how ``end.attempt`` ended and succeed, stop or bring the job back; once per attempt."""
        t0 = time.monotonic()
        with term_deferred():
            if not rd.claim_once(f"decide-attempt-{end.attempt}"):
                return self._already_decided(rd, end)
            history = History.from_log(rd.events(), end.attempt, cancelled=is_cancelled(rd), now=time.time())
            decision = policy.decide(history, end, settings)
            # Recorded before Slurm is asked: the requeue counts even if this process dies during it.
            rd.record(
                events.attempt_ended(
                    attempt=end.attempt,
                    reason=end.reason,
                    exit_code=end.exit_code,
                    signature=end.signature,
                    progressed=decision.progressed,
                    bad_nodes=end.bad_nodes,
                    action=decision.action.value,
                    exclude=decision.exclude,
                    progress=decision.progress,
                )
            )
            if decision.action is Action.SUCCEED:
                rd.record(events.job_succeeded(attempt=end.attempt))
                return Outcome(
                    Result.NOT_NEEDED, end.reason, decision.exit_code, end.attempt, message=decision.message
                )
            if decision.action is Action.SKIP:
                return self._skip(rd, end, decision)
            return self._unless_cancelled_meanwhile(rd, self._bring_back(rd, end, decision, settings, t0))

    # -- actions --------------------------------------------------------------------------------

    def _skip(self, rd: RunDir, end: AttemptEnd, decision: Decision) -> Outcome:
        assert decision.skip is not None and decision.job_end is not None
        rd.record(events.requeue_skipped(reason=decision.skip, attempt=end.attempt, detail=decision.message))
        if decision.slurm_requeued and end.job_id:  # Slurm queued it again itself: it must not run again
            self._retrying(lambda: slurm.cancel(str(end.job_id)))
        elif end.job_id and rd.read_meta().get("requeue_expedite"):
            # An expedited-requeue job that exits non-zero is held (REQUEUE_HOLD) unless Slurm blamed a
            # node: nothing may bring it back now (designed from Slurm 25.11's documentation; untested).
            job_id = str(end.job_id)
            self._retrying(lambda: slurm.set_requeue(job_id, False))
        rd.record(
            events.job_failed(exit_code=decision.exit_code, reason=decision.job_end, attempt=end.attempt)
        )
        self.say(decision.message)
        return Outcome(
            Result.SKIPPED, decision.job_end, decision.exit_code, end.attempt, message=decision.message
        )

    def _bring_back(
        self, rd: RunDir, end: AttemptEnd, decision: Decision, settings: Settings, t0: float
    ) -> Outcome:
        assert decision.job_id is not None
        job_id, exclude, attempt, reason = decision.job_id, list(decision.exclude), end.attempt, end.reason
        if self._cancelled_meanwhile(rd, job_id):  # scontrol requeue would bring a cancelled job back
            return self._skip(rd, end, policy.cancelled_decision(end, decision.progressed))
        if decision.slurm_requeued:  # preemption: a requeue or a resubmit now would run it twice
            return self._slurm_requeued(rd, end, decision, t0)
        if settings.mode is RequeueMode.REQUEUE:
            error, exclude_error = self._requeue(job_id, exclude, list(decision.release))
            by = Requeuer.HPCELASTIC
            if error is not None and self._already_pending(rd, job_id):
                error, by = None, Requeuer.SLURM
                exclude_error = exclude_error or "Slurm had already requeued the job"
            if error is None:
                return self._requeued(rd, end, decision, t0, by, exclude_error)
            rd.record(events.requeue_failed(error=error, fallback="resubmit", job_id=job_id, attempt=attempt))
            self.say(f"scontrol requeue {job_id} failed ({error}); resubmitting the batch script instead")
        if is_cancelled(rd):
            return self._skip(rd, end, policy.cancelled_decision(end, decision.progressed))
        new_id, error = self._resubmit(rd, job_id, exclude)
        if new_id is None:
            rd.record(
                events.requeue_failed(error=str(error), fallback="none", job_id=job_id, attempt=attempt)
            )
            rd.record(
                events.job_failed(exit_code=end.exit_code, reason=JobEnd.REQUEUE_FAILED, attempt=attempt)
            )
            msg = (
                f"could not bring the job back ({error}); the checkpoint is kept: resubmit by hand with "
                f"`sbatch --dependency=afterany:{job_id} {rd.script_path}`"
            )
            self.say(msg)
            return Outcome(Result.FAILED, reason, end.exit_code, attempt, None, job_id, msg)
        duration = round(time.monotonic() - t0, 4)
        record_job(new_id, rd.path)
        rd.record(
            events.resubmitted(
                job_id=new_id,
                previous_job_id=job_id,
                exclude=exclude,
                reason=reason,
                attempt=attempt + 1,
                duration_s=duration,
            )
        )
        msg = f"attempt {attempt} ended ({reason}); resubmitted as job {new_id} (attempt {attempt + 1})"
        self.say(msg + _nodes_note(exclude))
        return Outcome(
            Result.RESUBMITTED, reason, decision.exit_code, attempt, attempt + 1, new_id, msg, duration
        )

    def _unless_cancelled_meanwhile(self, rd: RunDir, outcome: Outcome) -> Outcome:
        """``outcome`` of a bring-back, unless the run was cancelled while Slurm queued the job again.

        Looked at after Slurm answered and the ``requeued``/``resubmitted`` event is written: a cancel
        that came earlier is seen here, and one that comes later finds the job in the event log.
        """
        if outcome.action not in (Result.REQUEUED, Result.RESUBMITTED) or not is_cancelled(rd):
            return outcome
        assert outcome.job_id is not None
        job_id = outcome.job_id
        _, error = self._retrying(lambda: slurm.cancel(job_id))
        # After the requeued/resubmitted event: status reads the cancel as the run's last word.
        rd.record(events.cancelled(job_id=job_id))
        msg = f"the run was cancelled while job {job_id} was queued again; " + (
            f"scancel {job_id}: {error} (its agents stop at start)" if error else f"cancelled job {job_id}"
        )
        self.say(msg)
        return replace(
            outcome, action=Result.SKIPPED, reason=JobEnd.CANCELLED, next_attempt=None, message=msg
        )

    def _slurm_requeued(self, rd: RunDir, end: AttemptEnd, decision: Decision, t0: float) -> Outcome:
        """Slurm has queued the job again itself: record it, exclude the bad nodes, submit nothing."""
        assert decision.job_id is not None
        job_id = decision.job_id
        _, exclude_error = self._retrying(
            lambda: slurm.exclude_nodes(job_id, list(decision.exclude), release=list(decision.release))
        )
        return self._requeued(rd, end, decision, t0, Requeuer.SLURM, exclude_error)

    def _requeued(
        self, rd: RunDir, end: AttemptEnd, decision: Decision, t0: float, by: Requeuer, note: str | None
    ) -> Outcome:
        """The job is pending again under its own id (queued by ``by``): the event, the line, the outcome."""
        assert decision.job_id is not None
        job_id, attempt, reason = decision.job_id, end.attempt, end.reason
        duration = round(time.monotonic() - t0, 4)
        hold = slurm.requeue_hold_s()
        rd.record(
            events.requeued(
                job_id=job_id,
                attempt=attempt + 1,
                reason=reason,
                exclude=decision.exclude,
                duration_s=duration,
                note=note,
                by=by,
                hold_s=hold,
            )
        )
        done = f"Slurm requeued job {job_id}" if by is Requeuer.SLURM else f"job {job_id} requeued"
        msg = f"attempt {attempt} ended ({reason}); {done} as attempt {attempt + 1} (Slurm holds it {hold} s)"
        self.say(msg + _nodes_note(decision.exclude))
        code = decision.exit_code
        return Outcome(Result.REQUEUED, reason, code, attempt, attempt + 1, job_id, msg, duration)

    def _already_decided(self, rd: RunDir, end: AttemptEnd) -> Outcome:
        reason: Reason | JobEnd = end.reason
        exit_code = end.exit_code
        ended = rd.events().last(events.ATTEMPT_ENDED, attempt=end.attempt)
        if ended is not None:
            reason = Reason.parse(ended.get("reason")) or reason
            exit_code = int(ended.get("exit_code", exit_code))
        return Outcome(
            Result.ALREADY_DECIDED,
            reason,
            exit_code,
            end.attempt,
            message=f"attempt {end.attempt} was already decided elsewhere",
        )

    def _retrying(self, action: Callable[[], T]) -> tuple[T | None, str | None]:
        """Run ``action``, retrying transient Slurm errors with backoff; returns (result, error)."""
        error = "not attempted"
        for delay in (0.0, *self.retry_delays_s):
            if delay:
                time.sleep(delay)
            try:
                return action(), None
            except SlurmError as e:
                error = str(e)
                if not e.transient:
                    break
                self.say(f"Slurm did not answer ({e}); retrying in a moment")
        return None, error

    def _requeue(self, job_id: str, exclude: list[str], release: list[str]) -> tuple[str | None, str | None]:
        """``scontrol requeue``, then ``scontrol update`` ExcNodeList; returns (error, exclude_error).

        Slurm refuses ExcNodeList on a running job ("Job is no longer pending execution"), so the
        bad nodes are excluded right after the requeue, while the job waits out its BeginTime
        and before it can start anywhere; nodes in ``release`` (cooldown over) leave the list. A
        failed exclusion does not undo the requeue; it is noted in the ``requeued`` event.
        """
        self._wait_for_dead_nodes(job_id, exclude)
        _, error = self._retrying(lambda: slurm.requeue(job_id))
        if error is not None:
            return error, None
        _, exclude_error = self._retrying(lambda: slurm.exclude_nodes(job_id, exclude, release=release))
        return None, exclude_error

    def _wait_for_dead_nodes(self, job_id: str, exclude: list[str]) -> None:
        """Before requeueing a job with GRES: wait until Slurm has marked its dead nodes DOWN.

        Slurm 22.05 corrupts the GRES record of a ``--no-kill`` job requeued while one of its nodes is dead
        but not yet DOWN: the next attempt's srun fails (``Invalid generic resource (gres)
        specification``) and GPUs stay allocated on idle nodes for every user (issue 18). Requeued once
        the node is DOWN, the job is clean. A node is dead when its slurmd does not answer; slurmctld
        notices within SlurmdTimeout, the longest wait (plus :data:`DOWN_WAIT_EXTRA_S`). The batch host is
        waited for like any other node (issue 31): a ``--no-kill`` job stays RUNNING without its batch
        script, and a requeue before its host is DOWN leaks that host's GPUs just the same.
        """
        try:
            job = slurm.show_job(job_id)
            if job.get("JobState") != "RUNNING" or not (job.get("TresPerNode") or job.get("TresPerJob")):
                return
            dead = [n for n in exclude if not slurm.node_is_down(n) and not slurm.slurmd_answers(n)]
            timeout = float((slurm.config_value("SlurmdTimeout") or "300").split()[0])
        except (SlurmError, ValueError):
            return
        if not dead:
            return
        self.say(f"waiting for Slurm to mark {','.join(dead)} DOWN before the requeue (its GPUs would leak)")
        deadline = time.monotonic() + timeout + DOWN_WAIT_EXTRA_S
        while dead and time.monotonic() < deadline:
            time.sleep(2.0)
            try:
                dead = [n for n in dead if not slurm.node_is_down(n) and not slurm.slurmd_answers(n)]
            except SlurmError:
                return

    def _cancelled_meanwhile(self, rd: RunDir, job_id: str) -> bool:
        """The run was cancelled, by ``hpcelastic cancel`` or a plain ``scancel`` Slurm is carrying out."""
        if is_cancelled(rd):
            return True
        try:
            info = slurm.job_info(job_id)
        except SlurmError:
            return False
        if slurm_ending(info, _attempt_restarts(rd, job_id)) is not Stop.CANCELLED:
            return False
        mark_cancelled(rd)
        rd.record(events.cancelled(job_id=job_id))
        return True

    def _already_pending(self, rd: RunDir, job_id: str) -> bool:
        """True when Slurm has requeued the job already (a lost reply, or preemption in REQUEUE mode)."""
        try:
            info = slurm.job_info(job_id)
        except SlurmError:
            return False
        if info.state in slurm.PENDING_AGAIN_STATES:
            return True
        return requeued_by_slurm(info, _attempt_restarts(rd, job_id))

    def _resubmit(self, rd: RunDir, job_id: str, exclude: list[str]) -> tuple[str | None, str | None]:
        """Submit ``<run>/job.sbatch`` again after ``job_id``; returns (new job id, error)."""
        if not rd.script_path.is_file():
            return None, f"the run has no batch script {rd.script_path} to resubmit"
        # The user's --sbatch-arg values went on the first sbatch's command line, not into
        # job.sbatch: pass them again, before ours so that ours (dependency, exclude) win.
        args = [str(a) for a in rd.read_meta().get("sbatch_args") or []]
        args.append(f"--dependency=afterany:{job_id}")
        if exclude:
            import hostlist  # python-hostlist; imported here to keep the CLI start-up lean

            args.append(f"--exclude={hostlist.collect_hostlist(exclude)}")
        if "_" in job_id:
            args.append(f"--array={job_id.split('_', 1)[1]}")
        env = slurm_env.outside_job(os.environ)
        cwd = _work_dir(rd, job_id)
        tried: list[bool] = []

        def submit_once() -> str:
            if tried:
                existing = slurm.dependent_job(job_id)
                if existing:
                    return existing
            tried.append(True)
            return slurm.sbatch(rd.script_path, args, env=env, cwd=cwd)

        return self._retrying(submit_once)


def _attempt_restarts(rd: RunDir, job_id: str) -> int | None:
    """The Slurm restart count of the attempt of ``job_id`` that the run is in (None: not that job)."""
    rec = handoff.load(rd)
    return rec.restart_count_slurm if rec.job_id == job_id else None


def _work_dir(rd: RunDir, job_id: str) -> str:
    """The original job's working directory (so relative paths in the script still resolve)."""
    try:
        work = slurm.job_info(job_id).work_dir
    except SlurmError:
        work = None
    meta = rd.read_meta()
    for candidate in (work, meta.get("cwd"), meta.get("workdir")):
        if candidate and Path(candidate).is_dir():
            return str(candidate)
    return str(rd.path)
