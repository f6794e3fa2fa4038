"""Name the rank(s) that hang: a pure function over every rank's stack.

Rules, first match wins:

1. ``stopped``: ranks whose process is stopped (SIGSTOP, state ``T``) are the cause: nobody else can be.
2. ``collective``: some ranks wait inside a collective (torch.distributed, c10d/gloo/NCCL frames) and some do
   not: the ones that do not are the cause (the others wait for them).
3. ``majority``: group ranks by :func:`~hpcelastic.hangs.stacks.signature`; when one group is strictly larger
   than every other, the ranks outside it are the cause.
4. ``all_same``: every rank has the same signature outside any collective (all asleep, all deadlocked in one
   place): all ranks are named, at that place.
5. ``network``: the stacks name nobody, but the nodes' pings (:class:`Reachability`) do: the node(s) with the
   most failed pings, counting both ways (the peers that cannot reach it, the peers it cannot reach), at least
   two; ties name every tied node (an asymmetric partition: a node reaches the coordinator but not its peers,
   so every collective just waits). All ranks of the named nodes.
6. ``undetermined``: everyone waits in a collective with the same stack (a rank that already left), or no
   group stands out (two ranks in two different places, all different): no rank named.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hpcelastic.hangs.stacks import ProcessStack, in_collective, signature, where


@dataclass(frozen=True)
class Localization:
    """The verdict. ``where`` maps each root rank to ``file:line in function`` (or ``process stopped``)."""

    root_ranks: tuple[int, ...]
    method: str
    majority_signature: str | None
    where: dict[int, str] = field(default_factory=dict)
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)
    detail: str = ""

    @property
    def determined(self) -> bool:
        return bool(self.root_ranks)

    def summary(self) -> str:
        """One line for a console or an event: ``rank 5 at train.py:42 in step (majority: ...)``."""
        if not self.root_ranks:
            return f"undetermined: {self.detail}"
        parts = [f"rank {r} at {self.where.get(r, '?')}" for r in self.root_ranks[:4]]
        more = f" (+{len(self.root_ranks) - 4} more)" if len(self.root_ranks) > 4 else ""
        return "; ".join(parts) + more

    def to_json(self) -> dict[str, Any]:
        return {
            "root_ranks": list(self.root_ranks),
            "method": self.method,
            "majority_signature": self.majority_signature,
            "where": {str(k): v for k, v in self.where.items()},
            "groups": {k: list(v) for k, v in self.groups.items()},
            "detail": self.detail,
            "summary": self.summary(),
        }


@dataclass(frozen=True)
class Reachability:
    """Network evidence of a hang: each rank's node, and the peers each node could not reach."""

    node_of: Mapping[int, int] = field(default_factory=dict)
    unreachable: Mapping[int, Sequence[int]] = field(default_factory=dict)

    def cut_off(self) -> tuple[list[int], int]:
        """The node ranks with the most failed pings (both ways, at least 2), and that count."""
        failed: Counter[int] = Counter()
        for node, peers in self.unreachable.items():
            for peer in peers:
                failed[node] += 1
                failed[peer] += 1
        most = max(failed.values(), default=0)
        if most < 2:
            return [], 0
        return sorted(n for n, c in failed.items() if c == most), most


def localize(stacks_by_rank: Mapping[int, ProcessStack], network: Reachability | None = None) -> Localization:
    """Apply the module's rules to one stack per rank (taken at about the same time), with the nodes'
    pings as the last resort (``network``)."""
    groups_l: dict[str, list[int]] = defaultdict(list)
    for rank in sorted(stacks_by_rank):
        groups_l[signature(stacks_by_rank[rank])].append(rank)
    groups = {sig: tuple(ranks) for sig, ranks in groups_l.items()}
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1]))
    top_sig, top = ordered[0] if ordered else (None, ())
    strict = len(ordered) == 1 or (len(ordered) > 1 and len(top) > len(ordered[1][1]))
    majority = top_sig if strict and len(ordered) > 1 else None

    def verdict(method: str, ranks: list[int], detail: str = "", maj: str | None = majority) -> Localization:
        ranks = sorted(ranks)
        return Localization(
            root_ranks=tuple(ranks),
            method=method,
            majority_signature=maj,
            where={r: where(stacks_by_rank[r]) for r in ranks},
            groups=groups,
            detail=detail,
        )

    if not stacks_by_rank:
        return verdict("undetermined", [], "no stacks")
    stopped = [r for r, s in stacks_by_rank.items() if s.stopped]
    if stopped:
        return verdict("stopped", stopped, f"{len(stopped)} process(es) stopped (SIGSTOP)")
    readable = {r: s for r, s in stacks_by_rank.items() if s.main is not None and s.main.python_frames}
    waiting = {r for r, s in readable.items() if in_collective(s)}
    outside = [r for r in readable if r not in waiting]
    if waiting and outside:
        return verdict("collective", outside, f"{len(waiting)} rank(s) wait in a collective")
    if majority is not None:
        rest = [r for sig, ranks in groups.items() if sig != majority for r in ranks]
        return verdict("majority", rest, f"{len(top)} of {len(stacks_by_rank)} ranks share one stack")
    if len(groups) == 1 and len(stacks_by_rank) > 1 and not waiting and readable:
        return verdict("all_same", list(stacks_by_rank), "every rank is in the same place", maj=top_sig)
    if len(stacks_by_rank) == 1 and outside:
        return verdict("single", outside, "one rank", maj=None)
    unread = [r for r in stacks_by_rank if r not in readable]
    if waiting and unread:
        return verdict("unreadable", unread, "the ranks not read are not in the collective")
    why = "all ranks wait in a collective" if waiting and not outside else "no stack is shared by a majority"
    nodes, failed = network.cut_off() if network is not None else ([], 0)
    named = [r for r in stacks_by_rank if network is not None and network.node_of.get(r) in nodes]
    if named:
        which = ", ".join(map(str, nodes))
        return verdict("network", named, f"{why}; node rank(s) {which}: {failed} failed pings with peers")
    return verdict("undetermined", [], why)
