"""Runs examples/torchft_train.py unchanged and logs every step it commits (for bench/replica_goodput.py).

The example calls ``worker.heartbeat(step)`` right after each committed step; this wrapper wraps that
function to also append ``{"group", "rank", "pid", "step", "ts"}`` to ``$REPLICA_BENCH_STEP_LOG`` (one
``O_APPEND`` write per line), then runs the example as ``__main__`` with the same arguments.

Under plain torchrun the worker API resumes by itself from what ``publish_checkpoint`` wrote
(``HPCELASTIC_CHECKPOINT_DIR`` is set, and torchrun's restarts count up).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from pathlib import Path

from hpcelastic import worker

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torchft_train.py"
STEP_LOG_VARIABLE = "REPLICA_BENCH_STEP_LOG"

_heartbeat = worker.heartbeat
_fd: list[int] = []


def logged_heartbeat(step: int) -> None:
    """The worker API's heartbeat, plus one line in the bench's step log."""
    if not _fd:
        _fd.append(os.open(os.environ[STEP_LOG_VARIABLE], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
    line = {
        "group": int(os.environ.get("REPLICA_GROUP_ID", "0")),
        "rank": int(os.environ.get("RANK", "0")),
        "pid": os.getpid(),
        "step": int(step),
        "ts": time.time(),
    }
    os.write(_fd[0], (json.dumps(line) + "\n").encode())
    _heartbeat(step)


def main() -> None:
    worker.heartbeat = logged_heartbeat  # type: ignore[assignment]
    sys.argv = [str(EXAMPLE), *sys.argv[1:]]
    runpy.run_path(str(EXAMPLE), run_name="__main__")


if __name__ == "__main__":
    main()
