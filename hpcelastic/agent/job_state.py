"""The coordinator's decisions, free of I/O: membership, rounds, the job-wide budget, root cause.

:class:`JobState` receives what agents report and returns :class:`Action` values (messages to send,
events to write, lines to print). The network server in ``coordinator.py`` applies them; the unit
tests drive this class directly.

Phases: ``rendezvous`` (waiting for the step's nodes) -> ``running`` (a round's workers run) ->
``stopping`` (a failure or lost node: every agent stops its workers) -> a new round, or
``finished``. ``preempting`` replaces ``stopping`` after a preemption signal.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from hpcelastic.errors import (
    EXIT_COORDINATOR_LOST,
    EXIT_NODE_UNHEALTHY,
    EXIT_OK,
    EXIT_RESTARTS_EXHAUSTED,
    EXIT_STOPPED_FOR_REQUEUE,
    EXIT_TOO_FEW_NODES,
)

FAILURE_FIELDS = ("round", "rank", "local_rank", "node_rank", "node", "exitcode", "signal", "error")
STOP_TIMEOUT_EXTRA = 15.0


@dataclass(frozen=True)
class Action:
    """One effect for the server: ``send`` a message to a node, write an ``event``, ``print`` a line."""

    kind: Literal["send", "event", "print"]
    node_rank: int = -1
    name: str = ""
    data: dict[str, Any] = field(default_factory=dict)


def send(node_rank: int, **msg: Any) -> Action:
    return Action("send", node_rank=node_rank, data=msg)


def event(name: str, **fields: Any) -> Action:
    return Action("event", name=name, data=fields)


@dataclass
class Member:
    """A joined, live agent."""

    node_rank: int
    host: str
    nproc: int


class JobState:
    """Membership, rounds and the restart budget of one job attempt."""

    def __init__(
        self,
        *,
        hosts: Sequence[str],
        min_nodes: int,
        max_restarts: int,
        master_addr: str,
        new_port: Callable[[], int],
        rdzv_timeout: float,
        stop_timeout: float = 10.0,
        now: Callable[[], float] = time.time,
    ) -> None:
        self.hosts = tuple(hosts)
        self.min_nodes = min_nodes
        self.max_restarts = max_restarts
        self.master_addr = master_addr
        self._new_port = new_port
        self._now = now
        self.stop_timeout = stop_timeout + STOP_TIMEOUT_EXTRA
        self.deadline = now() + rdzv_timeout
        self.rdzv_timeout = rdzv_timeout
        self.phase = "rendezvous"
        self.members: dict[int, Member] = {}
        self.round = -1
        self.restart_count = 0
        self.round_nodes: list[int] = []
        self.started: dict[int, float] = {}
        self.stopped: set[int] = set()
        self.done: set[int] = set()
        self.failures: list[dict[str, Any]] = []
        self.lost_in_round: list[dict[str, Any]] = []
        self.bad_nodes: list[str] = []
        self.lost_hosts: list[str] = []
        self.departed: set[int] = set()
        self.result: dict[str, Any] | None = None

    # ---- membership -------------------------------------------------------------------------
    def join_error(self, node_rank: Any) -> str | None:
        """Why an agent claiming ``node_rank`` may not join, or None."""
        if not isinstance(node_rank, int) or not 0 <= node_rank < len(self.hosts):
            return f"node rank {node_rank!r} is outside this job's {len(self.hosts)} nodes"
        if node_rank in self.members:
            return f"node rank {node_rank} has already joined (two agents on one node?)"
        if self.phase != "rendezvous":
            return f"node rank {node_rank} joined after the job started; it is not part of this attempt"
        return None

    def join(self, node_rank: int, host: str, nproc: int) -> list[Action]:
        """An authenticated agent joined; starts the first round once every node is there."""
        self.members[node_rank] = Member(node_rank, host, int(nproc))
        return self._rendezvous_complete()

    def _rendezvous_complete(self) -> list[Action]:
        """Start the first round once every node joined or left (a bad node leaves before joining)."""
        if len(self.members) + len(self.departed) < len(self.hosts):
            return []
        if len(self.members) >= self.min_nodes and 0 in self.members:
            return self._start_round()
        return self._check_stopped()

    def missing(self) -> list[str]:
        """The nodes (``rank (host)``) that have not joined."""
        return [f"{i} ({h})" for i, h in enumerate(self.hosts) if i not in self.members]

    def lost(self, node_rank: int, reason: str, *, unhealthy: bool = False) -> list[Action]:
        """An agent's connection closed or went silent, or it left because its node is bad."""
        member = self.members.pop(node_rank, None)
        if member is None or self.phase == "finished":
            return []
        if unhealthy:
            self.bad_nodes.append(member.host)
        self.lost_hosts.append(member.host)
        self.departed.add(node_rank)
        actions = [event("node_lost", node_rank=node_rank, node=member.host, reason=reason)]
        if self.phase == "rendezvous":
            return actions + self._rendezvous_complete()
        if self.phase == "finished" or node_rank not in self.round_nodes:
            return actions
        self.lost_in_round.append(
            {
                "node_rank": node_rank,
                "node": member.host,
                "reason": reason,
                "ts": self._now(),
                "round": self.round,
            }
        )
        if self.phase == "running":
            actions += self._begin_stop("node_lost")
        return actions + self._check_stopped()

    # ---- rounds -----------------------------------------------------------------------------
    def _start_round(self) -> list[Action]:
        self.round += 1
        self.phase = "running"
        self.round_nodes = sorted(self.members)
        self.started, self.stopped, self.done = {}, set(), set()
        self.failures, self.lost_in_round = [], []
        port = self._new_port()
        world = sum(self.members[n].nproc for n in self.round_nodes)
        hosts = [self.members[n].host for n in self.round_nodes]
        actions = [
            event(
                "rendezvous",
                round=self.round,
                hosts=hosts,
                world_size=world,
                master_addr=self.master_addr,
                master_port=port,
                restart_count=self.restart_count,
            )
        ]
        offset = 0
        for group_rank, n in enumerate(self.round_nodes):
            actions.append(
                send(
                    n,
                    t="round",
                    round=self.round,
                    restart_count=self.restart_count,
                    max_restarts=self.max_restarts,
                    group_rank=group_rank,
                    group_world_size=len(self.round_nodes),
                    rank_offset=offset,
                    world_size=world,
                    master_addr=self.master_addr,
                    master_port=port,
                )
            )
            offset += self.members[n].nproc
        return actions

    def _alive_round_nodes(self) -> set[int]:
        return {n for n in self.round_nodes if n in self.members}

    def started_workers(self, node_rank: int, round_: int, ts: float) -> list[Action]:
        """An agent spawned its workers; ``workers_started`` once every node has."""
        if round_ != self.round or self.phase != "running":
            return []
        self.started[node_rank] = ts
        if set(self.started) >= self._alive_round_nodes():
            world = sum(self.members[n].nproc for n in self._alive_round_nodes())
            return [
                event(
                    "workers_started",
                    round=self.round,
                    world_size=world,
                    spawned_ts=max(self.started.values()),
                )
            ]
        return []

    def worker_failed(self, node_rank: int, round_: int, failures: list[dict[str, Any]]) -> list[Action]:
        """An agent saw workers fail: every agent is told to stop its workers."""
        if round_ != self.round or self.phase == "finished":
            return []
        actions = self._record(node_rank, failures)
        if self.phase == "running":
            actions += self._begin_stop("worker_failed")
        return actions

    def workers_stopped(self, node_rank: int, round_: int, failures: list[dict[str, Any]]) -> list[Action]:
        """An agent's workers are all gone; decide once every agent of the round says so."""
        if round_ != self.round or self.phase not in ("stopping", "preempting"):
            return []
        actions = self._record(node_rank, failures)
        self.stopped.add(node_rank)
        return actions + self._check_stopped()

    def workers_done(self, node_rank: int, round_: int) -> list[Action]:
        """An agent's workers all exited 0 (exit barrier): success once every node is done."""
        if round_ != self.round or self.phase != "running":
            return []
        self.done.add(node_rank)
        if self.done >= self._alive_round_nodes():
            return self._finish("succeeded", EXIT_OK)
        return []

    def preempt(self, node_rank: int, signal: str) -> list[Action]:
        """A preemption/time-limit signal reached an agent: stop everywhere, no restart."""
        if self.phase in ("finished", "preempting"):
            return []
        if self.phase == "rendezvous" or not self._alive_round_nodes():
            return self._finish("preempted", EXIT_STOPPED_FOR_REQUEUE)
        self.phase = "preempting"
        self.stopped = set()
        self.deadline = self._now() + self.stop_timeout
        return [send(n, t="preempt", round=self.round, signal=signal) for n in sorted(self.members)]

    def tick(self) -> list[Action]:
        """Time-driven decisions: rendezvous timeout, agents that never finish stopping."""
        now = self._now()
        if self.phase == "rendezvous" and now >= self.deadline:
            if len(self.members) >= self.min_nodes and self.members:
                missing = ", ".join(self.missing())
                return [
                    Action(
                        "print",
                        data={"text": f"rendezvous timed out; continuing without node(s) {missing}"},
                    ),
                    *self._start_round(),
                ]
            return self._finish(
                "too_few_nodes",
                EXIT_TOO_FEW_NODES,
                f"rendezvous timed out after {self.rdzv_timeout:g} s: {len(self.members)} of "
                f"{len(self.hosts)} nodes joined (need {self.min_nodes}); "
                f"missing: {', '.join(self.missing())}",
            )
        if self.phase in ("stopping", "preempting") and now >= self.deadline:
            actions: list[Action] = []
            for n in sorted(self._alive_round_nodes() - self.stopped):
                actions += self.lost(n, f"did not stop its workers within {self.stop_timeout:g} s")
            return actions
        return []

    # ---- internals --------------------------------------------------------------------------
    def _record(self, node_rank: int, failures: list[dict[str, Any]]) -> list[Action]:
        actions = []
        for f in failures:
            f = {
                **f,
                "node_rank": node_rank,
                "node": self.members[node_rank].host if node_rank in self.members else "",
            }
            self.failures.append(f)
            actions.append(
                event("worker_failed", **{k: f.get(k) for k in FAILURE_FIELDS}, exit_ts=f.get("ts"))
            )
        return actions

    def _begin_stop(self, reason: str) -> list[Action]:
        self.phase = "stopping"
        self.deadline = self._now() + self.stop_timeout
        return [send(n, t="stop", round=self.round, reason=reason) for n in sorted(self._alive_round_nodes())]

    def _check_stopped(self) -> list[Action]:
        if self.phase == "rendezvous":
            actions: list[Action] = []
        elif self.phase not in ("stopping", "preempting") or not self.stopped >= self._alive_round_nodes():
            return []
        elif self.phase == "preempting":
            return self._finish("preempted", EXIT_STOPPED_FOR_REQUEUE)
        else:
            actions = self._root_cause()
        if 0 not in self.members:
            if self.hosts[0] in self.bad_nodes:
                return actions + self._finish(
                    "node_unhealthy", EXIT_NODE_UNHEALTHY, "the coordinator's node is unhealthy"
                )
            return actions + self._finish(
                "coordinator_lost", EXIT_COORDINATOR_LOST, "the coordinator's agent left"
            )
        if len(self.members) < self.min_nodes:
            return actions + self._finish(
                "too_few_nodes",
                EXIT_TOO_FEW_NODES,
                f"{len(self.members)} node(s) remain, fewer than the minimum {self.min_nodes}",
            )
        if self.restart_count >= self.max_restarts:
            return actions + self._finish(
                "restarts_exhausted",
                EXIT_RESTARTS_EXHAUSTED,
                f"the job-wide restart budget ({self.max_restarts}) is spent",
            )
        self.restart_count += 1
        cause = self.lost_in_round[0]["reason"] if self.lost_in_round else "worker_failed"
        actions.append(
            event(
                "restarting",
                round=self.round + 1,
                restart_count=self.restart_count,
                max_restarts=self.max_restarts,
                reason="node_lost" if self.lost_in_round else "worker_failed",
            )
        )
        actions.append(
            Action(
                "print",
                data={
                    "text": f"restarting all workers (restart {self.restart_count} "
                    f"of {self.max_restarts}) after: {cause}"
                },
            )
        )
        return actions + self._start_round()

    def _root_cause(self) -> list[Action]:
        if self.lost_in_round:
            lost = self.lost_in_round[0]
            cause = {k: None for k in FAILURE_FIELDS} | {
                "round": self.round,
                "node_rank": lost["node_rank"],
                "node": lost["node"],
                "error": f"node lost: {lost['reason']}",
                "traceback": "",
                "exit_ts": lost["ts"],
            }
        elif self.failures:
            first = min(self.failures, key=lambda f: f.get("ts") or 0.0)
            cause = {k: first.get(k) for k in FAILURE_FIELDS} | {
                "traceback": first.get("traceback") or "",
                "exit_ts": first.get("ts"),
            }
        else:
            return []
        where = (
            f"rank {cause['rank']} on {cause['node']}" if cause["rank"] is not None else f"{cause['node']}"
        )
        text = f"root cause (round {self.round}): {where}: {cause['error']}"
        if cause["traceback"]:
            text += "\n" + cause["traceback"].rstrip()
        return [event("root_cause", **cause), Action("print", data={"text": text})]

    def _finish(self, reason: str, exit_code: int, message: str = "") -> list[Action]:
        self.phase = "finished"
        self.result = {
            "reason": reason,
            "exit_code": exit_code,
            "message": message,
            # A node whose agent vanished (crash, OOM kill, node down) is as suspect as one that
            # failed a health check: the next attempt should not be placed on it either.
            "bad_nodes": list(dict.fromkeys([*self.bad_nodes, *self.lost_hosts])),
        }
        return [send(n, t="finish", **self.result) for n in sorted(self.members)]
