"""Thin, typed wrappers over Slurm's commands (sbatch, scontrol, squeue, scancel, sinfo): the one place
that runs them.

Each wrapper runs the real command, turns a failure into a :class:`SlurmError`
carrying Slurm's own message, and marks errors that are worth retrying
(slurmctld unreachable, socket time-outs) as ``transient``. Their output is parsed by
:mod:`hpcelastic.jobs.slurm_output`, which knows the formats of every release from 22.05 to 25.11.
"""

from __future__ import annotations

import datetime
import os
import re
import shutil
import signal
import socket
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hpcelastic.errors import SlurmError
from hpcelastic.jobs import slurm_output

DEFAULT_TIMEOUT_S = 60.0
#: One ``scontrol show -o`` line as a dict (the parser lives in :mod:`~hpcelastic.jobs.slurm_output`).
parse_scontrol_record = slurm_output.parse_record

_TRANSIENT_PATTERNS = (
    "unable to contact slurm controller",
    "socket timed out",
    "connection refused",
    "slurm_persist_conn",
    "communication connection failure",
    "resource temporarily unavailable",
    "slurmctld not responding",
    "zero bytes were transmitted or received",
    "timed out",
)


#: Job states after which a job id does not run again (a requeued job goes back to PENDING instead).
ENDED_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)
#: Job states of a job that Slurm has queued again (after a requeue).
PENDING_AGAIN_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"})


def run_slurm(
    argv: Sequence[str],
    *,
    input_text: str | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    cwd: str | os.PathLike[str] | None = None,
) -> str:
    """Run one Slurm command and return its stdout; raise :class:`SlurmError` on failure."""
    if shutil.which(argv[0]) is None:
        raise SlurmError(f"'{argv[0]}' was not found on PATH: is Slurm installed on this host?")
    # Slurm signals every process of a job it requeues or cancels, this command included when
    # the job requeues itself (scontrol requeue, then scontrol update). SIGTERM is blocked in
    # the child (a blocked mask survives exec), so the follow-up command is not killed halfway.
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE if input_text is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(env) if env is not None else None,
            cwd=cwd,
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    try:
        stdout, stderr = proc.communicate(input_text, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise SlurmError(f"'{argv[0]}' did not answer within {timeout:.0f} s", transient=True) from None
    if proc.returncode != 0:
        # The last line that says something (not getopt's 'Try "scontrol --help" ...' hint).
        msg = [line for line in (stderr or stdout).strip().splitlines() if not line.startswith("Try ")]
        text = msg[-1] if msg else f"exit code {proc.returncode}"
        text = re.sub(r"^(sbatch|scontrol|squeue|scancel|srun): error: ", "", text)
        transient = any(p in text.lower() for p in _TRANSIENT_PATTERNS)
        raise SlurmError(f"{argv[0]} failed: {text}", transient=transient)
    return stdout


def sbatch(
    script: str | os.PathLike[str],
    extra_args: Sequence[str] = (),
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> str:
    """Submit the batch script file ``script`` with ``sbatch --parsable`` and return the job id."""
    out = run_slurm(["sbatch", "--parsable", *extra_args, str(script)], env=env, cwd=cwd)
    first = out.strip().splitlines()[-1] if out.strip() else ""
    job_id = first.split(";", 1)[0].strip()
    if not re.fullmatch(r"\d+(_\d+)?", job_id):
        raise SlurmError(f"sbatch printed no job id (output: {out.strip()!r})")
    return job_id


def jobs_running_script(script: str | os.PathLike[str]) -> list[str]:
    """Ids of the jobs Slurm knows (pending or running) whose batch script is the file ``script``."""
    out = run_slurm(["squeue", "-h", "-o", "%i|%o"])
    wanted = str(script)
    return [jid for jid, command in slurm_output.parse_rows(out, 2) if command == wanted]


#: Whether an scontrol (by its path) has ``--json`` (24.11 does, 22.05 not); learnt from its first call.
_scontrol_json: dict[str | None, bool] = {}


def show_job(job_id: str) -> dict[str, str]:
    """``scontrol show job <id>`` as a dict with the text record's keys (the first record, for arrays the
    task itself): from ``scontrol --json`` where the release has it, else from ``-o`` (see
    :mod:`~hpcelastic.jobs.slurm_output`)."""
    records: list[dict[str, str]] = []
    scontrol = shutil.which("scontrol")
    if _scontrol_json.get(scontrol, True):
        try:
            out = run_slurm(["scontrol", "--json", "show", "job", str(job_id)])
            records = slurm_output.job_records_from_json(out)
            _scontrol_json[scontrol] = True
        except SlurmError as e:
            if "unrecognized option" not in str(e) and "invalid option" not in str(e):
                raise
            _scontrol_json[scontrol] = False
        except ValueError:
            records = []  # JSON this parser does not know: the text output says the same
    if not records:
        records = slurm_output.parse_records(run_slurm(["scontrol", "show", "job", "-o", str(job_id)]))
    if not records:
        raise SlurmError(f"scontrol knows no job {job_id}")
    return records[0]


def parse_time(value: str | None) -> float | None:
    """A Slurm time stamp (``2026-01-02T03:04:05``, local time) as epoch seconds; None when unset."""
    if not value or value in slurm_output.UNSET_TIMES:
        return None
    try:
        return datetime.datetime.strptime(value, slurm_output.TIME_FORMAT).timestamp()
    except ValueError:
        return None


@dataclass(frozen=True)
class JobInfo:
    """The facts of ``scontrol show job`` that hpcelastic uses."""

    state: str
    restarts: int | None
    end_time: float | None
    preempt_time: float | None
    work_dir: str | None
    start_time: float | None = None
    #: TimeLimit in seconds; None when UNLIMITED or unknown.
    time_limit_s: int | None = None
    #: Slurm's Reason field (``None``, ``NodeDown``, ...).
    reason: str = ""
    #: ``ExitCode`` as (status, signal); a node failure is ``0:0`` up to 23.11, ``0:1`` from 24.11.
    exit_code: tuple[int, int] | None = None
    #: When a pending job may start (a requeued one: cred_expire + 1 s after it stopped).
    eligible_time: float | None = None
    #: Whether Slurm may requeue the job (``Requeue=1``); None when not shown.
    requeue: bool | None = None
    partition: str = ""


def parse_limit(value: str | None) -> int | None:
    """A ``TimeLimit`` (``1-02:03:04``, ``10:00``) in seconds; None for UNLIMITED or anything unknown."""
    from hpcelastic.parse import parse_time as parse_duration

    try:
        return parse_duration(value) if value else None
    except ValueError:
        return None


def job_info(job_id: str) -> JobInfo:
    """One ``scontrol show job``, typed; raises :class:`SlurmError` when Slurm cannot tell."""
    return job_info_from(show_job(job_id))


def job_info_from(rec: Mapping[str, str]) -> JobInfo:
    """:class:`JobInfo` from one parsed ``scontrol show job`` record."""
    restarts = rec.get("Restarts", "")
    return JobInfo(
        state=rec.get("JobState", ""),
        restarts=int(restarts) if restarts.isdigit() else None,
        end_time=parse_time(rec.get("EndTime")),
        preempt_time=parse_time(rec.get("PreemptTime")),
        work_dir=rec.get("WorkDir") or None,
        start_time=parse_time(rec.get("StartTime")),
        time_limit_s=parse_limit(rec.get("TimeLimit")),
        reason=rec.get("Reason", ""),
        exit_code=slurm_output.parse_exit_code(rec.get("ExitCode")),
        eligible_time=parse_time(rec.get("EligibleTime")),
        requeue={"1": True, "0": False}.get(rec.get("Requeue", "")),
        partition=rec.get("Partition", "").split(",")[0],
    )


def dependent_job(job_id: str) -> str | None:
    """A pending job of ours waiting on ``job_id`` (``afterany``), e.g. an sbatch whose reply was lost."""
    try:
        out = run_slurm(["squeue", "--me", "-h", "-t", "PENDING", "-o", "%i|%E"], timeout=15)
    except SlurmError:
        return None
    for jid, deps in slurm_output.parse_rows(out, 2):
        if re.search(rf"afterany:{re.escape(job_id)}(\(|,|$)", deps):
            return jid.strip()
    return None


def set_requeue(job_id: str, requeue: bool) -> None:
    """``scontrol update JobId=<id> Requeue=0|1``: whether Slurm may requeue the job."""
    run_slurm(["scontrol", "update", f"JobId={job_id}", f"Requeue={int(requeue)}"])


def requeue(job_id: str) -> None:
    """``scontrol requeue <id>``: the job keeps its id and becomes pending again."""
    run_slurm(["scontrol", "requeue", str(job_id)])


def show_node(node: str) -> dict[str, str]:
    """``scontrol show node -o <node>`` as a dict."""
    records = slurm_output.parse_records(run_slurm(["scontrol", "show", "node", "-o", node]))
    if not records:
        raise SlurmError(f"scontrol knows no node {node}")
    return records[0]


def slurmd_answers(node: str, timeout: float = 2.0) -> bool:
    """Whether ``node``'s slurmd accepts a connection at its NodeAddr and Port now (slurmctld's own
    view of a dead node lags by up to SlurmdTimeout)."""
    rec = show_node(node)
    try:
        port = int(rec.get("Port") or 0) or int(config_value("SlurmdPort") or 6818)
        socket.create_connection((rec.get("NodeAddr") or node, port), timeout=timeout).close()
    except (OSError, ValueError):
        return False
    return True


def node_is_down(node: str) -> bool:
    """Slurm has marked ``node`` DOWN or FAILED (``NOT_RESPONDING`` alone comes earlier, before
    slurmctld acts on the node's jobs)."""
    state = show_node(node).get("State", "").upper()
    return "DOWN" in state or "FAIL" in state


def partition_node_states(partition: str) -> dict[str, str]:
    """Each node of ``partition`` and its short state as ``sinfo`` prints it (``idle``, ``down*``)."""
    out = run_slurm(["sinfo", "-h", "-N", "-p", partition, "-o", "%N|%t"])
    return {name: state for name, state in slurm_output.parse_rows(out, 2) if name}


def config_value(key: str) -> str | None:
    """One value of ``scontrol show config`` (``SlurmdTimeout`` -> ``60 sec``), None when absent."""
    return slurm_output.config_values(run_slurm(["scontrol", "show", "config"]), [key]).get(key)


def preempt_mode(partition: str) -> str:
    """The PreemptMode of ``partition`` (``REQUEUE``, ``CANCEL``, ``OFF``...), the cluster's where the
    partition sets none; empty when Slurm cannot say."""
    try:
        records = slurm_output.parse_records(run_slurm(["scontrol", "show", "partition", "-o", partition]))
    except SlurmError:
        return ""
    return records[0].get("PreemptMode", "") if records else ""


#: The first release with the expedited requeue (``sbatch --requeue=expedite``).
EXPEDITE_RELEASE = (25, 11)


def expedited_requeue() -> bool:
    """Whether this cluster's Slurm requeues ``--requeue=expedite`` jobs expedited: 25.11 or later, with
    ``enable_expedited_requeue`` in SlurmctldParameters (or SchedulerParameters, as some sites set it)."""
    found = release()
    if found is None or found < EXPEDITE_RELEASE:
        return False
    try:
        text = run_slurm(["scontrol", "show", "config"])
    except SlurmError:
        return False
    params = slurm_output.config_values(text, ["SlurmctldParameters", "SchedulerParameters"])
    return any("enable_expedited_requeue" in v for v in params.values())


def release() -> tuple[int, int] | None:
    """The Slurm release of this host's commands as ``(year, month)`` (``sbatch --version``); None when
    it cannot be told."""
    try:
        return slurm_output.parse_release(run_slurm(["sbatch", "--version"], timeout=15))
    except SlurmError:
        return None


def requeue_hold_s() -> int:
    """How long Slurm holds a job it requeued before it may start again: ``AuthInfo``'s cred_expire + 1 s
    (the job's old credentials must expire first; default 121 s). Nothing inside the job can shorten it:
    a BeginTime set while the job completes is reset when it has (22.05 and 24.11, measured)."""
    try:
        return slurm_output.cred_expire_s(config_value("AuthInfo")) + 1
    except SlurmError:
        return slurm_output.DEFAULT_CRED_EXPIRE_S + 1


def exclude_nodes(job_id: str, nodes: Sequence[str], *, release: Sequence[str] = ()) -> None:
    """Add ``nodes`` to the job's excluded nodes and take ``release`` off (keeps the others)."""
    if not nodes and not release:
        return
    import hostlist  # python-hostlist; imported here to keep the CLI start-up lean

    current = show_job(job_id).get("ExcNodeList", "(null)")
    names = [] if current in ("", "(null)") else hostlist.expand_hostlist(current)
    kept = [n for n in names if n not in release]
    kept += [n for n in nodes if n not in kept]
    if kept == names:
        return
    run_slurm(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={hostlist.collect_hostlist(kept)}"])


def cancel(job_id: str, *, signal: str | None = None, batch: bool = False) -> None:
    """``scancel`` the job, or send it ``signal`` (only the batch shell with ``batch``)."""
    argv = ["scancel"]
    if signal:
        argv.append(f"--signal={signal}")
    if batch:
        argv.append("--batch")
    argv.append(str(job_id))
    run_slurm(argv)


@dataclass(frozen=True)
class JobState:
    """One row of ``squeue``: the job's state, the reason it is pending and its nodes."""

    job_id: str
    state: str
    reason: str
    nodes: str


def query_states(job_ids: Sequence[str]) -> dict[str, JobState]:
    """States of ``job_ids`` with one ``squeue`` call (finished jobs still known to slurmctld included).

    Jobs that slurmctld no longer knows are simply absent from the result. The id of a job array
    with one task (what sbatch printed) gets that task's row (squeue lists only ``A_T``).
    """
    if not job_ids:
        return {}
    try:
        out = run_slurm(
            ["squeue", "-h", "-r", "-t", "all", "-j", ",".join(job_ids), "-o", "%i|%T|%r|%N"],
            timeout=30,
        )
    except SlurmError as e:
        if "invalid job id" in str(e).lower():
            return {}
        raise
    states = {row[0]: JobState(*row) for row in slurm_output.parse_rows(out, 4)}
    for jid in job_ids:
        tasks = [state for key, state in states.items() if key.startswith(f"{jid}_")]
        if jid not in states and len(tasks) == 1:
            states[jid] = tasks[0]
    return states


def cluster_name(slurm_conf: str | os.PathLike[str] | None = None) -> str | None:
    """The cluster's ``ClusterName`` read from slurm.conf (no RPC), or None if not found."""
    path = Path(slurm_conf or os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf"))
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    m = re.search(r"^\s*ClusterName\s*=\s*(\S+)", text, re.MULTILINE | re.IGNORECASE)
    return m.group(1) if m else None
