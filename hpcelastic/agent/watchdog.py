"""Process-tree cleanup that survives a SIGKILLed agent.

Every worker runs in its own session (its pid is its session id). The agent starts this module as
a tiny separate process (``python -m hpcelastic.agent.watchdog``) and writes ``+SID``/``-SID`` lines
to its stdin as workers come and go, and ``=NAME=VALUE`` for the variable that marks the workers'
environment (``hpcelastic.agent.workers.tree_marker``). The agent holds the only write end of that
pipe, so when the agent dies for any reason (SIGKILL included) the watchdog reads EOF and SIGKILLs
every process still in a registered session or started with that environment (a worker's child
that called ``setsid``): the workers and their children, which the workers' own parent-death signal
would not reach. Then it removes the directories registered with ``/PATH`` (the node-local checkpoint
tier: its bytes in ``/dev/shm`` are the node's memory) and, if empty, those registered with ``^PATH``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time


def session_pids(sids: set[int]) -> list[int]:
    """Pids of every process whose session id is in ``sids`` (one cheap pass over /proc)."""
    me = os.getpid()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        with contextlib.suppress(OSError):
            if os.getsid(int(name)) in sids:
                out.append(int(name))
    return out


def marked_pids(markers: set[str]) -> list[int]:
    """Pids of every process whose environment (``/proc/PID/environ``) holds one of ``markers``
    (``NAME=VALUE``).

    The workers' environment carries their agent's marker, and their descendants inherit it: this finds
    a worker's child that left the session with ``setsid`` and lost its parent.
    """
    wanted = {os.fsencode(m) for m in markers}
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        with contextlib.suppress(OSError), open(f"/proc/{name}/environ", "rb") as f:
            if wanted & set(f.read().split(b"\0")):
                out.append(int(name))
    return out


def kill_sessions(sids: set[int], sig: int = signal.SIGKILL) -> int:
    """Send ``sig`` to every process of the sessions ``sids``; returns how many were signalled."""
    pids = session_pids(sids)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)
    return len(pids)


class Watchdog:
    """The agent's handle on its watchdog process."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "hpcelastic.agent.watchdog"],
            stdin=subprocess.PIPE,
            start_new_session=True,
            close_fds=True,
        )
        self._lock = threading.Lock()

    def add(self, sid: int) -> None:
        """Register a worker session."""
        self._write(f"+{sid}\n")

    def mark(self, marker: str) -> None:
        """Also kill, on the agent's death, every process whose environment holds ``marker``
        (``NAME=VALUE``)."""
        self._write(f"={marker}\n")

    def remove_on_death(self, path: str, *, only_if_empty: bool = False) -> None:
        """Also remove directory ``path`` when the agent dies (``only_if_empty``: only an empty one)."""
        self._write(f"{'^' if only_if_empty else '/'}{path}\n")

    def remove(self, sid: int) -> None:
        """Forget a session whose processes are all gone."""
        self._write(f"-{sid}\n")

    def close(self) -> None:
        """Clean shutdown: the watchdog sees EOF with nothing registered and exits."""
        with self._lock, contextlib.suppress(OSError):
            assert self._proc.stdin is not None
            self._proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=5)

    def _write(self, line: str) -> None:
        with self._lock, contextlib.suppress(OSError, ValueError):
            assert self._proc.stdin is not None
            self._proc.stdin.write(line.encode())
            self._proc.stdin.flush()


def main() -> None:
    """Track sessions from stdin; on EOF, kill what is left of them."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    sids: set[int] = set()
    markers: set[str] = set()
    trees: list[str] = []
    empty: list[str] = []
    for raw in sys.stdin.buffer:
        line = raw.strip()
        if line[:1] == b"+" and line[1:].isdigit():
            sids.add(int(line[1:]))
        elif line[:1] == b"-" and line[1:].isdigit():
            sids.discard(int(line[1:]))
        elif line[:1] == b"=" and len(line) > 1:
            markers.add(os.fsdecode(line[1:]))
        elif line[:1] == b"/" and len(line) > 1:
            trees.append(os.fsdecode(line[1:]))
        elif line[:1] == b"^" and len(line) > 1:
            empty.append(os.fsdecode(line[1:]))
    for _ in range(5):
        killed = kill_sessions(sids) if sids else 0
        for pid in marked_pids(markers) if markers else []:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        if not killed:
            break
        time.sleep(0.05)
    for path in trees:
        shutil.rmtree(path, ignore_errors=True)
    for path in empty:
        with contextlib.suppress(OSError):
            os.rmdir(path)


if __name__ == "__main__":
    main()
