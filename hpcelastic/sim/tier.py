"""Simulated weeks of the node-local checkpoint tier: the real :class:`~hpcelastic.tier.book.TierBook` and
the real decisions of each node's :class:`~hpcelastic.tier.node.LocalTier` (its message handling, its drops,
its restores), driven through a model of the files truly on each node and on the shared filesystem.

Pure and seeded (``python -m hpcelastic.sim.tier --seed N``): no file, socket or thread. A week is one job
of 2-16 nodes (and spares) over several attempts: rounds of workers that save a checkpoint every few
minutes (DCP shards with ``.metadata`` on one node, a ``torch.save`` file per rank, or rank 0's file alone),
saves torn by the end of a round, the coordinator's messages delivered after delays (each connection in
order, the nodes in any order), copies to peers that fail (the peer gone, its budget, a reset), persists
that fail (the shared filesystem full) or die half-written, commits, node deaths (their memory gone),
worker crashes (a new round), spares taking a lost node's position, stops that flush the last checkpoint,
and requeues (a new attempt's book seeded with the published checkpoint). The I/O of a node (its scan,
copies, links) is modelled here, version-aware (``bench/sim_tier_weeks.py`` runs an older tree's book and
node through this same module); everything else is the tree's own code. :mod:`hpcelastic.sim.tier_invariants`
checks the invariants after every step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import inspect
import itertools
import random
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from types import SimpleNamespace
from typing import Any

from hpcelastic.agent import messages
from hpcelastic.agent.job_state import Send
from hpcelastic.sim.tier_invariants import TierChecker, Violation
from hpcelastic.tier import channel, scan
from hpcelastic.tier.book import TierBook
from hpcelastic.tier.node import LocalTier, Restored

#: This tree's node reports drops and judges saves by the script's behaviour (older ones did neither).
NEW_NODE = hasattr(LocalTier, "_notice_changes")
#: ``_report_own`` takes whether the part completes the checkpoint (older ones read the entry's marker).
REPORT_FINAL = "final" in inspect.signature(LocalTier._report_own).parameters
_ROUND_FIELDS = frozenset(f.name for f in dataclasses.fields(messages.Round))
SHARED = PurePosixPath("/shared")
#: Save styles: DCP (shards everywhere, ``.metadata`` last on position 0), a ``torch.save`` file per rank
#: (each complete on its own, a torn one visibly torn), rank 0's file alone (other nodes write nothing).
DCP, FILES, RANK0 = "dcp", "files", "rank0"
#: Seconds: a message on one connection, a lost node found, a scan after a part settles.
LINK_S = (0.001, 0.3)
DETECT_S = (2.0, 15.0)
SETTLE_S = (0.3, 0.9)
#: The week ends after this many attempts, or this many saves begun, or this simulated time.
ATTEMPTS = 4
SAVES = 24
HORIZON_S = 12 * 3600.0
#: A node reports its part complete this long after the restore at the earliest (round start in ns).
NS = 1_000_000_000

Save = tuple[int, int, str]  # (attempt, round, checkpoint name): one save of a name


@dataclass(frozen=True)
class Copy:
    """One file of a save: a position's part (its writer's position), whole or not."""

    save: Save
    position: str
    size: int
    whole: bool
    marker: bool
    mtime_ns: int
    #: A ``torch.save`` archive: a scan sees it torn while it is not whole.
    archive: bool


Files = dict[str, Copy]


@dataclass
class Params:
    """What a seed fixes about one week."""

    seed: int
    nodes: int
    spares: int
    replicas: int
    persist_every: int
    keep: int
    restore: str
    style: str
    sizes: dict[str, int]
    budget: int
    step_s: float
    save_every_s: float
    save_s: float
    copy_s_per_unit: float
    fault_every_s: float
    put_fail: float
    fetch_fail: float
    persist_fail: float
    die_in_op: float
    grace_s: float
    max_restarts: int

    def replay(self) -> str:
        return f"python -m hpcelastic.sim.tier --seed {self.seed}"


def draw(seed: int, nodes: int | None = None) -> Params:
    """The week of ``seed`` (``nodes`` forces the node count)."""
    rng = random.Random(seed * 7919 + 3)
    n = nodes or rng.choice((2, 2, 3, 4, 4, 5, 6, 8, 8, 12, 16))
    style = rng.choice((DCP, DCP, FILES, RANK0))
    sizes = {str(p): rng.randint(50, 150) if style != RANK0 or p == 0 else 0 for p in range(n)}
    total = sum(sizes.values())
    return Params(
        seed=seed,
        nodes=n,
        spares=rng.choice((0, 0, 1, 2)),
        replicas=rng.choice((0, 1, 1, 1, 2)),
        persist_every=rng.choice((1, 1, 2, 3)),
        keep=rng.choice((1, 1, 1, 2)),
        restore=rng.choice(("all", "all", "own")),
        style=style,
        sizes=sizes,
        budget=int(total * rng.choice((1.2, 2.5, 4.0, 50.0))),
        step_s=1.0,
        save_every_s=rng.uniform(60, 600),
        save_s=rng.choice((5.0, 20.0, 60.0)),
        copy_s_per_unit=rng.choice((0.02, 0.1, 0.4)),
        fault_every_s=rng.choice((300.0, 900.0, 2400.0)),
        put_fail=rng.choice((0.0, 0.05, 0.2)),
        fetch_fail=rng.choice((0.0, 0.05, 0.2)),
        persist_fail=rng.choice((0.0, 0.0, 0.1, 0.3)),
        die_in_op=rng.choice((0.0, 0.02, 0.05)),
        grace_s=rng.choice((30.0, 120.0, 600.0)),
        max_restarts=rng.choice((1, 3, 10)),
    )


# ---- a node's files, and paths into them ---------------------------------------------------------


class NodeFiles:
    """What is truly in one node's tier: ``live/<name>/<position>`` (saves and restored parts),
    ``live/<name>`` links to committed copies, ``replicas/<position>/<name>/<position>``."""

    def __init__(self, world: World, rank: int) -> None:
        self.world, self.rank = world, rank
        self.live: dict[str, Files] = {}
        self.links: dict[str, str] = {}
        self.replicas: dict[str, dict[str, Files]] = {}

    def listdir(self, parts: tuple[str, ...]) -> list[str]:
        if parts == ("live",):
            return [*self.live, *self.links]
        if parts == ("replicas",):
            return list(self.replicas)
        if len(parts) == 2 and parts[0] == "replicas":
            return list(self.replicas.get(parts[1], {}))
        return []

    def lookup(self, parts: tuple[str, ...]) -> Any:
        match parts:
            case ("live", name):
                return self.live.get(name) or self.links.get(name)
            case ("live", name, pos):
                return self.in_live(name).get(pos)
            case ("replicas", pos):
                return self.replicas.get(pos)
            case ("replicas", pos, name):
                return self.replicas.get(pos, {}).get(name)
            case ("replicas", pos, name, q):
                return self.replicas.get(pos, {}).get(name, {}).get(q)
        return None

    def remove(self, parts: tuple[str, ...]) -> None:
        """The tier's code deletes a path: the invariants hear of every whole copy it takes."""
        gone: list[Copy] = []
        match parts:
            case ("live", name):
                if self.links.pop(name, None) is None:
                    gone = list(self.live.pop(name, {}).values())
            case ("live", name, pos):
                if (c := self.live.get(name, {}).pop(pos, None)) is not None:
                    gone = [c]
            case ("replicas", pos, name):
                gone = list(self.replicas.get(pos, {}).pop(name, {}).values())
        self.world.deleted(self.rank, gone)

    def in_live(self, name: str) -> Files:
        """The files under ``live/<name>`` (through a link, the committed copy's)."""
        if name in self.links:
            return self.world.shared.committed.get(name, {})
        return self.live.get(name, {})

    def holds(self, position: str, want: dict[str, tuple[Save, int]]) -> bool:
        """Whether every file of part ``position`` (``want``: file -> save, size) is here whole."""
        for q, (save, _size) in want.items():
            name = save[2]
            c = self.in_live(name).get(q) or self.replicas.get(position, {}).get(name, {}).get(q)
            if c is None or not c.whole or c.save != save:
                return False
        return True

    def used(self) -> int:
        live = sum(c.size for files in self.live.values() for c in files.values())
        return live + sum(c.size for by in self.replicas.values() for fs in by.values() for c in fs.values())


def _snapshot(files: NodeFiles) -> NodeFiles:
    """A copy of ``files`` as they were (a dead node's, for the invariants)."""
    copy = NodeFiles(files.world, files.rank)
    copy.live = {n: dict(fs) for n, fs in files.live.items()}
    copy.links = dict(files.links)
    copy.replicas = {p: {n: dict(fs) for n, fs in by.items()} for p, by in files.replicas.items()}
    return copy


class SimPath:
    """A path into a :class:`NodeFiles` (what the node's real code walks, links and removes)."""

    __slots__ = ("files", "parts")

    def __init__(self, files: NodeFiles, parts: tuple[str, ...]) -> None:
        self.files, self.parts = files, parts

    def __truediv__(self, other: object) -> SimPath:
        return SimPath(self.files, self.parts + tuple(str(other).split("/")))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SimPath) and other.parts == self.parts and other.files is self.files

    def __hash__(self) -> int:
        return hash(self.parts)

    def __str__(self) -> str:
        return "/".join(("sim", *self.parts))

    @property
    def name(self) -> str:
        return self.parts[-1] if self.parts else ""

    @property
    def parent(self) -> SimPath:
        return SimPath(self.files, self.parts[:-1])

    @property
    def parents(self) -> tuple[SimPath, ...]:
        return tuple(SimPath(self.files, self.parts[:i]) for i in range(len(self.parts) - 1, -1, -1))

    def iterdir(self) -> Iterator[SimPath]:
        return iter([self / n for n in self.files.listdir(self.parts)])

    def exists(self) -> bool:
        return self.files.lookup(self.parts) is not None

    def is_symlink(self) -> bool:
        return len(self.parts) == 2 and self.parts[0] == "live" and self.parts[1] in self.files.links

    def is_file(self) -> bool:
        return len(self.parts) >= 2 and self.exists()

    def is_dir(self) -> bool:
        return False

    def unlink(self, missing_ok: bool = False) -> None:
        self.files.remove(self.parts)


# ---- the shared filesystem ----------------------------------------------------------------------


@dataclass
class Shared:
    """The shared checkpoint directory: staging per name, committed copies, the published one."""

    staging: dict[str, Files] = field(default_factory=dict)
    committed: dict[str, Files] = field(default_factory=dict)
    #: name -> the files a whole copy of that commit has (file -> save, size), judged when committed.
    whole: dict[str, dict[str, tuple[Save, int]]] = field(default_factory=dict)
    published: tuple[str, int] | None = None

    def committed_whole(self, name: str) -> bool:
        want = self.whole.get(name)
        got = self.committed.get(name, {})
        if not want:
            return False
        return all((c := got.get(q)) is not None and c.whole and c.save == s for q, (s, _) in want.items())


class SharedPath:
    """A path into the shared checkpoint directory (what the node's real code asks exists)."""

    __slots__ = ("shared", "parts")

    def __init__(self, shared: Shared, parts: tuple[str, ...] = ()) -> None:
        self.shared, self.parts = shared, parts

    def __truediv__(self, other: object) -> SharedPath:
        return SharedPath(self.shared, self.parts + tuple(str(other).split("/")))

    def __str__(self) -> str:
        return str(SHARED.joinpath(*self.parts))

    def exists(self) -> bool:
        return len(self.parts) == 1 and self.parts[0] in self.shared.committed


# ---- a node: the real LocalTier, its I/O modelled ------------------------------------------------


class _Tasks:
    """The node's copy thread: tasks run one after another; a generator task yields the seconds it waits."""

    def __init__(self, world: World, node: SimNode) -> None:
        self.world, self.node = world, node
        self.queue: deque[Callable[[], Any]] = deque()
        self.busy = False

    def put(self, task: Callable[[], Any] | None) -> None:
        if task is None or not self.node.alive:
            return
        self.queue.append(task)
        if not self.busy:
            self.busy = True
            self.world.at(self.world.t, self._next, self.node)

    def _next(self) -> None:
        if not self.queue:
            self.busy = False
            return
        result = self.queue.popleft()()
        if inspect.isgenerator(result):
            self._resume(result)
        else:
            self._next()

    def _resume(self, gen: Generator[float, None, None]) -> None:
        try:
            wait = next(gen)
        except StopIteration:
            self._next()
            return
        self.world.at(self.world.t + wait, lambda: self._resume(gen), self.node)


class SimNode(LocalTier):
    """One node's tier: the tree's own :class:`LocalTier` methods and starting state (``_init_state``), with
    its files, copies and scans modelled (not ``__init__``'s directories, thread and server): the I/O the
    real node does through small methods (``_live_entries``, ``_move_aside``, ``_file_state``, ``_place``,
    ``_fetch``) is done here on the model; the rules around it are the node's own."""

    def __init__(self, world: World, rank: int) -> None:
        self.world = world
        self.node_rank = rank
        self.host = f"n{rank:03d}"
        self.alive = True
        self.files = NodeFiles(world, rank)
        root = SimPath(self.files, ())
        self.base, self.live, self.replicas = root, root / "live", root / "replicas"
        self.staging, self.aside = root / "staging", root / "aside"
        self.settings = SimpleNamespace(keep=world.p.keep)  # type: ignore[assignment]
        self.budget, self.in_memory = world.p.budget, False
        self.checkpoint_dir = SharedPath(world.shared)  # type: ignore[assignment]
        self.secret, self.attempt = "", world.attempt
        self.say = lambda text: None
        self.send = lambda msg: world.node_send(rank, msg)
        self.throttle = SimpleNamespace(hold=contextlib.nullcontext)  # type: ignore[assignment]
        self._lock = contextlib.nullcontext()  # type: ignore[assignment]
        self.run_dir = SimpleNamespace(record=lambda *a, **k: None)  # type: ignore[assignment]
        if hasattr(LocalTier, "_init_state"):
            self._init_state()  # the real node's bookkeeping, as it starts
        else:
            self._state_before_init_state()
        self._round_start_ns = 0
        self._tasks = _Tasks(world, self)  # type: ignore[assignment]
        #: This node's position in the round whose workers run here, None between rounds.
        self.position: str | None = None
        self.restored_tier = ""

    def _state_before_init_state(self) -> None:
        """An older tree's node (no ``_init_state``, for ``bench/sim_tier_weeks.py``): what its methods and
        this simulation read."""
        self._held: dict[tuple[str, str], list[channel.FileRef]] = {}
        self._reserved = 0
        self._complete: list[str] = []
        self._safe: set[str] = set()
        self._known: set[str] = set()
        self._queried: set[str] = set()
        self._previous: dict[str, scan.Entry] = {}
        self._own_files: dict[str, tuple[str, tuple[scan.FileInfo, ...]]] = {}
        self._staged: dict[str, list[Any]] = {}
        self._restore: dict[int, list[messages.TierRestore]] = {}

    # ---- accounting ----
    def used(self) -> int:
        return self.files.used()

    def room_for(self, size: int, what: str) -> str | None:
        """As the real one: fits, else drop what is no longer needed and look again, else refuse."""
        if self.used() + self._reserved + size <= self.budget:
            self._reserved += size
            return None
        self._drop_unneeded()
        if self.used() + self._reserved + size <= self.budget:
            self._reserved += size
            return None
        return f"{what} does not fit the budget"

    # ---- scans ----
    def scan(self, writing: Any = (), position: str | None = None, finished: bool = False) -> None:
        """The real scan's rules over this node's modelled files (which entries settled, are marked, torn)."""
        if position is None or not self.alive:
            return
        entries = self._live_entries()
        if NEW_NODE:
            self._notice_changes(entries)
        resaved = getattr(self, "_notice_resaves", lambda entries: set())(entries)
        for name in scan.by_step(entries):
            entry = entries[name]
            if (
                name in self._known
                or name in resaved
                or entry.torn
                or not entry.files
                or (self.node_rank, name) in self.world.writing
            ):
                continue
            final = entry.marker
            if NEW_NODE and not final:
                final = scan.judge(name, entries, self._round_start_ns, finished)
            if final or name in self._queried:
                self.world.reporting = self
                if REPORT_FINAL:
                    self._report_own(entry, position, None, final)
                else:
                    self._report_own(entry, position, None)  # type: ignore[call-arg]
                self.world.reporting = None
        for name in scan.by_step(self._queried - self._known - set(entries)):
            self._known.add(name)
            self.send(messages.TierHave(name, position, "own", scan.step_of(name), 0))
        self._previous = entries

    # ---- copies (the task thread) ----
    def _copy_out(self, msg: messages.TierComplete) -> Generator[float, None, None]:  # type: ignore[override]
        files = list(self._held.get((msg.name, msg.position), []))
        if not files:
            return
        for peer, _address, _port in msg.peers:
            why = yield from self.world.put(self, msg.name, msg.position, files, peer)
            if why:
                self.send(
                    messages.TierHave(msg.name, msg.position, "refused", why=f"copy to node {peer}: {why}")
                )
        if msg.persist:
            yield from self._persist(msg.name, msg.position, files)

    def _persist(
        self, name: str, position: str, files: list[channel.FileRef]
    ) -> Generator[float, None, None]:  # type: ignore[override]
        yield from self.world.persist(self, name, position, files)

    def _commit(self, msg: messages.TierCommit) -> Generator[float, None, None]:  # type: ignore[override]
        yield from self.world.commit(self, msg)

    def _unstage(self, name: str) -> None:
        for q in self._staged.pop(name, []):
            self.world.shared.staging.get(name, {}).pop(q, None)
        if not self.world.shared.staging.get(name, True):
            del self.world.shared.staging[name]

    # ---- restores (the real _restore_plan and _place_part around these) ----
    def restore(self, round: int) -> Restored:
        """As the real one, without its I/O (the throttle, the step clocks): this round's plan, placed."""
        plan = self._restore.pop(round, [])
        for r in [r for r in self._restore if r < round]:
            del self._restore[r]
        return self._restore_plan(round, plan) if plan else Restored(None)

    def _live_entries(self) -> dict[str, scan.Entry]:
        return {name: self.world.entry(self, name) for name in self.files.live}

    def _move_aside(self, name: str) -> Any:
        """Out of the script's sight: gone from the model (the tier never restores from its aside folder)."""
        self.files.remove(("live", name))
        return self.aside / name

    def _file_state(self, path: Any) -> tuple[int, int]:
        c = self.files.lookup(path.parts)
        if not isinstance(c, Copy):
            raise FileNotFoundError(f"{path}: no such file")
        return c.size, c.mtime_ns

    def _place(self, src: Any, target: Any) -> None:
        """The file at ``src`` linked at ``target`` (``live/<name>/<position>``), over what was there."""
        c = self.files.lookup(src.parts)
        if not isinstance(c, Copy):
            raise FileNotFoundError(f"{src}: no such file")
        files = self.files.live.setdefault(target.parts[1], {})
        old = files.get(target.parts[2])
        files[target.parts[2]] = c
        if old is not None and old.save != c.save:  # another version's copy gone (the same bytes: nothing)
            self.world.deleted(self.node_rank, [old])

    if not hasattr(LocalTier, "_place"):  # an older tree's node (bench/sim_tier_weeks.py) links with os.link

        def _link_held(self, name: str, position: str) -> None:
            """What ``_held`` names linked into ``live`` where nothing is there yet."""
            for f in list(self._held.get((name, position), [])):
                c = self.files.lookup(f.path.parts)  # type: ignore[attr-defined]
                if not isinstance(c, Copy):
                    raise FileNotFoundError(f"{f.rel}: no such file")
                target = self.live / f.rel
                if not target.exists():
                    self.files.live.setdefault(name, {})[target.parts[2]] = c

    def _fetch(self, name: str, position: str, address: str, port: int) -> int:
        return self.world.fetch(self, name, position, port)

    def _link_persisted(self, target: Any, path: Any) -> None:
        name = target.name
        if name not in self.world.shared.committed:
            raise OSError(f"the persisted copy {path} is missing")
        self.files.remove(("live", name))  # moved aside (this tree) or deleted: out of the script's sight
        self.files.links[name] = str(path)

    def _record_restore(self, round: int, head: Any, tier: Any, *rest: Any) -> None:
        self.restored_tier = str(getattr(tier, "value", tier))


# ---- the world ----------------------------------------------------------------------------------


@dataclass
class TierWeekResult:
    params: Params
    attempts: int
    rounds: int
    saves: int
    completed: int
    committed: int
    restores: dict[str, int]
    final_step: int
    violations: list[Violation]
    events: int


class World:
    """One week: the nodes, the shared filesystem, the coordinator's book, the clock."""

    def __init__(
        self,
        p: Params,
        *,
        book_cls: type[TierBook] = TierBook,
        node_cls: type[SimNode] = SimNode,
        check: TierChecker | None = None,
    ) -> None:
        self.p = p
        self.node_cls = node_cls
        self.rng = random.Random(p.seed)
        self.book_cls = book_cls
        self.check = check or TierChecker()
        self.t = 0.0
        self._heap: list[tuple[float, int, Callable[[], Any], SimNode | None]] = []
        self._seq = itertools.count()
        self.shared = Shared()
        self.attempt = -1
        self.nodes: dict[int, SimNode] = {}
        self._ranks = itertools.count()
        self.book: TierBook = book_cls(p.replicas, p.persist_every, p.restore, clock=lambda: self.t)
        #: Per connection (src, dst): when its last message arrives (each connection keeps order).
        self._link_at: dict[tuple[int, int], float] = {}
        self.writing: set[tuple[int, str]] = set()
        self.reporting: SimNode | None = None
        self._mtime = itertools.count(1)
        #: A message sent -> what it said in fact (an own report's files, a commit's checkpoint).
        self._said: dict[int, Any] = {}
        #: id(book checkpoint) -> (checkpoint, {position: {file: (save, size)}}): what each part is.
        self.parts: dict[int, tuple[Any, dict[str, dict[str, tuple[Save, int]]]]] = {}
        #: (node, name, position, save) the book has heard of (own, replica), and drops it has yet to hear.
        self.reported: set[tuple[int, str, str]] = set()
        self.unheard_drops: dict[tuple[int, str, str], int] = {}
        self.known_dead: set[int] = set()
        #: What dead nodes held, until the coordinator hears of their death (what the job could know).
        self.ghosts: dict[int, NodeFiles] = {}
        self.saves_begun = 0
        self.rounds = 0
        self.round = -1
        self.round_nodes: dict[int, str] = {}
        self.step = 0
        self.restores: dict[str, int] = {}
        self.events = 0
        self._epoch = 0  # bumps when a round ends: its pending work is void
        self.attempt_over = True
        self.restarts = 0
        self.flushed: set[int] = set()
        self.ready: dict[int, bool] = {}
        self.stopping = False

    # ---- the clock ----
    def at(self, t: float, fn: Callable[[], Any], node: SimNode | None = None) -> None:
        """Run ``fn`` at ``t`` (not if ``node`` is dead by then)."""
        heapq.heappush(self._heap, (t, next(self._seq), fn, node))

    def run(self) -> TierWeekResult:
        self.at(0.0, self.start_attempt)
        while self._heap and self.t <= HORIZON_S:
            t, _, fn, node = heapq.heappop(self._heap)
            if node is not None and not node.alive:
                continue
            self.t = t
            fn()
            self.events += 1
            self.check.after_step(self)
        completed = sum(1 for _ in self.check.completed)
        return TierWeekResult(
            self.p,
            self.attempt + 1,
            self.rounds,
            self.saves_begun,
            completed,
            len(self.shared.committed),
            self.restores,
            self.step,
            self.check.violations,
            self.events,
        )

    def delay(self) -> float:
        return self.rng.uniform(*LINK_S)

    def _link(self, src: int, dst: int) -> float:
        at = max(self._link_at.get((src, dst), 0.0), self.t + self.delay())
        self._link_at[(src, dst)] = at
        return at

    # ---- attempts and rounds ----
    def start_attempt(self) -> None:
        if self.attempt + 1 >= ATTEMPTS or self.saves_begun >= SAVES:
            return
        self.attempt += 1
        self.attempt_over = False
        self.restarts = 0
        self.nodes = {}
        self.known_dead = set()
        self.ghosts = {}
        self._link_at = {}
        self.reported = set()
        self.unheard_drops = {}
        self.book = self.book_cls(
            self.p.replicas, self.p.persist_every, self.p.restore, attempt=self.attempt, clock=lambda: self.t
        )
        pub = self.shared.published
        if pub is not None and pub[0] in self.shared.committed:
            self.book.seed(pub[0], pub[1], str(SHARED / pub[0]))
            self.check.seeded(self, pub[0])
        for _ in range(self.p.nodes + self.p.spares):
            rank = next(self._ranks)
            self.nodes[rank] = self.node_cls(self, rank)
            self.book.join(rank, f"n{rank:03d}", f"10.0.0.{rank}", 20000 + rank)
        self.round_nodes = {}
        self.new_round()

    def end_attempt(self, why: str) -> None:
        """The attempt ends (a requeue): every node's tier is removed with its agent."""
        if self.attempt_over:
            return
        self.attempt_over = True
        self._epoch += 1
        for node in self.nodes.values():
            node.alive = False
        self.writing.clear()
        self.at(self.t + self.rng.uniform(60, 600), self.start_attempt)

    def live_members(self) -> list[int]:
        return sorted(r for r, n in self.nodes.items() if n.alive and r not in self.known_dead)

    def new_round(self) -> None:
        """Positions kept by the nodes that still have them, lost positions taken by spares; each round node
        gets its restore plan, then its Round."""
        if self.attempt_over:
            return
        live = self.live_members()
        kept = {r: p for r, p in self.round_nodes.items() if r in live}
        free = [str(i) for i in range(self.p.nodes) if str(i) not in kept.values()]
        spares = [r for r in live if r not in kept]
        if len(spares) < len(free):
            self.end_attempt("too few nodes")
            return
        kept.update(zip(spares, free, strict=False))
        self.round_nodes = kept
        self.round += 1
        self.rounds += 1
        self._epoch += 1
        self.stopping = False
        self.flushed = set()
        self.ready = {}
        epoch = self._epoch
        for rank, pos in sorted(kept.items(), key=lambda kv: int(kv[1])):
            rnd = self._round_message(pos)
            plan = self.book.restore_plan(rank, rnd)
            self.check.planned(self, rank, plan)
            for msg in plan:
                self.coord_send(rank, msg)
            at = self._link(-1, rank)
            self.at(at, lambda r=rank, m=rnd: self.node_round(r, m, epoch), self.nodes[rank])
        self._schedule_fault(epoch)

    def _round_message(self, pos: str) -> messages.Round:
        fields: dict[str, Any] = {
            "round": self.round,
            "restart_count": self.restarts,
            "max_restarts": self.p.max_restarts,
            "group_rank": int(pos),
            "group_world_size": self.p.nodes,
            "rank_offset": 0,
            "world_size": self.p.nodes,
            "master_addr": "10.0.0.0",
            "master_port": 29500,
        }
        return messages.Round(**{k: v for k, v in fields.items() if k in _ROUND_FIELDS})

    def node_round(self, rank: int, rnd: messages.Round, epoch: int) -> None:
        """The node's agent gets its Round: stop its workers, restore, start (or fail) the round's workers."""
        node = self.nodes[rank]
        node.position = None
        self.writing = {w for w in self.writing if w[0] != rank}
        node.restored_tier = ""
        restored = node.restore(rnd.round)
        node._round_start_ns = int(self.t * NS)
        self.check.restored(self, node, rnd.round, restored)
        ok = not restored.error
        if ok:
            node.position = str(rnd.group_rank)
            self.restores[node.restored_tier or "none"] = (
                self.restores.get(node.restored_tier or "none", 0) + 1
            )
        at = self._link(rank, -1)
        self.at(at, lambda: self.coord_ready(rank, ok, restored, epoch))

    def coord_ready(self, rank: int, ok: bool, restored: Any, epoch: int) -> None:
        if epoch != self._epoch:
            return
        if not ok:
            self.round_failed()
            return
        self.ready[rank] = True
        if set(self.ready) >= set(self.round_nodes):
            plan = self.book._plan[1] if self.book._plan else None
            self.step = plan.step if plan is not None and plan.step is not None else 0
            self.at(self.t + self.p.save_every_s, lambda: self.begin_save(epoch))

    def round_failed(self) -> None:
        """A worker failed (or a restore): the coordinator starts a new round, or ends the attempt."""
        self._epoch += 1
        for rank in self.round_nodes:
            self.writing = {w for w in self.writing if w[0] != rank}
            self.nodes[rank].position = None
        self.restarts += 1
        if self.restarts > self.p.max_restarts:
            self.end_attempt("restarts")
            return
        epoch = self._epoch
        self.at(self.t + self.rng.uniform(5, 30), lambda: epoch == self._epoch and self.new_round())

    # ---- saves ----
    def begin_save(self, epoch: int) -> None:
        if epoch != self._epoch or self.stopping or self.saves_begun >= SAVES:
            return
        self.saves_begun += 1
        self.step += max(1, round(self.p.save_every_s / self.p.step_s))
        name = f"step-{self.step:06d}"
        save: Save = (self.attempt, self.round, name)
        ends: dict[int, float] = {}
        for rank, pos in self.round_nodes.items():
            size = self.p.sizes[pos]
            if not size:
                continue
            node = self.nodes[rank]
            self._write(
                node, name, pos, Copy(save, pos, size // 3, False, False, self._now_ns(), self.p.style != DCP)
            )
            ends[rank] = self.t + self.p.save_s * self.rng.lognormvariate(0, 0.5)
        last = max(ends.values(), default=self.t)
        for rank, end in ends.items():
            pos = self.round_nodes[rank]
            marker_at = last + 0.5 if self.p.style == DCP and pos == "0" else end
            self.at(
                marker_at, lambda r=rank, p=pos: self.end_write(r, name, p, save, epoch), self.nodes[rank]
            )
        self.at(last + 0.5 + self.p.save_every_s, lambda: self.begin_save(epoch))

    def _now_ns(self) -> int:
        return int(self.t * NS) + next(self._mtime)

    def _write(self, node: SimNode, name: str, pos: str, copy: Copy) -> None:
        node.files.live.setdefault(name, {})[pos] = copy
        self.writing.add((node.node_rank, name))

    def end_write(self, rank: int, name: str, pos: str, save: Save, epoch: int) -> None:
        if epoch != self._epoch:
            return
        node = self.nodes[rank]
        marker = self.p.style != DCP or pos == "0"
        copy = Copy(save, pos, self.p.sizes[pos], True, marker, self._now_ns(), self.p.style != DCP)
        node.files.live.setdefault(name, {})[pos] = copy
        self.writing.discard((rank, name))
        self.at(self.t + self.rng.uniform(*SETTLE_S), lambda: self.node_scan(rank), node)

    def node_scan(self, rank: int) -> None:
        node = self.nodes[rank]
        node.scan((), node.position)

    def stop_workers(self) -> None:
        """The round's workers end (a crash, a lost node, the attempt's end): saves in progress are torn."""
        for rank in self.round_nodes:
            node = self.nodes[rank]
            for w in [w for w in self.writing if w[0] == rank]:
                self.writing.discard(w)
            node.position = None

    # ---- faults ----
    def _schedule_fault(self, epoch: int) -> None:
        at = self.t + self.rng.expovariate(1 / self.p.fault_every_s)
        self.at(at, lambda: self.fault(epoch))

    def fault(self, epoch: int) -> None:
        if epoch != self._epoch or self.attempt_over:
            return
        kind = self.rng.choices(("death", "crash", "stop", "requeue"), (4, 5, 2, 1))[0]
        if kind == "death":
            self.kill(self.rng.choice(self.live_members()))
        elif kind == "crash":
            self.stop_workers()
            self.round_failed()
        elif kind == "stop":
            self.stop(epoch)
        else:
            self.stop_workers()
            self.end_attempt("requeued")

    def kill(self, rank: int) -> None:
        """A node dies: its memory with it; the coordinator finds it lost a few seconds later."""
        node = self.nodes.get(rank)
        if node is None or not node.alive:
            return
        node.alive = False
        self.ghosts[rank] = _snapshot(node.files)
        node.files.live.clear()
        node.files.links.clear()
        node.files.replicas.clear()
        self.writing = {w for w in self.writing if w[0] != rank}
        at = max(self.t + self.rng.uniform(*DETECT_S), self._link_at.get((rank, -1), 0.0))
        self.at(at, lambda: self.coord_lost(rank))

    def coord_lost(self, rank: int) -> None:
        if self.attempt_over or rank in self.known_dead:
            return
        self.known_dead.add(rank)
        self.ghosts.pop(rank, None)
        self.apply(self.book.lost(rank))
        if rank in self.round_nodes and not self.stopping:
            self.stop_workers()
            self._epoch += 1
            epoch = self._epoch
            self.at(self.t + self.rng.uniform(5, 30), lambda: epoch == self._epoch and self.new_round())
        elif rank in self.round_nodes and self.stopping:
            self.round_nodes.pop(rank)
            self.maybe_flushed()

    def stop(self, epoch: int) -> None:
        """A stop signal (a time limit, a preemption with grace): saves in progress finish, every node scans
        a last time and flushes; the attempt ends when the book answers or at the grace's end."""
        self.stopping = True
        for rank in self.round_nodes:
            self.at(self.t + 1.0, lambda r=rank: self.node_flush(r, epoch), self.nodes[rank])
        self.at(self.t + self.p.grace_s, lambda: epoch == self._epoch and self.end_attempt("grace over"))

    def node_flush(self, rank: int, epoch: int) -> None:
        """The node's workers stopped once no save of theirs is open: a last scan, then ``TierFlush``."""
        if epoch != self._epoch:
            return
        node = self.nodes[rank]
        if any(w[0] == rank for w in self.writing):
            self.at(self.t + 1.0, lambda: self.node_flush(rank, epoch), node)
            return
        node.scan((), node.position, False)
        node.scan((), node.position, False)
        at = self._link(rank, -1)
        self.at(at, lambda: epoch == self._epoch and self.apply(self.book.flush(rank)))

    def maybe_flushed(self) -> None:
        if self.stopping and set(self.round_nodes) <= self.flushed:
            self.end_attempt("stopped")

    # ---- messages ----
    def coord_send(self, rank: int, msg: messages.Message) -> None:
        node = self.nodes.get(rank)
        if node is None or not node.alive:
            return
        self.at(self._link(-1, rank), lambda: self.node_receive(node, msg), node)

    def node_receive(self, node: SimNode, msg: messages.Message) -> None:
        if isinstance(msg, messages.TierFlushed):
            self.flushed.add(node.node_rank)
            self.maybe_flushed()
            return
        node.on_message(msg)
        if isinstance(msg, messages.TierQuery) and node.position is not None:
            node.scan((), node.position)

    def apply(self, actions: list[Any]) -> None:
        for a in actions:
            if isinstance(a, Send):
                if isinstance(a.message, messages.TierCommit) and not getattr(a.message, "abort", False):
                    self._said[id(a.message)] = (a.message, self.book.checkpoints.get(a.message.name))
                self.coord_send(a.node_rank, a.message)

    def node_send(self, rank: int, msg: messages.Message) -> bool:
        node = self.nodes[rank]
        if not node.alive:
            return False
        if isinstance(msg, messages.TierHave):
            key = (rank, msg.name, msg.position)
            if msg.kind == "own" and msg.size and self.reporting is node:
                refs = node._held.get((msg.name, msg.position), [])  # the files the node claims as its part
                paths = {f.rel.split("/")[-1]: f.path.parts for f in refs}  # type: ignore[attr-defined]
                files = {q: node.files.lookup(parts) for q, parts in paths.items()}
                said = {q: (c.save, c.size) for q, c in files.items() if isinstance(c, Copy)}
                self._said[id(msg)] = (msg, said)
            elif msg.kind == "replica":
                pass
            elif msg.kind == "dropped":
                self.unheard_drops[key] = self.unheard_drops.get(key, 0) + 1
        self.at(self._link(rank, -1), lambda: self.coord_receive(rank, msg))
        return True

    def coord_receive(self, rank: int, msg: messages.Message) -> None:
        if self.attempt_over or rank in self.known_dead:
            return
        if not isinstance(msg, messages.TierHave):
            return
        said = self._said.pop(id(msg), None)
        key = (rank, msg.name, msg.position)
        if msg.kind == "dropped":
            self.unheard_drops[key] -= 1
            self.reported.discard(key)
        actions = self.book.have(rank, msg)
        if msg.kind == "own" and said is not None:
            c = self.book.checkpoints.get(msg.name)
            part = c.parts.get(msg.position) if c is not None else None
            if part is not None and part.owner == rank:
                self.parts.setdefault(id(c), (c, {}))[1][msg.position] = said[1]
                self.reported.add(key)
        elif msg.kind == "replica":
            self.reported.add(key)
        if msg.kind == "committed":
            self.check.committed_heard(self, msg.name)
        self.apply(actions)

    # ---- the model's scan entries ----
    def entry(self, node: SimNode, name: str) -> scan.Entry:
        files = node.files.live.get(name, {})
        infos = tuple(scan.FileInfo(f"{name}/{q}", c.size, c.mtime_ns) for q, c in sorted(files.items()))
        return scan.Entry(
            name=name,
            files=infos,
            is_dir=True,
            dcp=self.p.style == DCP,
            marker=any(c.marker and c.whole for c in files.values()),
            torn=any(c.archive and not c.whole for c in files.values()),
        )

    def deleted(self, rank: int, gone: list[Copy]) -> None:
        if gone:
            self.check.deleted(self, rank, gone)

    # ---- copies between nodes and to the shared filesystem ----
    def _fault(self, p: float) -> bool:
        return p > 0 and self.rng.random() < p

    def _copy_s(self, files: list[channel.FileRef]) -> float:
        return sum(f.size for f in files) * self.p.copy_s_per_unit * self.rng.uniform(0.5, 1.5)

    def put(
        self, src: SimNode, name: str, pos: str, files: list[channel.FileRef], peer: int
    ) -> Generator[float, None, str]:
        """``channel.put``: the receiver checks its room first, the part arrives whole or not at all (a file
        rewritten meanwhile fails it), and only the receiver reports it held."""
        dst = self.nodes.get(peer)
        size = sum(f.size for f in files)
        start = {f.rel: src.files.lookup(f.path.parts) for f in files}  # type: ignore[attr-defined]
        if dst is None or not dst.alive:
            yield 0.01
            return "connection refused"
        if any(not isinstance(c, Copy) for c in start.values()):
            yield 0.01
            return "No such file or directory"
        why = dst.room_for(size, f"a replica of {name}")
        if why:
            yield 0.01
            return why
        yield self._copy_s(files)
        dst._reserved = max(0, dst._reserved - size)
        if self._fault(self.p.die_in_op):
            self.kill(peer if self.rng.random() < 0.5 else src.node_rank)
        if not src.alive:
            return "gone"
        if not dst.alive or self._fault(self.p.put_fail):
            return "connection reset by peer"
        got: Files = {}
        for f in files:
            if src.files.lookup(f.path.parts) is not start[f.rel]:  # type: ignore[attr-defined]
                return f"{f.rel} changed while it was sent"
            got[f.rel.split("/")[-1]] = dataclasses.replace(start[f.rel], mtime_ns=self._now_ns())
        dst.files.replicas.setdefault(pos, {})[name] = got
        dst._held[(name, pos)] = [
            channel.FileRef(f.rel, dst.replicas / pos / f.rel, f.size)  # type: ignore[arg-type]
            for f in files
        ]
        dst.send(messages.TierHave(name, pos, "replica"))
        return ""

    def persist(
        self, node: SimNode, name: str, pos: str, files: list[channel.FileRef]
    ) -> Generator[float, None, None]:
        """A part into the shared staging folder: the filesystem full (this node's staged files removed,
        ``persist_failed``), the node dying half-way (the partial copy stays), the source rewritten meanwhile
        (a mixed copy), or whole (``persisted``)."""
        start = {f.rel: node.files.lookup(f.path.parts) for f in files}  # type: ignore[attr-defined]
        if any(not isinstance(c, Copy) for c in start.values()):
            node.send(messages.TierHave(name, pos, "persist_failed", why="No such file or directory"))
            return
        written = node._staged.setdefault(name, []) if NEW_NODE else []
        staging = self.shared.staging.setdefault(name, {})
        for f in files:
            q = f.rel.split("/")[-1]
            written.append(q)
            staging[q] = dataclasses.replace(start[f.rel], whole=False, size=f.size // 2)
        yield self._copy_s(files)
        if self._fault(self.p.die_in_op):
            self.kill(node.node_rank)
            return
        staging = self.shared.staging.setdefault(name, {})
        if self._fault(self.p.persist_fail):
            for q in written:
                staging.pop(q, None)
            node.send(messages.TierHave(name, pos, "persist_failed", why="No space left on device"))
            return
        for f in files:
            now = node.files.lookup(f.path.parts)  # type: ignore[attr-defined]
            mixed = now is not start[f.rel] and isinstance(now, Copy)
            staging[f.rel.split("/")[-1]] = dataclasses.replace(start[f.rel], whole=not mixed)
        node.send(messages.TierHave(name, pos, "persisted"))

    def commit(self, node: SimNode, msg: messages.TierCommit) -> Generator[float, None, None]:
        """The staged copy renamed into the checkpoint directory and published, at once (this tree's node
        first checks it is every part's bytes)."""
        yield 0.2
        if self._fault(self.p.die_in_op):
            self.kill(node.node_rank)
            return
        src = self.shared.staging.get(msg.name)
        if not src:
            return
        size = getattr(msg, "size", 0)
        staged = sum(c.size for c in src.values())
        if size and staged != size:
            node.send(messages.TierHave(msg.name, "", "persist_failed", msg.step, why=f"{staged} of {size}"))
            return
        node._staged.pop(msg.name, None)
        self.shared.committed[msg.name] = dict(self.shared.staging.pop(msg.name))
        said = self._said.pop(id(msg), (msg, None))
        self.check.commit(self, msg.name, said[1])
        pub = self.shared.published
        if pub is None or (msg.step or 0) >= pub[1]:
            self.shared.published = (msg.name, msg.step or 0)
        node.send(messages.TierHave(msg.name, "", "committed", msg.step, path=str(SHARED / msg.name)))

    def fetch(self, node: SimNode, name: str, pos: str, port: int) -> int:
        """``channel.get`` during a restore: the peer gone, not holding it, a reset, no room; else the part
        in ``live``."""
        peer = self.nodes.get(port - 20000)
        if peer is None or not peer.alive:
            raise channel.ChannelError("connection refused")
        files = list(peer._held.get((name, pos), []))
        if not files:
            raise channel.ChannelError(f"node has no {name} part {pos}")
        copies = [peer.files.lookup(f.path.parts) for f in files]  # type: ignore[attr-defined]
        if any(not isinstance(c, Copy) for c in copies):
            raise channel.ChannelError("No such file or directory")
        size = sum(f.size for f in files)
        why = node.room_for(size, f"the restore of {name}")
        if why:
            raise channel.ChannelError(why)
        node._reserved = max(0, node._reserved - size)
        if self._fault(self.p.die_in_op):
            self.kill(peer.node_rank)
            raise channel.ChannelError("connection reset by peer")
        if self._fault(self.p.fetch_fail):
            raise channel.ChannelError("connection reset by peer")
        refs = []
        for f, c in zip(files, copies, strict=True):
            q = f.rel.split("/")[-1]
            node.files.live.setdefault(name, {})[q] = dataclasses.replace(c, mtime_ns=self._now_ns())
            refs.append(channel.FileRef(f.rel, node.live / f.rel, f.size))  # type: ignore[arg-type]
        node._held[(name, pos)] = refs
        return size


def run_week(
    seed: int,
    *,
    book_cls: type[TierBook] = TierBook,
    node_cls: type[SimNode] = SimNode,
    nodes: int | None = None,
) -> TierWeekResult:
    """The week of ``seed``, run by ``book_cls`` and ``node_cls`` (in tests, deliberately broken ones)."""
    return World(draw(seed, nodes), book_cls=book_cls, node_cls=node_cls).run()


def run_weeks(first: int, count: int) -> list[TierWeekResult]:
    return [run_week(s) for s in range(first, first + count)]


def main(argv: list[str] | None = None) -> int:
    """``python -m hpcelastic.sim.tier``: one week (``--seed``), or many (``--weeks``), one JSON line each
    with ``--json``; exit status 1 when any invariant broke."""
    import argparse
    import json
    import sys

    ap = argparse.ArgumentParser(prog="python -m hpcelastic.sim.tier", description=main.__doc__)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--weeks", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    broken = 0
    for seed in range(a.seed, a.seed + a.weeks):
        r = run_week(seed)
        broken += bool(r.violations)
        if a.json:
            row = {"seed": seed, "nodes": r.params.nodes, "events": r.events, "attempts": r.attempts}
            row |= {"violations": sorted({v.invariant for v in r.violations}), "restores": r.restores}
            print(json.dumps(row))
        elif a.weeks == 1:
            print(
                f"seed {seed}: {r.params.nodes} nodes + {r.params.spares} spares, {r.params.style}, "
                f"K={r.params.replicas}, {r.attempts} attempts, {r.rounds} rounds, {r.saves} saves, "
                f"{r.committed} committed, restores {r.restores}"
            )
        for v in r.violations[:20]:
            print(v, file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
