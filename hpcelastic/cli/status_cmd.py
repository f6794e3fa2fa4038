"""``hpcelastic status``, ``logs``, ``cancel`` and the hidden ``finalize`` (run by the batch script)."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import click

from hpcelastic.errors import UserError
from hpcelastic.rundir import RunDir

_JOB_ID = re.compile(r"\d+(_\d+)?")
FOLLOW_POLL_S = 0.5


def resolve_run(target: str | None) -> RunDir:
    """A run directory from a path, a Slurm job id (via the run index) or, if None, the latest run."""
    from hpcelastic.record import runindex

    if target is None:
        latest = runindex.latest_run()
        if latest is None:
            raise UserError("no run given and none recorded yet; pass a run directory or a job id")
        return RunDir.open(latest)
    if Path(target).exists():
        return RunDir.open(target)
    if _JOB_ID.fullmatch(target):
        found = runindex.lookup(target)
        if found is None:
            raise UserError(
                f"job {target} is not in the run index {runindex.index_path()}; "
                "pass its run directory instead"
            )
        return RunDir.open(found)
    raise UserError(f"{target}: no such run directory, and not a Slurm job id")


@click.command("status")
@click.argument("target", required=False, metavar="[RUN_DIR|JOB_ID]")
@click.option("--json", "as_json", is_flag=True, help="Print the same data as JSON.")
def status(target: str | None, as_json: bool) -> None:
    """Show what happened to a run: attempts, failures, requeues, checkpoints, Slurm state."""
    from hpcelastic.record.status import build_status, render_text

    st = build_status(resolve_run(target))
    if as_json:
        click.echo(json.dumps(st.to_json(), indent=2, default=str))
        return
    click.echo(render_text(st))
    if st.damaged_events:
        click.echo(
            f"hpcelastic: warning: skipped {st.damaged_events} damaged line(s) of "
            f"{Path(st.run_dir) / 'events.jsonl'} (not event objects); the timeline shows the rest",
            err=True,
        )
    if st.slurm_error:
        click.echo(
            f"hpcelastic: warning: could not ask Slurm ({st.slurm_error}); the timeline is still complete",
            err=True,
        )


def _attempts_with_logs(rd: RunDir) -> list[int]:
    found = []
    for d in rd.logs_path.glob("attempt-*"):
        suffix = d.name.split("-", 1)[1]
        if d.is_dir() and suffix.isdigit():
            found.append(int(suffix))
    return sorted(found)


def _ranks_with_logs(attempt_dir: Path, group: int | None) -> list[int]:
    """The ranks (of replica group ``group``, when given) with a log in the attempt's directory."""
    ranks = []
    tail = ".log" if group is None else f"-g{group}.log"
    for f in attempt_dir.glob(f"rank-*{tail}"):
        middle = f.name[len("rank-") : -len(tail)]
        if middle.isdigit():
            ranks.append(int(middle))
    return sorted(ranks)


def _groups_with_logs(attempt_dir: Path) -> list[int]:
    found = {f.name.rsplit("-g", 1)[1][: -len(".log")] for f in attempt_dir.glob("rank-*-g*.log")}
    return sorted(int(g) for g in found if g.isdigit())


def _log_file(rd: RunDir, rank: int, attempt: int | None, group: int | None = None) -> tuple[Path, int]:
    attempts = _attempts_with_logs(rd)
    if not attempts:
        raise UserError(
            f"no worker logs yet in {rd.logs_path}; the job may still be pending: "
            f"see `hpcelastic status {rd.path}`"
        )
    if attempt is None:
        attempt = attempts[-1]
    elif attempt not in attempts:
        raise UserError(
            f"no logs for attempt {attempt} in {rd.path}; attempts with logs: {_numbers(attempts)}"
        )
    attempt_dir = rd.logs_path / f"attempt-{attempt}"
    groups = _groups_with_logs(attempt_dir)
    if group is None and groups and not _ranks_with_logs(attempt_dir, None):
        raise UserError(
            f"attempt {attempt} of {rd.path} ran torchft replica groups: name one with --group "
            f"(groups with logs: {_numbers(groups)})"
        )
    ranks = _ranks_with_logs(attempt_dir, group)
    where = f"rank {rank}" + (f" of replica group {group}" if group is not None else "")
    if rank not in ranks:
        raise UserError(
            f"no log for {where} in attempt {attempt} of {rd.path}; "
            f"ranks with logs: {_numbers(ranks) or 'none'}"
        )
    return rd.rank_log_path(attempt, rank, -1 if group is None else group), attempt


def _numbers(values: list[int]) -> str:
    return ", ".join(str(v) for v in values)


def _attempt_over(rd: RunDir, attempt: int) -> str | None:
    """Why following the log of ``attempt`` should stop (it or the whole run ended), or None."""
    from hpcelastic import events

    log = rd.events()
    ended = log.last(events.ATTEMPT_ENDED, attempt=attempt)
    run_end = log.last(events.JOB_SUCCEEDED, events.JOB_FAILED, events.CANCELLED)
    if run_end is not None and (ended is None or run_end.get("ts", 0) > ended.get("ts", 0)):
        return f"the run ended ({run_end['event']})"
    return None if ended is None else f"attempt {attempt} ended ({ended.get('reason')})"


def _follow(rd: RunDir, path: Path, attempt: int) -> None:
    """Print the file, then what is appended, until the attempt or the run ends (or Ctrl-C)."""
    out = sys.stdout.buffer
    last_check = 0.0
    with open(path, "rb") as f:
        try:
            while True:
                chunk = f.read(1 << 16)
                if chunk:
                    out.write(chunk)
                    out.flush()
                    continue
                now = time.monotonic()
                if now - last_check >= 2.0:
                    last_check = now
                    over = _attempt_over(rd, attempt)
                    if over:
                        out.write(f.read())
                        out.flush()
                        click.echo(f"hpcelastic: {over}; see `hpcelastic status {rd.path}`", err=True)
                        return
                time.sleep(FOLLOW_POLL_S)
        except KeyboardInterrupt:
            return


@click.command("logs")
@click.argument("run", metavar="RUN_DIR|JOB_ID")
@click.option("--rank", type=click.IntRange(min=0), default=0, show_default=True, help="Global rank.")
@click.option("--group", type=click.IntRange(min=0), default=None, help="torchft replica group (its ranks).")
@click.option("--attempt", type=click.IntRange(min=0), default=None, help="Attempt number [default: latest].")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new output until the attempt ends.")
def logs(run: str, rank: int, group: int | None, attempt: int | None, follow: bool) -> None:
    """Show one rank's worker log of one attempt."""
    rd = resolve_run(run)
    path, attempt = _log_file(rd, rank, attempt, group)
    if follow:
        _follow(rd, path, attempt)
        return
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            sys.stdout.buffer.write(chunk)
    sys.stdout.buffer.flush()


@click.command("cancel")
@click.argument("run", metavar="RUN_DIR|JOB_ID")
def cancel(run: str) -> None:
    """Cancel the run's current Slurm job, whichever attempt it is on; it is not requeued.

    A previous job of the run that is still winding down is cancelled too.
    """
    from hpcelastic.lifecycle.cancel import cancel_run

    rd = resolve_run(run)
    result = cancel_run(rd)
    if not result.cancelled:
        click.echo(
            f"job {result.latest_job_id} has ended ({result.latest_state}); nothing to cancel; "
            "no requeue will follow"
        )
        return
    click.echo(f"cancelled job {', '.join(result.cancelled)} of {rd.path}; see `hpcelastic status {rd.path}`")


@click.command("finalize")
@click.option(
    "--run-dir", "run_dir", required=True, type=click.Path(file_okay=False), help="The run directory."
)
@click.option("--exit-code", "exit_code", required=True, type=int, help="srun's exit status.")
@click.option("--stopped", is_flag=True, help="The batch script's trap saw the stop signal.")
@click.option("--requeue-mode", type=click.Choice(["requeue", "resubmit"]), default=None)
@click.option("--max-requeues", type=click.IntRange(min=0), default=None)
def finalize(
    run_dir: str, exit_code: int, stopped: bool, requeue_mode: str | None, max_requeues: int | None
) -> None:
    """(internal) After srun: exit with the agents' decision, or decide when no agent could."""
    from hpcelastic.lifecycle.finalize import finalize as run_finalize

    sys.exit(
        run_finalize(
            RunDir.open(run_dir),
            exit_code,
            stopped=stopped,
            requeue_mode=requeue_mode,
            max_requeues=max_requeues,
        )
    )
