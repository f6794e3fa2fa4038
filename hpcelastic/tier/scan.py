"""Which checkpoints in a node's local directory are complete on this node (the I/O is one listing).

A checkpoint is a top-level entry of the directory the workers save into (``HPCELASTIC_CHECKPOINT_DIR``):
a file (``step-300.pt``) or a directory (a ``torch.distributed.checkpoint`` directory, Lightning's,
Accelerate's, a Hugging Face ``Trainer`` checkpoint). This node's files of it are *settled* when no worker
holds one open for writing and none changed since the previous scan.

What counts as complete is positive evidence only (:func:`judge`), never quiet time:

- the format's own completion marker (:attr:`Entry.marker`): the entry is one DCP directory with its
  ``.metadata`` (DCP writes it last, on one rank, after every rank's shards); a single ``torch.save``
  archive with its zip end record, or a safetensors file whose bytes reach its header's last tensor; a
  safetensors index with every shard it names, complete, beside only metadata files;
  ``worker.publish_checkpoint`` (:func:`publish_marker`). An entry of several DCP directories (``model/``,
  ``optim/``: several DCP saves) needs every one's ``.metadata`` *and* the behaviour below, since the
  next save may not have begun;
- or the script's own behaviour: every rank of this node went on to a newer save (a newer step, begun after
  this entry's last write, in the same round) and nothing in this entry changed since. A save is a
  synchronous call in the libraries users have (and the steps between two saves are collectives), so a
  rank that began the next save had finished this one;
- or the workers of the round all ended with exit status 0: nothing they wrote can still change.

An entry with none of these is *not judged*: never reported complete, never deleted. One with a
``torch.save`` archive that lacks its end record, or a safetensors file shorter than its header says, is
*torn* once its writers are gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hpcelastic.errors import UserError
from hpcelastic.lifecycle.evidence import DCP_METADATA, OWN_PREFIX, PARTIAL_SUFFIXES, ZIP_MAGIC, torn_zip

#: A shard of a DCP checkpoint: its directory is complete only with the ``.metadata`` one rank writes.
DCP_SHARD_SUFFIX = ".distcp"
#: ``worker.publish_checkpoint`` under the tier writes this file (one per entry) instead of the handoff.
PUBLISH_PREFIX = f"{OWN_PREFIX}publish-"
#: Files inside a checkpoint directory that may be ``torch.save`` archives (checked for their end record).
ARCHIVE_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".tar", ".pkl")
SAFETENSORS_SUFFIX = ".safetensors"
SAFETENSORS_INDEX_SUFFIX = ".safetensors.index.json"
#: Files beside a safetensors index that carry no tensors (``save_pretrained``'s config and tokenizer files).
METADATA_SUFFIXES = (".json", ".txt", ".md", ".model", ".jinja")
#: Why a DCP directory does not complete its entry (its shards without the file DCP writes last).
DCP_METADATA_MISSING = f"has no {DCP_METADATA}"
#: A safetensors header longer than this is not one (the format's own limit is 100 MB).
SAFETENSORS_MAX_HEADER = 100_000_000
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
    #: The format's own marker says this node's files complete the checkpoint (module docstring), or the
    #: script published it.
    marker: bool
    #: A ``torch.save`` archive without its end record or a short safetensors file (a save killed, or still
    #: writing).
    torn: bool
    #: Why the format alone cannot tell (``marker`` False, not torn): the one line ``status`` shows.
    why_unjudged: str = ""

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def first_ns(self) -> int:
        return min((f.mtime_ns for f in self.files), default=0)

    @property
    def last_ns(self) -> int:
        return max((f.mtime_ns for f in self.files), default=0)

    def same_files(self, other: Entry | None) -> bool:
        return other is not None and other.files == self.files


#: A version suffix that is not a step (Lightning's ``epoch=0-step=10-v1.ckpt``).
VERSION_SUFFIX = re.compile(r"-v\d+(?=\.[^.]*$|$)")


def step_of(name: str) -> int | None:
    """The step a checkpoint's name carries: its last number (``step-000300.pt`` -> 300), else None; a
    version suffix is not one (``epoch=0-step=10-v1.ckpt`` -> 10)."""
    numbers = re.findall(r"\d+", VERSION_SUFFIX.sub("", name))
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
        info = FileInfo(top.name, st.st_size, st.st_mtime_ns)
        state = file_state(Path(top.path), st.st_size)
        why = "" if state != UNKNOWN else f"{top.name} is in no format whose end can be checked"
        return Entry(top.name, (info,), False, False, published or state == COMPLETE, state == TORN, why)
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
    states = {f.rel: file_state(live / f.rel, f.size) if _has_end(f.rel) else UNKNOWN for f in files}
    torn = TORN in states.values()
    dcp_dirs = {f.rel.rsplit("/", 1)[0] for f in files if _is_dcp_file(f.rel)}
    complete, why = _dir_complete(live, top.name, [f.rel for f in files], dcp_dirs, states)
    marker = published or complete
    return Entry(
        top.name, tuple(files), True, bool(dcp_dirs), marker and not torn, torn, "" if marker else why
    )


COMPLETE, TORN, UNKNOWN = "complete", "torn", "unknown"


def _has_end(rel: str) -> bool:
    """A file inside a checkpoint directory whose format has an end to check (archives, safetensors)."""
    return rel.endswith((*ARCHIVE_SUFFIXES, SAFETENSORS_SUFFIX))


def _is_dcp_file(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return name.endswith(DCP_SHARD_SUFFIX) or name == DCP_METADATA


def file_state(path: Path, size: int) -> str:
    """One file by its format: :data:`COMPLETE` (a zip archive with its end record, a safetensors file that
    reaches its last tensor), :data:`TORN` (one without), or :data:`UNKNOWN` (no end to check)."""
    try:
        if path.name.endswith(SAFETENSORS_SUFFIX):
            return _safetensors_state(path, size)
        if size == 0:
            return TORN if path.name.endswith(ARCHIVE_SUFFIXES) else UNKNOWN
        with path.open("rb") as f:
            if f.read(4) != ZIP_MAGIC:
                return UNKNOWN
        return TORN if torn_zip(path, size) else COMPLETE
    except OSError:
        return UNKNOWN


def _safetensors_state(path: Path, size: int) -> str:
    """A safetensors file: an 8-byte little-endian header length, a JSON header whose ``data_offsets`` say
    where each tensor ends; complete when the file reaches the last one."""
    if size < 8:
        return TORN
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > SAFETENSORS_MAX_HEADER or 8 + n > size:
            return TORN
        try:
            header = json.loads(f.read(n))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError):
            return TORN
    return COMPLETE if size >= 8 + n + max(ends, default=0) else TORN


def _dir_complete(
    live: Path, top: str, rels: list[str], dcp_dirs: set[str], states: dict[str, str]
) -> tuple[bool, str]:
    """Whether this node's files of directory ``top`` complete it by their format alone, else why not."""
    if not rels:
        return False, f"{top} is empty"
    if dcp_dirs:
        missing = sorted(d for d in dcp_dirs if f"{d}/{DCP_METADATA}" not in states)
        if missing:
            return False, f"{missing[0]} {DCP_METADATA_MISSING} (DCP writes it last, on one rank)"
        others = [r for r in rels if r.rsplit("/", 1)[0] not in dcp_dirs]
        if others:
            return (
                False,
                f"{others[0]} sits beside DCP directories: nothing says the save wrote its last file",
            )
        if dcp_dirs != {top}:  # model/ and optim/ each a DCP save: the next may not have begun yet
            return False, f"{top} holds DCP directories below its top: nothing says the last one was begun"
        return True, ""
    index = [r for r in rels if r.endswith(SAFETENSORS_INDEX_SUFFIX)]
    if index:
        return _index_complete(live, rels, index, states)
    return False, f"nothing in {top} marks the save's end (a newer save, or the workers' end, will)"


def _index_complete(
    live: Path, rels: list[str], index: list[str], states: dict[str, str]
) -> tuple[bool, str]:
    """A safetensors index with every shard it names present and complete, beside metadata files only."""
    named: set[str] = set()
    for rel in index:
        folder = rel.rsplit("/", 1)[0]
        try:
            weight_map = json.loads((live / rel).read_text())["weight_map"]
            named |= {f"{folder}/{v}" for v in weight_map.values()}
        except (OSError, ValueError, TypeError, KeyError):
            return False, f"{rel} is not a readable safetensors index"
    for shard in sorted(named):
        if states.get(shard) != COMPLETE:
            return False, f"{shard}, named by the index, is missing or short"
    extra = [r for r in rels if r not in named and r not in index and not r.endswith(METADATA_SUFFIXES)]
    if extra:
        return (
            False,
            f"{extra[0]} sits beside the safetensors index: nothing says the save wrote its last file",
        )
    return True, ""


def judge(
    name: str,
    entries: Mapping[str, Entry],
    round_start_ns: int,
    finished: bool = False,
    stepped_ns: int | None = None,
) -> bool:
    """Whether the script's behaviour shows ``entries[name]`` finished on this node (its format could not):
    every worker of this node took a training step after the entry's last write (``stepped_ns``: the
    oldest of their last steps, from :mod:`hpcelastic.tier.step_clock`), the workers of the round all
    ended with status 0 (``finished``), or, for workers without a step clock, a newer save (by step) began
    after the entry's last write. Only for an entry written in this round, with no file torn and no DCP
    directory without its ``.metadata`` (DCP says itself when it is done, ``async_save`` too)."""
    entry = entries[name]
    if entry.torn or not entry.files or entry.last_ns < round_start_ns:
        return False
    if entry.dcp and DCP_METADATA_MISSING in entry.why_unjudged:
        return False
    if finished:
        return True
    if stepped_ns is not None:
        return stepped_ns > entry.last_ns
    step = step_of(name)
    if step is None:
        return False
    return any(
        (s := step_of(other.name)) is not None and s > step and other.first_ns > entry.last_ns
        for other in entries.values()
        if other.name != name and other.files
    )


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
    """Checkpoint names oldest first: by the step in the name, then by name; names without a step last
    (``last.ckpt`` is saved after the numbered checkpoint of its step)."""
    return sorted(names, key=lambda n: (step_of(n) is None, step_of(n) or 0, n))


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
