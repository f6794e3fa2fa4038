"""The agent's side of the local checkpoint tier: this node's directory, its scans, its copies.

Layout under the node's local directory (``checkpoint_tier.local_checkpoint_dir``), all of it this agent's
and removed when it ends::

    hpcelastic-tier/live/        HPCELASTIC_CHECKPOINT_DIR: what the workers save into and load from
    hpcelastic-tier/replicas/P/  peers' parts (P: the position of the node that wrote them)
    hpcelastic-tier/staging/     transfers in flight (moved into place once every file's MAC verified)
    hpcelastic-tier/aside/       saves proven torn, out of the script's sight until a newer one is safe

The main loop calls :meth:`LocalTier.scan` while workers run and hands over the coordinator's tier
messages (:meth:`LocalTier.on_message`); replicas, persists and the commit run on one thread of the tier's
own, so a copy never holds up the loop. Restores run in the loop before the round's workers start
(:meth:`LocalTier.restore`): nothing else can happen on the node meanwhile. A restore places the
round's checkpoint and deletes nothing the script wrote: what the tier could not judge stays where it is
(and is copied as it is to the shared checkpoint directory when the tier closes), a save proven torn is
moved aside. The coordinator's book learns of every copy this node gains or loses (``replica``,
``dropped``) before anything relies on it. Every copy into the tier is
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
from hpcelastic.tier import channel, scan, step_clock
from hpcelastic.tier.book import HERE, PEER, PERSISTED
from hpcelastic.tier.settings import MB, NodeTier, TierSettings, key, memory_left_after

TIER_SUBDIR = "hpcelastic-tier"
#: The checkpoint directory's hidden folder where each node's part is copied before the commit.
SHARED_STAGING = ".hpcelastic-staging"
#: The checkpoint directory's folder where a node's entries the tier could not judge are copied at its end.
UNJUDGED_DIR = "hpcelastic-unjudged"
#: Why a save was moved out of the script's sight before a round (``tier_set_aside``).
TORN_WHY = "torn: a torch.save archive without its end record, or a safetensors file shorter than its header"
NOT_WHOLE_WHY = "newer than the restored checkpoint, and not whole on the job's nodes (torn, or a part lost)"
#: A replica's copy to a peer that does not answer is tried this often, within this long: the tier's
#: thread does one copy at a time, and the coordinator learns of a dead peer from its own detection.
REPLICA_ATTEMPTS = 3
REPLICA_RETRY_S = 5.0
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
        self.aside = self.base / "aside"
        self.clocks = self.base / step_clock.CLOCK_DIR
        for d in (self.live, self.replicas, self.staging, self.aside, self.clocks):
            d.mkdir(parents=True, mode=0o700)
        self.throttle = channel.Throttle(settings.rate_bytes_s)
        self._lock = threading.Lock()
        self._init_state()
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

    def _init_state(self) -> None:
        """The tier's bookkeeping, empty (the simulated weeks' node starts from this same state)."""
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
        #: Own entries reported: their position and files as reported (a change is a save in place).
        self._own_files: dict[str, tuple[str, tuple[scan.FileInfo, ...]]] = {}
        #: Files a restore placed in the local directory, per checkpoint, as placed (not this node's own).
        self._placed: dict[str, set[scan.FileInfo]] = {}
        #: When the current round's workers started (a save written before it is judged by format only).
        self._round_start_ns = time.time_ns()
        #: Entries said not judged (name -> its files' last change), so each is said once; those set aside
        #: before a round (copied to the shared directory with the others at the end).
        self._unjudged: dict[str, int] = {}
        self._aside_unjudged: dict[str, Path] = {}
        #: The round's restored checkpoint: never dropped while the round runs (its workers may load it at
        #: any time; a checkpoint safe since may have been written before the round); while a restore
        #: places them, every checkpoint of its plan (a fetch that makes room must not drop one half-placed).
        self._pinned: set[str] = set()
        #: Files this node staged in the shared directory, per checkpoint (removed if the persist fails).
        self._staged: dict[str, list[Path]] = {}
        self._restore: dict[int, list[messages.TierRestore]] = {}

    @property
    def port(self) -> int:
        return self.server.port

    def clean_on_death(self, watchdog: Watchdog) -> None:
        """Have the agent's watchdog remove this tier if the agent dies before :meth:`close`."""
        watchdog.remove_on_death(str(self.base))
        if self._made_root:
            watchdog.remove_on_death(str(self.base.parent), only_if_empty=True)

    def close(self) -> None:
        """Stop serving and copying, copy what the tier could not judge to the shared checkpoint directory
        as it is (nothing the script wrote dies with the node's memory), and remove this node's tier (its
        memory is the node's again)."""
        self.server.close()
        self._tasks.put(None)
        self._thread.join(timeout=5)
        self._save_unjudged()
        shutil.rmtree(self.base, ignore_errors=True)
        if self._made_root:
            with contextlib.suppress(OSError):
                self.base.parent.rmdir()

    def _save_unjudged(self) -> None:
        """Each entry of the local directory the tier never judged complete, copied as it is under
        :data:`UNJUDGED_DIR` in the checkpoint directory (no checkpoint scan takes that for a checkpoint)."""
        dest_root = self.checkpoint_dir / UNJUDGED_DIR / f"attempt-{self.attempt}" / self.host
        live = scan.scan(self.live, scan.read_published(self.live))
        where = {
            name: self.live / name for name, e in live.items() if name not in self._known and not e.marker
        }
        where.update({name: path for name, path in self._aside_unjudged.items() if path.exists()})
        for name, src in where.items():
            dest = dest_root / name
            try:
                dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                if src.is_dir():
                    shutil.copytree(src, dest, dirs_exist_ok=True)
                else:
                    shutil.copy2(src, dest)
            except OSError as e:
                self.say(f"local checkpoint tier: could not save {name}, which it could not judge: {e}")
                continue
            event = events.tier_unjudged(
                attempt=self.attempt,
                node=self.host,
                checkpoint=name,
                why="left when the node's tier ended",
                saved_to=str(dest),
            )
            self.run_dir.record(event, host=self.host)

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
    def scan(self, writing: Iterable[str], position: str | None, finished: bool = False) -> None:
        """Report this node's parts that settled since the last scan (``writing``: real paths the workers
        hold open for writing; ``position``: this node's in the current round, None between rounds;
        ``finished``: the round's workers all exited with status 0). A part is reported complete only on
        the evidence :mod:`hpcelastic.tier.scan` names; one the coordinator asks about is reported as it
        is once settled, so the coordinator can tell the whole job's files are in."""
        if position is None:
            return
        published = scan.read_published(self.live)
        entries = scan.scan(self.live, published)
        writing = list(writing)
        stepped_ns = step_clock.last_step_ns(self.clocks)
        self._notice_changes(entries)
        resaved = self._notice_resaves(entries)
        for name in scan.by_step(entries):
            entry = entries[name]
            if name in self._known or name in resaved:
                continue
            if not scan.settled(self._previous.get(name), entry, writing, self.live):
                continue
            if entry.last_ns < self._round_start_ns and name not in self._queried:
                continue  # left from an earlier round: judged against that round's nodes, or never
            final = entry.marker or scan.judge(name, entries, self._round_start_ns, finished, stepped_ns)
            if final or name in self._queried:
                self._report_own(entry, position, published.get(name), final)
        for name in scan.by_step(self._queried - self._known - set(entries)):
            self._known.add(name)  # asked about a checkpoint this node wrote nothing of
            self.send(messages.TierHave(name, position, "own", scan.step_of(name), 0))
        self._answer_saved_elsewhere(entries, position)
        self._previous = entries

    def _answer_saved_elsewhere(self, entries: dict[str, scan.Entry], position: str) -> None:
        """Queries about checkpoints in the local directory that this node has no part of its own of at
        ``position`` (a restore placed them): another node saved a newer version under the same name
        (``last.ckpt`` rewritten in place), and this node wrote nothing of it (a file it wrote there would be
        its own part). It says so, once, or the coordinator waits for its answer for good."""
        for name in scan.by_step(self._queried & self._known & set(entries)):
            own = self._own_files.get(name)
            if own is None or own[0] != position:
                self._queried.discard(name)
                self.send(messages.TierHave(name, position, "own", scan.step_of(name), 0))

    def _notice_changes(self, entries: dict[str, scan.Entry]) -> None:
        """An own part reported before whose files changed (a save rewritten in place: ``last.ckpt``) or
        went (the script removed it): this node no longer holds what it reported; the coordinator hears so
        first, and the entry is judged again as a new save."""
        for name, (position, files) in list(self._own_files.items()):
            entry = entries.get(name)
            if entry is not None and set(files) <= set(entry.files):
                continue  # unchanged (a restore may have placed peers' files beside them)
            del self._own_files[name]
            with self._lock:
                self._held.pop((name, position), None)
                self._complete = [n for n in self._complete if n != name]
                self._safe.discard(name)
            self._known.discard(name)
            self._queried.discard(name)
            self.send(messages.TierHave(name, position, "dropped"))

    def _notice_resaves(self, entries: dict[str, scan.Entry]) -> set[str]:
        """Checkpoints a restore placed files of that the script saves again (files that are neither those
        nor this node's reported part): the placed files are an older version's, read as this node's part
        (and a stale ``.metadata`` as the new save's end) if they stayed. They leave the local directory
        (the tier's copies; the script's files stay), the parts they were stop being held (the coordinator
        hears so first), and the entry is judged as a new save once it settles. The names so seen."""
        resaved: set[str] = set()
        for name, placed in list(self._placed.items()):
            own = self._own_files.get(name)
            entry = entries.get(name)
            files = set(entry.files) if entry is not None else set()
            if not files - placed - set(own[1] if own is not None else ()):
                continue
            resaved.add(name)
            self._known.discard(name)
            for f in files & placed:
                with contextlib.suppress(OSError):
                    (self.live / f.rel).unlink()
            self._forget_live(name, keep=own[0] if own is not None else None)
        return resaved

    def _forget_live(self, name: str, keep: str | None = None) -> None:
        """The parts of ``name`` this node held in the local directory (but part ``keep``) are there no more
        (moved aside, a link to the persisted copy in their place, or the placed copies of an older
        version gone): not held, and the coordinator told first."""
        with self._lock:
            gone = [
                k
                for k, refs in self._held.items()
                if k[0] == name and k[1] != keep and any(self.live in f.path.parents for f in refs)
            ]
            for k in gone:
                del self._held[k]
        if any(self._own_files.get(name, ("",))[0] == position for _name, position in gone):
            del self._own_files[name]
        self._placed.pop(name, None)
        for _name, position in gone:
            self.send(messages.TierHave(name, position, "dropped"))

    def _report_own(self, entry: scan.Entry, position: str, published_step: int | None, final: bool) -> None:
        refs = [channel.FileRef(f.rel, self.live / f.rel, f.size) for f in entry.files]
        with self._lock:
            self._held[(entry.name, position)] = refs
        self._known.add(entry.name)
        self._own_files[entry.name] = (position, entry.files)
        step = published_step if published_step is not None else scan.step_of(entry.name)
        if self.used() > self.budget:
            self._drop_unneeded()
            if self.used() > self.budget:
                self.say(
                    f"checkpoint {entry.name} ({_mb(entry.size)} MB) takes the local tier past "
                    f"{key('local_checkpoint_mb')}={self.budget // MB}: its copies to peers may be refused; "
                    "raise the setting"
                )
        self.send(messages.TierHave(entry.name, position, "own", step, entry.size, final))

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
        elif isinstance(msg, messages.TierCommit) and msg.abort:
            self._tasks.put(lambda: self._unstage(msg.name))
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
                channel.put(
                    address, port, self.secret, msg.name, msg.position, files, self.throttle,
                    attempts=REPLICA_ATTEMPTS, within_s=REPLICA_RETRY_S,
                )  # fmt: skip
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
        written = self._staged.setdefault(name, [])
        try:
            for f in files:
                target = dest / f.rel
                target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                written.append(target)
                copy_file(f.path, target, self.throttle)
                if os.stat(target).st_size != f.size:
                    raise OSError(f"{f.rel} changed while it was persisted")
        except OSError as e:
            for target in written:
                with contextlib.suppress(OSError):
                    target.unlink()
            why = f"{e.strerror} in {self.checkpoint_dir}" if e.strerror else str(e)
            self.send(messages.TierHave(name, position, "persist_failed", why=why))
            return
        self.send(messages.TierHave(name, position, "persisted"))

    def _commit(self, msg: messages.TierCommit) -> None:
        """Every part is in the shared staging directory: move it into place and publish it."""
        src = self.checkpoint_dir / SHARED_STAGING / msg.name / msg.name
        final = self.checkpoint_dir / msg.name
        if not src.exists():
            return
        staged = src.stat().st_size if src.is_file() else bytes_under(src)
        if msg.size and staged != msg.size:  # never publish what is not every part, whole
            why = f"{staged} bytes staged of {msg.size}"
            self.send(messages.TierHave(msg.name, "", "persist_failed", msg.step, why=why))
            return
        self._staged.pop(msg.name, None)
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

    def _unstage(self, name: str) -> None:
        """A persist of ``name`` failed somewhere: remove what this node staged of it, then the staging
        folders left empty. Each node removes only its own files: its tasks run in order, so none of its
        copies can still be on its way, while another node may already be persisting the retry."""
        for path in self._staged.pop(name, []):
            with contextlib.suppress(OSError):
                path.unlink()
        root = self.checkpoint_dir / SHARED_STAGING
        for folder, _dirs, _files in sorted(os.walk(root / name), key=lambda w: -len(w[0])):
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        with contextlib.suppress(OSError):
            root.rmdir()

    def _drop_unneeded(self) -> None:
        """Drop this node's copies of checkpoints older than the newest safe one, but the newest ``keep`` and
        the round's restored one, telling the coordinator first; and the saves set aside as torn that the
        newest safe one is newer than. Replicas go; what lies in the script's own directory goes only once
        that checkpoint's persisted copy is in the checkpoint directory, and never a name without a step
        (``last.ckpt``: the script rewrites it)."""
        with self._lock:
            safe = [n for n in self._complete if n in self._safe]
            if not safe:
                return
            newest_safe = self._complete.index(safe[-1])
            keep = set(self._complete[max(0, len(self._complete) - self.settings.keep) :]) | {safe[-1]}
            drop = [n for n in self._complete[:newest_safe] if n not in keep and n not in self._pinned]
            for n in drop:
                self._complete.remove(n)
        in_live = {n for n in drop if scan.step_of(n) is not None and (self.checkpoint_dir / n).exists()}
        with self._lock:
            dropped = [
                k
                for k, refs in self._held.items()
                if k[0] in drop and (k[0] in in_live or not any(self.live in f.path.parents for f in refs))
            ]
            for k in dropped:
                del self._held[k]
                if self._own_files.get(k[0], ("",))[0] == k[1]:
                    del self._own_files[k[0]]
        for name, position in dropped:
            self.send(messages.TierHave(name, position, "dropped"))
        for n in drop:
            if n in in_live:
                _remove(self.live / n)
            for folder in self.replicas.iterdir():
                _remove(folder / n)
        newest_step = scan.step_of(safe[-1])
        for torn in list(self.aside.iterdir()):
            step = scan.step_of(torn.name.split("@", 1)[0])
            if newest_step is not None and step is not None and step < newest_step:
                _remove(torn)

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
        """A peer's part arrived whole: move it into the replica area (in place of an older version of it)
        and say so."""
        _inside(name, files)
        dest = self.replicas / position
        _remove(dest / name)
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
        the first of its sources that has it whole; set aside saves proven torn; delete nothing else."""
        plan = self._restore.pop(round, [])
        for r in [r for r in self._restore if r < round]:
            del self._restore[r]
        self._round_start_ns = time.time_ns()
        step_clock.reset(self.clocks)
        if not plan:
            return Restored(None)
        with self.throttle.hold():  # background copies wait: the round waits for this
            return self._restore_plan(round, plan)

    def _restore_plan(self, round: int, plan: list[messages.TierRestore]) -> Restored:
        with self._lock:
            self._pinned = {m.name for m in plan if m.name}
        extras = [m for m in plan if m.extra]
        plan = [m for m in plan if not m.extra]
        restored = self._restore_target(round, plan)
        if not restored.error:
            for name, path in dict.fromkeys((m.name, m.path) for m in extras):
                self._restore_extra(name, [s for m in extras if m.name == name for s in m.sources], path)
        with self._lock:
            self._pinned = {plan[0].name} if restored.path is not None else set()
        return restored

    def _restore_extra(
        self, name: str, sources: list[tuple[str, str, int, str, int]], path: str = ""
    ) -> None:
        """Another complete checkpoint the job holds, placed beside the round's own when every part can be;
        one that cannot is said, and the round goes on. One an earlier round linked from its persisted copy
        stays so (placing it from memory would take that link away first); one in no node's memory (an
        earlier attempt persisted it) is linked from its persisted copy ``path``."""
        if (self.live / name).is_symlink():
            return
        if any(source[1] == PERSISTED for source in sources):
            try:
                self._link_persisted(self.live / name, Path(path))
            except OSError as e:
                self.say(f"local checkpoint tier: {name} not placed beside the restored checkpoint: {e}")
                return
            self._forget_live(name)
            self._known.add(name)
            return
        options: dict[str, list[tuple[str, str, int, str, int]]] = {}
        for source in sources:
            options.setdefault(source[0], []).append(source)
        for position, part_sources in sorted(options.items()):
            got, error = self._place_part(name, position, part_sources)
            if got is None:
                self.say(f"local checkpoint tier: {name} not placed beside the restored checkpoint: {error}")
                return
        self._known.add(name)

    def _restore_target(self, round: int, plan: list[messages.TierRestore]) -> Restored:
        head = plan[0]
        t0 = time.monotonic()
        self._tidy_live(head.name, {name for msg in plan for name in msg.aside})
        if not head.name:
            if round > 0 or self.attempt > 0:
                self._record_restore(round, head, RestoreTier.NONE, [], 0, t0)
            return Restored(None)
        options: dict[str, list[tuple[str, str, int, str, int]]] = {}
        for source in (s for msg in plan for s in msg.sources):
            options.setdefault(source[0], []).append(source)
        placed = 0
        peers: list[str] = []
        tier = RestoreTier.LOCAL
        target = self.live / head.name
        for position, sources in sorted(options.items()):
            if sources[0][1] == PERSISTED:
                tier = RestoreTier.PERSISTED
                break
            got, error = self._place_part(head.name, position, sources)
            if got is None:
                if not head.path:
                    return Restored(None, f"restoring {head.name}: part {position}: {error}")
                self.say(f"restoring {head.name} from memory failed ({error}); restoring its persisted copy")
                tier = RestoreTier.PERSISTED
                break
            where, node_rank, size = got
            if where == PEER:
                tier, placed = RestoreTier.PEER, placed + size
                if str(node_rank) not in peers:
                    peers.append(str(node_rank))
        if tier == RestoreTier.PERSISTED:
            try:
                self._link_persisted(target, Path(head.path))
            except OSError as e:
                return Restored(None, f"restoring {head.name}: {e}")
            self._forget_live(head.name)  # what this node had under that name went aside
        self._known.add(head.name)
        self._record_restore(round, head, tier, peers, placed, t0)
        return Restored(target)

    def _place_part(
        self, name: str, position: str, sources: list[tuple[str, str, int, str, int]]
    ) -> tuple[tuple[str, int, int] | None, str]:
        """Part ``position`` of ``name`` into place from the first source that has it whole: (where,
        node rank, bytes copied), or None and the last source's error."""
        error = "no source"
        if (self.live / name).is_symlink():  # an earlier round's link to the persisted copy: parts from
            (self.live / name).unlink()  # memory go in a directory of the tier's, never the shared one
        for _pos, where, node_rank, address, port in sources:
            try:
                if where == HERE:
                    self._link_held(name, position)
                    self._note_placed(name, position)
                    return (HERE, node_rank, 0), ""
                size = self._fetch(name, position, address, port)
                self._note_placed(name, position)
                self.send(messages.TierHave(name, position, "replica"))  # this node holds it now
                return (PEER, node_rank, size), ""
            except (channel.ChannelError, OSError) as e:
                error = f"node {node_rank}: {e}"
                if where == HERE:  # what the book counted here is not whole: it hears so first
                    self._forget_held(name, position)
        return None, error

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

    def _tidy_live(self, keep: str, aside: set[str]) -> None:
        """Before a round, with ``keep`` the checkpoint it restores: move out of the script's sight this
        node's saves proven torn (a ``torch.save`` archive without its end record, a short safetensors file:
        their writers are gone now) and its files of the newer checkpoints the coordinator could not restore
        whole (``aside``: this node's files of one alone would show each node a different newest
        checkpoint); say once each entry the tier could not judge, which stays. Nothing is deleted."""
        for name, entry in self._live_entries().items():
            if name == keep:
                continue
            if entry.torn:
                self._set_aside(entry, TORN_WHY)
            elif name in aside:
                self._set_aside(entry, NOT_WHOLE_WHY, unjudged=not entry.marker)
            elif not entry.marker and name not in self._known and self._unjudged.get(name) != entry.last_ns:
                self._unjudged[name] = entry.last_ns
                self._say_unjudged(entry)
        self._queried.clear()
        self._previous = {}

    def _set_aside(self, entry: scan.Entry, why: str, unjudged: bool = False) -> None:
        dest = self._move_aside(entry.name)
        self._forget_live(entry.name)
        self._known.discard(entry.name)
        if unjudged:
            self._aside_unjudged[entry.name] = dest
        event = events.tier_set_aside(
            attempt=self.attempt, node=self.host, checkpoint=entry.name, why=why, path=str(dest)
        )
        self.run_dir.record(event, host=self.host)

    def _live_entries(self) -> dict[str, scan.Entry]:
        """The local directory's entries, as the scan sees them."""
        return scan.scan(self.live, scan.read_published(self.live))

    def _move_aside(self, name: str) -> Path:
        """``live/<name>`` moved out of the script's sight (not deleted); where it went."""
        dest = self.aside / f"{name}@{time.time_ns()}"
        os.replace(self.live / name, dest)
        return dest

    def _say_unjudged(self, entry: scan.Entry, saved_to: str = "") -> None:
        why = entry.why_unjudged or "no evidence that the save finished"
        event = events.tier_unjudged(
            attempt=self.attempt, node=self.host, checkpoint=entry.name, why=why, saved_to=saved_to
        )
        self.run_dir.record(event, host=self.host)

    def _link_held(self, name: str, position: str) -> None:
        """A part this node holds (its own, already in place, or a replica), checked whole (every file there
        at its size; an own file unchanged since it was reported), hard-linked into place over whatever is
        there (an older version of it that an earlier restore placed: left there, it would be restored as
        this version)."""
        with self._lock:
            files = list(self._held.get((name, position), []))
        if not files:
            raise OSError(f"no copy of {name} part {position} on this node")
        own = self._own_files.get(name)
        reported = {f.rel: f for f in own[1]} if own is not None and own[0] == position else {}
        for f in files:
            size, mtime_ns = self._file_state(f.path)
            seen = reported.get(f.rel)
            if size != f.size or (seen is not None and mtime_ns != seen.mtime_ns):
                raise OSError(f"{f.rel} changed since it was reported")
        for f in files:
            if self.live / f.rel != f.path:
                self._place(f.path, self.live / f.rel)

    def _file_state(self, path: Path) -> tuple[int, int]:
        """A file's size and change time."""
        st = os.stat(path)
        return st.st_size, st.st_mtime_ns

    def _place(self, src: Path, target: Path) -> None:
        """``target`` made a hard link of ``src``, at once in place of any other file there; nothing when it
        is one already."""
        with contextlib.suppress(FileNotFoundError):
            if os.path.samefile(src, target):
                return
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / f".{target.name}.hpcelastic-{time.time_ns()}"
        os.link(src, tmp)
        os.replace(tmp, target)

    def _note_placed(self, name: str, position: str) -> None:
        """The files of part ``position`` of ``name`` that a restore put in the local directory, as they are
        now (this node's own reported part is its own, not placed)."""
        own = self._own_files.get(name)
        if own is not None and own[0] == position:
            return
        with self._lock:
            files = list(self._held.get((name, position), []))
        placed = self._placed.setdefault(name, set())
        for f in files:
            size, mtime_ns = self._file_state(self.live / f.rel)
            placed.add(scan.FileInfo(f.rel, size, mtime_ns))

    def _forget_held(self, name: str, position: str) -> None:
        with self._lock:
            self._held.pop((name, position), None)
        if self._own_files.get(name, ("",))[0] == position:
            del self._own_files[name]
        self.send(messages.TierHave(name, position, "dropped"))

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
            _inside(name, files)
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
        """The persisted copy in the checkpoint directory, linked into the local directory (read in place);
        what this node had under that name is moved aside, not deleted."""
        if not path.exists():
            raise OSError(f"the persisted copy {path} is missing")
        if target.is_symlink():
            target.unlink()
        elif target.exists():
            os.replace(target, self.aside / f"{target.name}@{time.time_ns()}")
        os.symlink(path, target)

    # ---- the end -----------------------------------------------------------------------------
    def final_scan(self, writing: Iterable[str], position: str | None, finished: bool = False) -> None:
        """The workers are gone (``finished``: all with status 0, so nothing they wrote can change): whatever
        settled now is reported (a second look makes every file settled)."""
        self.scan(writing, position, finished)
        self.scan((), position, finished)


def _inside(name: str, files: list[tuple[str, int]]) -> None:
    """Every file a peer sent for checkpoint ``name`` is that checkpoint's (its name, or under it)."""
    for rel, _size in files:
        if rel != name and not rel.startswith(f"{name}/"):
            raise channel.ChannelError(f"{rel!r} is not a file of {name}")


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


def copy_file(src: Path, dest: Path, throttle: channel.Throttle) -> None:
    """Copy ``src`` to ``dest`` in throttled chunks, as a persist does (``sendfile``: no copy through Python;
    unlike ``copy_file_range`` it works from tmpfs to another filesystem on every kernel)."""
    with open(src, "rb") as fin, open(dest, "wb") as fout:
        size = os.fstat(fin.fileno()).st_size
        offset = 0
        while offset < size:
            n = min(channel.CHUNK, size - offset)
            throttle.take(n)
            copied = os.sendfile(fout.fileno(), fin.fileno(), offset, n)
            if copied <= 0:
                raise OSError(f"copying {src} stopped at byte {offset} of {size}")
            offset += copied
