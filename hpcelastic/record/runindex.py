"""A small per-user index from Slurm job ids to run directories.

``$XDG_STATE_HOME/hpcelastic/index.jsonl`` (default ``~/.local/state/hpcelastic/index.jsonl``), one
JSON line per submission, appended by ``submit`` and by the lifecycle executor when it resubmits. It
lets ``hpcelastic status 12345`` find the run directory of job 12345.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def index_path() -> Path:
    """Where the index lives for this user."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "hpcelastic" / "index.jsonl"


def record_job(job_id: str | int, run_dir: str | os.PathLike[str]) -> None:
    """Remember that ``job_id`` belongs to ``run_dir`` (one appended line; never raises on I/O trouble)."""
    path = index_path()
    line = (
        json.dumps({"job_id": str(job_id), "run_dir": str(Path(run_dir).absolute()), "ts": time.time()})
        + "\n"
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:  # the index is a convenience; status by run dir keeps working without it
        return


def _entries() -> list[dict[str, str]]:
    try:
        text = index_path().read_text(errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and obj.get("job_id") and obj.get("run_dir"):
            out.append({"job_id": str(obj["job_id"]), "run_dir": str(obj["run_dir"])})
    return out


def lookup(job_id: str | int) -> Path | None:
    """The run directory of ``job_id`` (an array task ``A_T`` also matches its array ``A``), or None."""
    wanted = [str(job_id)]
    if "_" in wanted[0]:
        wanted.append(wanted[0].split("_", 1)[0])
    entries = _entries()
    for key in wanted:
        for entry in reversed(entries):
            if entry["job_id"] == key:
                return Path(entry["run_dir"])
    return None


def latest_run() -> Path | None:
    """The most recently recorded run directory that still exists, or None."""
    for entry in reversed(_entries()):
        if Path(entry["run_dir"]).is_dir():
            return Path(entry["run_dir"])
    return None
