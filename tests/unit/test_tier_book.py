"""The coordinator's book of the local checkpoint tier (hpcelastic/tier/book.py), pure: when a checkpoint is
complete job-wide, who replicates and persists it, what each round restores and from where."""

from __future__ import annotations

import random

from hpcelastic.agent import messages
from hpcelastic.agent.job_state import Record, Send
from hpcelastic.tier.book import HERE, PEER, PERSISTED, TierBook


def round_msg(rnd: int, group_rank: int, world: int = 2, groups: int = 0, group: int = -1) -> messages.Round:
    return messages.Round(rnd, rnd, 3, group_rank, world, group_rank * 2, world * 2, "m", 1,
                          replica_group=group, num_replica_groups=groups)  # fmt: skip


def book(nodes: int = 3, replicas: int = 1, persist_every: int = 1, mode: str = "all") -> TierBook:
    b = TierBook(replicas, persist_every, mode, clock=lambda: 100.0)
    for n in range(nodes):
        b.join(n, f"n{n}", f"10.0.0.{n}", 7000 + n)
    return b


def start_round(b: TierBook, rnd: int, assignment: dict[int, int]) -> dict[int, list[messages.Message]]:
    """The restore messages every node of ``assignment`` (node rank -> group rank) gets before ``rnd``."""
    world = len(assignment)
    return {n: b.restore_plan(n, round_msg(rnd, g, world)) for n, g in assignment.items()}


def have(
    name: str, pos: str, kind: str = "own", size: int = 10, marker: bool = False, step: int = 5
) -> messages.TierHave:
    return messages.TierHave(name, pos, kind, step, size, marker)


def sends(actions: list, cls: type) -> list[tuple[int, messages.Message]]:
    return [(a.node_rank, a.message) for a in actions if isinstance(a, Send) and isinstance(a.message, cls)]


def complete_checkpoint(b: TierBook, name: str, step: int, nodes: tuple[int, ...] = (0, 1)) -> list:
    """Node 0 holds the completing part (DCP .metadata); the others answer the query with theirs."""
    actions = b.have(nodes[0], have(name, "0", marker=True, step=step))
    for n in nodes[1:]:
        actions += b.have(n, have(name, str(n), step=step))
    return actions


def test_a_checkpoint_is_complete_once_every_node_answered_after_the_marker() -> None:
    b = book()
    start_round(b, 0, {0: 0, 1: 1})
    early = b.have(1, have("step-5", "1"))  # a DCP shard settled before rank 0's .metadata: not an answer
    assert early == []
    actions = b.have(0, have("step-5", "0", marker=True))
    assert sends(actions, messages.TierQuery) == [(1, messages.TierQuery("step-5"))]
    assert not b.checkpoints["step-5"].complete
    actions = b.have(1, have("step-5", "1"))
    assert b.checkpoints["step-5"].complete
    assert [e.event.fields["checkpoint"] for e in actions if isinstance(e, Record)] == ["step-5"]
    # Each part goes to the next node of the round, and is persisted (persist_every 1).
    done = sends(actions, messages.TierComplete)
    assert sorted((n, m.position, m.persist, [p[0] for p in m.peers]) for n, m in done) == [
        (0, "0", True, [1]),
        (1, "1", True, [0]),
    ]


def test_a_node_that_wrote_nothing_answers_with_an_empty_part_and_gets_nothing_to_copy() -> None:
    b = book()
    start_round(b, 0, {0: 0, 1: 1})
    b.have(0, have("step-5.pt", "0", marker=True))
    actions = b.have(1, have("step-5.pt", "1", size=0))
    assert [n for n, _ in sends(actions, messages.TierComplete)] == [0]


def test_a_pending_checkpoint_is_torn_when_its_round_ends_and_never_restored() -> None:
    b = book()
    start_round(b, 0, {0: 0, 1: 1})
    complete_checkpoint(b, "step-5", 5)
    b.have(0, have("step-10", "0", marker=True, step=10))  # node 1 dies before it answers
    b.lost(1)
    assert b.checkpoints["step-10"].abandoned
    b.have(0, have("step-5", "1", kind="replica"))
    plan = start_round(b, 1, {0: 0, 2: 1})
    assert {m.name for msgs in plan.values() for m in msgs} == {"step-5"}


def test_restore_from_own_memory_after_a_worker_crash() -> None:
    b = book(nodes=2)
    start_round(b, 0, {0: 0, 1: 1})
    complete_checkpoint(b, "step-5", 5)
    plan = start_round(b, 1, {0: 0, 1: 1})
    # Without replicas yet, each node holds its own part: 'all' fetches the peer's part.
    assert plan[0][0].sources == (("0", HERE, 0, "", 0), ("1", PEER, 1, "10.0.0.1", 7001))
    assert plan[1][0].sources == (("0", PEER, 0, "10.0.0.0", 7000), ("1", HERE, 1, "", 0))


def test_a_spare_restores_the_lost_nodes_part_from_its_peers_replica() -> None:
    b = book(nodes=3)
    start_round(b, 0, {0: 0, 1: 1})
    complete_checkpoint(b, "step-5", 5)
    b.have(1, have("step-5", "0", kind="replica"))
    b.have(0, have("step-5", "1", kind="replica"))
    assert b.checkpoints["step-5"].safe
    b.lost(1)
    plan = start_round(b, 1, {0: 0, 2: 1})
    assert plan[0][0].sources == (("0", HERE, 0, "", 0), ("1", HERE, 0, "", 0))
    assert plan[2][0].sources == (("0", PEER, 0, "10.0.0.0", 7000), ("1", PEER, 0, "10.0.0.0", 7000))


def test_own_mode_restores_only_the_nodes_position_unless_the_world_changed() -> None:
    b = book(nodes=3, mode="own")
    start_round(b, 0, {0: 0, 1: 1, 2: 2})
    complete_checkpoint(b, "step-5", 5, nodes=(0, 1, 2))
    plan = start_round(b, 1, {0: 0, 1: 1, 2: 2})
    assert [s[0] for s in plan[1][0].sources] == ["1"]
    b.have(0, have("step-5", "2", kind="replica"))
    b.lost(2)
    b.have(0, have("step-6", "0", marker=True, step=6))
    plan = start_round(b, 2, {0: 0, 1: 1})  # 3 -> 2 nodes: the union of every part on each node
    assert plan[0][0].name == "step-5" and [s[0] for s in plan[0][0].sources] == ["0", "1", "2"]


def test_without_a_copy_in_memory_the_persisted_one_is_restored() -> None:
    b = book(nodes=3)
    start_round(b, 0, {0: 0, 1: 1})
    actions = complete_checkpoint(b, "step-5", 5)
    for n, m in sends(actions, messages.TierComplete):
        b.have(n, have("step-5", m.position, kind="persisted"))
    commit = [a for a in b.have(1, have("step-5", "1", kind="persisted")) if isinstance(a, Send)]
    b.have(0, messages.TierHave("step-5", "", "committed", 5, path="/ckpt/step-5"))
    assert b.checkpoints["step-5"].committed == "/ckpt/step-5"
    assert not commit or isinstance(commit[0].message, messages.TierCommit)
    b.lost(1)  # node 1's part had no replica yet
    plan = start_round(b, 1, {0: 0, 2: 1})
    assert plan[2][0].sources == (("*", PERSISTED, -1, "", 0),) and plan[2][0].path == "/ckpt/step-5"


def test_a_new_attempt_restores_the_checkpoint_the_last_one_published() -> None:
    b = book(nodes=2)
    b.seed("step-40", 40, "/ckpt/step-40")
    plan = start_round(b, 0, {0: 0, 1: 1})
    assert all(m[0].name == "step-40" and m[0].sources[0][1] == PERSISTED for m in plan.values())
    empty = book(nodes=2)
    assert start_round(empty, 0, {0: 0, 1: 1})[0] == [messages.TierRestore(0, "")]


def test_persist_every_m_th_and_the_last_one_at_the_flush() -> None:
    b = book(nodes=2, persist_every=3)
    start_round(b, 0, {0: 0, 1: 1})
    persisted = []
    for i, step in enumerate((5, 10, 15, 20)):
        actions = complete_checkpoint(b, f"step-{step}", step)
        persisted.append(any(m.persist for _, m in sends(actions, messages.TierComplete)))
        assert i >= 0
    assert persisted == [False, False, True, False]
    assert b.flush(0) == []  # node 1's workers still run: node 0's wait has not begun
    actions = b.flush(1)  # every node's workers are gone: persist step 20 now, and every node's wait starts
    assert sends(actions, messages.TierFlushing) == [(n, messages.TierFlushing("step-20")) for n in (0, 1)]
    assert sorted(m.position for _, m in sends(actions, messages.TierComplete)) == ["0", "1"]
    assert all(m.persist and m.name == "step-20" for _, m in sends(actions, messages.TierComplete))
    assert not sends(b.have(0, have("step-20", "0", kind="persisted")), messages.TierFlushing)  # said once
    commit = b.have(1, have("step-20", "1", kind="persisted"))
    assert sends(commit, messages.TierCommit) == [(0, messages.TierCommit("step-20", 20, size=20))]
    flushed = b.have(0, messages.TierHave("step-20", "", "committed", 20, path="/c/step-20"))
    assert sends(flushed, messages.TierFlushed) == [
        (n, messages.TierFlushed("step-20", 20, True, "")) for n in (0, 1)
    ]
    (event,) = [a.event for a in flushed if isinstance(a, Record)]
    assert event.fields["stop"] is True


def test_a_flush_waits_for_the_answers_to_a_marker_that_came_last() -> None:
    b = book(nodes=2)
    start_round(b, 0, {0: 0, 1: 1})
    b.have(0, have("step-5", "0", marker=True))  # node 0's final scan found .metadata
    assert b.flush(0) == [] and b.flush(1) == []  # node 1's answer to the query is on its way
    actions = b.have(1, have("step-5", "1"))
    assert b.checkpoints["step-5"].complete and sends(actions, messages.TierComplete)


def test_a_flush_with_a_part_in_no_memory_says_it_could_not_persist() -> None:
    b = book(nodes=2, persist_every=100)
    start_round(b, 0, {0: 0, 1: 1})
    complete_checkpoint(b, "step-5", 5)
    b.checkpoints["step-5"].parts["1"].holders.clear()
    b.flush(0)
    actions = b.flush(1)
    (flushed,) = {m for _, m in sends(actions, messages.TierFlushed)}
    assert not flushed.ok and "part 1" in flushed.why
    assert [a.event.name.value for a in actions if isinstance(a, Record)] == ["tier_persist_missed"]


def test_a_shared_file_system_that_fails_a_persist_is_said_once_and_retried_once_at_the_stop() -> None:
    """ENOSPC in the background: one ``tier_persist_missed`` naming the node and the error, and every node
    removes what it staged (nothing partial stays in the shared directory); at the stop every part is asked
    once more, and a second failure ends the flush at once (not at the grace's end)."""
    full = "No space left on device in /shared/ckpt"
    b = book(nodes=2)
    start_round(b, 0, {0: 0, 1: 1})
    complete_checkpoint(b, "step-5", 5)
    b.have(0, have("step-5", "0", kind="persisted"))
    actions = b.have(1, messages.TierHave("step-5", "1", "persist_failed", why=full))
    (event,) = [a.event for a in actions if isinstance(a, Record)]
    assert event.name.value == "tier_persist_missed" and event.fields["why"] == f"n1: {full}"
    abort = messages.TierCommit("step-5", 5, abort=True)
    assert sends(actions, messages.TierCommit) == [(0, abort), (1, abort)]
    assert b.have(1, messages.TierHave("step-5", "1", "persist_failed", why=full)) == []  # said once
    assert b.flush(0) == []
    retry = b.flush(1)
    assert sends(retry, messages.TierComplete) == [
        (0, messages.TierComplete("step-5", 5, "0", True, ())),
        (1, messages.TierComplete("step-5", 5, "1", True, ())),
    ]
    actions = b.have(1, messages.TierHave("step-5", "1", "persist_failed", why=full))
    (flushed,) = {m for _, m in sends(actions, messages.TierFlushed)}
    assert not flushed.ok and full in flushed.why
    assert [a.event.name.value for a in actions if isinstance(a, Record)] == ["tier_persist_missed"]


def test_a_lost_owner_s_part_is_persisted_from_its_replica() -> None:
    b = book(nodes=3)
    start_round(b, 0, {0: 0, 1: 1})
    complete_checkpoint(b, "step-5", 5)
    b.have(0, have("step-5", "1", kind="replica"))
    actions = b.lost(1)
    assert sends(actions, messages.TierComplete) == [(0, messages.TierComplete("step-5", 5, "1", True, ()))]


def test_with_replica_groups_only_a_nodes_first_round_restores() -> None:
    b = book(nodes=2)
    first = b.restore_plan(0, round_msg(0, 0, 1, groups=2, group=0))
    assert first == [messages.TierRestore(0, "")]
    assert b.restore_plan(0, round_msg(1, 0, 1, groups=2, group=0)) == []  # torchft heals the group


# ---- long random runs: the invariants of every restore plan ---------------------------------------
def test_restore_plans_are_sound_over_many_random_runs() -> None:
    """3,000 random runs of checkpoints, replicas, persists, node losses and rounds: every restore plan names
    the newest checkpoint that can be restored (complete, never torn; every part really held by a live node,
    or really committed), and each part comes from a node that really holds it (itself or a live peer) or from
    the committed copy. Nodes keep their copies across rounds, and a fetched part counts as held only once
    the node reports it (a fetch the book merely planned is no copy)."""
    for seed in range(3_000):
        rng = random.Random(seed)
        _random_run(rng)


def _random_run(rng: random.Random) -> None:
    nodes = rng.randint(2, 5)
    b = book(nodes=nodes, replicas=rng.choice([0, 1, 2]), persist_every=rng.choice([1, 2, 3]))
    live = set(range(nodes))
    holds: dict[tuple[str, str], set[int]] = {}  # (checkpoint, position) -> nodes that truly hold it
    complete: set[str] = set()
    committed: set[str] = set()
    positions: dict[int, str] = {}
    rnd = 0

    def deliver(actions: list) -> None:
        """The agents do what the coordinator asks, as the real ones would (copies always succeed here)."""
        queue = list(actions)
        while queue:
            a = queue.pop(0)
            if not isinstance(a, Send) or a.node_rank not in live:
                continue
            m = a.message
            if isinstance(m, messages.TierComplete):
                complete.add(m.name)
                for peer, _addr, _port in m.peers:
                    if peer in live:
                        holds.setdefault((m.name, m.position), set()).add(peer)
                        queue += b.have(peer, have(m.name, m.position, kind="replica"))
                if m.persist:
                    queue += b.have(a.node_rank, have(m.name, m.position, kind="persisted"))
            elif isinstance(m, messages.TierCommit):
                committed.add(m.name)
                queue += b.have(
                    a.node_rank, messages.TierHave(m.name, "", "committed", m.step, path=f"/c/{m.name}")
                )

    def new_round() -> None:
        nonlocal rnd
        rnd += 1
        order = sorted(live)[: rng.randint(1, len(live))]
        positions.clear()
        positions.update({n: str(i) for i, n in enumerate(order)})
        plans = {n: b.restore_plan(n, round_msg(rnd, int(p), len(order))) for n, p in positions.items()}
        names = {msgs[0].name for msgs in plans.values()}
        assert len(names) == 1
        name = names.pop()
        restorable = {
            c.name: c.step or 0
            for c in b.checkpoints.values()
            if c.name in complete
            and not c.abandoned
            and (
                c.name in committed
                or (c.stored() and all(holds.get((c.name, p.position), set()) & live for p in c.stored()))
            )
        }
        if name:
            assert name in restorable, (name, restorable)
            assert restorable[name] == max(restorable.values()), (name, restorable)  # the newest one
        else:
            assert not restorable, restorable
        for n, msgs in plans.items():
            for m in msgs:  # the round's checkpoint, then the others the job holds (``extra``)
                for pos, where, src, _addr, _port in m.sources:
                    if where == PERSISTED:
                        assert m.name in committed and not m.extra
                    elif where == HERE:
                        assert n in holds.get((m.name, pos), set()), (n, m.name, pos, holds)
                    else:
                        assert src in live and src in holds.get((m.name, pos), set()), (src, m.name, pos)
            for m_name in dict.fromkeys(m.name for m in msgs if m.name):
                sources = [s for m in msgs if m.name == m_name for s in m.sources]
                here = {pos for pos, where, *_ in sources if where == HERE}
                for pos in {pos for pos, where, *_ in sources if where == PEER} - here:
                    if rng.random() < 0.2:
                        continue  # the fetch failed: the book must not count it
                    holds[(m_name, pos)].add(n)
                    b.have(n, have(m_name, pos, kind="replica"))

    new_round()
    for step in range(1, rng.randint(5, 40)):
        name = f"step-{step}"
        writers = list(positions)
        rng.shuffle(writers)
        torn = rng.random() < 0.15
        marker_node = writers[0]
        actions = b.have(marker_node, have(name, positions[marker_node], marker=True, step=step))
        holds[(name, positions[marker_node])] = {marker_node}
        for n in writers[1:]:
            if torn and rng.random() < 0.5:
                live.discard(n)  # dies before it answers: the checkpoint is torn
                actions += b.lost(n)
                break
            size = rng.choice([0, 10])
            actions += b.have(n, have(name, positions[n], size=size, step=step))
            if size:
                holds[(name, positions[n])] = {n}
        deliver(actions)
        if rng.random() < 0.2 and len(live) > 1:
            victim = rng.choice(sorted(live))
            live.discard(victim)
            for h in holds.values():
                h.discard(victim)
            deliver(b.lost(victim))
        if rng.random() < 0.3 or set(positions) - live:
            new_round()


def test_the_next_round_waits_while_a_checkpoint_completed_before_the_stop_is_answered_for() -> None:
    """The bug: a save complete just before a crash was reported by its writer but not yet answered for by
    the others when the next round was planned: it was torn, and the round restored an older one."""
    b = book(nodes=2)
    start_round(b, 0, {0: 0, 1: 1})
    complete_checkpoint(b, "step-15", 15)
    b.have(0, have("step-20", "0", marker=True, step=20))
    assert b.settling()  # node 1 is alive and will answer
    b.have(1, have("step-20", "1", step=20))
    assert not b.settling()
    msg, *extras = start_round(b, 1, {0: 0, 1: 1})[0]
    assert msg.name == "step-20" and [m.name for m in extras] == ["step-15"]
    b.have(0, have("step-25", "0", marker=True, step=25))
    b.lost(1)
    assert not b.settling()  # nobody left to answer: it is torn


def test_a_save_reported_after_a_node_of_its_round_is_lost_is_never_complete() -> None:
    """The bug: node 2 died mid-save; node 0 reported the save after the loss, and the book judged it against
    the nodes left (0 and 1), so it completed, was published and restored without node 2's shard."""
    b = book(nodes=3)
    start_round(b, 0, {0: 0, 1: 1, 2: 2})
    b.lost(2)
    actions = b.have(0, have("step-20", "0", marker=True, step=20))
    actions += b.have(1, have("step-20", "1", step=20))
    assert not sends(actions, messages.TierComplete) and b.last_complete() is None
    assert b.have(0, have("step-20", "0", marker=True, step=20)) == []  # said again: still torn
    (plan,) = start_round(b, 1, {0: 0, 1: 1})[0]
    assert plan.name == "" and plan.aside == ("step-20",)  # each node moves its files of it aside


def test_every_node_also_gets_the_other_complete_checkpoints_the_job_holds() -> None:
    """Lightning loads ``last.ckpt`` by name: a round restoring ``epoch=0-step=10.ckpt`` gives every node the
    ``last.ckpt`` of step 5 too (as a shared directory would show it), after its own."""
    b = book(nodes=2)
    start_round(b, 0, {0: 0, 1: 1})
    complete_checkpoint(b, "epoch=0-step=5.ckpt", 5)
    b.have(0, have("last.ckpt", "0", marker=True, step=None))  # type: ignore[arg-type]
    b.have(1, have("last.ckpt", "1", step=None))  # type: ignore[arg-type]
    b.have(1, have("last.ckpt", "0", kind="replica"))
    complete_checkpoint(b, "epoch=0-step=10.ckpt", 10)
    plans = start_round(b, 1, {0: 0, 1: 1})
    main, *extras = plans[1]
    assert main.name == "epoch=0-step=10.ckpt" and not main.extra
    assert [(m.name, m.extra, m.step) for m in extras] == [
        ("last.ckpt", True, 5),
        ("epoch=0-step=5.ckpt", True, 5),
    ]
    assert extras[0].sources[0][:3] == ("0", HERE, 1)  # node 1 holds last.ckpt's replica


def test_an_older_checkpoint_its_writer_still_holds_is_given_to_every_node() -> None:
    """The bug (Lightning under the tier): ``epoch=0-step=10.ckpt`` was safe before the round after the crash,
    so node 1 dropped its replica of the older ``last.ckpt`` and the plan left it out; node 0 keeps its own
    ``last.ckpt`` (a name without a step), so ranks 0-1 resumed from it and ranks 2-3 from nothing. Now
    every node gets it, from its writer, as a shared directory would show it."""
    b = book(nodes=2)
    start_round(b, 0, {0: 0, 1: 1})
    for name in ("epoch=0-step=5.ckpt", "last.ckpt", "epoch=0-step=10.ckpt"):
        complete_checkpoint(b, name, 10 if "10" in name else 5, nodes=(0,))
        b.have(1, have(name, "1", size=0))
        b.have(1, have(name, "0", kind="replica"))
    assert b.checkpoints["epoch=0-step=10.ckpt"].safe
    b.have(1, have("epoch=0-step=5.ckpt", "0", kind="dropped"))
    b.have(1, have("last.ckpt", "0", kind="dropped"))
    b.have(0, have("epoch=0-step=5.ckpt", "0", kind="dropped"))  # Lightning removed it
    main, *extras = start_round(b, 1, {0: 0, 1: 1})[1]
    assert main.name == "epoch=0-step=10.ckpt"
    assert [(m.name, m.sources[0][:3]) for m in extras] == [("last.ckpt", ("0", PEER, 0))]


def test_a_new_attempt_places_the_checkpoints_earlier_attempts_persisted_beside_the_published_one() -> None:
    """The bug (Lightning under the tier, testbed: rank 0's node killed between ``epoch=0-step=15.ckpt`` and
    the rewrite of ``last.ckpt``, a requeue): the new attempt restored the published checkpoint alone, the
    script found no ``last.ckpt`` and started from step 0, where without the tier it resumed from step 10.
    Now every node also links the other persisted ones, until a checkpoint of this attempt is safe."""
    b = book(nodes=2)
    b.seed("epoch=0-step=15.ckpt", 15, "/ckpt/epoch=0-step=15.ckpt")
    b.seed("last.ckpt", 10, "/ckpt/last.ckpt")
    main, *extras = start_round(b, 0, {0: 0, 1: 1})[1]
    assert (main.name, main.sources[0][1], main.extra) == ("epoch=0-step=15.ckpt", PERSISTED, False)
    assert [(m.name, m.path, m.sources[0][1], m.extra) for m in extras] == [
        ("last.ckpt", "/ckpt/last.ckpt", PERSISTED, True)
    ]
    complete_checkpoint(b, "epoch=0-step=20.ckpt", 20)
    b.have(1, have("epoch=0-step=20.ckpt", "0", kind="replica"))
    b.have(0, have("epoch=0-step=20.ckpt", "1", kind="replica"))
    assert b.checkpoints["epoch=0-step=20.ckpt"].safe
    main, *extras = start_round(b, 1, {0: 0, 1: 1})[1]
    assert main.name == "epoch=0-step=20.ckpt" and not [m.name for m in extras if m.path]
