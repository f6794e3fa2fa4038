"""The agent's stacks for the ``input`` kind: whether its ranks sit in data loading, sampled only while its
pace has dropped.

The coordinator names a slow node's kind ``input`` when its late ranks' stacks sit in data loading more than
the others' (``slow/locate.py``). A stack costs a py-spy dump (tens of ms of CPU), so a node takes none
while it trains at its pace: :class:`LocalPace` follows its ranks' step count, and in synchronous training
every node slows with the job, so each sees the drop when the coordinator does. While the latest window is
:data:`DROP` below the best of the recent ones, :class:`InputWatch` dumps each worker's main thread every
:data:`SAMPLE_EVERY_S` in a thread of its own (the agent's loop never waits on py-spy), and reports the
share of each rank's last :data:`KEEP` stacks in data loading. Without py-spy it reports nothing (the
kind is then ``compute``).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from hpcelastic.hangs import pyspy
from hpcelastic.slow.collect import input_share

#: The pace windows (s), how many recent ones set the best, and the drop below it that starts sampling.
WINDOW_S = 10.0
BEST_OF = 30
DROP = 0.1
#: Complete windows before any drop counts (a round's first steps are slow).
WARMUP_WINDOWS = 2
SAMPLE_EVERY_S = 2.0
KEEP = 10


@dataclass
class LocalPace:
    """This node's step rate over windows of :data:`WINDOW_S`; pure (the caller passes the time)."""

    start: tuple[float, int] | None = None
    rates: list[float] = field(default_factory=list)

    def observe(self, now: float, steps: int) -> None:
        if self.start is None or steps < self.start[1]:
            self.start = (now, steps)
            return
        t0, s0 = self.start
        if now - t0 >= WINDOW_S:
            self.rates = [*self.rates, (steps - s0) / (now - t0)][-(BEST_OF + 1) :]
            self.start = (now, steps)

    def dropped(self) -> bool:
        """The latest complete window ran :data:`DROP` below the best recent one (after the warm-up)."""
        if len(self.rates) <= WARMUP_WINDOWS:
            return False
        best = max(self.rates[WARMUP_WINDOWS - 1 : -1] or self.rates[:-1])
        return best > 0 and self.rates[-1] < (1.0 - DROP) * best


class InputWatch:
    """Samples this node's workers of the current round while its pace has dropped; thread-safe."""

    def __init__(self) -> None:
        self.available = pyspy.pyspy_path() is not None
        self._lock = threading.Lock()
        self._pids: dict[int, int] = {}
        self._stacks: dict[int, deque[tuple[str, ...]]] = {}
        self._pace = LocalPace()
        self._sampling = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpcelastic-inputwatch", daemon=True)

    def start(self) -> None:
        if self.available:
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._sampling.set()  # wake it to stop

    def watch(self, workers: Mapping[int, int]) -> None:
        """A new round: sample ``rank -> pid`` from now on, the pace and the stacks start over."""
        with self._lock:
            self._pids = dict(workers)
            self._stacks = {rank: deque(maxlen=KEEP) for rank in workers}
            self._pace = LocalPace()
        self._sampling.clear()

    def observe(self, now: float, steps: int) -> None:
        """The node's ranks' step count now (the most of them): sample while the pace has dropped."""
        with self._lock:
            self._pace.observe(now, steps)
            dropped = self._pace.dropped()
        if dropped and self.available:
            self._sampling.set()
        elif self._sampling.is_set():  # the pace is back: what the drop's stacks said is past
            self._sampling.clear()
            with self._lock:
                self._stacks = {rank: deque(maxlen=KEEP) for rank in self._pids}

    def shares(self) -> dict[int, float]:
        """Each rank's share of its recent stacks in data loading (none: not sampled in this round)."""
        with self._lock:
            out = {rank: input_share(list(stacks)) for rank, stacks in self._stacks.items()}
        return {rank: share for rank, share in out.items() if share is not None}

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sampling.wait()
            if self._stop.wait(SAMPLE_EVERY_S) or not self._sampling.is_set():
                continue
            with self._lock:
                pids = dict(self._pids)
            for rank, pid in pids.items():
                stack = pyspy.dump(pid, nonblocking=True, timeout=SAMPLE_EVERY_S)
                main = stack.main
                if main is None:
                    continue
                functions = tuple(f.function for f in main.frames)
                with self._lock:
                    if self._pids.get(rank) == pid:
                        self._stacks[rank].append(functions)
