"""The requeue policy: after an attempt ends, bring the job back as a new attempt, or say why not.

One decision per attempt (``RunDir.claim_once``), taken by the group-rank-0 agent or, when no agent
could, by ``hpcelastic finalize`` in the batch script. ``requeue`` mode keeps the job id
(``scontrol update`` ExcNodeList, then ``scontrol requeue``); ``resubmit`` mode, and the fallback when
requeue is impossible, submits ``<run>/job.sbatch`` again with ``--dependency=afterany:<job>`` and
the bad nodes in ``--exclude``. Every step is an event in the run directory and a line on stderr.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from hpcelastic import handoff
from hpcelastic.errors import (
    EXIT_COORDINATOR_LOST,
    EXIT_NODE_UNHEALTHY,
    EXIT_OK,
    EXIT_RESTARTS_EXHAUSTED,
    EXIT_STARTUP_FAILURE,
    EXIT_STOPPED_FOR_REQUEUE,
    EXIT_TOO_FEW_NODES,
    SlurmError,
    UserError,
)
from hpcelastic.jobs import slurm
from hpcelastic.rundir import RunDir
from hpcelastic.runindex import record_job

MODES = ("requeue", "resubmit")
DEFAULT_MODE = "requeue"
DEFAULT_MAX_REQUEUES = 3
DEFAULT_RETRY_DELAYS_S = (0.5, 1.0, 2.0, 4.0)
TIME_LIMIT_WINDOW_S = 300.0
MAX_STOPS_WITHOUT_CHECKPOINT = 3

EXIT_CODES: dict[str, int] = {
    "succeeded": EXIT_OK,
    "restarts_exhausted": EXIT_RESTARTS_EXHAUSTED,
    "too_few_nodes": EXIT_TOO_FEW_NODES,
    "preempted": EXIT_STOPPED_FOR_REQUEUE,
    "time_limit": EXIT_STOPPED_FOR_REQUEUE,
    "node_unhealthy": EXIT_NODE_UNHEALTHY,
    "coordinator_lost": EXIT_COORDINATOR_LOST,
    "startup_failure": EXIT_STARTUP_FAILURE,
}
REASONS = tuple(EXIT_CODES)
STOP_REASONS = ("preempted", "time_limit")
_PENDING_AGAIN = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED")
_CANCEL_CLAIM = "cancelled"


@dataclass(frozen=True)
class RequeueOutcome:
    """What :meth:`RequeuePolicy.decide` did.

    ``action`` is ``requeued`` / ``resubmitted`` (the job comes back as ``next_attempt`` under
    ``job_id``), ``skipped`` (not requeued; ``message`` says why), ``not_needed`` (succeeded),
    ``failed`` (requeue and resubmit both failed) or ``already_decided`` (another process decided
    this attempt). ``exit_code`` is what the caller should exit with.
    """

    action: str
    reason: str
    exit_code: int
    attempt: int
    next_attempt: int | None = None
    job_id: str | None = None
    message: str = ""
    duration_s: float | None = None

    @property
    def comes_back(self) -> bool:
        """True when a new attempt of the job is queued."""
        return self.action in ("requeued", "resubmitted")


def stops_without_checkpoint(events: Sequence[Mapping[str, Any]], attempt: int, reason: str) -> int:
    """How many attempts in a row, ending with ``attempt``, were stopped before publishing a checkpoint.

    Preemption and time-limit requeues have no budget (a long job needs many), so this is what
    stops a job whose time limit is shorter than its start-up plus the signal lead from being
    requeued forever without progress.
    """
    ended = {e.get("attempt"): e.get("reason") for e in events if e.get("event") == "attempt_ended"}
    ended[attempt] = reason
    published = {e.get("attempt") for e in events if e.get("event") == "checkpoint_published"}
    count = 0
    for k in range(attempt, -1, -1):
        if ended.get(k) not in STOP_REASONS or k in published:
            break
        count += 1
    return count


def current_job_id(env: Mapping[str, str] | None = None) -> str | None:
    """The Slurm id to requeue: ``<array job>_<task>`` for an array task, else ``SLURM_JOB_ID``."""
    env = os.environ if env is None else env
    array_job, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array_job and task:
        return f"{array_job}_{task}"
    return env.get("SLURM_JOB_ID") or None


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


def mark_cancelled(run_dir: RunDir) -> None:
    """Record that the user cancelled the run, so that no decision requeues it afterwards."""
    run_dir.claim_once(_CANCEL_CLAIM)


def is_cancelled(run_dir: RunDir) -> bool:
    """True once ``hpcelastic cancel`` ran for this run."""
    return (run_dir.path / "claims" / _CANCEL_CLAIM).exists()


def _parse_slurm_time(value: str | None) -> float | None:
    if not value or value in ("Unknown", "None", "(null)"):
        return None
    try:
        return datetime.strptime(value, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


def classify_stop_signal(
    job_id: str, *, now: float | None = None, window_s: float = TIME_LIMIT_WINDOW_S
) -> str:
    """``"time_limit"`` when the job is within ``window_s`` of its EndTime, else ``"preempted"``.

    One ``scontrol show job``. A job with a PreemptTime is preempted whatever its EndTime (Slurm
    moves EndTime to the end of the grace time on preemption). When Slurm cannot be asked,
    ``"preempted"``: both requeue, they only count against different budgets.
    """
    try:
        info = slurm.show_job(job_id)
    except SlurmError:
        return "preempted"
    if _parse_slurm_time(info.get("PreemptTime")) is not None:
        return "preempted"
    end = _parse_slurm_time(info.get("EndTime"))
    now = time.time() if now is None else now
    return "time_limit" if end is not None and end - now <= window_s else "preempted"


@contextlib.contextmanager
def _term_deferred() -> Iterator[None]:
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


def _say(message: str) -> None:
    print(f"hpcelastic: {message}", file=sys.stderr, flush=True)


class RequeuePolicy:
    """How a run comes back after an attempt ends (see the module docstring)."""

    def __init__(
        self,
        mode: str = DEFAULT_MODE,
        max_requeues: int = DEFAULT_MAX_REQUEUES,
        *,
        retry_delays_s: Sequence[float] = DEFAULT_RETRY_DELAYS_S,
        say: Callable[[str], None] = _say,
    ) -> None:
        if mode not in MODES:
            raise UserError(f"unknown requeue mode {mode!r}; use one of: {', '.join(MODES)}")
        if max_requeues < 0:
            raise UserError(f"--max-requeues must be 0 or more, not {max_requeues}")
        self.mode = mode
        self.max_requeues = max_requeues
        self.retry_delays_s = tuple(retry_delays_s)
        self.say = say

    # -- the decision --------------------------------------------------------------------------

    def decide(
        self,
        run_dir: RunDir | str | os.PathLike[str],
        attempt: int,
        reason: str,
        exit_code: int,
        bad_nodes: Sequence[str],
        job_id: str | None,
        root_cause: Mapping[str, Any] | None = None,
        *,
        progressed: bool = False,
    ) -> RequeueOutcome:
        """Record how ``attempt`` ended and requeue, resubmit or stop; at most once per attempt.

        ``progressed`` tells that workers reported step progress (heartbeats) in this attempt; a
        checkpoint published in this attempt counts as progress too.
        """
        if reason not in EXIT_CODES:
            raise ValueError(f"unknown attempt end reason {reason!r}; expected one of {REASONS}")
        t0 = time.monotonic()
        rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
        with _term_deferred():
            if not rd.claim_once(f"decide-attempt-{attempt}"):
                return self._already_decided(rd, attempt, reason, exit_code)
            return self._decide_claimed(
                rd, attempt, reason, exit_code, bad_nodes, job_id, root_cause, progressed, t0
            )

    def _decide_claimed(
        self,
        rd: RunDir,
        attempt: int,
        reason: str,
        exit_code: int,
        bad_nodes: Sequence[str],
        job_id: str | None,
        root_cause: Mapping[str, Any] | None,
        progressed: bool,
        t0: float,
    ) -> RequeueOutcome:
        events = rd.events()
        signature = root_cause_signature(root_cause)
        progressed = progressed or any(
            e.get("event") == "checkpoint_published" and e.get("attempt") == attempt for e in events
        )
        previous = next(
            (
                e
                for e in reversed(events)
                if e.get("event") == "attempt_ended" and e.get("attempt") == attempt - 1
            ),
            None,
        )
        handoff.record_attempt_end(rd, attempt, reason, exit_code, signature=signature, progressed=progressed)

        if reason == "succeeded":
            rd.append_event("job_succeeded", exit_code=EXIT_OK, reason=reason, attempt=attempt)
            return RequeueOutcome("not_needed", reason, EXIT_OK, attempt, message="the job succeeded")
        if is_cancelled(rd):
            return self._skip(
                rd, attempt, "cancelled", exit_code, "cancelled", "the run was cancelled by the user"
            )
        repeated = (
            signature is not None
            and previous is not None
            and previous.get("signature") == signature
            and not previous.get("progressed")
            and not progressed
        )
        if reason == "startup_failure" or repeated:
            return self._skip(
                rd,
                attempt,
                "startup_failure",
                EXIT_STARTUP_FAILURE,
                "startup_failure",
                f"attempt {attempt} failed at start-up exactly like attempt {attempt - 1} (same root cause, "
                "no progress); not requeued: fix the script, then `hpcelastic submit` again",
            )
        if not job_id:
            return self._skip(
                rd,
                attempt,
                reason,
                exit_code,
                "no_slurm_job",
                "not running under Slurm (no job id): nothing to requeue",
            )
        stalled = stops_without_checkpoint(events, attempt, reason)
        if stalled >= MAX_STOPS_WITHOUT_CHECKPOINT:
            return self._skip(
                rd,
                attempt,
                reason,
                exit_code,
                "no_progress",
                f"the job was stopped ({reason}) {stalled} attempts in a row before it published a "
                "checkpoint; not requeued: give it a longer --time or a shorter --signal lead",
            )
        rec = handoff.load(rd)
        if reason not in STOP_REASONS:
            used = rec.requeues.get("failure", 0) + rec.requeues.get("node_unhealthy", 0)
            if used >= self.max_requeues:
                return self._skip(
                    rd,
                    attempt,
                    reason,
                    exit_code,
                    "limit_reached",
                    f"requeue limit reached ({used} of --max-requeues {self.max_requeues} used); "
                    "not requeued: raise --max-requeues to allow more",
                )
        exclude = list(dict.fromkeys([*rec.bad_nodes, *sorted(set(bad_nodes))]))
        return self._bring_back(rd, rec, attempt, reason, exit_code, str(job_id), exclude, t0)

    # -- actions --------------------------------------------------------------------------------

    def _bring_back(
        self,
        rd: RunDir,
        rec: handoff.HandoffRecord,
        attempt: int,
        reason: str,
        exit_code: int,
        job_id: str,
        exclude: list[str],
        t0: float,
    ) -> RequeueOutcome:
        outcome_code = EXIT_STOPPED_FOR_REQUEUE if reason in STOP_REASONS else exit_code
        if self.mode == "requeue":
            error, exclude_error = self._requeue(job_id, exclude)
            if error is not None and self._already_pending(job_id, rec):
                error = None
                exclude_error = exclude_error or "Slurm had already requeued the job"
            if error is None:
                duration = round(time.monotonic() - t0, 4)
                handoff.count_requeue(rd, reason, exclude)
                rd.append_event(
                    "requeued",
                    job_id=job_id,
                    attempt=attempt + 1,
                    reason=reason,
                    exclude=exclude,
                    duration_s=duration,
                    note=exclude_error,
                )
                msg = f"attempt {attempt} ended ({reason}); job {job_id} requeued as attempt {attempt + 1}"
                self.say(msg + (f" excluding {','.join(exclude)}" if exclude else ""))
                return RequeueOutcome(
                    "requeued", reason, outcome_code, attempt, attempt + 1, job_id, msg, duration
                )
            rd.append_event(
                "requeue_failed", error=error, fallback="resubmit", job_id=job_id, attempt=attempt
            )
            self.say(f"scontrol requeue {job_id} failed ({error}); resubmitting the batch script instead")
        if is_cancelled(rd):
            return self._skip(
                rd, attempt, "cancelled", exit_code, "cancelled", "the run was cancelled by the user"
            )
        new_id, error = self._resubmit(rd, job_id, exclude)
        if new_id is None:
            rd.append_event("requeue_failed", error=error, fallback="none", job_id=job_id, attempt=attempt)
            rd.append_event("job_failed", exit_code=exit_code, reason="requeue_failed", attempt=attempt)
            msg = (
                f"could not bring the job back ({error}); the checkpoint is kept: resubmit by hand with "
                f"`sbatch --dependency=afterany:{job_id} {rd.script_path}`"
            )
            self.say(msg)
            return RequeueOutcome("failed", reason, exit_code, attempt, None, job_id, msg)
        duration = round(time.monotonic() - t0, 4)
        handoff.count_requeue(rd, reason, exclude)
        record_job(new_id, rd.path)
        rd.append_event(
            "resubmitted",
            job_id=new_id,
            previous_job_id=job_id,
            dependency=f"afterany:{job_id}",
            exclude=exclude,
            reason=reason,
            attempt=attempt + 1,
            duration_s=duration,
        )
        msg = f"attempt {attempt} ended ({reason}); resubmitted as job {new_id} (attempt {attempt + 1})"
        self.say(msg + (f" excluding {','.join(exclude)}" if exclude else ""))
        return RequeueOutcome(
            "resubmitted", reason, outcome_code, attempt, attempt + 1, new_id, msg, duration
        )

    def _skip(
        self, rd: RunDir, attempt: int, reason: str, exit_code: int, why: str, message: str
    ) -> RequeueOutcome:
        rd.append_event("requeue_skipped", reason=why, attempt=attempt, detail=message)
        rd.append_event("job_failed", exit_code=exit_code, reason=reason, attempt=attempt)
        self.say(message)
        return RequeueOutcome("skipped", reason, exit_code, attempt, message=message)

    def _already_decided(self, rd: RunDir, attempt: int, reason: str, exit_code: int) -> RequeueOutcome:
        for ev in reversed(rd.events()):
            if ev.get("event") == "attempt_ended" and ev.get("attempt") == attempt:
                reason, exit_code = str(ev.get("reason")), int(ev.get("exit_code", exit_code))
                break
        return RequeueOutcome(
            "already_decided",
            reason,
            exit_code,
            attempt,
            message=f"attempt {attempt} was already decided elsewhere",
        )

    def _retrying(self, action: Callable[[], Any]) -> tuple[Any, str | None]:
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

    def _requeue(self, job_id: str, exclude: list[str]) -> tuple[str | None, str | None]:
        """``scontrol requeue``, then ``scontrol update`` ExcNodeList; returns (error, exclude_error).

        Slurm refuses ExcNodeList on a running job ("Job is no longer pending execution"), so the
        bad nodes are excluded right after the requeue, while the job waits out its BeginTime
        and before it can start anywhere. A failed exclusion does not undo the requeue; it is
        noted in the ``requeued`` event.
        """
        _, error = self._retrying(lambda: slurm.requeue(job_id))
        if error is not None:
            return error, None
        _, exclude_error = self._retrying(lambda: slurm.exclude_nodes(job_id, exclude))
        return None, exclude_error

    def _already_pending(self, job_id: str, rec: handoff.HandoffRecord) -> bool:
        """True when Slurm has requeued the job already (a lost reply, or preemption in REQUEUE mode)."""
        try:
            info = slurm.show_job(job_id)
        except SlurmError:
            return False
        if info.get("JobState") in _PENDING_AGAIN:
            return True
        restarts = info.get("Restarts", "")
        known = rec.restart_count_slurm if rec.job_id == job_id else None
        return restarts.isdigit() and known is not None and int(restarts) > known

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
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
        cwd = _work_dir(rd, job_id)
        tried: list[bool] = []

        def submit_once() -> str:
            if tried:
                existing = _dependent_job(job_id)
                if existing:
                    return existing
            tried.append(True)
            return slurm.sbatch(rd.script_path, args, env=env, cwd=cwd)

        return self._retrying(submit_once)


def _work_dir(rd: RunDir, job_id: str) -> str:
    """The original job's working directory (so relative paths in the script still resolve)."""
    try:
        work = slurm.show_job(job_id).get("WorkDir")
    except SlurmError:
        work = None
    meta = rd.read_meta()
    for candidate in (work, meta.get("cwd"), meta.get("workdir")):
        if candidate and Path(candidate).is_dir():
            return str(candidate)
    return str(rd.path)


def _dependent_job(job_id: str) -> str | None:
    """A job of ours already waiting on ``job_id`` (an earlier sbatch whose reply was lost), or None."""
    try:
        out = slurm.run_slurm(["squeue", "--me", "-h", "-t", "PENDING", "-o", "%i|%E"], timeout=15)
    except SlurmError:
        return None
    for line in out.splitlines():
        jid, _, deps = line.partition("|")
        if re.search(rf"afterany:{re.escape(job_id)}(\(|,|$)", deps):
            return jid.strip()
    return None
