"""A node's speed check: how fast it runs a fixed CPU workload now, so that a spare is known fast before it
takes a slow node's place (hpcelastic/slow/watch.py compares it with the round nodes' checks at their start).

Hashing a 64 KiB buffer, timed on the wall clock over about half a second: a node slowed by a CPU quota
(the kernel's CFS bandwidth control runs it for ``quota`` of every 100 ms period), a noisy neighbour or
thermal throttling runs fewer hashes a second. Half a second spans five CFS periods, so a quota shows in
full. It uses one core; a node's first check runs before its first round, a spare's again every minute.
"""

from __future__ import annotations

import hashlib
import time

#: Seconds one check runs.
CHECK_S = 0.5
#: A spare checks again this often while it waits (a spare may slow down while it idles).
RECHECK_S = 60.0
_BLOCK = bytes(range(256)) * 256  # 64 KiB


def measure(seconds: float = CHECK_S) -> float:
    """Hashes of a 64 KiB block a second of wall time, over ``seconds``."""
    done, start = 0, time.perf_counter()
    deadline = start + seconds
    while True:
        for _ in range(8):
            hashlib.sha256(_BLOCK).digest()
        done += 8
        now = time.perf_counter()
        if now >= deadline:
            return done / (now - start)
