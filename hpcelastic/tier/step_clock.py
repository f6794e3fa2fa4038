"""When each worker last finished a training step, for unchanged scripts: the evidence that a save ended.

A checkpoint no format marks as finished (Accelerate's ``save_state``, a ``Trainer`` checkpoint, several
``torch.save`` files) is complete once every rank went on training after its last write to it. A worker
started warm (the fork server, ``agent/forkserver.py``) registers one global optimizer step hook
(``torch.optim.optimizer.register_optimizer_step_post_hook``: it runs after every ``Optimizer.step`` of
any optimizer in the process, under Accelerate, Lightning, ``Trainer`` and plain loops alike) that
stores the step's count and wall time in 16 bytes of a file in the node's tier (a memory write per step:
no system call). The agent reads them when it scans (:func:`last_step_ns`). Without it (a cold start)
the tier falls back on the script beginning its next save (:func:`hpcelastic.tier.scan.judge`).

Hand-written: no library exposes "the process took a training step" for an unchanged script; the hook
is torch's own.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import sys
import time
from pathlib import Path

#: Set for a worker whose checkpoint dir is the node-local tier: the file its step clock writes.
VARIABLE = "HPCELASTIC_STEP_CLOCK"
#: The clocks' folder beside the tier's ``live`` directory.
CLOCK_DIR = "clocks"
#: Two little-endian int64: steps taken, wall time of the last one (ns since the epoch; 0: none yet).
LAYOUT = struct.Struct("<qq")


def clock_path(live: Path, local_rank: int) -> Path:
    """Local rank ``local_rank``'s clock, for the tier whose ``live`` directory the workers save into."""
    return live.parent / CLOCK_DIR / str(local_rank)


def install_from_env() -> bool:
    """In a worker, before its script runs: start the step clock if the agent asked for one and torch is
    already imported (a warm start); whether it runs."""
    path = os.environ.get(VARIABLE)
    torch = sys.modules.get("torch")
    if not path or torch is None:
        return False
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, LAYOUT.size)
            view = mmap.mmap(fd, LAYOUT.size)
        finally:
            os.close(fd)
        from torch.optim.optimizer import register_optimizer_step_post_hook
    except (OSError, ImportError):
        return False
    steps = [0]

    def tick(_optimizer: object, _args: object, _kwargs: object) -> None:
        steps[0] += 1
        LAYOUT.pack_into(view, 0, steps[0], time.time_ns())

    register_optimizer_step_post_hook(tick)
    return True


def last_step_ns(clock_dir: Path) -> int | None:
    """The wall time of the last step every worker with a clock in ``clock_dir`` has taken (the oldest of
    their last steps; 0 when one has taken none), or None when no worker keeps a clock."""
    times = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(clock_dir):
            with contextlib.suppress(OSError, struct.error), open(entry.path, "rb") as f:
                times.append(LAYOUT.unpack(f.read(LAYOUT.size))[1])
    return min(times) if times else None


def reset(clock_dir: Path) -> None:
    """A new round: the last round's workers' clocks say nothing of the new ones."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(clock_dir):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
