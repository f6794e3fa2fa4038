"""The coordinator's event writes, off its network loop and tolerant of a failing filesystem.

The coordinator thread reads heartbeats: one write that blocks on a slow shared filesystem must not
delay them, and a write that fails (ENOSPC, EDQUOT, EIO, ESTALE, EMFILE, ...) must not end the
control plane. :class:`EventWriter` queues each event with the time it happened; its own thread writes
them in order, and on an error logs one line, keeps the events (at most ``max_pending``; the oldest
are dropped beyond that, and counted) and tries again after a pause.
"""

from __future__ import annotations

import collections
import sys
import threading
import time

from hpcelastic.events import Event
from hpcelastic.rundir import RunDir

MAX_PENDING = 10_000
RETRY_DELAY = 1.0


class EventWriter:
    """Writes events to ``run_dir`` from a thread of its own, in the order they were queued."""

    def __init__(
        self, run_dir: RunDir, *, max_pending: int = MAX_PENDING, retry_delay: float = RETRY_DELAY
    ) -> None:
        self.run_dir = run_dir
        self.retry_delay = retry_delay
        self._pending: collections.deque[tuple[Event, str | None, float]] = collections.deque(
            maxlen=max_pending
        )
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        #: Events dropped because the buffer was full while the filesystem failed.
        self.dropped = 0
        #: The last write error, None once a write succeeded again.
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="hpcelastic-event-writer", daemon=True)
        self._thread.start()

    def record(self, event: Event, *, host: str | None = None) -> None:
        """Queue ``event`` (stamped now); never blocks and never raises."""
        with self._cond:
            if len(self._pending) == self._pending.maxlen:
                self.dropped += 1
            self._pending.append((event, host, time.time()))
            self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until every queued event is written (or ``timeout`` s passed); True if all were."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float) -> bool:
        """Flush for at most ``timeout`` s, then stop the thread; True if nothing was left unwritten."""
        done = self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=1.0)
        if not done:
            _log(f"{len(self._pending)} event(s) not written to {self.run_dir.events_path}")
        return done

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                event, host, ts = self._pending[0]
                self._busy = True
            try:
                self.run_dir.record(event, host=host, ts=ts)
            except Exception as e:  # noqa: BLE001 - any write error: keep the event and retry
                self._failed(e)
                continue
            with self._cond:
                if self._pending and self._pending[0][2] == ts and self._pending[0][0] is event:
                    self._pending.popleft()
                self._busy = False
                self._cond.notify_all()
            if self.error is not None:
                _log(f"writing {self.run_dir.events_path} works again")
                self.error = None

    def _failed(self, e: Exception) -> None:
        text = f"{type(e).__name__}: {e}"
        if text != self.error:
            _log(
                f"cannot write {self.run_dir.events_path} ({text}); the job goes on, "
                f"events are kept in memory and written again every {self.retry_delay:g} s"
            )
            self.error = text
        with self._cond:
            self._busy = False
            self._cond.notify_all()
            self._cond.wait(self.retry_delay)


def _log(text: str) -> None:
    print(f"hpcelastic: {text}", file=sys.stderr, flush=True)
