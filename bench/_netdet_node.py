"""The processes of bench/network_detection.py, run in one testbed node's network namespace.

``coordinator``: for each agent and each detection mode (old, new) a real :class:`Coordinator` with a
:class:`JobState` of two nodes: rank 0, a real client in this process (on the node's own address: it
stays on the node, as the rank-0 agent hosting the coordinator does), and rank 1, the agent on another
node. Both send ``Started`` and never ``Done``: the round never ends. When the round is disturbed (rank 0
gets anything after its ``Round``) the ``node_lost`` events are logged and the pair starts afresh on the
same port, so the agent can join again.

``agent``: one real :class:`CoordinatorClient` per mode, rank 1 of its pair; it logs when it joined and
when its client reported the coordinator ``Lost`` (its lease ended: the fence), then connects again.

Every line of the log (JSON, appended and flushed) has ``kind``, ``mode``, ``agent`` and ``t`` (wall time).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hpcelastic.agent import messages  # noqa: E402
from hpcelastic.agent.client import CoordinatorClient, CoordinatorUnreachable  # noqa: E402
from hpcelastic.agent.coordinator import Coordinator  # noqa: E402
from hpcelastic.agent.job_state import JobState  # noqa: E402
from hpcelastic.agent.runtime import Timing  # noqa: E402
from hpcelastic.events import EventName  # noqa: E402
from hpcelastic.rundir import RunDir  # noqa: E402

SECRET = "netdet" * 11
#: Detection modes: "new" is the shipped timing (HPCELASTIC_* variables); "old" is it without the probe
#: phase (probe_timeout 0): lost after heartbeat_timeout of silence on the TCP stream, as before issue 19;
#: "watch" is a job of WATCH_NODES nodes as shipped: heartbeats that slow, and the peer watch
#: (``agent/peerwatch.py``; the pair's two agents watch each other across the links).
MODES = ("old", "new", "watch")
WATCH_NODES = 16384
PORT0 = 41000
JOIN_TIMEOUT = 120.0
#: The agents never miss a rendezvous: the round waits for them however long a lossy link takes.
RDZV_TIMEOUT = 1e9


def timing_of(mode: str) -> Timing:
    if mode == "watch":
        return Timing.from_environ({**os.environ, "HPCELASTIC_PEER_WATCH": "1"}, nodes=WATCH_NODES)
    timing = Timing.from_environ(os.environ)
    return dataclasses.replace(timing, probe_timeout=0.0) if mode == "old" else timing


def port_of(agent: int, mode: str) -> int:
    return PORT0 + len(MODES) * agent + MODES.index(mode)


class Log:
    """JSON lines, appended and flushed one by one (several threads write)."""

    def __init__(self, path: Path) -> None:
        self._f = path.open("a", buffering=1)
        self._lock = threading.Lock()

    def write(self, kind: str, mode: str, agent: int, **fields: Any) -> None:
        line = json.dumps({"kind": kind, "mode": mode, "agent": agent, "t": time.time(), **fields})
        with self._lock:
            self._f.write(line + "\n")


def timing_args(timing: Timing) -> dict[str, Any]:
    """The keyword arguments of ``Coordinator`` that ``timing`` sets (the coordinator echoes each heartbeat
    as it arrives)."""
    return {
        "heartbeat_timeout": timing.heartbeat_timeout,
        "probe_timeout": timing.probe_timeout,
        "peer_watch": timing.peer_watch,
        "beat_timeout": timing.beat_timeout,
    }


def client(
    addr: str, port: int, timing: Timing, inbox: queue.SimpleQueue[messages.Message]
) -> CoordinatorClient:
    return CoordinatorClient(
        addr,
        port,
        SECRET,
        on_message=inbox.put,
        heartbeat_interval=timing.heartbeat_interval,
        heartbeat_timeout=timing.heartbeat_timeout,
        probe_timeout=timing.probe_timeout,
        beat_interval=timing.beat_interval,
        beat_timeout=timing.beat_timeout,
    )


def next_message(
    inbox: queue.SimpleQueue[messages.Message], stop: threading.Event
) -> messages.Message | None:
    while not stop.is_set():
        with contextlib.suppress(queue.Empty):
            return inbox.get(timeout=0.5)
    return None


def serve_pair(
    addr: str, hosts: tuple[str, str], agent: int, mode: str, runs: Path, log: Log, stop: threading.Event
) -> None:
    """Coordinator of one agent in one mode, started afresh after each disturbance of its round."""
    timing = timing_of(mode)
    generation = 0
    while not stop.is_set():
        generation += 1
        run_dir = RunDir(runs / f"{mode}-{agent}-{generation}")
        run_dir.path.mkdir(parents=True)
        state = JobState(
            hosts=hosts,
            min_nodes=1,
            max_restarts=1,
            master_addr=addr,
            new_port=lambda: 29500,
            rdzv_timeout=RDZV_TIMEOUT,
        )
        coordinator = Coordinator(
            socket.create_server((addr, port_of(agent, mode))),
            SECRET,
            state,
            run_dir,
            **timing_args(timing),
        )
        coordinator.start()
        inbox: queue.SimpleQueue[messages.Message] = queue.SimpleQueue()
        rank0 = client(addr, port_of(agent, mode), timing, inbox)
        rank0.connect(messages.Hello(node_rank=0, host=hosts[0], nproc=1), timeout=JOIN_TIMEOUT)
        rank0.start()
        msg = next_message(inbox, stop)
        if isinstance(msg, messages.Round) and msg.group_world_size == len(hosts):
            rank0.send(messages.Started(msg.round, time.time()))
            log.write("round", mode, agent, generation=generation)
            msg = next_message(inbox, stop)
        if msg is not None:
            coordinator.events.flush(timeout=5)
            for e in run_dir.events():
                if e["event"] == EventName.NODE_LOST.value and e.get("node_rank") == 1:
                    log.write("lost", mode, agent, at=float(e["ts"]), reason=str(e.get("reason", "")))
            log.write("disturbed", mode, agent, message=type(msg).__name__)
        rank0.close()
        coordinator.stop(drain_timeout=1)


def run_agent(addr: str, host: str, agent: int, mode: str, log: Log, stop: threading.Event) -> None:
    """Rank 1 of its pair: joins, starts its (imaginary) workers, logs its fences, joins again."""
    timing = timing_of(mode)
    while not stop.is_set():
        inbox: queue.SimpleQueue[messages.Message] = queue.SimpleQueue()
        c = client(addr, port_of(agent, mode), timing, inbox)
        try:
            c.connect(messages.Hello(node_rank=1, host=host, nproc=1), timeout=JOIN_TIMEOUT)
        except CoordinatorUnreachable as e:
            log.write("unreachable", mode, agent, error=str(e))
            c.close()
            continue
        c.start()
        while (msg := next_message(inbox, stop)) is not None:
            if isinstance(msg, messages.Round):
                c.send(messages.Started(msg.round, time.time()))
                log.write("joined", mode, agent)
                continue
            if isinstance(msg, messages.Lost):
                log.write("fenced", mode, agent, reason=msg.reason)
            else:
                log.write("ended", mode, agent, message=type(msg).__name__)
            break
        c.close()
        stop.wait(0.5)


def fail_fast(target: Any, args: tuple[Any, ...]) -> None:
    """Run ``target``; if it raises, the whole process ends (exit 1) so the bench sees it at once."""
    try:
        target(*args)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("role", choices=("coordinator", "agent"))
    p.add_argument("--addr", required=True, help="the coordinator's address")
    p.add_argument("--host", required=True, help="this node's name")
    p.add_argument("--log", type=Path, required=True)
    p.add_argument(
        "--agents", nargs="+", required=True, help="coordinator: the agents' hosts; agent: its index"
    )
    p.add_argument("--runs", type=Path, help="coordinator: where its run directories go")
    args = p.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    log = Log(args.log)
    threads = []
    for mode in MODES:
        if args.role == "coordinator":
            for agent, host in enumerate(args.agents):
                target: Any = serve_pair
                targs: tuple[Any, ...] = (args.addr, (args.host, host), agent, mode, args.runs, log, stop)
                threads.append(threading.Thread(target=fail_fast, args=(target, targs), daemon=True))
        else:
            targs = (args.addr, args.host, int(args.agents[0]), mode, log, stop)
            threads.append(threading.Thread(target=fail_fast, args=(run_agent, targs), daemon=True))
    for t in threads:
        t.start()
    while not stop.wait(1.0):
        pass


if __name__ == "__main__":
    main()
