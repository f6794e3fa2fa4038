"""Simulated weeks drive the real TierBook and the nodes' real tier decisions; each invariant catches a
deliberately broken rule (hpcelastic/sim/tier.py, hpcelastic/sim/tier_invariants.py). The bugs weeks found
are pinned below, each by its sequence played directly (on the simulation's nodes, or on real LocalTiers).

A failing week prints its replay command (``python -m hpcelastic.sim.tier --seed N``); the 10,000-week
count, for this tree and the code before issue 27, is bench/sim_tier_weeks.py's.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hpcelastic.agent import messages
from hpcelastic.agent.job_state import Action, Send
from hpcelastic.sim.tier import SHARED, Copy, SimNode, TierWeekResult, World, draw, run_week
from hpcelastic.tier import channel
from hpcelastic.tier.book import HERE, PEER, Checkpoint, TierBook
from hpcelastic.tier.node import LocalTier
from tests.unit.test_tier_evidence import Node, write, zip_bytes

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


# ---- the bugs simulated weeks found, each sequence played directly --------------------------------------
def _world(nodes: int = 2, **params: Any) -> tuple[World, list[SimNode]]:
    """A week's world with ``nodes`` simulated nodes and no random faults, for a sequence played by hand."""
    quiet = {"put_fail": 0.0, "fetch_fail": 0.0, "persist_fail": 0.0, "die_in_op": 0.0}
    w = World(dataclasses.replace(draw(0, nodes), **(quiet | params)))
    w.attempt = 0
    w.nodes = {rank: SimNode(w, rank) for rank in range(nodes)}
    return w, list(w.nodes.values())


def _save(node: SimNode, name: str, position: str, size: int = 100) -> Copy:
    """The node's worker wrote its part of ``name`` (a file complete on its own), and the node reported it."""
    copy = Copy((0, 0, name), position, size, True, True, node.world._now_ns(), True)
    node.files.live.setdefault(name, {})[position] = copy
    node.scan((), position)
    node.scan((), position)  # a second look, as the node's loop takes
    assert (name, position) in node._held
    return copy


def test_the_simulated_node_starts_from_the_real_nodes_state_and_tidies_with_its_rule() -> None:
    """The simulation's node had its own copy of LocalTier's attributes and of its tidy before a round (the
    tidy lagged behind: it kept the newer checkpoints the coordinator named to set aside)."""
    _, (node, _peer) = _world()
    assert SimNode._tidy_live is LocalTier._tidy_live
    assert {"_held", "_placed", "_pinned", "_own_files", "_aside_unjudged"} <= set(vars(node))


def test_a_checkpoint_set_aside_leaves_the_node_before_the_script_saves_it_again() -> None:
    """Seeds 1300, 3766, 4270: a node restored X whole (its own part and a peer's placed beside it); X then
    lost a part, the next round restored nothing and named X to set aside, and the script saved X again.
    The simulation's own tidy had kept X in place, so the node read the placed part as its own and the
    plans named stale copies; the real tidy moves X out of sight (its parts no longer held there), and the
    new save is the node's own."""
    w, (node, peer) = _world(budget=10_000)
    x = "step-000010"
    _save(node, x, "0")
    _save(peer, x, "1")
    node.on_message(messages.TierRestore(1, x, 10, "", (("0", HERE, 0, "", 0), ("1", PEER, 1, "", 20001))))
    assert node.restore(1).path == node.live / x and set(node.files.live[x]) == {"0", "1"}
    node.on_message(messages.TierRestore(2, "", aside=(x,)))
    node.restore(2)
    assert x not in node.files.live and not any(key[0] == x for key in node._held)
    node.position = "0"
    node._round_start_ns = w._now_ns()
    again = _save(node, x, "0", size=120)
    assert [f.rel for f in node._held[(x, "0")]] == [f"{x}/0"] and node.files.live[x] == {"0": again}


def test_a_restore_that_makes_room_keeps_the_checkpoint_it_places() -> None:
    """Seed 7557: a fetch during the restore made room by dropping what the node no longer needed, and the
    checkpoint being restored was among it (older than a newer safe one, and pinned only once restored):
    its own part, placed first, was deleted, and the restore still said it placed every part."""
    w, (node, peer) = _world(budget=250, keep=1)
    x, older, newer = "step-000010", "step-000005", "step-000020"
    mine = _save(node, x, "0")
    theirs = _save(peer, x, "1")
    w.shared.committed.update({x: {}, older: {}})  # persisted: a drop may remove their live copies
    node.files.replicas["1"] = {older: {"1": dataclasses.replace(theirs, save=(0, 0, older))}}
    path = node.replicas / "1" / older / "1"
    node._held[(older, "1")] = [channel.FileRef(f"{older}/1", path, 100)]  # type: ignore[arg-type]
    node._complete, node._safe = [older, x, newer], {newer}
    sources = (("0", HERE, 0, "", 0), ("1", PEER, 1, "10.0.0.1", 20001))
    node.on_message(messages.TierRestore(1, x, 10, str(SHARED / x), sources))
    restored = node.restore(1)
    assert restored.path == node.live / x and not restored.error
    assert {q: (c.save, c.whole) for q, c in node.files.live[x].items()} == {
        "0": (mine.save, True),
        "1": (theirs.save, True),
    }
    assert older not in node.files.replicas["1"]  # the room came from what is no longer needed
    assert node._pinned == {x}


def test_the_simulation_counts_a_part_linked_over_the_same_bytes_as_no_deletion() -> None:
    """Seed 3863 (the simulation's own model of ``_place``): a restore linked a held replica over the copy an
    earlier restore had fetched of the same save, and the model reported that copy deleted; the check then
    blamed the node for a checkpoint whose other parts were on a node that had just died."""
    w, (node, _peer) = _world()
    gone: list[list[Copy]] = []
    w.deleted = lambda rank, copies: gone.append(copies)  # type: ignore[method-assign]
    x = "step-000010"
    fetched = Copy((0, 0, x), "1", 100, True, True, 1, True)
    node.files.live[x] = {"1": fetched}
    node.files.replicas["1"] = {x: {"1": dataclasses.replace(fetched, mtime_ns=2)}}
    node._place(node.replicas / "1" / x / "1", node.live / x / "1")
    assert gone == [] and node.files.live[x]["1"].mtime_ns == 2
    node.files.replicas["1"][x]["1"] = dataclasses.replace(fetched, save=(0, 1, x), mtime_ns=3)
    node._place(node.replicas / "1" / x / "1", node.live / x / "1")
    assert [[c.mtime_ns for c in copies] for copies in gone] == [[2]]  # another version's copy: deleted


@pytest.fixture
def tiers(tmp_path: Path) -> Iterator[list[Node]]:
    """Real LocalTiers (tests.unit.test_tier_evidence's Node), closed at the end."""
    made: list[Node] = []
    (tmp_path / "ckpt").mkdir()
    yield made
    for node in made:
        node.tier.close()


def _scan(node: Node, position: str, times: int = 2) -> None:
    for _ in range(times):
        node.tier.scan((), position)


def _dcp_saved_on_two_nodes(tmp_path: Path, tiers: list[Node], name: str) -> tuple[Node, Node]:
    """Nodes 0 and 1 (positions 0 and 1) with their parts of DCP save ``name`` reported (node 0's has the
    ``.metadata``; node 1 answered the coordinator's query)."""
    tiers.append(n0 := Node(tmp_path, "n0"))
    tiers.append(n1 := Node(tmp_path, "n1", node_rank=1))
    write(n0.tier.live / name / "__0_0.distcp", os.urandom(3000), time.time_ns())
    write(n0.tier.live / name / ".metadata", b"meta", time.time_ns())
    n0.scan_twice()
    write(n1.tier.live / name / "__1_0.distcp", os.urandom(2000), time.time_ns())
    n1.tier.on_message(messages.TierQuery(name))
    _scan(n1, "1")
    assert n0.kinds() == [("own", name, "0")] and n1.kinds() == [("own", name, "1")]
    return n0, n1


def _wait_for(node: Node, kind: tuple[str, str, str], count: int, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while node.kinds().count(kind) < count:
        assert time.monotonic() < deadline, node.kinds()
        time.sleep(0.02)


def test_a_held_part_replaces_the_older_version_an_earlier_restore_placed(
    tmp_path: Path, tiers: list[Node]
) -> None:
    """Seeds 3766, 4270's mechanism, with Lightning's ``last.ckpt`` (rank 0 writes it, every node gets it): a
    restore fetched version 1 onto node 1; rank 0 saved it again and node 1 got version 2 as a replica. The
    next restore linked that replica into place only where nothing was: version 1 stayed, restored as 2."""
    tiers.append(n0 := Node(tmp_path, "n0"))
    tiers.append(n1 := Node(tmp_path, "n1", node_rank=1))
    v1, v2 = zip_bytes(b"1" * 1000), zip_bytes(b"2" * 2000)
    write(n0.tier.live / "last.ckpt", v1, time.time_ns())
    n0.scan_twice()
    from_n0 = ("0", PEER, 0, "127.0.0.1", n0.tier.port)
    n1.tier.on_message(messages.TierRestore(1, "last.ckpt", 5, "", (from_n0,)))
    assert n1.tier.restore(1).path == n1.tier.live / "last.ckpt"
    assert (n1.tier.live / "last.ckpt").read_bytes() == v1
    write(n0.tier.live / "last.ckpt", v2, time.time_ns())
    n0.scan_twice()
    assert n0.kinds()[-2:] == [("dropped", "last.ckpt", "0"), ("own", "last.ckpt", "0")]
    n0.tier.on_message(messages.TierComplete("last.ckpt", 10, "0", False, ((1, "127.0.0.1", n1.tier.port),)))
    _wait_for(n1, ("replica", "last.ckpt", "0"), count=2)  # the restore's fetch, then this copy
    n1.tier.on_message(messages.TierRestore(2, "last.ckpt", 10, "", (("0", HERE, 1, "", 0), from_n0)))
    assert n1.tier.restore(2).path == n1.tier.live / "last.ckpt"
    assert (n1.tier.live / "last.ckpt").read_bytes() == v2


def test_a_restored_directory_saved_again_is_judged_on_the_nodes_own_files(
    tmp_path: Path, tiers: list[Node]
) -> None:
    """Seed 1300's mechanism, for a DCP directory saved again under one name: node 1 restored ``latest``
    (node 0's shard and ``.metadata`` placed beside its own), then its rank saved its shard again. The scan
    took every file there for node 1's part, the placed ``.metadata`` as the new save's end: a part of the
    old version reported as the new one, complete before node 0 had written its own."""
    n0, n1 = _dcp_saved_on_two_nodes(tmp_path, tiers, "latest")
    sources = (("0", PEER, 0, "127.0.0.1", n0.tier.port), ("1", HERE, 1, "", 0))
    n1.tier.on_message(messages.TierRestore(1, "latest", 5, "", sources))
    assert n1.tier.restore(1).path == n1.tier.live / "latest"
    assert (n1.tier.live / "latest" / ".metadata").read_bytes() == b"meta"
    write(n1.tier.live / "latest" / "__1_0.distcp", os.urandom(2500), time.time_ns())
    _scan(n1, "1", times=1)
    n1.tier.on_message(messages.TierQuery("latest"))  # node 0's new .metadata came: the coordinator asks
    _scan(n1, "1", times=3)
    assert sorted(p.name for p in (n1.tier.live / "latest").iterdir()) == ["__1_0.distcp"]
    assert n1.kinds()[1:] == [
        ("replica", "latest", "0"),  # the restore fetched it
        ("dropped", "latest", "1"),  # its own files changed
        ("dropped", "latest", "0"),  # the placed copy of node 0's part went
        ("own", "latest", "1"),
    ]
    assert (n1.sent[-1].size, n1.sent[-1].marker) == (2500, False)  # not complete: node 0's end is to come
    assert [f.rel for f in n1.tier._held[("latest", "1")]] == ["latest/__1_0.distcp"]
    assert ("latest", "0") not in n1.tier._held


def test_a_restore_from_memory_never_writes_through_an_earlier_link_to_the_persisted_copy(
    tmp_path: Path, tiers: list[Node]
) -> None:
    """Seeds 637, 697, 741 (once held parts replaced what was in place): an earlier round restored X from its
    persisted copy (a link in the local directory to the shared one), and this round restores X from
    memory. The fetch wrote through the link, into the shared copy (or failed across filesystems, and the
    round fell back to the shared copy or failed)."""
    tiers.append(n0 := Node(tmp_path, "n0"))
    tiers.append(n1 := Node(tmp_path, "n1", node_rank=1))
    new = {"step-5/__0_0.distcp": os.urandom(3000), "step-5/.metadata": b"meta-2"}
    for rel, data in new.items():
        write(n0.tier.live / rel, data, time.time_ns())
    n0.scan_twice()
    persisted = tmp_path / "ckpt" / "step-5"
    write(persisted / "__0_0.distcp", b"old" * 100)
    write(persisted / ".metadata", b"meta-1")
    n1.tier.on_message(messages.TierRestore(1, "step-5", 5, str(persisted), (("*", "persisted", -1, "", 0),)))
    assert n1.tier.restore(1).path == n1.tier.live / "step-5" and (n1.tier.live / "step-5").is_symlink()
    from_n0 = (("0", PEER, 0, "127.0.0.1", n0.tier.port),)
    n1.tier.on_message(messages.TierRestore(2, "step-5", 5, "", from_n0))
    restored = n1.tier.restore(2)
    assert restored.path == n1.tier.live / "step-5" and not restored.error
    assert not (n1.tier.live / "step-5").is_symlink()
    for rel, data in new.items():
        assert (n1.tier.live / rel).read_bytes() == data
    assert (persisted / ".metadata").read_bytes() == b"meta-1"  # the shared copy as it was


def test_parts_that_leave_the_local_directory_for_a_persisted_restore_are_no_longer_held(
    tmp_path: Path, tiers: list[Node]
) -> None:
    """Seed 229: a restore placed node 0's part beside this node's own, then a third part could not be had
    from memory and the round took the persisted copy (what the node had under the name moved aside, a
    link in its place). The node still counted both parts as held there, and the coordinator's later plans
    sent other nodes to fetch them from it."""
    n0, n1 = _dcp_saved_on_two_nodes(tmp_path, tiers, "step-5")
    persisted = tmp_path / "ckpt" / "step-5"
    for name in ("__0_0.distcp", "__1_0.distcp", "__2_0.distcp", ".metadata"):
        write(persisted / name, b"p")
    from_n0 = [(pos, PEER, 0, "127.0.0.1", n0.tier.port) for pos in ("0", "2")]  # n0 has no part 2
    sources = (from_n0[0], ("1", HERE, 1, "", 0), from_n0[1])
    n1.tier.on_message(messages.TierRestore(1, "step-5", 5, str(persisted), sources))
    assert n1.tier.restore(1).path == n1.tier.live / "step-5" and (n1.tier.live / "step-5").is_symlink()
    assert n1.kinds()[1] == ("replica", "step-5", "0")
    assert sorted(n1.kinds()[2:]) == [("dropped", "step-5", "0"), ("dropped", "step-5", "1")]
    assert not any(key[0] == "step-5" for key in n1.tier._held)
