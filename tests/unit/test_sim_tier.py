"""Simulated weeks drive the real TierBook and the nodes' real tier decisions; each invariant catches a
deliberately broken rule (hpcelastic/sim/tier.py, hpcelastic/sim/tier_invariants.py).

A failing week prints its replay command (``python -m hpcelastic.sim.tier --seed N``); the 10,000-week
count, for this tree and the code before issue 27, is bench/sim_tier_weeks.py's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hpcelastic.agent import messages
from hpcelastic.agent.job_state import Action, Send
from hpcelastic.sim.tier import SimNode, TierWeekResult, run_week
from hpcelastic.tier.book import PEER, Checkpoint, TierBook

WEEKS = 300


def test_simulated_weeks_keep_every_invariant() -> None:
    results = [run_week(seed) for seed in range(WEEKS)]
    violations = [str(v) for r in results for v in r.violations]
    assert not violations, f"{len(violations)} violations, first:\n" + "\n".join(violations[:15])
    restores = {k for r in results for k, n in r.restores.items() if n}
    assert restores >= {"local", "peer", "persisted", "none"}, restores
    assert sum(r.committed for r in results) > WEEKS


def _first(invariant: str, seeds: Iterable[int] = range(200), **broken: Any) -> TierWeekResult:
    """The first week of ``seeds`` that the broken rule makes break ``invariant``; the real code keeps it."""
    for seed in seeds:
        res = run_week(seed, **broken)
        if any(v.invariant == invariant for v in res.violations):
            assert not run_week(seed).violations, "the real code breaks it too"
            return res
    raise AssertionError(f"no week broke {invariant}")


class _CountsPlannedFetches(TierBook):
    """Broken (the rule before issue 27): a node a restore plan sends to fetch a part counts as holding it."""

    def _sources(self, target: Checkpoint, node_rank: int, position: str) -> list[Any]:
        out = super()._sources(target, node_rank, position)
        for pos, where, *_ in out:
            if where == PEER:
                target.parts[pos].holders.add(node_rank)
        return out


def test_a_plan_naming_a_node_without_the_part_is_caught() -> None:
    res = _first("restore_holds", book_cls=_CountsPlannedFetches)
    assert any("does not hold whole" in str(v) for v in res.violations)


class _CommitsEarly(TierBook):
    """Broken: commits once any part is persisted, without the expected size."""

    def _maybe_commit(self, c: Checkpoint) -> list[Action]:
        if c.committed or not any(p.persisted for p in c.stored()) or not self.members:
            return []
        return [Send(min(self.members), messages.TierCommit(c.name, c.step))]


def test_publishing_an_incomplete_checkpoint_is_caught() -> None:
    res = _first("published_whole", book_cls=_CommitsEarly)
    assert any("without part" in str(v) for v in res.violations)


class _DropsTheSafeOne(SimNode):
    """Broken: on ``TierSafe`` a node also deletes its copies of the checkpoint that is safe."""

    def on_message(self, msg: messages.Message) -> None:
        super().on_message(msg)
        if isinstance(msg, messages.TierSafe):
            for key in [k for k in self._held if k[0] == msg.name]:
                del self._held[key]
            self.files.remove(("live", msg.name))
            for pos in list(self.files.replicas):
                self.files.remove(("replicas", pos, msg.name))


def test_deleting_the_last_copy_of_the_newest_checkpoint_is_caught() -> None:
    res = _first("last_copy_kept", node_cls=_DropsTheSafeOne)
    assert any("last whole copy" in str(v) for v in res.violations)


class _RestoresOldest(TierBook):
    """Broken: restores the oldest complete checkpoint it can, not the newest."""

    def _restore_target(self) -> Checkpoint | None:
        live = set(self.members)
        complete = [c for c in self.checkpoints.values() if c.complete and not c.abandoned]
        for c in sorted(complete, key=lambda c: (c.step or -1, c.seq or 0)):
            if c.committed or (c.stored() and all(p.holders & live for p in c.stored())):
                return c
        return None


def test_resuming_from_an_older_checkpoint_is_caught() -> None:
    res = _first("newest_restored", book_cls=_RestoresOldest)
    assert any("complete and restorable" in str(v) for v in res.violations)


def test_a_week_replays_alone() -> None:
    a, b = run_week(42), run_week(42)
    assert (a.events, a.rounds, a.saves, a.committed, a.restores) == (
        b.events,
        b.rounds,
        b.saves,
        b.committed,
        b.restores,
    )
