"""The API a training script imports: resume, publish checkpoints, stop in time, report progress.

Works under the hpcelastic agent (which sets the ``HPCELASTIC_*`` variables of
docs/ARCHITECTURE.md) and in plain ``python train.py`` alike: without the agent
:func:`resume_path` is None, :func:`should_stop` is False and :func:`heartbeat`
does nothing. No torch import, no agent import.

Typical loop::

    from hpcelastic import worker
    start = load(worker.resume_path()) if worker.resume_path() else 0
    for step in range(start, steps):
        train_step()
        worker.heartbeat(step)
        if step % 100 == 0 or worker.should_stop():
            path = save(os.path.join(worker.checkpoint_dir(), f"step-{step}.pt"))  # on rank 0
            worker.publish_checkpoint(path, step)
            if worker.should_stop():
                break
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from types import FrameType

from hpcelastic.errors import UserError
from hpcelastic.parse import parse_signal

ENV_RUN_DIR = "HPCELASTIC_RUN_DIR"
ENV_ATTEMPT = "HPCELASTIC_ATTEMPT"
ENV_CHECKPOINT_DIR = "HPCELASTIC_CHECKPOINT_DIR"
ENV_RESUME_FROM = "HPCELASTIC_RESUME_FROM"
ENV_HEARTBEAT_SOCKET = "HPCELASTIC_HEARTBEAT_SOCKET"
ENV_STOP_FILE = "HPCELASTIC_STOP_FILE"
ENV_STOP_SIGNAL = "HPCELASTIC_STOP_SIGNAL"
ENV_CHECKPOINT_TIER = "HPCELASTIC_CHECKPOINT_TIER"
DEFAULT_STOP_SIGNAL = "USR2"
DEFAULT_CHECKPOINT_SUBDIR = "checkpoints"

#: Set by the stop signal's handler alone: a plain assignment, no lock (a handler that took one could run
#: while the main thread holds it, and that rank would freeze with every other rank waiting for it).
_stop_signalled = False
#: Set by the main thread when it sees the stop file.
_stop_file_seen = False
_handler_signal: int | None = None
_heartbeat_sock: socket.socket | None = None
_resume_cache: list[str | None] = []
_last_step: int | None = None


def _on_stop_signal(signum: int, frame: FrameType | None) -> None:
    global _stop_signalled
    _stop_signalled = True


def _install_stop_handler() -> None:
    """Catch the stop signal with a flag-setting handler, once, and only if nobody else handles it.

    The agent starts its workers with the stop signal ignored (a script without a handler is not killed
    by it): ignored counts as unhandled here.
    """
    global _handler_signal
    if _handler_signal is not None:
        return
    try:
        sig = parse_signal(os.environ.get(ENV_STOP_SIGNAL, DEFAULT_STOP_SIGNAL))
    except UserError:
        return
    try:
        if signal.getsignal(sig) in (signal.SIG_DFL, signal.SIG_IGN):
            signal.signal(sig, _on_stop_signal)
            _handler_signal = int(sig)
    except ValueError:  # not the main thread: the stop file still works
        return


def rank() -> int:
    """This worker's global rank (``RANK``), 0 outside a distributed launch."""
    return int(os.environ.get("RANK", "0") or 0)


def attempt() -> int:
    """The attempt number (0 for the first allocation, +1 per requeue), 0 without the agent."""
    return int(os.environ.get(ENV_ATTEMPT, "0") or 0)


def run_dir() -> str | None:
    """The run directory, or None outside the agent."""
    return os.environ.get(ENV_RUN_DIR) or None


def checkpoint_dir() -> str:
    """Where to write checkpoints (created if missing).

    ``$HPCELASTIC_CHECKPOINT_DIR`` under the agent; otherwise ``<run>/checkpoints`` or ``./checkpoints``.
    Raises :class:`hpcelastic.errors.UserError` when it cannot be created.
    """
    value = os.environ.get(ENV_CHECKPOINT_DIR)
    if not value:
        base = run_dir()
        value = (
            os.path.join(base, DEFAULT_CHECKPOINT_SUBDIR)
            if base
            else os.path.abspath(DEFAULT_CHECKPOINT_SUBDIR)
        )
    try:
        os.makedirs(value, exist_ok=True)
    except OSError as e:
        from hpcelastic.errors import UserError

        raise UserError(
            f"cannot create the checkpoint dir {value}: {e.strerror}; pass a writable --checkpoint-dir"
        ) from None
    return value


def _restarted_without_agent() -> bool:
    """Outside the agent, resume what this job published: the user named the checkpoint directory, or
    torchrun restarted the workers (``TORCHELASTIC_RESTART_COUNT`` > 0)."""
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    return bool(os.environ.get(ENV_CHECKPOINT_DIR)) or (restarts.isdigit() and int(restarts) > 0)


def _find_resume_path() -> str | None:
    value = os.environ.get(ENV_RESUME_FROM) or None
    if value is not None and Path(value).exists():
        return value
    base = run_dir()
    if value is not None:
        print(f"hpcelastic: warning: {ENV_RESUME_FROM}={value} does not exist", file=sys.stderr, flush=True)
    from hpcelastic import handoff

    if base is None:
        return handoff.latest_published(checkpoint_dir()) if _restarted_without_agent() else None
    return handoff.resume_path(base) if value is not None else None


def resume_path() -> str | None:
    """The latest published checkpoint when this worker started, or None.

    The same for an in-allocation restart and a new attempt; fixed for the life of the process. Without
    the agent: ``$HPCELASTIC_RESUME_FROM``, else the checkpoint ``hpcelastic-latest.json`` in
    :func:`checkpoint_dir` names when ``$HPCELASTIC_CHECKPOINT_DIR`` is set or torchrun restarted the
    workers (a fresh run in a directory with old checkpoints starts from scratch).
    """
    if not _resume_cache:
        _resume_cache.append(_find_resume_path())
    return _resume_cache[0]


def publish_checkpoint(path: str | os.PathLike[str], step: int) -> None:
    """Mark the fully written checkpoint at ``path`` as complete; only published ones are ever resumed.

    Call it from one rank (usually rank 0) after every rank has finished writing. Under the
    agent it updates the run's handoff record; without it, ``hpcelastic-latest.json`` in
    :func:`checkpoint_dir` is still written. Raises ``UserError`` if ``path`` does not exist.
    """
    from hpcelastic import handoff

    base = run_dir()
    if base is not None and os.environ.get(ENV_CHECKPOINT_TIER):
        from hpcelastic.tier.scan import write_publish_marker

        # The local tier: the agent publishes the persisted copy once every node's files are there.
        write_publish_marker(checkpoint_dir(), os.fspath(path), step)
        return
    if base is not None:
        handoff.publish(base, checkpoint_dir(), path, step, attempt(), rank())
        return
    p = Path(os.path.abspath(path))
    if not p.exists():
        from hpcelastic.errors import UserError

        raise UserError(
            f"cannot publish checkpoint {p}: it does not exist; save it completely, then publish it"
        )
    checkpoint = {
        "path": str(p),
        "step": int(step),
        "attempt": attempt(),
        "rank": rank(),
        "published_at": time.time(),
    }
    handoff.write_latest_file(checkpoint_dir(), checkpoint)


def should_stop() -> bool:
    """True once this rank should save, publish and exit; the job comes back as a new attempt.

    After a preemption or time-limit signal the coordinator fixes one stop step for the whole job
    (the highest step any rank reported + 1 + about one second of recent steps) and every rank that calls
    :func:`heartbeat` turns true once its own step reaches it: all ranks stop after the same step. Such a
    rank waits for that step however long it takes (never decides on its own clock); one that never called
    :func:`heartbeat` turns true as soon as the signal or the stop file reaches it.
    """
    global _stop_file_seen
    _install_stop_handler()
    stop_file = os.environ.get(ENV_STOP_FILE)
    if not (_stop_signalled or _stop_file_seen):
        if not (stop_file and os.path.exists(stop_file)):
            return False
        _stop_file_seen = True
    if _last_step is None or not stop_file:
        return True
    try:
        with open(stop_file) as f:
            text = f.read().strip()
    except OSError:  # not written yet: the coordinator's stop step is on its way
        return False
    if not (text.isascii() and text.isdigit()):
        return True  # the stop file names no step: stop now
    return _last_step >= int(text)


def heartbeat(step: int) -> None:
    """Tell the agent this rank reached ``step`` (a non-blocking datagram; a no-op outside the agent).

    The step is also what :func:`should_stop` compares with the job's stop step.
    """
    global _heartbeat_sock, _last_step
    path = os.environ.get(ENV_HEARTBEAT_SOCKET)
    if not path:
        return
    _last_step = int(step)
    payload = json.dumps({"rank": rank(), "pid": os.getpid(), "step": int(step), "ts": time.time()}).encode()
    try:
        if _heartbeat_sock is None:
            _heartbeat_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            _heartbeat_sock.setblocking(False)
        _heartbeat_sock.sendto(payload, path)
    except OSError:  # agent gone or busy: progress reports are best effort by design
        return


if os.environ.get(ENV_STOP_SIGNAL):
    _install_stop_handler()
