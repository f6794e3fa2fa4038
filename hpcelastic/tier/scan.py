"""Which checkpoints in a node's local directory are complete on this node (the I/O is one listing).

A checkpoint is a top-level entry of the directory the workers save into (``HPCELASTIC_CHECKPOINT_DIR``):
a file (``step-300.pt``) or a directory (a ``torch.distributed.checkpoint`` directory, Lightning's or
Accelerate's). This node's files of it are *settled* when no worker holds one open for writing and none
changed since the previous scan. The judgement of what is complete is
:mod:`hpcelastic.lifecycle.evidence`'s: a DCP directory is complete with its ``.metadata`` (DCP writes
it last, on one rank, after every rank's shards are written), a ``torch.save`` archive with its zip end
record; ``worker.publish_checkpoint`` marks an entry complete explicitly (:func:`publish_marker`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hpcelastic.errors import UserError
from hpcelastic.lifecycle.evidence import DCP_METADATA, OWN_PREFIX, PARTIAL_SUFFIXES, torn_zip

#: A shard of a DCP checkpoint: its directory is complete only with the ``.metadata`` one rank writes.
DCP_SHARD_SUFFIX = ".distcp"
#: ``worker.publish_checkpoint`` under the tier writes this file (one per entry) instead of the handoff.
PUBLISH_PREFIX = f"{OWN_PREFIX}publish-"
#: Files inside a checkpoint directory that may be ``torch.save`` archives (checked for their end record).
ARCHIVE_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".tar")
#: Files not changed for this long, and not open for writing, are settled at first sight.
SETTLE_S = 0.3
#: The scan reads at most this many files of one entry (a checkpoint of more is judged on those).
MAX_FILES = 10000


@dataclass(frozen=True)
class FileInfo:
    """One file of a checkpoint: its path relative to the local directory, size and change time."""

    rel: str
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class Entry:
    """This node's files of one checkpoint, as one scan saw them."""

    name: str
    files: tuple[FileInfo, ...]
    is_dir: bool
    dcp: bool
    #: It holds what makes the checkpoint complete: DCP's ``.metadata``, a complete file, a published mark.
    marker: bool
    #: A ``torch.save`` archive without its end record (a save killed, or still writing).
    torn: bool

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def same_files(self, other: Entry | None) -> bool:
        return other is not None and other.files == self.files


def step_of(name: str) -> int | None:
    """The step a checkpoint's name carries: its last number (``step-000300.pt`` -> 300), else None."""
    numbers = re.findall(r"\d+", name)
    return int(numbers[-1]) if numbers else None


def publish_marker(live: Path, entry: str) -> Path:
    """The file ``worker.publish_checkpoint`` writes for ``entry`` under the tier."""
    return live / f"{PUBLISH_PREFIX}{entry}.json"


def read_published(live: Path) -> dict[str, int]:
    """Entries the script published, with their steps (from :func:`publish_marker` files)."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for e in os.scandir(live):
            if e.name.startswith(PUBLISH_PREFIX) and e.name.endswith(".json"):
                with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
                    obj = json.loads(Path(e.path).read_text())
                    out[str(obj["entry"])] = int(obj["step"])
    return out


def is_candidate(name: str) -> bool:
    """A top-level name that may be a checkpoint (not hpcelastic's own, not hidden, not a partial write)."""
    return not name.startswith((".", OWN_PREFIX)) and not name.endswith(PARTIAL_SUFFIXES)


def scan(live: Path, published: Mapping[str, int] = {}, skip: Iterable[str] = ()) -> dict[str, Entry]:
    """Every candidate entry of ``live`` but those in ``skip``, with its files."""
    out: dict[str, Entry] = {}
    skipped = set(skip)
    try:
        top = list(os.scandir(live))
    except OSError:
        return out
    for e in top:
        if e.name in skipped or not is_candidate(e.name):
            continue
        with contextlib.suppress(OSError):
            entry = _entry(live, e, e.name in published)
            if entry is not None:
                out[e.name] = entry
    return out


def _entry(live: Path, top: os.DirEntry[str], published: bool) -> Entry | None:
    if top.is_symlink():
        return None  # a restore from the shared directory: not this node's to replicate or persist
    if not top.is_dir():
        st = top.stat()
        torn = st.st_size == 0 or torn_zip(Path(top.path), st.st_size)
        info = FileInfo(top.name, st.st_size, st.st_mtime_ns)
        return Entry(top.name, (info,), False, False, published or not torn, torn)
    files: list[FileInfo] = []
    todo = [Path(top.path)]
    while todo and len(files) < MAX_FILES:
        folder = todo.pop()
        for e in os.scandir(folder):
            if e.is_dir(follow_symlinks=False):
                todo.append(Path(e.path))
            elif e.is_file(follow_symlinks=False):
                st = e.stat()
                files.append(FileInfo(os.path.relpath(e.path, live), st.st_size, st.st_mtime_ns))
    files.sort(key=lambda f: f.rel)
    names = [f.rel.rsplit("/", 1)[-1] for f in files]
    dcp = any(n.endswith(DCP_SHARD_SUFFIX) or n == DCP_METADATA for n in names)
    torn = any(torn_zip(live / f.rel, f.size) for f in files if f.rel.endswith(ARCHIVE_SUFFIXES))
    has_metadata = f"{top.name}/{DCP_METADATA}" in {f.rel for f in files}
    marker = published or (has_metadata if dcp else bool(files) and not torn)
    return Entry(top.name, tuple(files), True, dcp, marker and not torn, torn)


def settled(
    previous: Entry | None, current: Entry, writing: Iterable[str], live: Path, now_ns: int | None = None
) -> bool:
    """This node's files of ``current`` are done: none open for writing (``writing``: real paths the workers
    hold open for writing), no torn archive among them, and unchanged since the previous scan or for
    :data:`SETTLE_S`."""
    if current.torn or not current.files:
        return False
    now_ns = time.time_ns() if now_ns is None else now_ns
    quiet = all(now_ns - f.mtime_ns >= SETTLE_S * 1e9 for f in current.files)
    if not (quiet or current.same_files(previous)):
        return False
    prefix = str(live / current.name)
    return not any(p == prefix or p.startswith(prefix + "/") for p in writing)


def by_step(names: Iterable[str]) -> list[str]:
    """Checkpoint names oldest first: by the step in the name, then by name."""
    return sorted(names, key=lambda n: (step_of(n) is not None, step_of(n) or 0, n))


def write_publish_marker(live: str, path: str, step: int) -> Path:
    """``worker.publish_checkpoint`` under the tier: the checkpoint with ``path`` is complete at ``step``."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(live))
    if rel.startswith("..") or rel == ".":
        raise UserError(f"cannot publish {path}: under the local checkpoint tier it must be inside {live}")
    entry = rel.split(os.sep, 1)[0]
    marker = publish_marker(Path(live), entry)
    tmp = marker.with_name(f".{marker.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"entry": entry, "step": int(step)}))
    os.replace(tmp, marker)
    return marker
