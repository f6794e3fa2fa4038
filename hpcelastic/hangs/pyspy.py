"""The I/O edge: stack dumps with py-spy and progress counters from ``/proc``.

Permissions: py-spy reads the worker's memory (``process_vm_readv``) and, unless ``--nonblocking``, pauses it
with ptrace; both are ptrace access checks. py-spy runs as the job's user, as a child of the agent, so it is
the workers' sibling, not their ancestor:

- ``kernel.yama.ptrace_scope`` 0 (or no Yama): any process of the same user may be read. Nothing to do.
- ``ptrace_scope`` 1 (Ubuntu's default): only ancestors or a declared tracer. The worker must declare the
  agent between fork and exec: ``prctl(PR_SET_PTRACER, agent_pid)`` (:func:`allow_tracing_by`, for the
  spawn's ``preexec_fn``); Yama then allows the agent and its descendants (py-spy). No privilege needed.
- ``ptrace_scope`` 2: only with ``CAP_SYS_PTRACE`` (``setcap cap_sys_ptrace+ep`` on the py-spy binary, or
  the agent started with it); 3: ptrace is off, no stacks (localization falls back to process state).
- containers: the seccomp profile must allow ``ptrace`` and ``process_vm_readv`` (Docker's default does on
  kernels >= 4.8); Apptainer/Singularity runs as the user and needs nothing more.

When py-spy cannot read a process the dump carries ``error`` and localization falls back to process state.

A process stopped by SIGSTOP (state ``T``) cannot be paused again: ``py-spy dump`` fails there with "Failed to
suspend process". ``--nonblocking`` still reads its Python frames (no native frames: those need the pause),
and the process stays stopped. :func:`dump` does that by itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from hpcelastic.hangs.stacks import ProcessStack, parse_pyspy

CLK_TCK = os.sysconf("SC_CLK_TCK")
PR_SET_PTRACER = 0x59616D61  # "Yama"


def allow_tracing_by(pid: int) -> None:
    """Let ``pid`` and its descendants read this process under Yama ptrace_scope 1 (a no-op without Yama).

    Call it in the worker between fork and exec; it holds across exec for the life of the process.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0)  # EINVAL without Yama: nothing to allow


def pyspy_path() -> str | None:
    """py-spy next to this interpreter (the venv's bin), else on ``PATH``."""
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm is in parentheses and may contain spaces or ')': the fields start after the last ')'.
    return raw[raw.rindex(")") + 2 :].split()


def proc_state(pid: int) -> str:
    """The state letter of ``/proc/PID/stat`` (``R S D T t Z X``), ``"gone"`` when the pid is gone."""
    fields = _stat_fields(pid)
    return fields[0] if fields else "gone"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of the process (all its threads), 0 when it is gone."""
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / CLK_TCK if fields else 0.0


def io_bytes(pid: int, tid: int | None = None) -> int:
    """``rchar + wchar`` of ``/proc/PID/io`` (of thread ``tid`` alone when given): bytes through read/write
    of any kind (files, pipes, sockets)."""
    try:
        lines = Path(f"/proc/{pid}/task/{tid}/io" if tid else f"/proc/{pid}/io").read_text().splitlines()
    except OSError:
        return 0
    values = dict(line.split(": ", 1) for line in lines if ": " in line)
    return int(values.get("rchar", 0)) + int(values.get("wchar", 0))


def descendants(pid: int) -> list[int]:
    """All descendants of ``pid`` (DataLoader workers, compile workers), via ``/proc/*/task/*/children``."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                kids = [int(k) for k in Path(f"/proc/{p}/task/{tid}/children").read_text().split()]
            except OSError:
                continue
            out.extend(kids)
            todo.extend(kids)
    return out


def dump(
    pid: int, *, native: bool = False, nonblocking: bool = False, timeout: float = 10.0, retry: bool = True
) -> ProcessStack:
    """One stack dump of ``pid``: all threads; native frames when ``native`` and the process is not stopped.

    Never raises for a process that cannot be read: the result has ``error`` set. A stopped process gets a
    non-blocking, Python-only dump; a blocking dump that fails is retried non-blocking (unless not ``retry``).
    """
    state = proc_state(pid)
    now = time.time()
    if state == "gone":
        return ProcessStack(pid=pid, state=state, error="process gone", taken_at=now)
    exe = pyspy_path()
    if exe is None:
        return ProcessStack(pid=pid, state=state, error="py-spy not installed", taken_at=now)
    stopped = state in ("T", "t")
    attempts = [(native and not stopped and not nonblocking, nonblocking or stopped)]
    if not attempts[0][1] and retry:
        attempts.append((False, True))
    error = ""
    for use_native, use_nonblocking in attempts:
        cmd = [exe, "dump", "--pid", str(pid), "--json"]
        cmd += ["--native"] if use_native else []
        cmd += ["--nonblocking"] if use_nonblocking else []
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            error = f"py-spy timed out after {timeout:g} s"
            continue
        if proc.returncode == 0:
            try:
                doc = json.loads(proc.stdout)
            except json.JSONDecodeError as e:
                error = f"py-spy printed no JSON: {e}"
                continue
            stack = _with(parse_pyspy(doc, pid, state=state, native=use_native), now)
            if error:  # the native dump failed, this is the retry: say why there are no native frames
                stack.extra["native_error"] = error
            return stack
        error = _first_error(proc.stderr) or f"py-spy exited with {proc.returncode}"
    return ProcessStack(pid=pid, state=proc_state(pid), error=error, taken_at=now)


def _with(stack: ProcessStack, taken_at: float) -> ProcessStack:
    return ProcessStack(
        pid=stack.pid, threads=stack.threads, state=stack.state, native=stack.native, taken_at=taken_at
    )


def _first_error(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    # py-spy prints "Error: <what>" then "Caused by:" and an indented cause list, then a backtrace.
    head = next((line for line in lines if line.startswith("Error:")), lines[0] if lines else "")
    causes = [line.split(": ", 1)[-1] for line in lines if line[:2].rstrip(":").isdigit()][:2]
    return "; ".join([head.removeprefix("Error: "), *causes]) if head else ""


def dump_many(
    pids: Iterable[int],
    *,
    native: bool = False,
    nonblocking: bool = False,
    timeout: float = 10.0,
    retry: bool = True,
) -> dict[int, ProcessStack]:
    """:func:`dump` of several pids at once (one py-spy per pid, in parallel threads)."""
    pids = list(pids)
    if not pids:
        return {}
    kw = {"native": native, "nonblocking": nonblocking, "timeout": timeout, "retry": retry}
    with ThreadPoolExecutor(max_workers=min(16, len(pids))) as pool:
        results = pool.map(lambda p: dump(p, **kw), pids)
        return dict(zip(pids, results, strict=True))


@dataclass(frozen=True)
class Counters:
    """What ``/proc`` says about a worker and its descendants at one instant."""

    state: str
    own_cpu_s: float
    own_io_bytes: int
    children_cpu_s: float
    children_io_bytes: int


def counters(pid: int, *, main_thread_io: bool = False) -> Counters:
    """Read :class:`Counters` for ``pid`` (a few small ``/proc`` reads; no ptrace pause); with
    ``main_thread_io`` its own I/O is its main thread's alone."""
    kids = descendants(pid)
    return Counters(
        state=proc_state(pid),
        own_cpu_s=cpu_seconds(pid),
        own_io_bytes=io_bytes(pid, pid if main_thread_io else None),
        children_cpu_s=sum(cpu_seconds(k) for k in kids),
        children_io_bytes=sum(io_bytes(k) for k in kids),
    )
