"""``hpcelastic report``: where a run's time went, as one self-contained HTML page."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import click

from hpcelastic.cli.status_cmd import resolve_run
from hpcelastic.errors import UserError


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder: never half a page."""
    if not path.parent.is_dir():
        raise UserError(f"cannot write {path}: no such directory {path.parent}")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise UserError(f"cannot write {path}: {e.strerror}") from None


@click.command("report")
@click.argument("run", metavar="RUN_DIR|JOB_ID")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The HTML file to write [default: RUN_DIR/report.html].",
)
def report(run: str, output: Path | None) -> None:
    """Write an HTML page of where the run's time went: a timeline of attempts, rounds, failures and
    checkpoints, and the lost time by cause. One file, viewable offline in any browser."""
    from hpcelastic.record.ledger import ratio_text
    from hpcelastic.record.report import render_report
    from hpcelastic.record.status import build_status

    rd = resolve_run(run)
    log = rd.events()
    ledger = build_status(rd).ledger  # as status has it: a dead run's clock stopped at its newest event
    assert ledger is not None
    path = output if output is not None else rd.path / "report.html"
    write_atomically(path, render_report(ledger, log, run=str(rd.path)))
    ratio = ratio_text(ledger)
    reps = ledger.replica_groups
    groups = sum(len(lane.incidents) for lane in reps.lanes) if reps is not None else 0
    more = f", {groups} in replica groups" if groups else ""
    click.echo(
        f"wrote {path} (effective training time ratio {ratio}, {len(ledger.incidents)} incident(s){more})\n"
        f"next: open it in a web browser (it needs no network); `hpcelastic status {rd.path}` "
        "shows the same ledger as text"
    )
