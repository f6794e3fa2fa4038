"""What must hold in every simulated week of the checkpoint tier (:mod:`hpcelastic.sim.tier`), checked at the
step that could break it (each plan, restore, commit and deletion, as it happens):

- ``restore_holds``: every source a restore plan names for a part is a node that truly holds that part whole
  (or held it and its ``dropped`` report, or its death, has not reached the coordinator yet), or a committed
  copy that truly exists whole; and a node's restore that succeeds placed every part whole.
- ``published_whole``: a checkpoint committed and published is complete in every part.
- ``last_copy_kept``: no deletion by the tier removes the last whole copy of a part of the newest
  checkpoint restorable in fact (complete job-wide, every part whole on a live node, or committed whole);
  a node whose death the coordinator has not heard of yet still counts (no rule can know it is gone).
- ``newest_restored``: a round restores no older a checkpoint than the newest complete one restorable in
  fact from what the coordinator has been told (parts reported held by live nodes, copies committed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hpcelastic.tier.book import PERSISTED

if TYPE_CHECKING:
    from hpcelastic.sim.tier import Copy, SimNode, World

INVARIANTS = ("restore_holds", "published_whole", "last_copy_kept", "newest_restored")
Want = dict[str, tuple[Any, int]]


@dataclass(frozen=True)
class Violation:
    invariant: str
    seed: int
    ts: float
    detail: str

    def __str__(self) -> str:
        return (
            f"{self.invariant} (seed {self.seed}, t={self.ts:.1f} s): {self.detail}; "
            f"replay: python -m hpcelastic.sim.tier --seed {self.seed}"
        )


@dataclass
class TierChecker:
    """Collects one week's violations."""

    violations: list[Violation] = field(default_factory=list)
    completed: set[int] = field(default_factory=set)
    #: Names committed whose ``committed`` report reached this attempt's coordinator, and the seeded one.
    heard: set[str] = field(default_factory=set)
    #: (node, round) -> the restore plan it was sent: (target, sources).
    plans: dict[tuple[int, int], tuple[Any, list[tuple[str, str, int, str, int]]]] = field(
        default_factory=dict
    )
    _published: Any = None

    def fail(self, w: World, invariant: str, detail: str) -> None:
        self.violations.append(Violation(invariant, w.p.seed, w.t, detail))

    # ---- hooks ----
    def after_step(self, w: World) -> None:
        """The published checkpoint (what a requeue resumes from) stays whole whatever happened this step
        (only a commit changes the checkpoint directory: judged again when its files changed)."""
        pub = w.shared.published
        files = w.shared.committed.get(pub[0]) if pub is not None else None
        if files is self._published:
            return
        self._published = files
        if pub is not None and pub[0] in w.shared.whole and not w.shared.committed_whole(pub[0]):
            self.fail(w, "published_whole", f"the published {pub[0]} is not whole")

    def seeded(self, w: World, name: str) -> None:
        self.heard = {name}

    def committed_heard(self, w: World, name: str) -> None:
        self.heard.add(name)

    def planned(self, w: World, rank: int, plan: list[Any]) -> None:
        target = w.book._plan[1] if w.book._plan else None
        own = [msg for msg in plan if not getattr(msg, "extra", False)]
        sources = [s for msg in own for s in getattr(msg, "sources", ())]
        self.plans[(rank, w.round)] = (target, sources)
        if rank == min(w.round_nodes):
            self._newest(w, target)
        if target is None:
            return
        self._sources_held(w, rank, target, sources)
        for msg in plan:  # the other complete checkpoints placed beside it: their sources hold them too
            other = w.book.checkpoints.get(msg.name) if getattr(msg, "extra", False) else None
            if other is not None:
                self._sources_held(w, rank, other, list(msg.sources))

    def _sources_held(self, w: World, rank: int, target: Any, sources: list[Any]) -> None:
        for pos, where, node, _a, _p in sources:
            if where == PERSISTED:
                if not w.shared.committed_whole(target.name):
                    self.fail(
                        w, "restore_holds", f"round {w.round}: {target.name} has no whole committed copy"
                    )
                continue
            want = _want(w, target, pos)
            holder = w.nodes.get(node)
            if holder is not None and holder.alive and want and holder.files.holds(pos, want):
                continue
            if holder is not None and not holder.alive and node not in w.known_dead:
                continue  # dead, and the coordinator cannot know yet
            if w.unheard_drops.get((node, target.name, pos), 0) > 0:
                continue  # dropped, and its report is on its way
            self.fail(
                w,
                "restore_holds",
                f"round {w.round}: node {rank}'s plan names node {node} for {target.name} part {pos}, "
                "which it does not hold whole",
            )

    def restored(self, w: World, node: SimNode, round: int, restored: Any) -> None:
        if restored.error or restored.path is None:
            return
        target, sources = self.plans.get((node.node_rank, round), (None, []))
        if target is None:
            return
        name = target.name
        if name in node.files.links:
            if not w.shared.committed_whole(name):
                self.fail(
                    w, "restore_holds", f"node {node.node_rank} restored {name} from an incomplete copy"
                )
            return
        for pos in sorted({s[0] for s in sources if s[1] != PERSISTED}):
            want = _want(w, target, pos)
            got = node.files.live.get(name, {})
            if not want or not all(
                (c := got.get(q)) and c.whole and c.save == s for q, (s, _) in want.items()
            ):
                self.fail(
                    w,
                    "restore_holds",
                    f"node {node.node_rank} restored {name} in round {round} without part {pos} whole",
                )

    def commit(self, w: World, name: str, c: Any) -> None:
        if c is None:
            return
        want: Want = {}
        for p in c.stored():
            want.update(_want(w, c, p.position))
        if not want:
            return
        w.shared.whole[name] = want
        got = w.shared.committed.get(name, {})
        bad = sorted(q for q, (s, _) in want.items() if not ((x := got.get(q)) and x.whole and x.save == s))
        if bad:
            self.fail(
                w, "published_whole", f"{name} committed and published without part(s) {', '.join(bad)} whole"
            )

    def deleted(self, w: World, rank: int, gone: list[Copy]) -> None:
        """Copies the tier deleted: none may be the last whole one of a part of the newest checkpoint
        restorable in fact just before."""
        saves = {c.save for c in gone if c.whole}
        if not saves:
            return
        candidates = self._candidates(w)
        if not any(_saves(w, c) & saves for _, c in candidates):
            return
        newest = next((c for _, c in candidates if self._restorable(w, c, (rank, gone))), None)
        if newest is not None and _saves(w, newest) & saves and not self._restorable(w, newest):
            self.fail(
                w,
                "last_copy_kept",
                f"node {rank} deleted the last whole copy of a part of {newest.name}, the newest complete "
                "checkpoint",
            )

    # ---- the newest checkpoint restorable in fact ----
    def _newest(self, w: World, target: Any) -> None:
        newest = self._newest_restorable(w, None, told=True)
        if newest is None:
            return
        c, step = newest
        got = -1 if target is None else (target.step if target.step is not None else -1)
        if got < step:
            self.fail(
                w,
                "newest_restored",
                f"round {w.round} restores {target.name if target else 'nothing'} (step {got}); "
                f"{c.name if hasattr(c, 'name') else c} (step {step}) is complete and restorable",
            )

    def _candidates(self, w: World) -> list[tuple[int, Any]]:
        out = [
            (c.step if c.step is not None else -1, c)
            for c in w.book.checkpoints.values()
            if c.complete and not c.abandoned
        ]
        return sorted(out, key=lambda sc: (sc[0], sc[1].seq or 0), reverse=True)

    def _newest_restorable(
        self, w: World, extra: tuple[int, list[Copy]] | None, told: bool = False
    ) -> tuple[Any, int] | None:
        for step, c in self._candidates(w):
            if self._restorable(w, c, extra, told):
                return c, step
        return None

    def _restorable(
        self, w: World, c: Any, extra: tuple[int, list[Copy]] | None = None, told: bool = False
    ) -> bool:
        if c.committed and w.shared.committed_whole(c.name) and (not told or c.name in self.heard):
            return True
        parts = c.stored()
        if not parts:
            return False
        for p in parts:
            want = _want(w, c, p.position)
            if not want:
                return False
            if not any(_holds(w, n, p.position, want, extra, told) for n in w.nodes):
                return False
        return True


def _saves(w: World, c: Any) -> set[Any]:
    return {s for want in w.parts.get(id(c), (None, {}))[1].values() for s, _ in want.values()}


def _want(w: World, c: Any, pos: str) -> Want:
    return w.parts.get(id(c), (None, {}))[1].get(pos, {})


def _holds(
    w: World, rank: int, pos: str, want: Want, extra: tuple[int, list[Copy]] | None, told: bool
) -> bool:
    node = w.nodes[rank]
    if not node.alive:
        ghost = w.ghosts.get(rank) if extra is not None else None  # dead, and no one can know yet
        return ghost is not None and ghost.holds(pos, want)
    if told and (rank, next(iter(want.values()))[0][2], pos) not in w.reported:
        return False
    if node.files.holds(pos, want):
        return True
    if extra is None or extra[0] != rank:
        return False
    more = {c.position: c for c in extra[1]}
    files = node.files
    for q, (save, _) in want.items():
        name = save[2]
        c = files.in_live(name).get(q) or files.replicas.get(pos, {}).get(name, {}).get(q)
        if not (c is not None and c.whole and c.save == save) and not (
            (x := more.get(q)) is not None and x.save == save
        ):
            return False
    return True
