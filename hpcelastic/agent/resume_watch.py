"""Which checkpoint a round resumed from, for scripts that publish nothing: the first checkpoint file one
of its workers opens for reading, seen through inotify on the checkpoint directory.

The stop path polls ``/proc/PID/fd`` for saves, which last seconds; a load does not: ``torch.load`` of a
small model holds its file for about 1 ms, ``dcp.load`` and Accelerate's ``load_state`` for 2-20 ms
(measured on this machine), far shorter than any affordable poll. inotify tells the agent of every open
on this node as it happens, at no cost while nothing happens; on a shared filesystem it sees this node's
opens only, which are this node's workers'. The watch is armed from a round's start on the node of its
group rank 0 and ends at the first read-only close of a checkpoint file, the round's first heartbeat or
its end (:class:`ResumeWatch`); :meth:`ResumeWatch.take` turns the file into its checkpoint
(:func:`hpcelastic.lifecycle.evidence.checkpoint_of`).

Under the local checkpoint tier the directory is the tier's ``live`` one, which the workers read: a restore
places a checkpoint there as hard links or fetched files (seen like any file) or as a symlink to its
persisted copy in the shared directory; inotify reports an open through a symlink on the target's folder,
so a symlink's target is watched too and its files are named by their path through the link. inotify does
not say who opened a file: the agent's own reads (the tier's scans judge files by reading them) are dropped
by :meth:`ResumeWatch.own_reads`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from inotify_simple import INotify
from inotify_simple import flags as fl

from hpcelastic.lifecycle import evidence

#: Watched directory levels below the checkpoint dir (``step-N/`` of DCP, ``checkpoint_N/`` of Accelerate).
WATCH_DEPTH = 2
#: Most directories watched (each costs a kernel watch of the user's ``max_user_watches``).
MAX_WATCHES = 256


@dataclass(frozen=True)
class Opened:
    """A checkpoint file a worker read: the file, its checkpoint, when that was complete, the newest."""

    file: str
    path: str
    completed_ts: float | None
    newest: str | None


class ResumeWatch:
    """inotify on one checkpoint directory for one round; ``fileno`` goes into the agent's selector."""

    def __init__(self, checkpoint_dir: str, round_: int) -> None:
        self.root = os.path.realpath(checkpoint_dir)
        self.round = round_
        self._inotify = INotify(nonblocking=True)
        #: Watch -> the folder as the workers see it (under the root, through a symlink if one led there).
        self._dirs: dict[int, str] = {}
        #: Watch of a symlinked file's real folder -> {its real name: its path under the root}.
        self._links: dict[int, dict[str, str]] = {}
        #: A worker's read taken out of the queue before the agent's own reads (see :meth:`own_reads`).
        self._found: str | None = None
        todo = [(self.root, self.root, 0)]  # (the real folder, the folder as the workers see it, depth)
        while todo and len(self._dirs) + len(self._links) < MAX_WATCHES:
            real, seen, depth = todo.pop()
            with contextlib.suppress(OSError):
                wd = self._inotify.add_watch(real, fl.CLOSE_NOWRITE)
                self._dirs.setdefault(wd, seen)
                if depth >= WATCH_DEPTH:
                    continue
                for e in os.scandir(real):
                    if e.is_dir(follow_symlinks=False):
                        todo.append((e.path, os.path.join(seen, e.name), depth + 1))
                    elif e.is_symlink():  # a restore's link to the persisted copy
                        todo += self._follow(e.path, os.path.join(seen, e.name), depth + 1)

    def _follow(self, link: str, seen: str, depth: int) -> list[tuple[str, str, int]]:
        """A symlink: its target folder to watch as ``seen``, or its target file's folder watched for it."""
        target = os.path.realpath(link)
        if os.path.isdir(target):
            return [(target, seen, depth)]
        with contextlib.suppress(OSError):
            wd = self._inotify.add_watch(os.path.dirname(target), fl.CLOSE_NOWRITE)
            self._links.setdefault(wd, {})[os.path.basename(target)] = seen
        return []

    def fileno(self) -> int:
        return self._inotify.fileno()

    @property
    def pending(self) -> bool:
        """A worker's read is waiting for :meth:`take` (set aside by :meth:`own_reads`)."""
        return self._found is not None

    def take(self) -> str | None:
        """The first checkpoint file read since the watch began, if any (the watch is then done)."""
        if self._found is not None:
            return self._found
        for ev in self._inotify.read(timeout=0):
            if ev.mask & fl.ISDIR or not ev.name or not _checkpoint_file(ev.name):
                continue
            if ev.wd in self._dirs:
                return os.path.join(self._dirs[ev.wd], ev.name)
            if (path := self._links.get(ev.wd, {}).get(ev.name)) is not None:
                return path
        return None

    @contextlib.contextmanager
    def own_reads(self) -> Iterator[None]:
        """Around the agent's own reads of the directory (the tier's scan): the workers' reads before are
        kept for :meth:`take` (check :attr:`pending` after), the reads meanwhile are dropped (a worker's
        read of that same moment with them: the ledger then rests on the tier's restore)."""
        if self._found is None:
            self._found = self.take()
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                self._inotify.read(timeout=0)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._inotify.close()


def describe(root: str, file: str) -> Opened:
    """``file``'s checkpoint, when it was complete, and the newest complete checkpoint under ``root``: a scan
    of the directory (run it off the agent's loop: a checkpoint directory on a parallel filesystem may be
    large and slow)."""
    path, completed = evidence.checkpoint_of(root, file)
    newest = evidence.newest_checkpoint(root)
    if newest is not None:
        newest = evidence.checkpoint_of(root, os.path.join(root, newest))[0]
    return Opened(str(Path(file).relative_to(root)), path, completed, newest)


def _checkpoint_file(name: str) -> bool:
    """A file a checkpoint is made of (DCP's ``.metadata`` and ``.distcp`` shards too), not a temporary
    file or hpcelastic's own ``hpcelastic-latest.json``."""
    if name == evidence.DCP_METADATA or name.endswith(".distcp"):
        return True
    return not name.startswith((".", evidence.OWN_PREFIX)) and not name.endswith(evidence.PARTIAL_SUFFIXES)
