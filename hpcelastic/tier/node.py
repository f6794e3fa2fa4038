"""The agent's side of the local checkpoint tier: this node's directory, its scans, its copies.

Layout under the node's local directory (``checkpoint_tier.local_checkpoint_dir``), all of it this agent's
and removed when it ends::

    hpcelastic-tier/live/        HPCELASTIC_CHECKPOINT_DIR: what the workers save into and load from
    hpcelastic-tier/replicas/P/  peers' parts (P: the position of the node that wrote them)
    hpcelastic-tier/staging/     transfers in flight (moved into place once every file's MAC verified)

The main loop calls :meth:`LocalTier.scan` while workers run and hands over the coordinator's tier
messages (:meth:`LocalTier.on_message`); replicas, persists and the commit run on one thread of the tier's
own, so a copy never holds up the loop. Restores run in the loop before the round's workers start
(:meth:`LocalTier.restore`): nothing else can happen on the node meanwhile. Every copy into the tier is
checked against the budget and the filesystem's free space first: a copy that does not fit is refused with
one line naming ``checkpoint_tier.local_checkpoint_mb``, never written to fill the node's memory.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from hpcelastic import events, handoff
from hpcelastic.agent import messages
from hpcelastic.agent.watchdog import Watchdog
from hpcelastic.errors import UserError
from hpcelastic.events import RestoreTier
from hpcelastic.rundir import RunDir
from hpcelastic.tier import channel, scan
from hpcelastic.tier.book import HERE, PEER, PERSISTED
from hpcelastic.tier.settings import MB, NodeTier, TierSettings, key, memory_left_after

TIER_SUBDIR = "hpcelastic-tier"
#: The checkpoint directory's hidden folder where each node's part is copied before the commit.
SHARED_STAGING = ".hpcelastic-staging"
#: How often the loop scans the local directory while the workers run.
SCAN_INTERVAL_S = 0.5

Send = Callable[[messages.Message], bool]
Say = Callable[[str], None]


@dataclass(frozen=True)
class Restored:
    """What :meth:`LocalTier.restore` placed: the checkpoint's path in the local directory (None: nothing)."""

    path: Path | None
    error: str = ""


def bytes_under(path: Path) -> int:
    """Bytes of the files under ``path``, each inode once (the tier hard-links a checkpoint's files
    between its copies); files that vanish meanwhile count nothing."""
    seen: set[int] = set()
    total = 0
    for folder, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(folder, f))
                if st.st_ino not in seen:
                    seen.add(st.st_ino)
                    total += st.st_size
    return total


class LocalTier:
    """One node's tier for one attempt (see the module docstring)."""

    def __init__(
        self,
        settings: TierSettings,
        node: NodeTier,
        *,
        run_dir: RunDir,
        checkpoint_dir: Path,
        secret: str,
        host: str,
        node_rank: int,
        attempt: int,
        say: Say,
    ) -> None:
        self.settings = settings
        self.budget = node.budget
        self.in_memory = node.in_memory
        self.base = node.root / TIER_SUBDIR
        self.live = self.base / "live"
        self.replicas = self.base / "replicas"
        self.staging = self.base / "staging"
        self.run_dir = run_dir
        self.checkpoint_dir = checkpoint_dir
        self.secret = secret
        self.host = host
        self.node_rank = node_rank
        self.attempt = attempt
        self.say = say
        self.send: Send = lambda msg: False
        #: The local directory itself, when this agent made it (removed at the end if empty).
        self._made_root = not node.root.exists()
        shutil.rmtree(self.base, ignore_errors=True)  # an earlier attempt's, or a killed agent's
        for d in (self.live, self.replicas, self.staging):
            d.mkdir(parents=True, mode=0o700)
        self.throttle = channel.Throttle(settings.rate_bytes_s)
        self._lock = threading.Lock()
        #: (checkpoint, position) -> the files of that part this node holds.
        self._held: dict[tuple[str, str], list[channel.FileRef]] = {}
        self._reserved = 0
        #: Checkpoints completed job-wide, oldest first; those safe (every part replicated).
        self._complete: list[str] = []
        self._safe: set[str] = set()
        #: Names the scan leaves alone: reported already, or placed by a restore.
        self._known: set[str] = set()
        self._queried: set[str] = set()
        self._previous: dict[str, scan.Entry] = {}
        self._restore: dict[int, list[messages.TierRestore]] = {}
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._ids = itertools.count()
        self.server = channel.DataServer(
            secret,
            channel.Handlers(
                self._part_files, self._reserve, self._release, self._new_staging, self._received
            ),
            self.throttle,
        )
        self._thread = threading.Thread(target=self._work, name="hpcelastic-tier", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self.server.port

    def clean_on_death(self, watchdog: Watchdog) -> None:
        """Have the agent's watchdog remove this tier if the agent dies before :meth:`close`."""
        watchdog.remove_on_death(str(self.base))
        if self._made_root:
            watchdog.remove_on_death(str(self.base.parent), only_if_empty=True)

    def close(self) -> None:
        """Stop serving and copying, and remove this node's tier (its memory is the node's again)."""
        self.server.close()
        self._tasks.put(None)
        self._thread.join(timeout=5)
        shutil.rmtree(self.base, ignore_errors=True)
        if self._made_root:
            with contextlib.suppress(OSError):
                self.base.parent.rmdir()

    # ---- accounting -------------------------------------------------------------------------
    def used(self) -> int:
        """Bytes this tier holds on the node (every file under its directory, once per inode)."""
        return bytes_under(self.base)

    def room_for(self, size: int, what: str) -> str | None:
        """None when ``size`` more bytes fit the budget and the filesystem, else the one line saying why."""
        with self._lock:
            if self._fits(size):
                self._reserved += size
                return None
        self._drop_unneeded()
        with self._lock:
            if self._fits(size):
                self._reserved += size
                return None
            used = self.used() + self._reserved
        free = _free_bytes(self.base)
        memory = memory_left_after(size) if self.in_memory else None
        why = (
            f"{what} ({_mb(size)} MB) does not fit {key('local_checkpoint_mb')}={self.budget // MB} on "
            f"{self.host} ({_mb(used)} MB in use, {_mb(free)} MB free on the filesystem"
            + (f"; {memory}" if memory else "")
            + f"); raise it, lower {key('replicas')}, or give the node more memory"
        )
        event = events.tier_refused(
            attempt=self.attempt, node=self.host, checkpoint=what, size=size, budget=self.budget, why=why
        )
        self.run_dir.record(event, host=self.host)
        return why

    def _fits(self, size: int) -> bool:
        used = self.used() + self._reserved
        if used + size > self.budget or size > _free_bytes(self.base):
            return False
        return not (self.in_memory and memory_left_after(self._reserved + size))

    def _release(self, size: int) -> None:
        with self._lock:
            self._reserved = max(0, self._reserved - size)

    # ---- scans (main loop) ------------------------------------------------------------------
    def scan(self, writing: Iterable[str], position: str | None) -> None:
        """Report this node's parts that settled since the last scan (``writing``: real paths the workers
        hold open for writing; ``position``: this node's in the current round, None between rounds)."""
        if position is None:
            return
        published = scan.read_published(self.live)
        entries = scan.scan(self.live, published, skip=self._known)
        writing = list(writing)
        for name in scan.by_step(entries):
            entry = entries[name]
            ready = scan.settled(self._previous.get(name), entry, writing, self.live)
            if ready and (entry.marker or name in self._queried):
                self._report_own(entry, position, published.get(name))
        for name in scan.by_step(self._queried - self._known - set(entries)):
            self._known.add(name)  # asked about a checkpoint this node wrote nothing of
            self.send(messages.TierHave(name, position, "own", scan.step_of(name), 0))
        self._previous = entries

    def _report_own(self, entry: scan.Entry, position: str, published_step: int | None) -> None:
        refs = [channel.FileRef(f.rel, self.live / f.rel, f.size) for f in entry.files]
        with self._lock:
            self._held[(entry.name, position)] = refs
        self._known.add(entry.name)
        step = published_step if published_step is not None else scan.step_of(entry.name)
        if self.used() > self.budget:
            self._drop_unneeded()
            if self.used() > self.budget:
                self.say(
                    f"checkpoint {entry.name} ({_mb(entry.size)} MB) takes the local tier past "
                    f"{key('local_checkpoint_mb')}={self.budget // MB}: its copies to peers may be refused; "
                    "raise the setting"
                )
        self.send(messages.TierHave(entry.name, position, "own", step, entry.size, entry.marker))

    # ---- the coordinator's messages (main loop) ---------------------------------------------
    def on_message(self, msg: messages.Message) -> None:
        if isinstance(msg, messages.TierQuery):
            self._queried.add(msg.name)
        elif isinstance(msg, messages.TierComplete):
            with self._lock:
                if msg.name not in self._complete:
                    self._complete.append(msg.name)
            self._tasks.put(lambda: self._copy_out(msg))
        elif isinstance(msg, messages.TierSafe):
            with self._lock:
                self._safe.add(msg.name)
                if msg.name not in self._complete:  # a checkpoint this node holds replicas of only
                    self._complete.append(msg.name)
            self._tasks.put(self._drop_unneeded)
        elif isinstance(msg, messages.TierCommit):
            self._tasks.put(lambda: self._commit(msg))
        elif isinstance(msg, messages.TierRestore):
            self._restore.setdefault(msg.round, []).append(msg)

    # ---- copies (the tier's thread) ---------------------------------------------------------
    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            try:
                task()
            except Exception as e:  # a copy that fails must not end the agent; say what happened
                self.say(f"local checkpoint tier: {type(e).__name__}: {e}")

    def _copy_out(self, msg: messages.TierComplete) -> None:
        """Replicate part ``msg.position`` of ``msg.name`` to the peers; persist it if asked."""
        with self._lock:
            files = list(self._held.get((msg.name, msg.position), []))
        if not files:
            return
        for peer, address, port in msg.peers:
            try:
                channel.put(address, port, self.secret, msg.name, msg.position, files, self.throttle)
            except channel.ChannelError as e:
                self.send(
                    messages.TierHave(msg.name, msg.position, "refused", why=f"copy to node {peer}: {e}")
                )
        if msg.persist:
            self._persist(msg.name, msg.position, files)

    def _persist(self, name: str, position: str, files: list[channel.FileRef]) -> None:
        """Copy this node's files of part ``position`` into the shared staging directory. A shared file
        system that fails (full, an I/O error) gets this node's partial copy removed and the coordinator a
        ``persist_failed`` report, so the job's record says it at once."""
        dest = self.checkpoint_dir / SHARED_STAGING / name
        written: list[Path] = []
        try:
            for f in files:
                target = dest / f.rel
                target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                written.append(target)
                self._copy_file(f.path, target)
        except OSError as e:
            for target in written:
                with contextlib.suppress(OSError):
                    target.unlink()
            why = f"{e.strerror} in {self.checkpoint_dir}" if e.strerror else str(e)
            self.send(messages.TierHave(name, position, "persist_failed", why=why))
            return
        self.send(messages.TierHave(name, position, "persisted"))

    def _copy_file(self, src: Path, dest: Path) -> None:
        """Copy ``src`` to ``dest`` in throttled chunks (``sendfile``: no copy through Python; unlike
        ``copy_file_range`` it works from tmpfs to another filesystem on every kernel)."""
        with open(src, "rb") as fin, open(dest, "wb") as fout:
            size = os.fstat(fin.fileno()).st_size
            offset = 0
            while offset < size:
                n = min(channel.CHUNK, size - offset)
                self.throttle.take(n)
                copied = os.sendfile(fout.fileno(), fin.fileno(), offset, n)
                if copied <= 0:
                    raise OSError(f"copying {src} stopped at byte {offset} of {size}")
                offset += copied

    def _commit(self, msg: messages.TierCommit) -> None:
        """Every part is in the shared staging directory: move it into place and publish it."""
        src = self.checkpoint_dir / SHARED_STAGING / msg.name / msg.name
        final = self.checkpoint_dir / msg.name
        if not src.exists():
            return
        if final.exists() or final.is_symlink():
            old = self.checkpoint_dir / SHARED_STAGING / f"old-{msg.name}-{time.time_ns()}"
            os.replace(final, old)
            _remove(old)
        os.replace(src, final)
        shutil.rmtree(src.parent, ignore_errors=True)
        with contextlib.suppress(OSError):
            src.parent.parent.rmdir()  # the staging folder, once no other checkpoint is on its way
        try:
            handoff.publish(self.run_dir, self.checkpoint_dir, final, msg.step or 0, self.attempt, 0)
        except UserError as e:
            self.say(f"local checkpoint tier: could not publish {final}: {e}")
        self.send(messages.TierHave(msg.name, "", "committed", msg.step, path=str(final)))

    def _drop_unneeded(self) -> None:
        """Drop this node's copies of checkpoints older than the newest safe one, but the newest ``keep``."""
        with self._lock:
            safe = [n for n in self._complete if n in self._safe]
            if not safe:
                return
            newest_safe = self._complete.index(safe[-1])
            keep = set(self._complete[max(0, len(self._complete) - self.settings.keep) :]) | {safe[-1]}
            drop = [n for n in self._complete[:newest_safe] if n not in keep]
            for n in drop:
                self._complete.remove(n)
                for k in [k for k in self._held if k[0] == n]:
                    del self._held[k]
        for n in drop:
            _remove(self.live / n)
            for folder in self.replicas.iterdir():
                _remove(folder / n)

    # ---- the data server's callbacks (its threads) ------------------------------------------
    def _part_files(self, name: str, position: str) -> list[channel.FileRef] | None:
        with self._lock:
            files = self._held.get((name, position))
            return list(files) if files else None

    def _reserve(self, name: str, position: str, size: int) -> str | None:
        return self.room_for(size, f"a replica of {name}")

    def _new_staging(self) -> Path:
        path = self.staging / f"in-{os.getpid()}-{next(self._ids)}"
        path.mkdir(mode=0o700)
        return path

    def _received(self, name: str, position: str, staging: Path, files: list[tuple[str, int]]) -> None:
        """A peer's part arrived whole: move it into the replica area and say so."""
        dest = self.replicas / position
        refs = []
        for rel, size in files:
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / rel, target)
            refs.append(channel.FileRef(rel, target, size))
        with self._lock:
            self._held[(name, position)] = refs
        self.send(messages.TierHave(name, position, "replica"))

    # ---- restores (main loop, before the round's workers start) -----------------------------
    def restore(self, round: int) -> Restored:
        """Place the checkpoint the coordinator chose for ``round`` in the local directory, each part from
        the nearest copy; clear everything else out of it (a torn save is never seen by the script)."""
        plan = self._restore.pop(round, [])
        for r in [r for r in self._restore if r < round]:
            del self._restore[r]
        if not plan:
            return Restored(None)
        with self.throttle.hold():  # background copies wait: the round waits for this
            return self._restore_plan(round, plan)

    def _restore_plan(self, round: int, plan: list[messages.TierRestore]) -> Restored:
        head = plan[0]
        sources = [s for msg in plan for s in msg.sources]
        t0 = time.monotonic()
        cleared = self._clear_live(keep=head.name)
        if not head.name:
            if cleared or round > 0 or self.attempt > 0:
                self._record_restore(round, head, RestoreTier.NONE, [], 0, t0)
            return Restored(None)
        placed = 0
        peers: list[str] = []
        tier = RestoreTier.LOCAL
        target = self.live / head.name
        try:
            for position, where, node_rank, address, port in sources:
                if where == PERSISTED:
                    tier = RestoreTier.PERSISTED
                    self._link_persisted(target, Path(head.path))
                    break
                if where == HERE:
                    self._link_held(head.name, position)
                elif where == PEER:
                    tier = RestoreTier.PEER
                    placed += self._fetch(head.name, position, address, port)
                    if str(node_rank) not in peers:
                        peers.append(str(node_rank))
        except (channel.ChannelError, OSError) as e:
            if not head.path:
                return Restored(None, f"restoring {head.name}: {e}")
            self.say(f"restoring {head.name} from memory failed ({e}); restoring its persisted copy instead")
            tier = RestoreTier.PERSISTED
            self._link_persisted(target, Path(head.path))
        self._known.add(head.name)
        self._record_restore(round, head, tier, peers, placed, t0)
        return Restored(target)

    def _record_restore(
        self,
        round: int,
        head: messages.TierRestore,
        tier: RestoreTier,
        peers: list[str],
        size: int,
        t0: float,
    ) -> None:
        event = events.tier_restored(
            attempt=self.attempt,
            round=round,
            node=self.host,
            node_rank=self.node_rank,
            checkpoint=head.name,
            step=head.step,
            tier=tier,
            peers=peers,
            size=size,
            duration_s=time.monotonic() - t0,
        )
        self.run_dir.record(event, host=self.host)

    def _clear_live(self, keep: str) -> bool:
        """Remove every checkpoint but ``keep`` from the local directory, and the replicas of others; whether
        anything was in the local directory to remove."""
        keep_marker = scan.publish_marker(self.live, keep).name if keep else ""
        cleared = False
        for entry in list(self.live.iterdir()):
            if not keep or entry.name not in (keep, keep_marker):
                _remove(entry)
                cleared = True
        for folder in list(self.replicas.iterdir()):
            for entry in list(folder.iterdir()):
                if entry.name != keep:
                    _remove(entry)
        with self._lock:
            for k in [k for k in self._held if k[0] != keep]:
                del self._held[k]
            self._complete = [n for n in self._complete if n == keep]
        self._known = {keep} if keep else set()
        self._queried.clear()
        self._previous = {}
        return cleared

    def _link_held(self, name: str, position: str) -> None:
        """A part this node holds (its own, already in place, or a replica): hard links into place."""
        with self._lock:
            files = list(self._held.get((name, position), []))
        for f in files:
            target = self.live / f.rel
            if target != f.path and not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                os.link(f.path, target)

    def _fetch(self, name: str, position: str, address: str, port: int) -> int:
        """A part from a peer, into place; its size."""
        staging = self._new_staging()
        reserved: list[int] = []

        def reserve(size: int) -> str | None:
            why = self.room_for(size, f"the restore of {name}")
            if why is None:
                reserved.append(size)
            return why

        try:
            files = channel.get(address, port, self.secret, name, position, staging, reserve)
            refs = []
            for rel, size in files:
                target = self.live / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(staging / rel, target)
                refs.append(channel.FileRef(rel, target, size))
            with self._lock:
                self._held[(name, position)] = refs
            return sum(size for _, size in files)
        finally:
            for size in reserved:
                self._release(size)
            shutil.rmtree(staging, ignore_errors=True)

    def _link_persisted(self, target: Path, path: Path) -> None:
        """The persisted copy in the checkpoint directory, linked into the local directory (read in place)."""
        _remove(target)
        if not path.exists():
            raise OSError(f"the persisted copy {path} is missing")
        os.symlink(path, target)

    # ---- the end -----------------------------------------------------------------------------
    def final_scan(self, writing: Iterable[str], position: str | None) -> None:
        """The workers are gone: whatever settled now is reported (a second look makes every file settled)."""
        self.scan(writing, position)
        self.scan((), position)


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _mb(size: int) -> int:
    return -(-size // MB)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def published_size(run_dir: RunDir) -> int:
    """Bytes of the checkpoint the handoff record names (what a new attempt restores), 0 if none."""
    rec = handoff.load(run_dir)
    if rec.checkpoint is None:
        return 0
    path = Path(rec.checkpoint["path"])
    if path.is_file():
        return path.stat().st_size
    total = 0
    for folder, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(folder, f))
    return total
