"""The handoff record: the current allocation's attempt number and the latest published checkpoint.

``<run>/handoff.json`` is rewritten atomically under ``RunDir.locked("handoff")``, so a crash at any
moment leaves the old record or the new one. A copy of the checkpoint object goes to
``<checkpoint_dir>/hpcelastic-latest.json`` for scripts that do not use Python, under the same lock;
the step of either never goes back. A record that is
damaged anyway (disk trouble, a hand edit) is rebuilt from that file and the event log; reading it
never raises.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hpcelastic import events
from hpcelastic.errors import UserError
from hpcelastic.lifecycle.cancel import is_cancelled
from hpcelastic.rundir import RunDir, write_json_atomic

VERSION = 1
LATEST_FILE = "hpcelastic-latest.json"
RESUME_PLACEHOLDER = "{resume}"
CHECKPOINT_DIR_PLACEHOLDER = "{checkpoint_dir}"


@dataclass
class HandoffRecord:
    """Contents of ``<run>/handoff.json`` (see docs/ARCHITECTURE.md, "Handoff record").

    Only what the event log cannot give: the identity of the current allocation (``attempt``,
    ``job_id``, ``restart_count_slurm``) and the checkpoint to resume from. How attempts ended,
    requeue counts and excluded nodes are read from the event log (``lifecycle.history``).
    Records written by older versions may hold more keys; they are ignored.
    """

    version: int = VERSION
    attempt: int = 0
    job_id: str | None = None
    restart_count_slurm: int | None = None
    checkpoint_dir: str | None = None
    checkpoint: dict[str, Any] | None = None

    @property
    def started(self) -> bool:
        """True once some allocation called :func:`begin_attempt`."""
        return self.job_id is not None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any) -> HandoffRecord:
        """Validate and convert a parsed record; ``ValueError`` names the first problem."""
        if not isinstance(obj, dict):
            raise ValueError("the record is not a JSON object")
        if obj.get("version") != VERSION:
            raise ValueError(f"unknown record version {obj.get('version')!r}")
        if not isinstance(obj.get("attempt"), int) or obj["attempt"] < 0:
            raise ValueError("'attempt' is not a non-negative integer")
        ckpt = obj.get("checkpoint")
        if ckpt is not None and not (isinstance(ckpt, dict) and isinstance(ckpt.get("path"), str)):
            raise ValueError("'checkpoint' has no 'path'")
        rc = obj.get("restart_count_slurm")
        return cls(
            attempt=obj["attempt"],
            job_id=None if obj.get("job_id") is None else str(obj["job_id"]),
            restart_count_slurm=None if rc is None else int(rc),
            checkpoint_dir=obj.get("checkpoint_dir"),
            checkpoint=ckpt,
        )


def _rundir(run_dir: RunDir | str | os.PathLike[str]) -> RunDir:
    return run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)


def _warn(message: str) -> None:
    print(f"hpcelastic: warning: {message}", file=sys.stderr, flush=True)


def _read_latest_file(checkpoint_dir: str | None) -> dict[str, Any] | None:
    if not checkpoint_dir:
        return None
    try:
        obj = json.loads((Path(checkpoint_dir) / LATEST_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return obj if isinstance(obj, dict) and isinstance(obj.get("path"), str) else None


def latest_published(checkpoint_dir: str) -> str | None:
    """The checkpoint ``hpcelastic-latest.json`` in ``checkpoint_dir`` names, if it still exists: the worker
    API's resume point without the agent (a torchrun restart)."""
    latest = _read_latest_file(checkpoint_dir)
    return latest["path"] if latest is not None and Path(latest["path"]).exists() else None


def _recover(rd: RunDir, error: str) -> HandoffRecord:
    """Rebuild a record from the event log and ``hpcelastic-latest.json`` after corruption."""
    rec = HandoffRecord()
    log = rd.events()
    started = [e for e in log.of(events.ATTEMPT_STARTED) if isinstance(e.get("attempt"), int)]
    if started:
        newest = max(reversed(started), key=lambda e: e["attempt"])  # the last start of the newest attempt
        rc = newest.get("restart_count_slurm")
        rec.attempt, rec.job_id = newest["attempt"], str(newest.get("job_id"))
        rec.restart_count_slurm = int(rc) if isinstance(rc, int) else None
    published = log.of(events.CHECKPOINT_PUBLISHED)
    if published:
        last = published[-1]
        rec.checkpoint = {k: last.get(k) for k in ("path", "step", "attempt", "rank")}
        rec.checkpoint["published_at"] = last.get("ts")
    ckpt_dirs = list(dict.fromkeys(str(e["checkpoint_dir"]) for e in published if e.get("checkpoint_dir")))
    for d in ckpt_dirs:
        latest = _read_latest_file(d)
        newer = latest and (
            rec.checkpoint is None
            or (latest.get("published_at") or 0) > (rec.checkpoint.get("published_at") or 0)
        )
        if newer:
            rec.checkpoint = latest
    if ckpt_dirs:
        rec.checkpoint_dir = ckpt_dirs[-1]
    rd.record(
        events.handoff_corrupt(
            error=error,
            recovered_attempt=rec.attempt,
            recovered_checkpoint=(rec.checkpoint or {}).get("path"),
        )
    )
    _warn(
        f"the handoff record {rd.handoff_path} was damaged ({error}); rebuilt it from the event log: "
        f"attempt {rec.attempt}, checkpoint {(rec.checkpoint or {}).get('path')}"
    )
    return rec


def _read(rd: RunDir, *, repair: bool) -> tuple[HandoffRecord, bool]:
    """Read the record; returns (record, was_corrupt). With ``repair`` a corrupt one is rebuilt."""
    try:
        text = rd.handoff_path.read_text()
    except FileNotFoundError:
        return HandoffRecord(), False
    except OSError as e:
        error = f"unreadable: {e.strerror}"
    else:
        try:
            return HandoffRecord.from_json(json.loads(text)), False
        except (json.JSONDecodeError, ValueError, TypeError) as e:
            error = f"invalid: {e}"
    if not repair:
        return HandoffRecord(), True
    return _recover(rd, error), True


def _write(rd: RunDir, rec: HandoffRecord) -> None:
    write_json_atomic(rd.handoff_path, rec.to_json())


def load(run_dir: RunDir | str | os.PathLike[str]) -> HandoffRecord:
    """The current record: fresh when missing; rebuilt (with a ``handoff_corrupt`` event) when damaged."""
    rd = _rundir(run_dir)
    rec, corrupt = _read(rd, repair=False)
    if not corrupt:
        return rec
    with rd.locked("handoff"):
        rec, corrupt = _read(rd, repair=True)
        if corrupt:
            _write(rd, rec)
    return rec


def begin_attempt(
    run_dir: RunDir | str | os.PathLike[str],
    job_id: str | int,
    slurm_restart_count: int,
    nodes: Sequence[str] = (),
) -> int:
    """Start (or re-join) the attempt of this allocation and return its number.

    Rank 0 calls it once per allocation. The same ``job_id`` and restart count return the
    same attempt without a new event, so re-running it in one allocation (agent, then
    ``finalize``) never bumps the number. A new allocation gets the next number and an
    ``attempt_started`` event, unless the run was cancelled (a requeue or resubmission raced the
    cancel): then no attempt begins and the last one's number is returned.
    """
    rd = _rundir(run_dir)
    with rd.locked("handoff"):
        for stale in rd.path.glob(f".{rd.handoff_path.name}.*"):  # temp files of writers killed mid-write
            stale.unlink(missing_ok=True)
        rec, _ = _read(rd, repair=True)
        same = rec.job_id == str(job_id) and rec.restart_count_slurm == int(slurm_restart_count)
        if same or is_cancelled(rd):
            return rec.attempt
        if rec.started:
            rec.attempt += 1
        rec.job_id = str(job_id)
        rec.restart_count_slurm = int(slurm_restart_count)
        attempt = rec.attempt
        _write(rd, rec)
    rd.record(
        events.attempt_started(
            attempt=attempt, job_id=str(job_id), restart_count_slurm=int(slurm_restart_count), nodes=nodes
        )
    )
    return attempt


def _check_checkpoint_dir(checkpoint_dir: str | os.PathLike[str]) -> Path:
    d = Path(checkpoint_dir)
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise UserError(
            f"cannot create the checkpoint dir {d}: {e.strerror}; pass a writable --checkpoint-dir"
        ) from None
    if not os.access(d, os.W_OK | os.X_OK):
        raise UserError(f"the checkpoint dir {d} is not writable; pass a writable --checkpoint-dir")
    return d


def write_latest_file(checkpoint_dir: str | os.PathLike[str], checkpoint: dict[str, Any]) -> Path:
    """Atomically write ``<checkpoint_dir>/hpcelastic-latest.json`` (the documented non-Python contract)."""
    d = _check_checkpoint_dir(checkpoint_dir)
    target = d / LATEST_FILE
    write_json_atomic(target, checkpoint, mode=0o644)
    return target


def publish(
    run_dir: RunDir | str | os.PathLike[str],
    checkpoint_dir: str | os.PathLike[str],
    path: str | os.PathLike[str],
    step: int,
    attempt: int,
    rank: int,
) -> dict[str, Any]:
    """Mark the checkpoint at ``path`` complete: it becomes what the next start resumes from.

    Returns the checkpoint in force afterwards. A step older than the one published already (a
    leftover worker of a lost round, another replica group's rank 0) is ignored: the newer record
    stays, a ``checkpoint_rejected`` event and a warning say so. Raises :class:`UserError` (and
    logs ``checkpoint_rejected``) when ``path`` does not exist or the checkpoint dir cannot be
    written; the previous record then stays in force. The record and ``hpcelastic-latest.json``
    are written under one lock, so the two never disagree about which step is newest.
    """
    rd = _rundir(run_dir)
    p = Path(os.path.abspath(path))

    def reject(why: str) -> None:
        rd.record(events.checkpoint_rejected(path=str(p), step=step, attempt=attempt, rank=rank, why=why))

    if not p.exists():
        reject("missing")
        raise UserError(
            f"cannot publish checkpoint {p}: it does not exist; save it completely, then publish it"
        )
    ckpt = {
        "path": str(p),
        "step": int(step),
        "attempt": int(attempt),
        "rank": int(rank),
        "published_at": time.time(),
    }
    ckpt_dir = str(Path(os.path.abspath(checkpoint_dir)))
    with rd.locked("handoff"):
        rec, _ = _read(rd, repair=True)
        newer = newer_checkpoint(rec.checkpoint, int(step))
        if newer is not None:
            why = f"older than step {newer['step']} published already ({newer['path']})"
            reject(why)
            _warn(f"checkpoint {p} of step {step} not published: {why}")
            return newer
        try:
            write_latest_file(ckpt_dir, ckpt)
        except (UserError, OSError) as e:
            reject(str(e))
            raise UserError(str(e)) from None
        rec.checkpoint = ckpt
        rec.checkpoint_dir = ckpt_dir
        _write(rd, rec)
    rd.record(
        events.checkpoint_published(
            path=str(p), step=int(step), attempt=int(attempt), rank=int(rank), checkpoint_dir=ckpt_dir
        )
    )
    return ckpt


def newer_checkpoint(current: dict[str, Any] | None, step: int) -> dict[str, Any] | None:
    """``current`` when it is a still existing checkpoint of a later step than ``step``, else None.

    A vanished checkpoint does not count: the run resumed from an older one and publishes from there.
    """
    if current is None or not isinstance(current.get("step"), int) or current["step"] <= step:
        return None
    return current if Path(current["path"]).exists() else None


def _published_paths_newest_first(rd: RunDir) -> list[str]:
    paths = [str(ev["path"]) for ev in rd.events().of(events.CHECKPOINT_PUBLISHED) if ev.get("path")]
    return list(dict.fromkeys(reversed(paths)))


def resume_path(run_dir: RunDir | str | os.PathLike[str]) -> str | None:
    """The newest published checkpoint that still exists, or None.

    When the latest one was deleted, an older published one is used and a ``checkpoint_missing``
    event says so; a half-written checkpoint is never returned because it was never published.
    """
    rd = _rundir(run_dir)
    rec = load(rd)
    if rec.checkpoint is None:
        return None
    latest = rec.checkpoint["path"]
    if Path(latest).exists():
        return latest
    fallback = next((p for p in _published_paths_newest_first(rd) if p != latest and Path(p).exists()), None)
    rd.record(events.checkpoint_missing(path=latest, fallback=fallback))
    _warn(
        f"the published checkpoint {latest} no longer exists; "
        + (f"resuming from the older {fallback}" if fallback else "starting from scratch")
    )
    return fallback


def expand_args(args: Sequence[str], resume: str | None, checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """Replace ``{resume}`` in the script's arguments with the handed-off path ("" when none) and
    ``{checkpoint_dir}`` with the workers' checkpoint directory."""
    return [
        a.replace(RESUME_PLACEHOLDER, resume or "").replace(CHECKPOINT_DIR_PLACEHOLDER, str(checkpoint_dir))
        for a in args
    ]
