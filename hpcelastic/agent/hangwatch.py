"""Hang detection on one node without the worker API: sample the workers, report a node-wide stall.

A sampler thread takes a non-blocking, Python-only py-spy dump and the ``/proc`` counters of each worker
every :func:`sample_interval` seconds and feeds :class:`~hpcelastic.hangs.progress.ProgressTracker`; the
agent's main loop never waits on py-spy. When every local rank has made no progress for the stall timeout
(or one progresses again after that), the thread queues a report and wakes the main loop, which sends
:class:`~hpcelastic.agent.messages.StallReport` to the coordinator. On
:class:`~hpcelastic.agent.messages.DumpStacks` a second thread takes native dumps of every worker and sends
:class:`~hpcelastic.agent.messages.StacksReport`.

Ranks that send heartbeats are judged on them (:meth:`HangWatch.heartbeat`).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hpcelastic.agent import messages
from hpcelastic.agent.protocol import MAX_FRAME
from hpcelastic.hangs import pyspy
from hpcelastic.hangs.progress import ProgressTracker, sample
from hpcelastic.hangs.stacks import ProcessStack

MIN_INTERVAL = 2.0
#: A native dump (about a second of CPU each) that takes longer falls back to a Python-only one.
NATIVE_TIMEOUT = 3.0
#: A Python-only dump takes tens of ms; more only on an overloaded node, where waiting beats no stack.
QUICK_TIMEOUT = 10.0
_FRAME_BUDGET = MAX_FRAME * 3 // 4


def sample_interval(stall_timeout: float) -> float:
    """A fifth of the stall timeout, at least :data:`MIN_INTERVAL` (< 1% of a core per worker)."""
    return max(MIN_INTERVAL, stall_timeout / 5)


class HangWatch:
    """Samples this node's workers of the current round; thread-safe towards the agent's main loop."""

    def __init__(self, stall_timeout: float, wake: Callable[[], None]) -> None:
        self.stall_timeout = stall_timeout
        self.interval = sample_interval(stall_timeout)
        self._wake = wake
        self._lock = threading.Lock()
        self._tracker = ProgressTracker(stall_timeout)
        self._round = -1
        self._targets: tuple[tuple[int, int], ...] = ()
        self._main_thread_io = False
        self._reported = False
        self._pending: messages.StallReport | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpcelastic-hangwatch", daemon=True)
        #: False when py-spy is missing: only heartbeats can show a stall.
        self.available = pyspy.pyspy_path() is not None

    def start(self) -> None:
        if self.available:
            self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def watch(self, round_: int, workers: Sequence[tuple[int, int]], *, main_thread_io: bool = False) -> None:
        """Sample ``(rank, pid)`` of round ``round_`` from now on (a new round starts over); with
        ``main_thread_io`` (torchft replica groups) a worker's I/O counts from its main thread alone."""
        with self._lock:
            self._round, self._targets = round_, tuple(workers)
            self._main_thread_io = main_thread_io
            self._tracker.reset()
            self._reported, self._pending = False, None

    def unwatch(self) -> None:
        """The round's workers are being stopped: sample nothing."""
        with self._lock:
            self._targets, self._pending = (), None

    def heartbeat(self, rank: int, step: int | None) -> None:
        with self._lock:
            if step is not None and any(r == rank for r, _ in self._targets):
                self._tracker.heartbeat(rank, step, time.monotonic())

    def take_report(self) -> messages.StallReport | None:
        """The stall report to send, if the node's state changed since the last one."""
        with self._lock:
            report, self._pending = self._pending, None
            return report

    def _run(self) -> None:
        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="hpcelastic-sample") as pool:
            deadline = time.monotonic() + self.interval
            while not self._stop.wait(max(0.0, deadline - time.monotonic())):
                deadline += self.interval  # a fixed cadence, however long a round of samples takes
                self._sample(pool)

    def _sample(self, pool: ThreadPoolExecutor) -> None:
        """Sample every worker at once, then let the tracker decide (all under the lock)."""
        with self._lock:
            round_, targets, main_io = self._round, self._targets, self._main_thread_io
        start = time.monotonic()  # what the samples show holds at least since then
        taken = pool.map(
            lambda pid: sample(pid, timeout=self.interval, main_thread_io=main_io),
            [pid for _, pid in targets],
        )
        samples = list(zip([rank for rank, _ in targets], taken, strict=True))
        with self._lock:
            if round_ != self._round or targets != self._targets:
                return
            now = start
            for rank, s in samples:
                self._tracker.observe(rank, s, now)
            hung = self._tracker.job_stalled(now)
            if hung == self._reported:
                return
            self._reported = hung
            ranks = tuple(sorted(self._tracker.stalled(now)))
            idle = min((self._tracker.idle_for(r, now) for r in ranks), default=0.0)
            self._pending = messages.StallReport(round_, hung, ranks, round(idle, 1))
        self._wake()

    def dump(
        self,
        round_: int,
        workers: Sequence[tuple[int, int, int]],
        send: Callable[..., Any],
        unreachable: Callable[[], tuple[int, ...]] = tuple,
    ) -> None:
        """In a thread: native stacks of ``(rank, local_rank, pid)`` and the peers ``unreachable()`` names
        (pinged meanwhile), then ``send(StacksReport)``."""

        def work() -> None:
            pids = [pid for _, _, pid in workers]
            # Python-only dumps alongside the native ones: a native dump that times out costs no more time.
            with ThreadPoolExecutor(max_workers=3) as pool:
                quick = pool.submit(pyspy.dump_many, pids, nonblocking=True, timeout=QUICK_TIMEOUT)
                full = pool.submit(pyspy.dump_many, pids, native=True, timeout=NATIVE_TIMEOUT, retry=False)
                cut_off = pool.submit(unreachable)
                stacks = {pid: best(full.result()[pid], quick.result()[pid]) for pid in pids}
            doc = {
                str(rank): {**stacks[pid].to_json(), "local_rank": local_rank}
                for rank, local_rank, pid in workers
            }
            send(messages.StacksReport(round_, fit(doc), cut_off.result()))

        threading.Thread(target=work, name="hpcelastic-stacks", daemon=True).start()


def best(native: ProcessStack, quick: ProcessStack) -> ProcessStack:
    """The native dump when it worked, else the Python-only one (saying why there are no native frames)."""
    if native.error is None and native.threads:
        return native
    if native.error and not quick.error:
        quick.extra["native_error"] = native.error
    return quick


def fit(doc: dict[str, Any]) -> dict[str, Any]:
    """Shrink a stacks report below the frame limit: drop native frames, then threads other than main."""
    if len(json.dumps(doc)) <= _FRAME_BUDGET:
        return doc
    for rank in doc.values():
        rank["truncated"] = True
        for t in rank["threads"]:
            t["frames"] = [f for f in t["frames"] if not f["native"]]
    if len(json.dumps(doc)) <= _FRAME_BUDGET:
        return doc
    for rank in doc.values():
        rank["threads"] = [t for t in rank["threads"] if t["os_thread_id"] == rank["pid"]][:1]
    return doc
