"""The run directory: one per submission, the single source of truth for ``status``.

Layout (see docs/ARCHITECTURE.md)::

    <run>/meta.json        what was submitted (written once by submit)
    <run>/job.sbatch       the rendered batch script, byte for byte what sbatch got
    <run>/config.yaml      the resolved configuration (all layers merged)
    <run>/secret           the job's control-plane secret, mode 0600
    <run>/events.jsonl     append-only event log, one JSON object per line
    <run>/handoff.json     latest published checkpoint, attempt, last end reason
    <run>/logs/attempt-<K>/rank-<R>.log   per-rank worker logs
    <run>/slurm-<jobid>.out               the batch step's output (--open-mode=append)

Every writer appends whole lines with a single ``write`` on an ``O_APPEND``
descriptor, so concurrent writers on one node never interleave inside a line.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hpcelastic.errors import UserError
from hpcelastic.events import Event, EventLog

SECRET_BYTES = 32


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the new one, never a torn one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_json_atomic(path: Path, obj: Any, mode: int = 0o600) -> None:
    """Atomically write ``obj`` as pretty JSON."""
    write_atomic(Path(path), (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode(), mode)


class RunDir:
    """Paths and helpers of one run directory."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).absolute()

    @classmethod
    def create(cls, path: str | os.PathLike[str]) -> RunDir:
        """Create a new, empty run directory readable by the user only.

        Raises :class:`UserError` when it exists already or cannot be created.
        """
        p = Path(path).absolute()
        if p.exists():
            raise UserError(f"run directory {p} already exists; pick another with --run-dir")
        try:
            p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            p.mkdir(mode=0o700)
            os.chmod(p, 0o700)
        except OSError as e:
            raise UserError(f"cannot create run directory {p}: {e.strerror}") from None
        return cls(p)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> RunDir:
        """Open an existing run directory; :class:`UserError` if it is not one."""
        rd = cls(path)
        if not rd.path.is_dir() or not (rd.events_path.exists() or rd.meta_path.exists()):
            raise UserError(f"{rd.path} is not an hpcelastic run directory (no events.jsonl or meta.json)")
        return rd

    meta_path = property(lambda self: self.path / "meta.json")
    script_path = property(lambda self: self.path / "job.sbatch")
    config_path = property(lambda self: self.path / "config.yaml")
    secret_path = property(lambda self: self.path / "secret")
    events_path = property(lambda self: self.path / "events.jsonl")
    handoff_path = property(lambda self: self.path / "handoff.json")
    logs_path = property(lambda self: self.path / "logs")

    def attempt_log_dir(self, attempt: int) -> Path:
        """Directory of the per-rank logs of one attempt (created on demand)."""
        # mkdir(parents=True) gives parents the default mode: create logs/ itself as user-only too.
        self.logs_path.mkdir(exist_ok=True, mode=0o700)
        d = self.logs_path / f"attempt-{attempt}"
        d.mkdir(exist_ok=True, mode=0o700)
        return d

    def rank_log_path(self, attempt: int, rank: int) -> Path:
        """Log file of one global rank in one attempt."""
        return self.attempt_log_dir(attempt) / f"rank-{rank}.log"

    def create_secret(self) -> str:
        """Generate the job's control-plane secret and store it with mode 0600."""
        value = secrets.token_hex(SECRET_BYTES)
        write_atomic(self.secret_path, value.encode(), mode=0o600)
        return value

    def read_secret(self) -> str:
        """Read the job's secret; :class:`UserError` if it is missing or empty."""
        try:
            value = self.secret_path.read_text().strip()
        except OSError as e:
            raise UserError(f"cannot read the job secret {self.secret_path}: {e.strerror}") from None
        if not value:
            raise UserError(f"the job secret {self.secret_path} is empty")
        return value

    def record(self, event: Event, *, host: str | None = None) -> dict[str, Any]:
        """Append one event to ``events.jsonl`` and return the written record.

        ``ts`` (epoch seconds) and ``host`` (this machine unless given) are added.
        """
        record: dict[str, Any] = {"ts": round(time.time(), 6), "event": event.name.value}
        record["host"] = host if host is not None else socket.gethostname()
        record.update(event.fields)
        line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
        fd = os.open(self.events_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        return record

    def events(self) -> EventLog:
        """The event log in file order; damaged lines (a torn last line, a line that is not an
        event object) are skipped and counted in ``EventLog.damaged``."""
        records: list[Any] = []
        damaged = 0
        try:
            text = self.events_path.read_text(errors="replace")
        except FileNotFoundError:
            return EventLog(records)
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, RecursionError):
                damaged += 1
                continue
            if isinstance(obj, dict) and isinstance(obj.get("event"), str):
                records.append(obj)
            else:
                damaged += 1
        return EventLog(records, damaged)

    def read_meta(self) -> dict[str, Any]:
        """The submission's metadata, or an empty dict if none was written."""
        try:
            return json.loads(self.meta_path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def write_meta(self, meta: dict[str, Any]) -> None:
        """Atomically (re)write the submission's metadata."""
        write_json_atomic(self.meta_path, meta)

    def job_ids(self) -> list[str]:
        """Slurm job ids of this run in submission order (first submission, then resubmissions)."""
        return self.events().job_ids()

    def latest_job_id(self) -> str | None:
        """The job id the run is on now (the latest submission), or None."""
        ids = self.job_ids()
        return ids[-1] if ids else None

    @contextlib.contextmanager
    def locked(self, name: str = "run") -> Iterator[None]:
        """Hold an exclusive ``flock`` on ``<run>/.<name>.lock`` for a read-modify-write."""
        fd = os.open(self.path / f".{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def claim_once(self, key: str) -> bool:
        """Return True for exactly one caller per ``key`` across all processes and nodes.

        Used so that a decision (for example: requeue attempt 3) is taken once even
        when two failures race. Creation with ``O_EXCL`` is atomic on local file
        systems and on NFSv3+.
        """
        d = self.path / "claims"
        d.mkdir(exist_ok=True, mode=0o700)
        try:
            fd = os.open(d / key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(f"{socket.gethostname()} {os.getpid()} {time.time()}\n")
        return True
