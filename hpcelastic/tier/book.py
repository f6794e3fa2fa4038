"""The coordinator's view of the local checkpoint tier, pure: :class:`TierBook` takes the agents'
reports and returns the coordinator's actions (``job_state.Send``, ``Record``, ``Say``) that
``coordinator.py`` applies.

A checkpoint is a top-level name in the nodes' local directories. Each node's files of it are a *part*,
keyed by the *position* (the node's group rank in the round, ``G:R`` with replica groups) of the node that
wrote it, so a spare that takes a lost node's position restores that position's files. A checkpoint is
*complete* when one node reported the part that completes it (DCP's ``.metadata``, a complete file, a
published mark) and every node of the round answered for its part afterwards (0 bytes when it wrote none);
DCP writes ``.metadata`` after every rank's shards, so no part can still grow by then. A pending checkpoint
whose round ends (a failure, a node killed during the save) is torn: never replicated, persisted or restored.

Complete checkpoints are replicated (each part to the next ``replicas`` nodes of the round, in position
order), persisted every ``persist_every``-th (and the last one when the workers end: :meth:`flush`), and
*safe* once every part has its replicas: then the nodes drop older local copies. Before each round every
node gets a restore plan (:meth:`restore_plan`): the newest complete checkpoint that can be restored (every
part still in some node's memory, or persisted); each part from the nearest copy (this node, a peer), or the
whole persisted copy when a part is in no node's memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hpcelastic import events
from hpcelastic.agent import messages
from hpcelastic.agent.job_state import Action, Record, Say, Send

#: Sources per :class:`~hpcelastic.agent.messages.TierRestore` message (each frame stays small).
RESTORE_CHUNK = 64
HERE, PEER, PERSISTED = "here", "peer", "persisted"


def position_of(rnd: messages.Round) -> str:
    """A node's position in ``rnd``: its group rank (``G:R`` within replica group ``G``)."""
    return f"{rnd.replica_group}:{rnd.group_rank}" if rnd.num_replica_groups else str(rnd.group_rank)


@dataclass
class Part:
    """One node's files of a checkpoint: who wrote them, their size, which nodes hold a copy."""

    position: str
    owner: int
    size: int
    holders: set[int] = field(default_factory=set)
    persisted: bool = False


@dataclass
class Checkpoint:
    """What the coordinator knows of one checkpoint of this attempt (or the persisted one it resumed from)."""

    name: str
    step: int | None
    round: int
    positions: frozenset[str]
    parts: dict[str, Part] = field(default_factory=dict)
    #: Positions that reported since the marker (only those reports can complete it).
    answered: set[str] = field(default_factory=set)
    marker: bool = False
    seq: int | None = None
    complete_ts: float = 0.0
    persist: bool = False
    committed: str = ""
    safe: bool = False
    abandoned: bool = False
    #: Why a node could not persist its part (the shared file system failed), or "".
    persist_failed: str = ""

    @property
    def complete(self) -> bool:
        return self.seq is not None

    @property
    def pending(self) -> bool:
        return not self.complete and not self.abandoned

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts.values())

    def stored(self) -> list[Part]:
        """The parts with files (a node that wrote none has an empty part)."""
        return [p for p in self.parts.values() if p.size > 0]


@dataclass
class TierBook:
    """The job's checkpoints in the local tier, for one attempt (see the module docstring)."""

    replicas: int
    persist_every: int
    restore_mode: str
    attempt: int = 0
    clock: Callable[[], float] = time.time
    #: node rank -> (host name, address, data port) of every joined agent with a tier.
    members: dict[int, tuple[str, str, int]] = field(default_factory=dict)
    #: node rank -> its position in the current round.
    position: dict[int, str] = field(default_factory=dict)
    checkpoints: dict[str, Checkpoint] = field(default_factory=dict)
    round: int = -1
    completed: int = 0
    flushing: set[int] = field(default_factory=set)
    #: Every node of the round has flushed and the last checkpoint's persist began (``TierFlushing`` sent).
    flush_begun: bool = False
    flushed: bool = False
    #: (round, checkpoint) of the restore planned for the current round.
    _plan: tuple[int, Checkpoint | None] | None = None
    #: Nodes that got a round in this attempt (with replica groups only their first round restores).
    _started: set[int] = field(default_factory=set)
    #: Every position of the current round, those of nodes lost since included: a checkpoint of the round
    #: has a part at each (a lost node's part is lost with it).
    _round_positions: set[str] = field(default_factory=set)

    # ---- who is there -----------------------------------------------------------------------
    def seed(self, name: str, step: int | None, path: str) -> None:
        """A checkpoint an earlier attempt persisted: the published one first (restored when memory has none),
        then the others still in the checkpoint directory (placed beside it: :meth:`_extras`)."""
        self.checkpoints[name] = Checkpoint(name, step, -1, frozenset(), seq=0, committed=path)

    def join(self, node_rank: int, host: str, address: str, data_port: int) -> None:
        if data_port:
            self.members[node_rank] = (host, address, data_port)

    def lost(self, node_rank: int) -> list[Action]:
        """A node is gone: its copies with it; a pending checkpoint it had not answered for is torn."""
        self.members.pop(node_rank, None)
        pos = self.position.pop(node_rank, None)
        self.flushing.discard(node_rank)
        actions: list[Action] = []
        for key, c in self.checkpoints.items():
            for part in c.parts.values():
                part.holders.discard(node_rank)
            if c.pending and pos is not None and pos in c.positions and pos not in c.answered:
                c.abandoned = True
            # a version the name has since been saved over is never persisted again: the nodes' messages
            # name a checkpoint, not a version, and its copies would count for the current one
            if c.persist and not c.committed and key == c.name:
                actions += self._persist_parts(c, only_owner=node_rank)
        return actions + self._settle_flush()

    # ---- rounds and restores ----------------------------------------------------------------
    def restore_plan(self, node_rank: int, rnd: messages.Round) -> list[messages.Message]:
        """The :class:`~hpcelastic.agent.messages.TierRestore` messages for ``node_rank`` before ``rnd``."""
        first = node_rank not in self._started
        self._started.add(node_rank)
        if rnd.round != self.round:
            self._new_round(rnd.round)
        self.position[node_rank] = position_of(rnd)
        self._round_positions.add(position_of(rnd))
        if rnd.num_replica_groups and not first:
            return []  # torchft heals a restarted group from a live peer group; the tier is not needed
        assert self._plan is not None
        target = self._plan[1]
        aside = self._aside(target)
        if target is None:
            return [messages.TierRestore(rnd.round, "", aside=aside)]
        out = self._plan_messages(rnd.round, target, node_rank, position_of(rnd), aside)
        for other in self._extras(target, aside):
            out += self._plan_messages(rnd.round, other, node_rank, position_of(rnd), (), extra=True)
        return out

    def _plan_messages(
        self,
        round: int,
        c: Checkpoint,
        node_rank: int,
        position: str,
        aside: tuple[str, ...],
        extra: bool = False,
    ) -> list[messages.Message]:
        sources = self._sources(c, node_rank, position)
        return [
            messages.TierRestore(
                round,
                c.name,
                c.step,
                c.committed,
                tuple(sources[i : i + RESTORE_CHUNK]),
                last=i + RESTORE_CHUNK >= len(sources),
                aside=aside if i == 0 else (),
                extra=extra,
            )
            for i in range(0, max(1, len(sources)), RESTORE_CHUNK)
        ]

    def _extras(self, target: Checkpoint, aside: tuple[str, ...]) -> list[Checkpoint]:
        """The other complete checkpoints live nodes hold whole (their current versions), newest first: every
        node gets them too, as every rank would see them in a shared directory. Only those no node drops:
        the newest safe one and any completed since (older ones go as soon as a newer one is safe), and the
        older ones whose writers still hold them in their own directories, where their ranks see them
        (``last.ckpt``: a name without a step is never dropped there). At a new attempt, until one of its own
        is safe, also those earlier attempts persisted (:meth:`seed`: each node links the persisted copy, as
        the shared directory shows it: Lightning loads ``last.ckpt``, older than the one published, by
        name)."""
        live = set(self.members)
        floor = max((c.seq or 0 for c in self.checkpoints.values() if c.safe and not c.abandoned), default=0)
        return sorted(
            (
                c
                for key, c in self.checkpoints.items()
                if key == c.name and c is not target and c.name not in aside and c.complete
                if (c.seq or 0) >= floor or (c.stored() and all(p.owner in p.holders for p in c.stored()))
                if not c.abandoned
                if (c.stored() and all(p.holders & live for p in c.stored())) or _seeded(c)
            ),
            key=_newest,
            reverse=True,
        )

    def _aside(self, target: Checkpoint | None) -> tuple[str, ...]:
        """The checkpoints the book knows that are newer than ``target`` (by step) but not restored: torn,
        or a part gone with a node. Each node moves its files of them out of the script's sight, or each
        would see a different newest checkpoint (its own files of it only)."""
        newer = {
            c.name
            for c in self.checkpoints.values()
            if c.step is not None and (target is None or (target.step is not None and c.step > target.step))
        }
        return tuple(sorted(newer - {target.name if target else ""}))

    def _new_round(self, round: int) -> None:
        """A new round: pending checkpoints of earlier rounds are torn; pick what this round restores. Nodes
        keep every other copy they hold (they drop copies only as :class:`TierSafe` allows, and say so)."""
        self.round = round
        self._round_positions = set()
        self.flushing.clear()
        self.flush_begun = False
        self.flushed = False
        for c in self.checkpoints.values():
            if c.pending:
                c.abandoned = True
        self._plan = (round, self._restore_target())

    def _restore_target(self) -> Checkpoint | None:
        """The newest complete checkpoint that can be restored: each part in live memory, or persisted."""
        complete = sorted(
            (c for c in self.checkpoints.values() if c.complete and not c.abandoned),
            key=_newest,
            reverse=True,
        )
        live = set(self.members)
        for c in complete:
            if c.committed or (c.stored() and all(p.holders & live for p in c.stored())):
                return c
        return None

    def _sources(
        self, target: Checkpoint, node_rank: int, position: str
    ) -> list[tuple[str, str, int, str, int]]:
        """Each part's sources in the order to try: this node's own copy, else every live holder, the first
        chosen by ``node_rank`` so that a whole job's restore spreads over the holders rather than fanning
        in on each part's owner. A holder is counted only once its copy is reported (:meth:`have`), never
        for a fetch merely planned here."""
        live = set(self.members)
        in_memory = bool(target.stored()) and all(p.holders & live for p in target.stored())
        if not in_memory:
            return [("*", PERSISTED, -1, "", 0)]
        same_world = set(self.position.values()) == set(target.positions)
        parts = target.stored()
        if self.restore_mode == "own" and same_world:
            parts = [p for p in parts if p.position == position]
        out = []
        for p in sorted(parts, key=lambda p: p.position):
            if node_rank in p.holders:
                out.append((p.position, HERE, node_rank, "", 0))
            holders = sorted(p.holders & live - {node_rank})
            first = node_rank % len(holders) if holders else 0
            for holder in holders[first:] + holders[:first]:
                _host, address, port = self.members[holder]
                out.append((p.position, PEER, holder, address, port))
        return out

    def settling(self) -> bool:
        """A checkpoint of the round that just ended has its completing part in and waits only for answers
        from live nodes (a node answers a query once its workers are stopped): the next round's plan should
        wait for them, or it would take an older checkpoint than the job has."""
        live = set(self.members)
        for c in self.checkpoints.values():
            if c.pending and c.marker and c.round == self.round:
                waiting = {n for n, p in self.position.items() if p in c.positions - c.answered}
                if waiting and waiting <= live:
                    return True
        return False

    # ---- reports ----------------------------------------------------------------------------
    def have(self, node_rank: int, msg: messages.TierHave) -> list[Action]:
        """A node's report (:class:`~hpcelastic.agent.messages.TierHave`)."""
        c = self.checkpoints.get(msg.name)
        if msg.kind == "own":
            return self._own(node_rank, msg, c)
        if c is None:
            return []
        part = c.parts.get(msg.position)
        if msg.kind == "replica" and part is not None:
            self._forget_older(msg.name, msg.position, node_rank, c)
            part.holders.add(node_rank)
            return self._maybe_safe(c)
        if msg.kind == "dropped":
            for version in self._versions(msg.name):
                if (p := version.parts.get(msg.position)) is not None:
                    p.holders.discard(node_rank)
            return []
        if msg.kind == "persisted" and part is not None:
            part.persisted = True
            return self._maybe_commit(c)
        if msg.kind == "committed":
            c.committed = msg.path
            stop = bool(self.flushing)
            duration = self.clock() - c.complete_ts if c.complete_ts else 0.0
            event = events.tier_persisted(
                attempt=self.attempt,
                checkpoint=c.name,
                step=c.step,
                path=msg.path,
                size=c.size,
                duration_s=duration,
                stop=stop,
            )
            return [Record(event), *self._settle_flush()]
        if msg.kind == "refused":
            host = self.members.get(node_rank, (str(node_rank),))[0]
            return [Say(f"local checkpoint tier on {host}: {msg.why}")]
        if msg.kind == "persist_failed":
            return self._persist_failed(c, node_rank, msg.why)
        return []

    def _persist_failed(self, c: Checkpoint, node_rank: int, why: str) -> list[Action]:
        """A node could not copy its part of ``c`` to the shared file system: the checkpoint is not
        persisted (said once), every node removes what it staged of it (nothing partial stays in the shared
        directory), and a stop waiting for it ends now rather than at the end of its grace."""
        if c.persist_failed:
            return []
        host = self.members.get(node_rank, (str(node_rank),))[0]
        c.persist_failed = f"{host}: {why}"
        for p in c.parts.values():
            p.persisted = False
        abort: list[Action] = [
            Send(n, messages.TierCommit(c.name, c.step, abort=True)) for n in sorted(self.members)
        ]
        if self.flushing and not self.flushed and c.persist:
            return abort + self._flushed(c, ok=False, why=c.persist_failed)
        event = events.tier_persist_missed(
            attempt=self.attempt, checkpoint=c.name, step=c.step, why=c.persist_failed
        )
        return [
            *abort,
            Record(event),
            Say(f"local checkpoint tier: {c.name} not persisted: {c.persist_failed}"),
        ]

    def _own(self, node_rank: int, msg: messages.TierHave, c: Checkpoint | None) -> list[Action]:
        rewritten = c is not None and c.complete and (p := c.parts.get(msg.position)) is not None
        rewritten = rewritten and node_rank not in p.holders  # it dropped the old version: a save in place
        if c is not None and c.complete and (rewritten or (c.round != self.round and not c.committed)):
            self.checkpoints[f"{c.name}@{c.seq}"] = c  # the older version stays, with whatever still holds it
            c = None
        if c is not None and c.abandoned and (c.round == self.round or not msg.marker):
            return []  # torn in this round, or a late answer about an earlier round's: never complete
        if c is None or c.abandoned:
            positions = frozenset(self._round_positions | set(self.position.values()))
            c = Checkpoint(msg.name, msg.step, self.round, positions)
            self.checkpoints[msg.name] = c
            # A position whose node is gone can never answer: its part went with it.
            c.abandoned = not positions <= set(self.position.values())
            if c.abandoned:
                return []
        elif c.complete:
            return []  # a report of a part already counted (a rescan)
        if msg.step is not None:
            c.step = msg.step
        elif c.step is None:  # a name without a step (last.ckpt): saved with the newest one it follows
            c.step = max((x.step for x in self.checkpoints.values() if x.step is not None), default=None)
        pos = msg.position
        c.parts[pos] = Part(pos, node_rank, msg.size, {node_rank} if msg.size else set())
        actions: list[Action] = []
        if msg.marker and not c.marker:
            c.marker = True
            c.answered = {pos}
            for other, q in self.position.items():
                if q in c.positions and other != node_rank:
                    actions.append(Send(other, messages.TierQuery(c.name)))
        elif c.marker:
            c.answered.add(pos)
        return actions + self._maybe_complete(c)

    def _maybe_complete(self, c: Checkpoint) -> list[Action]:
        if not c.marker or c.complete or c.abandoned or not c.positions <= c.answered:
            return []
        self.completed += 1
        c.seq = max((x.seq or 0 for x in self.checkpoints.values()), default=0) + 1
        c.complete_ts = self.clock()
        c.persist = bool(self.flushing) or self.completed % self.persist_every == 0
        event = events.tier_checkpoint(
            attempt=self.attempt,
            round=c.round,
            checkpoint=c.name,
            step=c.step,
            size=c.size,
            parts=len(c.stored()),
        )
        actions: list[Action] = [Record(event)]
        for p in c.stored():
            peers = self._ring(p.owner)
            actions.append(Send(p.owner, messages.TierComplete(c.name, c.step, p.position, c.persist, peers)))
        return actions + self._maybe_safe(c) + self._settle_flush()

    def _ring(self, owner: int) -> tuple[tuple[int, str, int], ...]:
        """The next ``replicas`` nodes of the round after ``owner``, in position order."""
        order = [
            n for n, _ in sorted(self.position.items(), key=lambda kv: _order(kv[1])) if n in self.members
        ]
        if owner not in order or self.replicas == 0:
            return ()
        i = order.index(owner)
        ring = [order[(i + d) % len(order)] for d in range(1, len(order))][: self.replicas]
        return tuple((n, self.members[n][1], self.members[n][2]) for n in ring)

    def _wanted_replicas(self) -> int:
        return min(self.replicas, max(0, len([n for n in self.position if n in self.members]) - 1))

    def _maybe_safe(self, c: Checkpoint) -> list[Action]:
        if c.safe or not c.complete:
            return []
        wanted = self._wanted_replicas()
        if any(len(p.holders - {p.owner}) < wanted for p in c.stored()):
            return []
        c.safe = True
        event = events.tier_replicated(
            attempt=self.attempt,
            checkpoint=c.name,
            step=c.step,
            replicas=wanted,
            duration_s=self.clock() - c.complete_ts if c.complete_ts else 0.0,
        )
        return [Record(event), *(Send(n, messages.TierSafe(c.name)) for n in sorted(self.members))]

    def _maybe_commit(self, c: Checkpoint) -> list[Action]:
        if c.committed or not c.stored() or not all(p.persisted for p in c.stored()) or not self.members:
            return []
        return [Send(min(self.members), messages.TierCommit(c.name, c.step, size=c.size))]

    def _persist_parts(self, c: Checkpoint, only_owner: int | None = None) -> list[Action]:
        """Ask a live holder of each part not yet persisted (of ``only_owner``'s parts) to persist it."""
        actions: list[Action] = []
        for p in c.stored():
            if p.persisted or (only_owner is not None and p.owner != only_owner):
                continue
            live = p.holders & set(self.members)
            if not live:
                continue
            holder = p.owner if p.owner in live else min(live)
            actions.append(Send(holder, messages.TierComplete(c.name, c.step, p.position, True, ())))
        return actions

    def _versions(self, name: str) -> list[Checkpoint]:
        """Every version the book knows of checkpoint ``name`` (a save rewritten in place makes a new one)."""
        return [c for c in self.checkpoints.values() if c.name == name]

    def _forget_older(self, name: str, position: str, node_rank: int, current: Checkpoint) -> None:
        """``node_rank`` now holds ``current``'s part ``position``: its copy of an older version is gone."""
        for version in self._versions(name):
            if version is not current and (p := version.parts.get(position)) is not None:
                p.holders.discard(node_rank)

    def last_complete(self) -> tuple[str, int | None] | None:
        """The newest complete checkpoint (name, step), or None."""
        complete = [c for c in self.checkpoints.values() if c.complete and not c.abandoned]
        newest = max(complete, key=_newest, default=None)
        return (newest.name, newest.step) if newest is not None else None

    # ---- the end of the workers -------------------------------------------------------------
    def flush(self, node_rank: int) -> list[Action]:
        """``node_rank``'s workers are gone and it reported everything: persist the last checkpoint."""
        self.flushing.add(node_rank)
        return self._settle_flush()

    def _settle_flush(self) -> list[Action]:
        round_nodes = {n for n in self.position if n in self.members}
        if self.flushed or not self.flushing or not round_nodes <= self.flushing:
            return []
        if any(c.pending and c.marker and c.round == self.round for c in self.checkpoints.values()):
            return []  # a node's answer is on its way
        complete = [c for c in self.checkpoints.values() if c.complete and not c.abandoned]
        target = max(complete, key=_newest, default=None)
        if target is None or target.committed:
            return self._flushed(target, ok=True, why="" if target else "no complete checkpoint")
        if not target.persist or target.persist_failed:  # a copy the shared file system failed: once more
            target.persist, target.persist_failed = True, ""
            missing = [p.position for p in target.stored() if not p.holders & set(self.members)]
            if missing:
                return self._flushed(target, ok=False, why=f"no node holds part {missing[0]} any more")
            return self._begin_flush(target) + self._persist_parts(target)
        return self._begin_flush(target)

    def _begin_flush(self, target: Checkpoint) -> list[Action]:
        """Tell every node, once, that the last checkpoint's persist runs: their wait counts from now."""
        if self.flush_begun:
            return []
        self.flush_begun = True
        return [Send(n, messages.TierFlushing(target.name)) for n in sorted(self.members)]

    def _flushed(self, target: Checkpoint | None, *, ok: bool, why: str) -> list[Action]:
        self.flushed = True
        name, step = (target.name, target.step) if target else ("", None)
        msg = messages.TierFlushed(name, step, ok, why)
        actions: list[Action] = [Send(n, msg) for n in sorted(self.members)]
        if not ok and target is not None:
            actions.append(
                Record(events.tier_persist_missed(attempt=self.attempt, checkpoint=name, step=step, why=why))
            )
        return actions


def _seeded(c: Checkpoint) -> bool:
    """A checkpoint an earlier attempt persisted, known from :meth:`TierBook.seed` (no part in any memory)."""
    return bool(c.committed) and not c.parts


def _newest(c: Checkpoint) -> tuple[int, int]:
    """Newer first by step (a checkpoint of unknown step by when it completed)."""
    return (c.step if c.step is not None else -1, c.seq or 0)


def _order(position: str) -> tuple[int, ...]:
    return tuple(int(x) for x in position.split(":"))
