"""The control plane's vocabulary: one frozen dataclass per message, one encoder, one decoder per
direction and one dispatch used by both the coordinator and the agent.

On the wire a message is a JSON object whose ``t`` field names its type (``protocol.py`` frames and
authenticates it); :func:`encode` and :func:`decode` convert between those objects and the classes
below. A type this side does not know decodes to None and is ignored (a newer peer may send it); a
known type with missing or ill-typed fields raises :class:`InvalidMessage`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from hpcelastic.events import Event, EventName
from hpcelastic.reasons import Reason, RestartCause
from hpcelastic.slow.sample import RankSample

Wire = dict[str, Any]
Failure = Mapping[str, Any]


class InvalidMessage(ValueError):
    """A message of a known type whose fields are missing or of the wrong type."""


@dataclass(frozen=True)
class Message:
    """Base of every control message; ``TAG`` is its ``t`` on the wire."""

    TAG: ClassVar[str]

    def wire(self) -> Wire:
        """The JSON object this message is on the wire."""
        return {"t": self.TAG, **{name: _plain(getattr(self, name)) for name in _field_names(type(self))}}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Message:
        """Parse the wire object (``t`` already matched); KeyError/TypeError/ValueError when invalid."""
        return cls()


@functools.cache
def _field_names(cls: type[Message]) -> tuple[str, ...]:
    """A message class's field names (``dataclasses.fields`` costs more than the encoding it feeds)."""
    return tuple(f.name for f in dataclasses.fields(cls))


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Event):
        return {"event": value.name.value, "fields": dict(value.fields)}
    return value


def _failures(value: Any) -> tuple[Failure, ...]:
    if not isinstance(value, list) or not all(isinstance(f, dict) for f in value):
        raise TypeError("failures must be a list of objects")
    return tuple(value)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _node_rank(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"node rank {value!r} is not an integer")
    return value


# ---- both directions -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Heartbeat(Message):
    """Liveness. An agent's carries ``sent`` (its clock); the coordinator's ``echo``es the latest ``sent`` it
    received from that agent, which renews the agent's lease (``liveness.py``)."""

    TAG = "hb"
    sent: float | None = None
    echo: float | None = None

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Heartbeat:
        return cls(_optional_float(d.get("sent")), _optional_float(d.get("echo")))


# ---- agent -> coordinator ------------------------------------------------------------------------
@dataclass(frozen=True)
class Hello(Message):
    """An agent's first, authenticated frame (``protocol`` adds its nonce)."""

    TAG = "hello"
    node_rank: int
    host: str = ""
    nproc: int = 1
    pid: int | None = None
    #: The agent's UDP port for liveness probes (0: none).
    probe_port: int = 0
    #: The agent's TCP port of the local checkpoint tier's data channel (0: no tier).
    data_port: int = 0

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Hello:
        pid = d.get("pid")
        return cls(
            _node_rank(d.get("node_rank")),
            str(d.get("host", "")),
            int(d.get("nproc", 1)),
            None if pid is None else int(pid),
            int(d.get("probe_port", 0)),
            int(d.get("data_port", 0)),
        )


@dataclass(frozen=True)
class Started(Message):
    """This node's workers of ``round`` are spawned (``ts``: when the last one was).

    ``spawn``: "warm" (forked by the node's fork server) or "cold"; ``spawn_reason``: why cold.
    """

    TAG = "started"
    round: int
    ts: float
    spawn: str = "cold"
    spawn_reason: str = ""

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Started:
        return cls(
            int(d.get("round", -1)),
            float(d.get("ts", time.time())),
            str(d.get("spawn", "cold")),
            str(d.get("spawn_reason", "")),
        )


@dataclass(frozen=True)
class Failed(Message):
    """Workers of this node failed; the agent stops the others and then sends :class:`Stopped`."""

    TAG = "failed"
    round: int
    failures: tuple[Failure, ...] = ()

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Failed:
        return cls(int(d.get("round", -1)), _failures(d.get("failures", [])))


@dataclass(frozen=True)
class Stopped(Message):
    """Every worker of this node is gone for ``round`` (``failures``: those that failed meanwhile)."""

    TAG = "stopped"
    round: int
    failures: tuple[Failure, ...] = ()

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Stopped:
        return cls(int(d.get("round", -1)), _failures(d.get("failures", [])))


@dataclass(frozen=True)
class Done(Message):
    """Every worker of this node exited 0 (the exit barrier)."""

    TAG = "done"
    round: int

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Done:
        return cls(int(d.get("round", -1)))


@dataclass(frozen=True)
class PreemptSignal(Message):
    """The stop signal reached this agent: the job stops everywhere."""

    TAG = "preempt"
    signal: str

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> PreemptSignal:
        return cls(str(d.get("signal", "")))


@dataclass(frozen=True)
class StepReport(Message):
    """Answer to :class:`Preempt`: the highest step of this node's workers (None: no heartbeats yet)
    and their steps per second, from which the coordinator fixes the stop step."""

    TAG = "steps"
    round: int
    step: int | None
    rate: float = 0.0

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> StepReport:
        step = d.get("step")
        return cls(int(d["round"]), None if step is None else int(step), float(d.get("rate", 0.0)))


@dataclass(frozen=True)
class Leave(Message):
    """The agent leaves the job: its node is unhealthy, or a signal delivered at ``signalled_at`` told
    it to stop (Slurm ending the step on a cancel, preemption or time limit sends every agent SIGTERM)."""

    TAG = "leave"
    reason: str
    unhealthy: bool = False
    signalled_at: float | None = None

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Leave:
        at = d.get("signalled_at")
        return cls(str(d.get("reason", "left")), bool(d.get("unhealthy")), None if at is None else float(at))


@dataclass(frozen=True)
class Progress(Message):
    """The highest step this node's workers of ``round`` reported (``ts``: the worker's time of that
    heartbeat) and how many of its ranks have reported one; sent only when the step changed."""

    TAG = "progress"
    round: int
    step: int
    ts: float
    ranks: int

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Progress:
        return cls(int(d["round"]), int(d["step"]), float(d["ts"]), int(d.get("ranks", 1)))


@dataclass(frozen=True)
class AgentEvent(Message):
    """An event seen by an agent, for the coordinator to write (``ts``, ``host`` are its own)."""

    TAG = "event"
    event: Event

    def wire(self) -> Wire:
        return {"t": self.TAG, "event": self.event.name.value, "fields": dict(self.event.fields)}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> AgentEvent:
        fields = {k: v for k, v in dict(d.get("fields", {})).items() if k not in ("ts", "event", "host")}
        return cls(Event(EventName(d["event"]), fields))


@dataclass(frozen=True)
class StallReport(Message):
    """No local rank made progress for the stall timeout (``stalled``), or one progresses again."""

    TAG = "stall"
    round: int
    stalled: bool
    ranks: tuple[int, ...] = ()
    idle_s: float = 0.0

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> StallReport:
        ranks = d.get("ranks", [])
        if not isinstance(ranks, list):
            raise TypeError("ranks must be a list")
        return cls(
            int(d["round"]), bool(d["stalled"]), tuple(int(r) for r in ranks), float(d.get("idle_s", 0))
        )


@dataclass(frozen=True)
class StacksReport(Message):
    """This node's workers' stacks for ``round`` (rank -> ``ProcessStack.to_json()`` plus ``local_rank``)."""

    TAG = "stacks"
    round: int
    stacks: Mapping[str, Any]
    #: The peers (node ranks) of the ``DumpStacks`` this node could not reach.
    unreachable: tuple[int, ...] = ()

    def wire(self) -> Wire:
        return {
            "t": self.TAG,
            "round": self.round,
            "stacks": dict(self.stacks),
            "unreachable": list(self.unreachable),
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> StacksReport:
        stacks = d.get("stacks", {})
        if not isinstance(stacks, dict) or not all(isinstance(v, dict) for v in stacks.values()):
            raise TypeError("stacks must be an object of objects")
        return cls(int(d["round"]), stacks, tuple(_node_rank(r) for r in d.get("unreachable", [])))


@dataclass(frozen=True)
class Saving(Message):
    """While a stop is under way, sent only when it changes: whether a worker of this node holds a file in the
    checkpoint directory open for writing (``saving``); ``idle_s``: how long ago one last did (None: none
    seen)."""

    TAG = "saving"
    round: int
    saving: bool
    idle_s: float | None = None

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Saving:
        return cls(int(d["round"]), bool(d["saving"]), _optional_float(d.get("idle_s")))


@dataclass(frozen=True)
class SlowSample(Message):
    """This node's evidence for the slow-node detector (hpcelastic/slow/), every few seconds while it is on:
    per rank its steps and its latest collectives (:class:`~hpcelastic.slow.sample.RankSample`);
    ``sent_ns``: the agent's wall clock when sent (the coordinator estimates the node's clock offset from
    it); ``rtt_s``: the kernel's smoothed round trip of the agent's connection to the coordinator
    (``CoordinatorClient.link_rtt_s``; None: not known);
    ``saving``: a worker of this node holds a checkpoint file open for writing now; ``save_age_s``: seconds
    since one last did (None: none seen this round)."""

    TAG = "slow"
    round: int
    sent_ns: int
    rtt_s: float | None = None
    ranks: tuple[RankSample, ...] = ()
    saving: bool = False
    save_age_s: float | None = None

    def wire(self) -> Wire:
        return {
            "t": self.TAG,
            "round": self.round,
            "sent_ns": self.sent_ns,
            "rtt_s": self.rtt_s,
            "ranks": [r.wire() for r in self.ranks],
            "saving": self.saving,
            "save_age_s": self.save_age_s,
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> SlowSample:
        ranks = d.get("ranks", [])
        if not isinstance(ranks, list) or not all(isinstance(r, dict) for r in ranks):
            raise TypeError("ranks must be a list of objects")
        return cls(
            int(d["round"]),
            int(d["sent_ns"]),
            _optional_float(d.get("rtt_s")),
            tuple(RankSample.from_wire(r) for r in ranks),
            bool(d.get("saving", False)),
            _optional_float(d.get("save_age_s")),
        )


@dataclass(frozen=True)
class SpeedCheck(Message):
    """This node's speed check (:func:`hpcelastic.slow.speed.measure`, hashes a second): sent before its
    first round and, while it waits as a spare, now and then."""

    TAG = "speed"
    speed: float

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> SpeedCheck:
        return cls(float(d["speed"]))


@dataclass(frozen=True)
class Watching(Message):
    """The agent took its peer-watch assignment ``epoch`` (``peerwatch.py``): it watches ``watchee`` and
    stopped echoing anyone else's beats; with a ``watcher`` its fast lease runs (-1: none)."""

    TAG = "watching"
    epoch: int
    watchee: int = -1
    watcher: int = -1

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Watching:
        return cls(int(d["epoch"]), int(d.get("watchee", -1)), int(d.get("watcher", -1)))


@dataclass(frozen=True)
class PeerSilent(Message):
    """The agent heard no beat from its watchee ``node_rank`` for ``silent_s`` seconds."""

    TAG = "peer_silent"
    node_rank: int
    silent_s: float

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> PeerSilent:
        return cls(_node_rank(d.get("node_rank")), float(d["silent_s"]))


@dataclass(frozen=True)
class PeerHeard(Message):
    """The agent hears its watchee ``node_rank`` again after reporting it silent."""

    TAG = "peer_heard"
    node_rank: int

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> PeerHeard:
        return cls(_node_rank(d.get("node_rank")))


# ---- the local checkpoint tier (hpcelastic/tier/): agent -> coordinator ---------------------------
@dataclass(frozen=True)
class TierHave(Message):
    """What this node now holds of checkpoint ``name``, part ``position`` (the position in the round of the
    node that wrote it): ``kind`` ``own`` (its files settled here; 0 bytes: it wrote none), ``replica`` (a
    peer's part copied here), ``persisted`` (copied to the shared staging directory), ``committed`` (the
    whole checkpoint is in the checkpoint directory at ``path``), ``refused`` (``why``: it did not fit),
    ``persist_failed`` (``why``: the shared file system failed the copy), or ``dropped`` (this node no longer
    holds that part: removed for room, or its own files rewritten in place by a newer save)."""

    TAG = "tier_have"
    name: str
    position: str
    kind: str
    step: int | None = None
    size: int = 0
    marker: bool = False
    path: str = ""
    why: str = ""

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> TierHave:
        step = d.get("step")
        return cls(
            str(d["name"]),
            str(d["position"]),
            str(d["kind"]),
            None if step is None else int(step),
            int(d.get("size", 0)),
            bool(d.get("marker")),
            str(d.get("path", "")),
            str(d.get("why", "")),
        )


@dataclass(frozen=True)
class TierFlush(Message):
    """This node's workers are gone (a stop or the end) and it reported every checkpoint it holds: persist the
    job's last one before the attempt ends."""

    TAG = "tier_flush"
    round: int

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> TierFlush:
        return cls(int(d["round"]))


# ---- coordinator -> agent ------------------------------------------------------------------------
@dataclass(frozen=True)
class Challenge(Message):
    """The coordinator's first, unauthenticated frame (see ``protocol.py``)."""

    TAG = "challenge"
    nonce: str
    v: int


@dataclass(frozen=True)
class Refusal(Message):
    """The unauthenticated answer to an agent that may not join; the connection closes after it."""

    TAG = "error"
    error: str
    auth: bool = False


@dataclass(frozen=True)
class Welcome(Message):
    """The agent has joined."""

    TAG = "welcome"
    round: int
    session: str = ""
    #: The coordinator's UDP port for liveness probes (0: none).
    probe_port: int = 0

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Welcome:
        return cls(int(d.get("round", -1)), str(d.get("session", "")), int(d.get("probe_port", 0)))


@dataclass(frozen=True)
class Round(Message):
    """This node's part of one round: start its workers."""

    TAG = "round"
    round: int
    restart_count: int
    max_restarts: int
    group_rank: int
    group_world_size: int
    rank_offset: int
    world_size: int
    master_addr: str
    master_port: int
    #: torchft replica groups (``--replica-groups``): this node's group, the number of groups, the lighthouse.
    replica_group: int = -1
    num_replica_groups: int = 0
    lighthouse: str = ""

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Round:
        texts = ("master_addr", "lighthouse")
        ints = {
            f.name: int(d[f.name]) for f in dataclasses.fields(cls) if f.name not in texts and f.name in d
        }
        return cls(master_addr=str(d["master_addr"]), lighthouse=str(d.get("lighthouse", "")), **ints)


@dataclass(frozen=True)
class Stop(Message):
    """Stop the workers of ``round`` (a worker failed or a node was lost) and report :class:`Stopped`."""

    TAG = "stop"
    round: int
    reason: RestartCause

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Stop:
        return cls(int(d["round"]), RestartCause(d["reason"]))


@dataclass(frozen=True)
class Preempt(Message):
    """The job is being stopped by a signal: ask the workers to checkpoint and stop."""

    TAG = "preempt"
    round: int
    signal: str = ""

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Preempt:
        return cls(int(d.get("round", -1)), str(d.get("signal") or ""))


@dataclass(frozen=True)
class DumpStacks(Message):
    """Every rank of the round stalled: take every worker's stacks and answer :class:`StacksReport`."""

    TAG = "dump_stacks"
    round: int
    #: Neighbours in the round to ping, ``(node rank, address, probe port)``: filled in by the coordinator.
    peers: tuple[tuple[int, str, int], ...] = ()

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> DumpStacks:
        peers = tuple((_node_rank(p[0]), str(p[1]), int(p[2])) for p in d.get("peers", []))
        return cls(int(d["round"]), peers)


@dataclass(frozen=True)
class StopAt(Message):
    """Every rank stops after ``step`` (None: stop now); the agent writes it into the stop file."""

    TAG = "stop_at"
    round: int
    step: int | None

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> StopAt:
        step = d.get("step")
        return cls(int(d["round"]), None if step is None else int(step))


@dataclass(frozen=True)
class Retire(Message):
    """This node leaves the job for ``reason`` (a slow node a spare replaces: hpcelastic/slow/): it stops its
    workers and leaves as a bad node does, so that the next round runs on a spare in its place and a requeue
    excludes it."""

    TAG = "retire"
    round: int
    reason: str

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Retire:
        return cls(int(d["round"]), str(d["reason"]))


@dataclass(frozen=True)
class JobSaving(Message):
    """Answer to every node's :class:`Saving`, sent to each round node when it changes: some node of the job
    is saving a checkpoint (``saving``), or none is and none has for ``quiet_s`` seconds (None: no node saw
    a save)."""

    TAG = "job_saving"
    round: int
    saving: bool
    quiet_s: float | None = None

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> JobSaving:
        return cls(int(d["round"]), bool(d["saving"]), _optional_float(d.get("quiet_s")))


@dataclass(frozen=True)
class Finish(Message):
    """The attempt is over: ``reason`` (its exit code is ``reason.exit_code``), nodes to avoid next."""

    TAG = "finish"
    reason: Reason
    message: str = ""
    bad_nodes: tuple[str, ...] = ()
    #: Of ``bad_nodes``, those only lost by silence: held against a node only while it stays unreachable.
    unreachable: tuple[str, ...] = ()

    @property
    def exit_code(self) -> int:
        return self.reason.exit_code

    def wire(self) -> Wire:
        return {**super().wire(), "exit_code": self.exit_code}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Finish:
        return cls(
            Reason(d["reason"]),
            str(d.get("message") or ""),
            tuple(map(str, d.get("bad_nodes", []))),
            tuple(map(str, d.get("unreachable", []))),
        )


def _peer_addr(value: Any) -> tuple[int, str, int] | tuple[()]:
    if not value:
        return ()
    return (_node_rank(value[0]), str(value[1]), int(value[2]))


@dataclass(frozen=True)
class Watch(Message):
    """The agent's peer-watch assignment ``epoch`` (``peerwatch.py``): the peer it watches and the peer that
    watches it, each ``(node rank, address, probe port)`` or empty. Sent again unchanged: watch afresh."""

    TAG = "watch"
    epoch: int
    watchee: tuple[int, str, int] | tuple[()] = ()
    watcher: tuple[int, str, int] | tuple[()] = ()

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Watch:
        return cls(int(d["epoch"]), _peer_addr(d.get("watchee")), _peer_addr(d.get("watcher")))


# ---- the local checkpoint tier: coordinator -> agent ----------------------------------------------
Peer = tuple[int, str, int]


def _peers(value: Any) -> tuple[Peer, ...]:
    return tuple((_node_rank(p[0]), str(p[1]), int(p[2])) for p in value)


@dataclass(frozen=True)
class TierQuery(Message):
    """Another node holds a complete part of checkpoint ``name``: report yours (:class:`TierHave`, 0 bytes
    when you wrote none) once your files of it are settled."""

    TAG = "tier_query"
    name: str

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> TierQuery:
        return cls(str(d["name"]))


@dataclass(frozen=True)
class TierComplete(Message):
    """Checkpoint ``name`` is complete on every node: copy your part ``position`` (your own, or one you hold
    as a replica) to ``peers`` (node rank, address, data port) and, with ``persist``, to the shared staging
    directory."""

    TAG = "tier_complete"
    name: str
    step: int | None
    position: str
    persist: bool = False
    peers: tuple[Peer, ...] = ()

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> TierComplete:
        step = d.get("step")
        return cls(
            str(d["name"]),
            None if step is None else int(step),
            str(d["position"]),
            bool(d.get("persist")),
            _peers(d.get("peers", [])),
        )


@dataclass(frozen=True)
class TierSafe(Message):
    """Checkpoint ``name`` is complete and every part has its replicas: older local copies may go."""

    TAG = "tier_safe"
    name: str

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> TierSafe:
        return cls(str(d["name"]))


@dataclass(frozen=True)
class TierCommit(Message):
    """Every part of checkpoint ``name`` (``size`` bytes in all) is in the shared staging directory: move it
    into the checkpoint directory and publish it (one node does this). With ``abort``: a node failed to
    persist its part; every node removes what it staged of ``name``."""

    TAG = "tier_commit"
    name: str
    step: int | None
    size: int = 0
    abort: bool = False

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> TierCommit:
        step = d.get("step")
        return cls(
            str(d["name"]), None if step is None else int(step), int(d.get("size", 0)), bool(d.get("abort"))
        )


@dataclass(frozen=True)
class TierRestore(Message):
    """Before ``round``'s :class:`Round`: restore checkpoint ``name`` ("" : none, clear the directory) from
    ``sources``, one per part (position, ``here`` | ``peer`` | ``persisted``, node rank, address, data
    port); ``path`` is its persisted copy; ``aside``: newer checkpoints not restored, whose files the node
    moves out of the script's sight. Sent in chunks; ``last`` marks the final one. With ``extra``: another
    complete checkpoint the job holds in memory, placed too if it can be (a script may load it by name,
    as Lightning loads ``last.ckpt``), after the round's own."""

    TAG = "tier_restore"
    round: int
    name: str
    step: int | None = None
    path: str = ""
    sources: tuple[tuple[str, str, int, str, int], ...] = ()
    last: bool = True
    aside: tuple[str, ...] = ()
    extra: bool = False

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> TierRestore:
        step = d.get("step")
        sources = tuple((str(s[0]), str(s[1]), int(s[2]), str(s[3]), int(s[4])) for s in d.get("sources", []))
        return cls(
            int(d["round"]),
            str(d["name"]),
            None if step is None else int(step),
            str(d.get("path", "")),
            sources,
            bool(d.get("last", True)),
            tuple(str(n) for n in d.get("aside", [])),
            bool(d.get("extra")),
        )


@dataclass(frozen=True)
class TierFlushing(Message):
    """Every node of the round has sent :class:`TierFlush`: the persist of the job's last checkpoint
    ``name`` begins now (the wait for it counts from here, not from the end of this node's workers)."""

    TAG = "tier_flushing"
    name: str

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> TierFlushing:
        return cls(str(d["name"]))


@dataclass(frozen=True)
class TierFlushed(Message):
    """Answer to every node's :class:`TierFlush`: the job's last checkpoint ``name`` is persisted (``ok``),
    or why not."""

    TAG = "tier_flushed"
    name: str
    step: int | None = None
    ok: bool = True
    why: str = ""

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> TierFlushed:
        step = d.get("step")
        return cls(
            str(d["name"]), None if step is None else int(step), bool(d.get("ok")), str(d.get("why", ""))
        )


@dataclass(frozen=True)
class Lost(Message):
    """Never on the wire: the agent's client reports the coordinator lost."""

    TAG = "lost"
    reason: str


def _table(*classes: type[Message]) -> dict[str, type[Message]]:
    return {c.TAG: c for c in classes}


#: What a coordinator accepts from an authenticated agent (``hello`` is read by the handshake).
FROM_AGENT = _table(
    Heartbeat,
    Started,
    Failed,
    Stopped,
    Done,
    PreemptSignal,
    Leave,
    AgentEvent,
    Progress,
    StallReport,
    StacksReport,
    StepReport,
    Saving,
    TierHave,
    TierFlush,
    SlowSample,
    SpeedCheck,
    Watching,
    PeerSilent,
    PeerHeard,
)
#: What an agent accepts from its coordinator once joined.
FROM_COORDINATOR = _table(
    Heartbeat,
    Round,
    Stop,
    Preempt,
    StopAt,
    JobSaving,
    Retire,
    Finish,
    DumpStacks,
    TierQuery,
    TierComplete,
    TierSafe,
    TierCommit,
    TierRestore,
    TierFlushing,
    TierFlushed,
    Watch,
)


def encode(msg: Message) -> Wire:
    """The wire object of ``msg``."""
    return msg.wire()


def decode(table: Mapping[str, type[Message]], d: Mapping[str, Any]) -> Message | None:
    """The message ``d`` is, by ``table`` (:data:`FROM_AGENT` or :data:`FROM_COORDINATOR`).

    None for a type this side does not know; :class:`InvalidMessage` for a malformed one.
    """
    cls = table.get(str(d.get("t")))
    if cls is None:
        return None
    try:
        return cls.from_wire(d)
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidMessage(f"malformed {cls.TAG!r} message: {e!r}") from None


#: A handler table: message class -> handler(message, *context).
Handlers = Mapping[type[Message], Callable[..., None]]


def dispatch(handlers: Handlers, msg: Message, *context: Any) -> None:
    """Call the handler registered for ``msg``'s type with ``msg`` and ``context``; no handler: ignored."""
    handler = handlers.get(type(msg))
    if handler is not None:
        handler(msg, *context)
