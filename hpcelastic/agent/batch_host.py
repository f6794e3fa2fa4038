"""Is the batch shell still alive? Asked by an agent that lost the coordinator.

With ``--no-kill`` Slurm 22.05 keeps a job RUNNING when its batch host's node dies: it drops the
node from the job and leaves it without a batch script until the time limit, and ``finalize``
never runs. The batch script therefore writes a counter into the run directory (shared by every
node) once a second; an agent that lost the coordinator reads it twice: a counter that moves means
the batch host lives (its ``finalize`` decides after the step), one that stands still means the
batch host died with the coordinator, and a survivor ends the attempt itself.
"""

from __future__ import annotations

import time
from pathlib import Path

#: How often the batch script writes its counter (the template's ``sleep``), seconds.
BEAT_INTERVAL_S = 1.0
#: How long a reader waits for the counter to move: several beats, for slow shared file systems.
WATCH_S = 4.0


def beat_path(run_dir: Path, job_id: str) -> Path:
    """The file the batch script of ``job_id`` beats in."""
    return run_dir / f"batch-{job_id}.alive"


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def batch_shell_dead(path: Path, *, watch_s: float = WATCH_S, poll_s: float = 0.25) -> bool:
    """True when the counter in ``path`` stood still for ``watch_s``; False if it moved or never existed.

    No file (a script from before this check, an agent started by hand) is never taken for a death.
    """
    first = _read(path)
    if first is None:
        return False
    deadline = time.monotonic() + watch_s
    while time.monotonic() < deadline:
        time.sleep(poll_s)
        if _read(path) != first:
            return False
    return True
