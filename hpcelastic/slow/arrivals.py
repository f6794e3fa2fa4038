"""When each rank issued its recent collectives, for unchanged scripts: who the others wait for.

PyTorch's Flight Recorder (``TORCH_FR_BUFFER_SIZE`` entries, gloo and NCCL alike) records every collective a
rank issues, DDP's C++ reducer included, with its process group, its sequence number in that group and
``time_created_ns`` (the wall time the rank issued it). In synchronous training the rank that issues
collective ``(pg, seq)`` last is the one the others wait for; :mod:`hpcelastic.slow.locate` reads that.

A worker started warm (``agent/forkserver.py``) with :data:`VARIABLE` set (the agent sets it when slow-node
detection is on; a job may set it itself) turns the recorder on (:data:`FR_ENTRIES` entries unless the job
set a size) and registers one global optimizer step post hook. Every ``every`` steps (a power of two chosen
so that a dump falls about every :data:`INTERVAL_S` seconds, halved while a dump is overdue twice that;
powers of two nest, so ranks that measured the step time slightly differently still dump at common steps,
where their last collectives coincide) it
dumps the recorder without stack traces and writes its last :data:`KEEP` collectives to
``<VARIABLE>/arrivals-<RANK>`` (replaced atomically), which the agent reads (:func:`read`).

Hand-written: the recorder is torch's; no library hands another process a rank's recent collectives.
Without an optimizer step (a script that updates its parameters by hand) nothing is written.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import struct
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Set for a worker whose collectives the agent watches: the node's directory for the files.
VARIABLE = "HPCELASTIC_SLOW_DIR"
#: The recorder's size variables (torch reads the first, or the second of older versions).
FR_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
#: The recorder's size when the job set none: a dump's cost grows with it (``bench``: 256 entries ~2 ms).
FR_ENTRIES = 256
#: About how often a rank writes its file.
INTERVAL_S = 5.0
#: Collectives written per dump.
KEEP = 64
#: Header: steps taken, wall time of the dump (ns), collectives that follow.
HEADER = struct.Struct("<qqi")
#: One collective: process group id, sequence number in it, wall time issued (ns).
ENTRY = struct.Struct("<iqq")
_MAX_EVERY = 1 << 16


def path(directory: str | os.PathLike[str], rank: int) -> Path:
    """Global rank ``rank``'s arrivals file in the node's directory."""
    return Path(directory) / f"arrivals-{rank}"


def clock_path(directory: str | os.PathLike[str], rank: int) -> Path:
    """Global rank ``rank``'s step clock (``tier/step_clock.py``) in the node's directory, where the tier
    keeps none."""
    return Path(directory) / f"clock-{rank}"


@dataclass(frozen=True)
class Dump:
    """One rank's file: its steps at the dump, the dump's wall time, and ``(pg, seq, created_ns)``s."""

    steps: int
    dump_ns: int
    entries: tuple[tuple[int, int, int], ...]


def encode(steps: int, dump_ns: int, entries: Iterable[tuple[int, int, int]]) -> bytes:
    """The file's bytes."""
    rows = list(entries)
    return HEADER.pack(steps, dump_ns, len(rows)) + b"".join(ENTRY.pack(*row) for row in rows)


def decode(data: bytes) -> Dump | None:
    """A file's contents, or None when it is not one (short, or cut)."""
    if len(data) < HEADER.size:
        return None
    steps, dump_ns, count = HEADER.unpack_from(data)
    if count < 0 or len(data) != HEADER.size + count * ENTRY.size:
        return None
    entries = tuple(ENTRY.unpack_from(data, HEADER.size + i * ENTRY.size) for i in range(count))
    return Dump(steps, dump_ns, entries)


def read(file: Path) -> Dump | None:
    """A rank's latest dump, or None (none yet, unreadable)."""
    try:
        return decode(file.read_bytes())
    except OSError:
        return None


def collectives(entries: Iterable[Mapping[str, Any]], keep: int = KEEP) -> list[tuple[int, int, int]]:
    """The last ``keep`` collectives (not point-to-point) of the recorder's entries, oldest first."""
    rows = [
        (int(e["pg_id"]), int(e["collective_seq_id"]), int(e["time_created_ns"]))
        for e in entries
        if not e.get("is_p2p") and e.get("collective_seq_id") and e.get("time_created_ns")
    ]
    return rows[-keep:]


def next_every(period_ns: float, interval_s: float = INTERVAL_S) -> int:
    """Steps between dumps: the least power of two whose steps last ``interval_s`` at ``period_ns`` a step."""
    every = 1
    while every < _MAX_EVERY and every * period_ns < interval_s * 1e9:
        every <<= 1
    return every


def _write(file: Path, data: bytes) -> None:
    tmp = file.with_name(f".{file.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, file)


def install_from_env() -> bool:
    """In a worker, before its script runs: start writing arrivals if the agent asked for them and torch is
    already imported (a warm start); whether it runs."""
    directory = os.environ.get(VARIABLE)
    rank = os.environ.get("RANK", "")
    if not directory or not rank.isdigit() or sys.modules.get("torch") is None:
        return False
    try:
        from torch._C._distributed_c10d import _dump_fr_trace
        from torch.optim.optimizer import register_optimizer_step_post_hook
    except ImportError:
        return False
    if not any(os.environ.get(v) for v in FR_VARIABLES):
        os.environ[FR_VARIABLES[0]] = str(FR_ENTRIES)  # read when the script creates its process group
    with contextlib.suppress(OSError):
        os.makedirs(directory, exist_ok=True)
    file = path(directory, int(rank))
    state = {"steps": 0, "every": 1, "last_ns": 0, "last_steps": 0}

    def tick(_optimizer: object, _args: object, _kwargs: object) -> None:
        state["steps"] += 1
        steps = state["steps"]
        if steps % state["every"]:
            if state["every"] == 1 or time.time_ns() - state["last_ns"] < 2 * INTERVAL_S * 1e9:
                return
            state["every"] >>= 1  # the steps slowed down: halve (still a power of two, so still common)
            if steps % state["every"]:
                return
        now = time.time_ns()
        try:
            rows = collectives(pickle.loads(_dump_fr_trace(True, False, False)).get("entries", ()))
            _write(file, encode(steps, now, rows))
        except Exception:  # noqa: BLE001 - never break training: stop writing instead
            state["every"] = _MAX_EVERY << 20
            with contextlib.suppress(OSError):
                file.unlink()
            return
        if state["last_steps"]:
            state["every"] = next_every((now - state["last_ns"]) / (steps - state["last_steps"]))
        state["last_ns"], state["last_steps"] = now, steps

    register_optimizer_step_post_hook(tick)
    return True
