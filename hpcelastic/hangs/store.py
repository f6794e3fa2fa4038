"""Stack files: ``<run>/stacks/attempt-<K>/round-<R>.json``, every rank and every thread of one stall."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpcelastic.hangs.localize import Localization
from hpcelastic.hangs.stacks import ProcessStack
from hpcelastic.rundir import write_json_atomic


def stacks_path(run_dir: str | Path, attempt: int, round_: int) -> Path:
    """Where the stacks of ``attempt``/``round_`` go (directories created 0700)."""
    base = Path(run_dir) / "stacks"
    d = base / f"attempt-{attempt}"
    for p in (base, d):
        p.mkdir(exist_ok=True, mode=0o700)
    return d / f"round-{round_}.json"


def write_stacks(
    run_dir: str | Path,
    attempt: int,
    round_: int,
    stacks_by_rank: Mapping[int, ProcessStack],
    localization: Localization | None = None,
    *,
    info_by_rank: Mapping[int, Mapping[str, Any]] | None = None,
) -> Path:
    """Write one file (0600, atomically) with every rank's stacks and the verdict; returns its path.

    ``info_by_rank`` adds per-rank fields (``host``, ``node_rank``, ``local_rank``) next to the stacks.
    """
    info_by_rank = info_by_rank or {}
    doc = {
        "attempt": attempt,
        "round": round_,
        "written_at": time.time(),
        "localization": localization.to_json() if localization else None,
        "ranks": {
            str(rank): {**dict(info_by_rank.get(rank, {})), **stacks_by_rank[rank].to_json()}
            for rank in sorted(stacks_by_rank)
        },
    }
    path = stacks_path(run_dir, attempt, round_)
    write_json_atomic(path, doc)
    return path
