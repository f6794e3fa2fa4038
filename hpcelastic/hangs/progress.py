"""Progress without the worker API: a pure decision over periodic samples of each rank.

Between two samples a rank made progress when any of these changed:

- its :func:`~hpcelastic.hangs.stacks.progress_key` (main thread's Python frames with lines, except the
  innermost line: a busy loop inside one function is not progress);
- the bytes it or its descendants moved through read/write (``/proc/PID/io``: data loading, gloo traffic,
  checkpoint writes, printing);
- the CPU time of its descendants (DataLoader and compile workers working for it).

Its own CPU time is not progress: a busy Python loop and an NCCL wait spinning on the GPU both burn it.
A stopped process (SIGSTOP) never progresses.

The job is hung when **every** rank has made no progress for ``stall_timeout``: a rank waiting inside a
collective is waiting for someone, so while one rank still progresses (a long checkpoint save on rank 0
writes bytes and changes stacks while the others wait in a barrier; a slow first step compiles, loads data
or allocates with changing stacks) nothing is declared. ``grace_s`` postpones the first possible stall of a
rank after its first sample (a first step that sits in one native call longer than the timeout).

A rank that sends ``heartbeat(step)`` is judged on its heartbeats and the bytes it moves: the script says
what a step is, and a checkpoint save between two heartbeats writes (a save longer than the timeout on
rank 0, the others waiting in a barrier, is no hang).
Sampling I/O lives in :mod:`hpcelastic.hangs.pyspy`; :class:`ProgressTracker` only decides.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    """One observation of one rank. ``key`` None: no stack could be taken (counters only)."""

    key: str | None
    io_bytes: int = 0
    children_cpu_s: float = 0.0
    stopped: bool = False


@dataclass
class _Rank:
    first_seen: float
    last_progress: float
    last: Sample | None = None
    heartbeat_step: int | None = None
    stack_seen: bool = False


class ProgressTracker:
    """Per-rank "no progress for ``stall_timeout``" from samples; ``now`` is always passed in (testable)."""

    def __init__(self, stall_timeout: float, *, grace_s: float = 0.0, cpu_epsilon_s: float = 0.05) -> None:
        if stall_timeout <= 0:
            raise ValueError("stall_timeout must be > 0")
        self.stall_timeout = stall_timeout
        self.grace_s = grace_s
        self.cpu_epsilon_s = cpu_epsilon_s
        self._ranks: dict[int, _Rank] = {}

    def _rank(self, rank: int, now: float) -> _Rank:
        r = self._ranks.get(rank)
        if r is None:
            r = self._ranks[rank] = _Rank(first_seen=now, last_progress=now + self.grace_s)
        return r

    def observe(self, rank: int, sample: Sample, now: float) -> set[int]:
        """Record a sample of ``rank``; returns the ranks stalled at ``now``."""
        r = self._rank(rank, now)
        if r.last is not None and self._progressed(r.last, sample, beats=r.heartbeat_step is not None):
            r.last_progress = max(r.last_progress, now)
        r.last = sample
        r.stack_seen = r.stack_seen or sample.key is not None or sample.stopped
        return self.stalled(now)

    def heartbeat(self, rank: int, step: int, now: float) -> None:
        """A ``heartbeat(step)`` from the worker API: from now on this rank is judged on heartbeats (and
        I/O: its saves)."""
        r = self._rank(rank, now)
        if r.heartbeat_step is None or step != r.heartbeat_step:
            r.last_progress = max(r.last_progress, now)
        r.heartbeat_step = step

    def _progressed(self, before: Sample, after: Sample, *, beats: bool = False) -> bool:
        """Progress between two samples; a rank that sends heartbeats only by the bytes it moved."""
        if after.stopped:
            return False
        if beats:
            return after.io_bytes > before.io_bytes
        return (
            (after.key is not None and before.key is not None and after.key != before.key)
            or after.io_bytes > before.io_bytes
            or after.children_cpu_s - before.children_cpu_s > self.cpu_epsilon_s
        )

    def idle_for(self, rank: int, now: float) -> float:
        """Seconds since ``rank`` last progressed (negative inside its grace)."""
        return now - self._ranks[rank].last_progress

    def stalled(self, now: float) -> set[int]:
        """Ranks with no progress for ``stall_timeout``; a rank never seen with a stack is never stalled."""
        return {
            rank
            for rank, r in self._ranks.items()
            if (r.stack_seen or r.heartbeat_step is not None) and now - r.last_progress >= self.stall_timeout
        }

    def job_stalled(self, now: float) -> bool:
        """Every rank observed is stalled: the job is hung."""
        return bool(self._ranks) and len(self.stalled(now)) == len(self._ranks)

    def forget(self, rank: int) -> None:
        self._ranks.pop(rank, None)

    def reset(self) -> None:
        """A new round: all ranks start over."""
        self._ranks.clear()


def sample(pid: int, *, timeout: float = 5.0, main_thread_io: bool = False) -> Sample:
    """One :class:`Sample` of a worker: a non-blocking, Python-only py-spy dump and ``/proc`` counters.

    ``main_thread_io``: count the main thread's I/O alone (torchft's threads talk to the lighthouse all
    the time, which is no progress)."""
    from hpcelastic.hangs import pyspy
    from hpcelastic.hangs.stacks import progress_key

    c = pyspy.counters(pid, main_thread_io=main_thread_io)
    stack = pyspy.dump(pid, nonblocking=True, timeout=timeout)
    key = None if stack.error and not stack.threads else progress_key(stack)
    return Sample(
        key=key,
        io_bytes=c.own_io_bytes + c.children_io_bytes,
        children_cpu_s=c.children_cpu_s,
        stopped=c.state in ("T", "t"),
    )
