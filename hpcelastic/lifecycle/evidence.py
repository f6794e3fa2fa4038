"""The evidence the end-of-attempt decision reads from outside the event log (I/O at the edge).

- :func:`new_checkpoint`: a complete checkpoint the attempt wrote into the checkpoint directory, published
  or not (an unchanged script saves on its own, with ``torch.save`` or ``torch.distributed.checkpoint``);
  :func:`written_checkpoints`: all of them, for ``status`` and the report.
- :func:`partition_capacity`: which nodes of its partition a requeued job could run on, and how many it needs.
- :func:`still_bad`: the bad nodes, less those lost by silence whose slurmd answers again (a cut link healed).

Each answers None when it cannot tell; the policy then decides without it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from hpcelastic.errors import SlurmError
from hpcelastic.jobs import slurm
from hpcelastic.lifecycle.policy import Capacity

#: ``torch.distributed.checkpoint`` writes this file last: a directory holding it is a complete checkpoint.
DCP_METADATA = ".metadata"
#: Names of files still being written, not checkpoints at all, or a shard of a DCP checkpoint (which is
#: complete only with its directory's ``.metadata``).
PARTIAL_SUFFIXES = (".tmp", ".part", ".partial", ".lock", "~", ".distcp")
OWN_PREFIX = "hpcelastic-"
#: ``torch.save`` writes a zip archive; a complete one ends with its end-of-central-directory record.
ZIP_MAGIC = b"PK\x03\x04"
ZIP_END = b"PK\x05\x06"
ZIP_TAIL_BYTES = 65536 + 22
#: The scan stops after this many entries or this depth (a checkpoint directory on Lustre may be huge).
SCAN_LIMIT = 20000
SCAN_DEPTH = 3


def new_checkpoint(checkpoint_dir: str | os.PathLike[str] | None, since: float) -> str | None:
    """The newest complete checkpoint under ``checkpoint_dir`` modified at or after ``since`` (epoch s),
    relative to the directory; None when there is none or the directory cannot be read."""
    if not checkpoint_dir:
        return None
    root = Path(checkpoint_dir)
    best: tuple[float, str] | None = None
    for path, depth in _walk(root)[:SCAN_LIMIT]:
        mtime = _complete_mtime(path, depth)
        if mtime is not None and mtime >= since and (best is None or mtime > best[0]):
            best = (mtime, str(path.relative_to(root)))
    return best[1] if best else None


def newest_checkpoint(checkpoint_dir: str | os.PathLike[str] | None) -> str | None:
    """The newest complete checkpoint under ``checkpoint_dir``, relative to it (None: none)."""
    return new_checkpoint(checkpoint_dir, float("-inf"))


def written_checkpoints(checkpoint_dir: str | os.PathLike[str] | None) -> list[tuple[str, float]]:
    """Every complete checkpoint in ``checkpoint_dir`` (a top-level entry, as :func:`checkpoint_of` names
    them) and when it was complete, oldest first: what a script wrote, published or not. Empty when the
    directory is missing or unreadable."""
    if not checkpoint_dir:
        return []
    root = Path(checkpoint_dir)
    try:
        entries = [e for e in os.scandir(root) if not e.name.startswith((".", OWN_PREFIX))]
    except OSError:
        return []
    found: list[tuple[str, float]] = []
    for e in sorted(entries, key=lambda e: e.name)[:SCAN_LIMIT]:
        if e.name.endswith(PARTIAL_SUFFIXES):
            continue
        path = Path(e.path)
        if e.is_dir(follow_symlinks=False) and not (path / DCP_METADATA).is_file():
            done = _newest_complete_file(path)
        else:
            done = _complete_mtime(path, 0)
        if done is not None:
            found.append((e.name, done))
    return sorted(found, key=lambda f: (f[1], f[0]))


def checkpoint_of(
    checkpoint_dir: str | os.PathLike[str], file: str | os.PathLike[str]
) -> tuple[str, float | None]:
    """The checkpoint ``file`` (a path under ``checkpoint_dir``) belongs to, relative to the directory, and
    when it was complete (None: it is not): the DCP directory holding it (its ``.metadata``), else the
    top-level directory holding it (a checkpoint of several files, as Accelerate's ``save_state`` writes:
    its newest complete file), else the file itself."""
    root, path = Path(checkpoint_dir), Path(file)
    rel = path.relative_to(root)
    for depth in range(1, len(rel.parts)):
        folder = root.joinpath(*rel.parts[:depth])
        if (folder / DCP_METADATA).is_file():
            return str(folder.relative_to(root)), _complete_mtime(folder, depth - 1)
    if len(rel.parts) > 1:
        return rel.parts[0], _newest_complete_file(root / rel.parts[0])
    return str(rel), _complete_mtime(path, 0)


def _newest_complete_file(folder: Path) -> float | None:
    """When the newest complete file under ``folder`` was (a checkpoint of several files: Accelerate's
    ``save_state``); None when it holds none."""
    times = [t for p, d in _walk(folder) if not p.is_dir() and (t := _complete_mtime(p, d)) is not None]
    return max(times) if times else None


def _walk(root: Path) -> list[tuple[Path, int]]:
    """Entries under ``root`` to :data:`SCAN_DEPTH`, not descending into DCP checkpoints."""
    out: list[tuple[Path, int]] = []
    todo = [(root, 0)]
    while todo and len(out) <= SCAN_LIMIT:
        folder, depth = todo.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for e in entries:
            if e.name.startswith((".", OWN_PREFIX)) or e.name.endswith(PARTIAL_SUFFIXES):
                continue
            path = Path(e.path)
            out.append((path, depth))
            deeper = depth + 1 < SCAN_DEPTH and e.is_dir(follow_symlinks=False)
            if deeper and not (path / DCP_METADATA).exists():
                todo.append((path, depth + 1))
    return out


def _complete_mtime(path: Path, depth: int) -> float | None:
    """When ``path`` was completed, if it is a complete checkpoint: a DCP directory (its ``.metadata``)
    or a non-empty file (a zip archive only with its end record: a save killed halfway is not one)."""
    try:
        if path.is_dir():
            meta = path / DCP_METADATA
            return meta.stat().st_mtime if meta.is_file() else None
        st = path.stat()
        if not path.is_file() or st.st_size == 0 or torn_zip(path, st.st_size):
            return None
        return st.st_mtime
    except OSError:
        return None


def torn_zip(path: Path, size: int) -> bool:
    """A ``torch.save`` zip archive without its end record: a save killed or still writing."""
    with path.open("rb") as f:
        if f.read(4) != ZIP_MAGIC:
            return False
        f.seek(max(0, size - ZIP_TAIL_BYTES))
        return ZIP_END not in f.read()


def partition_capacity(job_id: str) -> Capacity | None:
    """The nodes of job ``job_id``'s partition that can run it now or once back up (all but drained ones:
    a down node usually comes back, a drained one waits for an admin) and how many it needs (the low end
    of its ``NumNodes``); None when Slurm cannot say."""
    try:
        job = slurm.show_job(job_id)
        partition = job.get("Partition", "").split(",")[0]
        needed = int(job.get("NumNodes", "").split("-")[0])
        states = slurm.partition_node_states(partition) if partition else {}
    except (SlurmError, ValueError):
        return None
    usable = {n for n, state in states.items() if not state.rstrip("*~#!%$@^-").startswith(("drain", "drng"))}
    return Capacity(frozenset(usable), needed) if usable else None


def still_bad(bad_nodes: Sequence[str], unreachable: Sequence[str]) -> tuple[str, ...]:
    """``bad_nodes`` less the ``unreachable`` ones (lost by silence only) whose slurmd answers now from this
    node: the link that cut them off came back, so nothing is known against the node itself."""
    silent = set(unreachable)
    out = []
    for node in bad_nodes:
        if node in silent:
            try:
                if slurm.slurmd_answers(node):
                    continue
            except SlurmError:
                pass
        out.append(node)
    return tuple(out)
