"""Typed stacks of one process, parsed from ``py-spy dump --json [--native]``, and their signatures."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

_LIB_MARKERS = ("/site-packages/", "/dist-packages/", "<frozen ")
_STDLIB = re.compile(r"/lib(64)?/python3\.\d+/")
_HEX = re.compile(r"^0x[0-9a-fA-F]+$")
# Where a rank waits for the others: torch.distributed in Python, c10d/gloo/nccl in native frames.
_COLLECTIVE_NATIVE = re.compile(r"c10d|gloo|nccl", re.IGNORECASE)


@dataclass(frozen=True)
class Frame:
    """One frame, innermost first in a :class:`ThreadStack`. ``native`` frames come from ``--native``."""

    function: str
    filename: str
    line: int
    native: bool = False

    @property
    def short(self) -> str:
        """``file.py:function``, the line-free form used in signatures."""
        return f"{self.filename.rsplit('/', 1)[-1]}:{self.function}"

    @property
    def location(self) -> str:
        """``/path/file.py:LINE in function``."""
        return f"{self.filename}:{self.line} in {self.function}"

    @property
    def is_user_code(self) -> bool:
        """A Python frame outside the standard library and installed packages."""
        return (
            not self.native
            and not any(m in self.filename for m in _LIB_MARKERS)
            and not _STDLIB.search(self.filename)
        )

    @property
    def in_collective(self) -> bool:
        """Inside ``torch.distributed`` or torchft (quorum, cross-group collectives), or c10d/gloo/NCCL."""
        if self.native:
            return bool(_COLLECTIVE_NATIVE.search(self.function))
        return "/torch/distributed/" in self.filename or "/torchft/" in self.filename


@dataclass(frozen=True)
class ThreadStack:
    """The frames of one thread, innermost first."""

    thread_id: int
    name: str
    os_thread_id: int | None
    frames: tuple[Frame, ...]
    owns_gil: bool = False
    active: bool = False

    @property
    def python_frames(self) -> tuple[Frame, ...]:
        return tuple(f for f in self.frames if not f.native)


@dataclass(frozen=True)
class ProcessStack:
    """All threads of one process at one instant, or why there are none (``error``).

    ``state`` is the ``/proc/PID/stat`` state letter when the dump was taken (``T``: stopped).
    """

    pid: int
    threads: tuple[ThreadStack, ...] = ()
    state: str = "?"
    native: bool = False
    error: str | None = None
    taken_at: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def stopped(self) -> bool:
        return self.state in ("T", "t")

    @property
    def main(self) -> ThreadStack | None:
        """The main thread: the one whose OS id is the pid, else ``MainThread``, else the first."""
        for t in self.threads:
            if t.os_thread_id == self.pid:
                return t
        for t in self.threads:
            if t.name == "MainThread":
                return t
        return self.threads[0] if self.threads else None

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "state": self.state,
            "native": self.native,
            "error": self.error,
            "taken_at": self.taken_at,
            **self.extra,
            "threads": [
                {
                    "thread_id": t.thread_id,
                    "name": t.name,
                    "os_thread_id": t.os_thread_id,
                    "owns_gil": t.owns_gil,
                    "active": t.active,
                    "frames": [
                        {"function": f.function, "filename": f.filename, "line": f.line, "native": f.native}
                        for f in t.frames
                    ],
                }
                for t in self.threads
            ],
        }


def _is_native(raw: dict[str, Any]) -> bool:
    # py-spy sets ``module`` (the shared object) on native frames and leaves it null on Python frames.
    return bool(raw.get("module")) or _HEX.match(str(raw.get("name", ""))) is not None


def parse_pyspy(
    doc: list[dict[str, Any]], pid: int, *, state: str = "?", native: bool = False
) -> ProcessStack:
    """Parse the JSON list ``py-spy dump --json`` prints (one object per thread)."""
    threads = []
    for t in doc:
        frames = tuple(
            Frame(
                function=str(f.get("name", "?")),
                filename=str(f.get("filename", "?")),
                line=int(f.get("line") or 0),
                native=_is_native(f),
            )
            for f in t.get("frames", [])
        )
        threads.append(
            ThreadStack(
                thread_id=int(t.get("thread_id", 0)),
                name=str(t.get("thread_name") or ""),
                os_thread_id=t.get("os_thread_id"),
                frames=frames,
                owns_gil=bool(t.get("owns_gil")),
                active=bool(t.get("active")),
            )
        )
    return ProcessStack(pid=pid, threads=tuple(threads), state=state, native=native)


def signature(stack: ProcessStack) -> str:
    """The main thread's Python frames as ``file:function``, innermost first, no line numbers.

    Native frames are left out: their names are addresses that differ per process, and a rank taken with
    ``--native`` must compare equal to one taken without. A stopped process or a failed dump has a
    signature of its own (``<stopped>``, ``<error>``).
    """
    main = stack.main
    if main is None or not main.python_frames:
        if stack.stopped:
            return "<stopped>"
        return "<error>" if stack.error else "<no python frames>"
    return " < ".join(f.short for f in main.python_frames)


def progress_key(stack: ProcessStack) -> str:
    """What must change between two samples for a rank to count as progressing.

    The main thread's Python frames with their lines, except the innermost frame's line: a busy Python loop
    in one function (``while True: x += 1``) samples at varying lines of that function, which is no progress.
    """
    main = stack.main
    if main is None or not main.python_frames:
        return signature(stack)
    inner, *outer = main.python_frames
    return " < ".join([inner.short, *(f"{f.short}:{f.line}" for f in outer)])


def in_collective(stack: ProcessStack) -> bool:
    """Whether the main thread waits inside torch.distributed / c10d / gloo / NCCL."""
    main = stack.main
    return main is not None and any(f.in_collective for f in main.frames)


def where(stack: ProcessStack) -> str:
    """``file:line in function`` of the main thread's innermost user-code frame (else innermost Python)."""
    main = stack.main
    if main is None or not main.python_frames:
        return "process stopped" if stack.stopped else (stack.error or "no Python frames")
    frames = main.python_frames
    chosen = next((f for f in frames if f.is_user_code), frames[0])
    return chosen.location


def stack_from_json(d: dict[str, Any]) -> ProcessStack:
    """The inverse of :meth:`ProcessStack.to_json` (stacks sent over the control plane, stacks files)."""
    threads = tuple(
        ThreadStack(
            thread_id=int(t.get("thread_id", 0)),
            name=str(t.get("name") or ""),
            os_thread_id=t.get("os_thread_id"),
            frames=tuple(
                Frame(str(f["function"]), str(f["filename"]), int(f.get("line") or 0), bool(f.get("native")))
                for f in t.get("frames", [])
            ),
            owns_gil=bool(t.get("owns_gil")),
            active=bool(t.get("active")),
        )
        for t in d.get("threads", [])
    )
    known = {"pid", "state", "native", "error", "taken_at", "threads"}
    return ProcessStack(
        pid=int(d.get("pid", 0)),
        threads=threads,
        state=str(d.get("state", "?")),
        native=bool(d.get("native")),
        error=d.get("error"),
        taken_at=float(d.get("taken_at") or 0.0),
        extra={k: v for k, v in d.items() if k not in known},
    )


def python_traceback(stack: ProcessStack) -> str:
    """The main thread's Python frames as a traceback (outermost first), for events and consoles."""
    main = stack.main
    if main is None:
        return ""
    lines = [f'  File "{f.filename}", line {f.line}, in {f.function}' for f in reversed(main.python_frames)]
    return "\n".join(["Stack (most recent call last):", *lines]) if lines else ""
