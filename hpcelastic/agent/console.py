"""What the job's console shows: whole lines from one writer, and which worker lines reach it.

Every line a worker prints goes to its rank log unchanged (``workers.py``); the console (the terminal of
``hpcelastic run``, the job's output file under Slurm) gets a share of them, each line whole, in one
``write`` under one lock with the agent's own lines (:func:`write_line`), so no two lines run together:

- one prefix per line: ``[rank3]``, or ``[g1 r0]`` with torchft replica groups; torch.distributed's own
  ``[rankN]:`` prefix of an uncaught exception is dropped;
- ``--console all`` shows every rank, ``rank0`` rank 0 (of each replica group), ``failures`` no worker
  line at all: hpcelastic's lines (progress, restarts, the root cause with its traceback) only;
- third-party chatter (:data:`RANK_LOG_ONLY`: torchft's quorum and commit logs, its checkpoint HTTP
  server's access lines, gloo's connection notes, torch's C++ warnings) stays in the rank logs;
- a traceback is held back until its worker's fate is known: a worker that fails has its traceback
  printed once by the coordinator (the round's root cause first, the peers' consequent tracebacks in the
  rank logs only); one that goes on or ends well has it printed then.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading

from hpcelastic.parse import CONSOLE_MODES

ALL, RANK0, FAILURES = CONSOLE_MODES
#: Lines of third-party libraries kept in the rank logs only. Matched anywhere in the line: another
#: thread's output can land in front of them (seen in CI as a line that began " [INFO] [torchft::manager]").
RANK_LOG_ONLY = re.compile(
    rb"\[INFO\] \[torchft::"  # torchft's Rust quorum/commit lines
    rb"|(?:INFO|WARNING|DEBUG):torchft[.:]"  # torchft's Python loggers
    rb'|"(?:GET|POST|PUT) /[^"]* HTTP/1\.[01]" \d{3}'  # torchft's checkpoint server's access log
    rb"|\[Gloo\] Rank \d+ is connected to"  # gloo's connection note, one per rank and process group
    rb"|^(?:\[(?:rank|default)\d+\]:)?\[[WI]\d{4} \d\d:\d\d:\d\d"  # torch's C++ warnings and notes
)
TORCH_RANK_PREFIX = re.compile(rb"^\[(?:rank|default)\d+\]:\s?")
_TRACEBACK = b"Traceback (most recent call last):"
#: Lines inside a traceback block that do not end it: chained exceptions and the blank lines between.
_CHAINED = (
    b"During handling of the above exception",
    b"The above exception was the direct cause",
    _TRACEBACK,
)
_LOCK = threading.Lock()


def write_line(text: str | bytes, fd: int = 2) -> None:
    """``text`` as whole lines on ``fd``, in one ``write`` under the process's console lock."""
    data = text.encode(errors="replace") if isinstance(text, str) else text
    if not data.endswith(b"\n"):
        data += b"\n"
    with _LOCK, contextlib.suppress(OSError):
        os.write(fd, data)


def prefix(rank: int, replica_group: int = -1) -> bytes:
    """``[rank3] `` or, with replica groups, ``[g1 r0] ``."""
    return (f"[g{replica_group} r{rank}] " if replica_group >= 0 else f"[rank{rank}] ").encode()


class WorkerConsole:
    """One worker's lines on their way to the console (see the module docstring)."""

    def __init__(self, mode: str, rank: int, replica_group: int = -1, fd: int = 1) -> None:
        self.shown = mode == ALL or (mode == RANK0 and rank == 0)
        self.prefix = prefix(rank, replica_group)
        self.fd = fd
        self.held: list[bytes] | None = None  # a traceback block, until the worker's fate is known
        self._raised = False  # the held block has its exception line

    def line(self, raw: bytes) -> None:
        """One whole line of the worker's output (with its newline)."""
        if not self.shown or RANK_LOG_ONLY.search(raw):
            return
        text = TORCH_RANK_PREFIX.sub(b"", raw)
        body = text.rstrip(b"\r\n")
        if self.held is None:
            if body.startswith(_TRACEBACK):
                self.held, self._raised = [text], False
                return
            self._write([text])
            return
        ends = self._raised and body and not body.startswith((b" ", b"\t")) and not body.startswith(_CHAINED)
        if ends:  # the worker goes on after printing a traceback: it was logged, not fatal
            self.release()
            self._write([text])
            return
        self.held.append(text)
        if body and not body.startswith((b" ", b"\t")) and not body.startswith(_CHAINED):
            self._raised = True

    def release(self) -> None:
        """Show a held traceback: the worker did not die of it."""
        held, self.held = self.held, None
        if held:
            self._write(held)

    def finish(self, failed: bool) -> None:
        """The worker ended: a held traceback is shown when it ended well; a failed worker's traceback is the
        coordinator's to show (once, as the round's root cause) and stays in the rank log."""
        if failed:
            self.held = None
        else:
            self.release()

    def _write(self, lines: list[bytes]) -> None:
        write_line(b"".join(self.prefix + line for line in lines), self.fd)
