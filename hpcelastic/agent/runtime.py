"""What a bootstrapped node agent runs on: every part built and connected, nothing left to set up.

:func:`~hpcelastic.agent.bootstrap.bootstrap` builds a :class:`NodeRuntime`;
:class:`~hpcelastic.agent.loop.NodeLoop` runs the attempt over it.
"""

from __future__ import annotations

import contextlib
import os
import queue
import selectors
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from hpcelastic.agent import liveness
from hpcelastic.agent.client import CoordinatorClient
from hpcelastic.agent.console import write_line
from hpcelastic.agent.coordinator import Coordinator
from hpcelastic.agent.health import GpuHealth
from hpcelastic.agent.messages import Message
from hpcelastic.agent.peerwatch import PEER_WATCH_ABOVE
from hpcelastic.agent.spec import AgentSpec
from hpcelastic.agent.workers import WorkerGroup
from hpcelastic.env.base import NodeContext
from hpcelastic.errors import UserError
from hpcelastic.rundir import RunDir
from hpcelastic.tier.node import LocalTier

RESTART_KILL_GRACE = 3.0
STALL_CHECK_INTERVAL = 0.5
#: Agent heartbeats a second the coordinator is sized for: a job of more than 500 nodes heartbeats less
#: often, so that the idle coordinator stays under 10 % of a core (each costs it a receive and an echo,
#: 11-13 us each on 2 cores: bench/control_plane_load.py); silence is suspected after 2.5 intervals.
HEARTBEATS_PER_S = 2000.0
SUSPECT_AFTER_INTERVALS = 2.5


@dataclass(frozen=True)
class Timing:
    """Control-plane heartbeats, failure detection (``liveness.py``) and the GPU health check period
    (``HPCELASTIC_*`` variables)."""

    heartbeat_interval: float = liveness.HEARTBEAT_INTERVAL
    #: Silence on the control connection after which a peer is suspected and probed.
    heartbeat_timeout: float = liveness.HEARTBEAT_TIMEOUT
    #: Probing with no answer for this long after that: the peer is lost.
    probe_timeout: float = liveness.PROBE_TIMEOUT
    health_interval: float = 30.0
    #: Agents watch each other in a ring (``peerwatch.py``): beats every ``beat_interval`` to the watcher,
    #: reported after ``beat_timeout`` without one; a silent node is then found as fast as in a small job.
    peer_watch: bool = False
    beat_interval: float = liveness.HEARTBEAT_INTERVAL
    beat_timeout: float = liveness.HEARTBEAT_TIMEOUT

    @property
    def detection_s(self) -> float:
        """Silence on both paths after which a peer is lost (``liveness.detection_bound``)."""
        suspect_after = min(self.heartbeat_timeout, self.beat_timeout) if self.peer_watch else None
        return liveness.detection_bound(suspect_after or self.heartbeat_timeout, self.probe_timeout)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], nodes: int = 1) -> Timing:
        """The variables' values, else the defaults for a job of ``nodes`` nodes (:meth:`for_nodes`)."""

        def number(name: str, default: float) -> float:
            try:
                return float(environ.get(name, default))
            except ValueError:
                raise UserError(f"{name}={environ[name]!r} is not a number") from None

        interval = number("HPCELASTIC_HEARTBEAT_INTERVAL", cls.for_nodes(nodes).heartbeat_interval)
        watch = environ.get("HPCELASTIC_PEER_WATCH", "")
        if watch not in ("", "0", "1"):
            raise UserError(f"HPCELASTIC_PEER_WATCH={watch!r} is not 0 or 1")
        return cls(
            interval,
            number("HPCELASTIC_HEARTBEAT_TIMEOUT", cls.suspect_after(interval)),
            number("HPCELASTIC_PROBE_TIMEOUT", cls.probe_timeout),
            number("HPCELASTIC_HEALTH_INTERVAL", cls.health_interval),
            peer_watch=watch == "1" if watch else cls.for_nodes(nodes).peer_watch,
        )

    @classmethod
    def for_nodes(cls, nodes: int) -> Timing:
        """The defaults for ``nodes`` agents: heartbeats every 0.25 s up to 500 nodes, then every
        ``nodes / HEARTBEATS_PER_S`` s (8.2 s at 16,384), suspected after 2.5 intervals (at least 2 s); above
        500 nodes the agents also watch each other (``peerwatch.py``)."""
        interval = max(cls.heartbeat_interval, nodes / HEARTBEATS_PER_S)
        return cls(interval, cls.suspect_after(interval), peer_watch=nodes > PEER_WATCH_ABOVE)

    @classmethod
    def suspect_after(cls, interval: float) -> float:
        """The default heartbeat timeout for heartbeats every ``interval`` seconds."""
        return max(cls.heartbeat_timeout, SUSPECT_AFTER_INTERVALS * interval)


class Wake:
    """The self-pipe that wakes the main loop: written by signal delivery and the client's reader."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def ring(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self.w, b"\0")

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self.r, 4096)

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


@dataclass
class Inbox:
    """Messages from the coordinator, handed over from the client's reader thread to the main loop."""

    wake: Wake
    queue: queue.SimpleQueue[Message] = field(default_factory=queue.SimpleQueue)

    def post(self, msg: Message) -> None:
        """Called from the reader thread: queue ``msg`` and wake the main loop."""
        self.queue.put(msg)
        self.wake.ring()

    def take(self) -> Message | None:
        try:
            return self.queue.get_nowait()
        except queue.Empty:
            return None


@dataclass
class NodeRuntime:
    """One node agent's attempt, fully set up."""

    spec: AgentSpec
    environ: Mapping[str, str]
    ctx: NodeContext
    run_dir: RunDir
    attempt: int
    timing: Timing
    selector: selectors.BaseSelector
    inbox: Inbox
    client: CoordinatorClient
    #: Only group rank 0 hosts the coordinator.
    coordinator: Coordinator | None
    group: WorkerGroup
    heartbeats: socket.socket
    stop_file: Path
    #: None where NVML or GPUs are absent.
    health: GpuHealth | None
    #: The node-local checkpoint tier (``--local-tier``), None when off.
    tier: LocalTier | None = None
    #: Signals delivered and not yet handled, with when (appended by the signal handler).
    signals: list[tuple[int, float]] = field(default_factory=list)

    def say(self, text: str) -> None:
        say(self.ctx.node_rank, text)


def say(node_rank: int, text: str) -> None:
    """One line from this agent on standard error."""
    write_line(f"hpcelastic[agent {node_rank}]: {text.rstrip()}")
