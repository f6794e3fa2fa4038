"""The run directory: one per submission, the single source of truth for ``status``.

Layout (see docs/ARCHITECTURE.md)::

    <run>/meta.json        what was submitted (written once by submit)
    <run>/job.sbatch       the rendered batch script, byte for byte what sbatch got
    <run>/config.yaml      the resolved configuration (all layers merged)
    <run>/secret           the job's control-plane secret, mode 0600
    <run>/events.<host>.jsonl  append-only event log of the writers on one host, one JSON object a line
    <run>/events.jsonl     the event log of runs written before per-host files (still read)
    <run>/handoff.json     latest published checkpoint, attempt, last end reason
    <run>/local.json       ``hpcelastic run`` only: its host and process ids (is the run alive?)
    <run>/run_id           the run's stable id (the same across requeues and resubmissions)
    <run>/metrics.json     the coordinator's OpenMetrics endpoint, as Prometheus' file_sd_configs reads it
    <run>/logs/attempt-<K>/rank-<R>.log   per-rank worker logs (``rank-<R>-g<G>.log`` in replica group G)
    <run>/slurm-<jobid>.out               the batch step's output (--open-mode=append)

Filesystem requirements (a shared filesystem such as NFS, Lustre or GPFS is fine):

* every writer appends whole lines with a single ``write`` on an ``O_APPEND`` descriptor to the
  file of its own host, so writers never share a file across hosts (``O_APPEND`` is atomic between
  processes of one host, not between NFS clients); :meth:`RunDir.events` merges the files by ``ts``;
* once-per-attempt claims create a file with ``O_EXCL`` (atomic on local filesystems and NFSv3+);
* the handoff lock is an ``O_EXCL`` lock file too, not ``flock`` (node-local or missing on some
  mounts): a lock whose holder died is broken after :data:`LOCK_STALE_S` seconds (at once on the
  holder's own host);
* records are replaced with ``rename``; clocks of the hosts agree to a second or so.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import json
import os
import re
import secrets
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hpcelastic.errors import UserError
from hpcelastic.events import Event, EventLog
from hpcelastic.worker import DEFAULT_CHECKPOINT_SUBDIR

SECRET_BYTES = 32
#: The run id's size: 16 hex characters.
RUN_ID_BYTES = 8
#: A lock file older than this whose holder cannot be checked is taken to be left by a dead holder.
LOCK_STALE_S = 60.0
_UNSAFE_IN_NAME = re.compile(r"[^A-Za-z0-9._-]")


def _host_file_name(host: str) -> str:
    return "events." + (_UNSAFE_IN_NAME.sub("_", host) or "_") + ".jsonl"


def _ts_key(record: Any) -> float:
    ts = record.get("ts") if isinstance(record, dict) else None
    return float(ts) if isinstance(ts, int | float) and ts == ts else 0.0


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
        rd = cls(p)
        write_atomic(rd.run_id_path, secrets.token_hex(RUN_ID_BYTES).encode())
        return rd

    @property
    def run_id(self) -> str:
        """The run's stable id, written when it was created: every requeue and resubmission of the run
        shares it (metrics label their figures with it). A run directory made before it existed gets a
        digest of its path."""
        with contextlib.suppress(OSError):
            found = self.run_id_path.read_text().strip()
            if found:
                return found
        return hashlib.sha256(str(self.path).encode()).hexdigest()[: 2 * RUN_ID_BYTES]

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> RunDir:
        """Open an existing run directory; :class:`UserError` if it is not one."""
        rd = cls(path)
        if not rd.path.is_dir() or not (rd.event_files() or rd.meta_path.exists()):
            raise UserError(f"{rd.path} is not an hpcelastic run directory (no event log or meta.json)")
        return rd

    meta_path = property(lambda self: self.path / "meta.json")
    script_path = property(lambda self: self.path / "job.sbatch")
    config_path = property(lambda self: self.path / "config.yaml")
    secret_path = property(lambda self: self.path / "secret")
    #: The event file this host appends to.
    events_path = property(lambda self: self.path / _host_file_name(socket.gethostname()))
    handoff_path = property(lambda self: self.path / "handoff.json")
    logs_path = property(lambda self: self.path / "logs")
    #: ``hpcelastic run``'s processes (agent/launcher.py), so that ``status`` can tell whether they live.
    local_path = property(lambda self: self.path / "local.json")
    run_id_path = property(lambda self: self.path / "run_id")
    #: The job id of a run outside Slurm (``hpcelastic run``): it keys attempts like a Slurm job id. The
    #: default run directory's name already starts with ``local-`` (``launcher.default_run_dir``).
    local_job_id = property(
        lambda self: self.path.name if self.path.name.startswith("local-") else f"local-{self.path.name}"
    )

    def attempt_log_dir(self, attempt: int) -> Path:
        """Directory of the per-rank logs of one attempt (created on demand)."""
        # mkdir(parents=True) gives parents the default mode: create logs/ itself as user-only too.
        self.logs_path.mkdir(exist_ok=True, mode=0o700)
        d = self.logs_path / f"attempt-{attempt}"
        d.mkdir(exist_ok=True, mode=0o700)
        return d

    def rank_log_path(self, attempt: int, rank: int, group: int = -1) -> Path:
        """Log file of one global rank in one attempt; with torchft replica groups, of rank ``rank`` of
        replica group ``group`` (each group numbers its ranks from 0)."""
        return self.attempt_log_dir(attempt) / (
            f"rank-{rank}.log" if group < 0 else f"rank-{rank}-g{group}.log"
        )

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

    def record(self, event: Event, *, host: str | None = None, ts: float | None = None) -> dict[str, Any]:
        """Append one event to ``events.jsonl`` and return the written record.

        ``ts`` (epoch seconds: now unless given, a queued event keeps its own) and ``host`` (this
        machine unless given) are added.
        """
        when = time.time() if ts is None else ts
        record: dict[str, Any] = {"ts": round(when, 6), "event": event.name.value}
        record["host"] = host if host is not None else socket.gethostname()
        record.update(event.fields)
        line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
        fd = os.open(self.events_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        return record

    def event_files(self) -> list[Path]:
        """Every event file of the run: one per host that wrote events, and the older ``events.jsonl``."""
        return sorted(p for p in self.path.glob("events*.jsonl") if p.is_file())

    def events(self) -> EventLog:
        """The event log: each host's file in its order, the files merged by ``ts``.

        Damaged lines (a torn last line, a line that is not an event object) are skipped and
        counted in ``EventLog.damaged``.
        """
        per_file: list[list[dict[str, Any]]] = []
        damaged = 0
        for path in self.event_files():
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            records = []
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
            per_file.append(records)
        merged = per_file[0] if len(per_file) == 1 else list(heapq.merge(*per_file, key=_ts_key))
        return EventLog(merged, damaged)

    def read_meta(self) -> dict[str, Any]:
        """The submission's metadata, or an empty dict if none was written."""
        try:
            return json.loads(self.meta_path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def checkpoint_dir(self) -> Path:
        """Where the run's workers save: the submission's ``checkpoint_dir``, else the agent's default
        (``RUN/checkpoints``, as ``hpcelastic run`` has it)."""
        given = self.read_meta().get("checkpoint_dir")
        return Path(given) if given else self.path / DEFAULT_CHECKPOINT_SUBDIR

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
        """Hold the lock ``<run>/.<name>.excl`` (created with ``O_EXCL``) for a read-modify-write.

        Works where ``flock`` is node-local or missing. A lock left by a dead holder is broken: at
        once when the holder ran on this host, else after :data:`LOCK_STALE_S` seconds.
        """
        path = self.path / f".{name}.excl"
        token = _lock_token()
        _acquire(path, token)
        try:
            yield
        finally:
            _release(path, token)

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


def _lock_token() -> str:
    return f"{socket.gethostname()} {os.getpid()} {secrets.token_hex(8)}\n"


def _try_create(path: Path, token: str) -> bool:
    """Create the lock file ``path`` holding ``token``; False when it exists already.

    The token is written to a private file first and linked in place (``link`` fails on an existing
    name, on NFS too), so a lock file is never seen empty, even when its creator is killed.
    """
    tmp = path.with_name(f"{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.write(fd, token.encode())
        finally:
            os.close(fd)
        os.link(tmp, path)
    except FileExistsError:  # NFS: a retried link whose first try succeeded also says EEXIST
        return os.stat(tmp).st_nlink == 2
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return True


def _acquire(path: Path, token: str) -> None:
    """Wait until ``path`` is created by this caller, breaking it when its holder is dead."""
    delay = 0.001
    while not _try_create(path, token):
        _break_if_stale(path)
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def _release(path: Path, token: str) -> None:
    with contextlib.suppress(OSError):
        if path.read_text() == token:
            path.unlink()


def _is_stale(path: Path) -> bool:
    """True when the lock file ``path`` was left by a dead holder (see :meth:`RunDir.locked`)."""
    try:
        text = path.read_text()
        age = time.time() - path.stat().st_mtime
    except OSError:
        return False
    host, _, rest = text.partition(" ")
    pid = rest.split(" ", 1)[0]
    dead_here = host == socket.gethostname() and pid.isdigit() and not _alive(int(pid))
    return dead_here or age > LOCK_STALE_S


def _break_if_stale(path: Path) -> None:
    """Remove the lock file ``path`` when its holder is dead, never a live holder's lock.

    Breakers take turns under a second lock, ``<path>.break`` (itself broken the same way when a
    breaker died holding it), and judge the lock again under it: only a breaker removes a dead
    holder's lock, so the file judged stale there is the file removed, not a fresh lock that
    replaced it after another breaker's removal.
    """
    if not _is_stale(path):
        return
    breaker = path.with_name(path.name + ".break")
    token = _lock_token()
    if not _try_create(breaker, token):
        _break_if_stale(breaker)
        return
    try:
        if _is_stale(path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    finally:
        _release(breaker, token)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
