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
"""

from __future__ import annotations

import contextlib
import os
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
        self._dirs: dict[int, str] = {}
        todo = [(self.root, 0)]
        while todo and len(self._dirs) < MAX_WATCHES:
            folder, depth = todo.pop()
            with contextlib.suppress(OSError):
                self._dirs[self._inotify.add_watch(folder, fl.CLOSE_NOWRITE)] = folder
                if depth < WATCH_DEPTH:
                    todo += [
                        (e.path, depth + 1) for e in os.scandir(folder) if e.is_dir(follow_symlinks=False)
                    ]

    def fileno(self) -> int:
        return self._inotify.fileno()

    def take(self) -> str | None:
        """The first checkpoint file read since the watch began, if any (the watch is then done)."""
        for ev in self._inotify.read(timeout=0):
            folder = self._dirs.get(ev.wd)
            if folder is None or ev.mask & fl.ISDIR or not ev.name or not _checkpoint_file(ev.name):
                continue
            return os.path.join(folder, ev.name)
        return None

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
