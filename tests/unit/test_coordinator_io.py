"""The coordinator under a failing and a slow filesystem: real coordinator, real authenticated clients.

A write to ``events.jsonl`` that fails (``/dev/full``: ENOSPC; a directory: EISDIR) or blocks for seconds
(a FIFO nobody reads yet: ``open`` waits for a reader) must neither end the control plane nor starve
the heartbeats: the round completes, no node is lost, and the events reach the file once it works.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcelastic.agent import messages
from hpcelastic.agent.client import CoordinatorClient
from hpcelastic.agent.coordinator import Coordinator
from hpcelastic.agent.job_state import JobState
from hpcelastic.reasons import Reason
from hpcelastic.rundir import RunDir

SECRET = "s" * 64
HOSTS = ("n0", "n1")
# Short, so that a 4 s blocked write spans several timeouts; not so short that a loaded CI machine misses one.
HB_INTERVAL, HB_TIMEOUT = 0.2, 1.0


def loopback_coordinator(rd: RunDir, *, min_nodes: int, max_restarts: int, **timing: float) -> Coordinator:
    """A coordinator for ``HOSTS`` on a loopback port (not started), ``timing`` its heartbeat settings."""
    state = JobState(
        hosts=HOSTS,
        min_nodes=min_nodes,
        max_restarts=max_restarts,
        master_addr="127.0.0.1",
        new_port=lambda: 29500,
        rdzv_timeout=20,
    )
    return Coordinator(socket.create_server(("127.0.0.1", 0)), SECRET, state, rd, **timing)


class Plane:
    """A coordinator on loopback and one connected client per host."""

    def __init__(self, rd: RunDir) -> None:
        self.coordinator = loopback_coordinator(
            rd, min_nodes=len(HOSTS), max_restarts=0, heartbeat_timeout=HB_TIMEOUT
        )
        self.coordinator.events.retry_delay = 0.05
        self.coordinator.start()
        self.inboxes: list[queue.SimpleQueue[messages.Message]] = []
        self.clients: list[CoordinatorClient] = []

    def connect(self) -> None:
        for rank, host in enumerate(HOSTS):
            inbox: queue.SimpleQueue[messages.Message] = queue.SimpleQueue()
            client = CoordinatorClient(
                "127.0.0.1",
                self.coordinator.port,
                SECRET,
                on_message=inbox.put,
                heartbeat_interval=HB_INTERVAL,
                heartbeat_timeout=HB_TIMEOUT,
            )
            client.connect(messages.Hello(node_rank=rank, host=host, nproc=1), timeout=10)
            client.start()
            self.inboxes.append(inbox)
            self.clients.append(client)

    def expect(self, rank: int, kind: type[messages.Message], timeout: float = 15) -> messages.Message:
        msg = self.inboxes[rank].get(timeout=timeout)
        assert isinstance(msg, kind), f"agent {rank} got {msg!r}, expected a {kind.__name__}"
        return msg

    def run_one_round(self) -> messages.Finish:
        """Both agents start their workers, the workers finish: the attempt succeeds."""
        rounds = [self.expect(rank, messages.Round) for rank in range(len(HOSTS))]
        for client, rnd in zip(self.clients, rounds, strict=True):
            client.send(messages.Started(rnd.round, time.time()))
        time.sleep(3 * HB_TIMEOUT)  # heartbeats must keep flowing both ways meanwhile
        for client, rnd in zip(self.clients, rounds, strict=True):
            client.send(messages.Done(rnd.round))
        finishes = [self.expect(rank, messages.Finish) for rank in range(len(HOSTS))]
        assert all(isinstance(f, messages.Finish) for f in finishes)
        return finishes[0]  # type: ignore[return-value]

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.coordinator.stop(drain_timeout=5)


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[Plane]:
    p = Plane(RunDir(tmp_path))
    yield p
    p.close()


@pytest.mark.parametrize("broken", ["dev-full", "directory"])
def test_failing_event_writes_do_not_end_the_control_plane(plane: Plane, broken: str) -> None:
    events = plane.coordinator.run_dir.events_path
    if broken == "dev-full":
        events.symlink_to("/dev/full")  # every write: ENOSPC
    else:
        events.mkdir()  # every open: EISDIR
    plane.connect()
    finish = plane.run_one_round()
    assert finish.reason is Reason.SUCCEEDED and finish.bad_nodes == ()
    assert plane.coordinator.events.error is not None
    assert plane.coordinator._thread.is_alive()
    # The filesystem works again: the events kept in memory are written, in order.
    events.unlink() if broken == "dev-full" else events.rmdir()
    assert plane.coordinator.events.flush(timeout=10)
    names = [e["event"] for e in plane.coordinator.run_dir.events()]
    assert names[0] == "rendezvous" and "node_lost" not in names, names
    assert plane.coordinator.events.error is None


def test_a_write_blocked_for_seconds_starves_no_heartbeat(plane: Plane) -> None:
    events = plane.coordinator.run_dir.events_path
    os.mkfifo(events)  # open(O_WRONLY) blocks until a reader opens it: a write that hangs
    lines: list[bytes] = []
    stop = threading.Event()

    def slow_reader() -> None:
        time.sleep(4 * HB_TIMEOUT)  # four heartbeat timeouts
        while not stop.is_set():
            with open(events, "rb") as f:
                lines.extend(f.read().splitlines())

    reader = threading.Thread(target=slow_reader, daemon=True)
    reader.start()
    plane.connect()
    finish = plane.run_one_round()
    assert finish.reason is Reason.SUCCEEDED and finish.bad_nodes == ()
    for inbox in plane.inboxes:
        assert inbox.empty()  # no Lost: the coordinator's heartbeats kept coming
    assert plane.coordinator.events.flush(timeout=20)
    stop.set()
    with contextlib.suppress(OSError):  # let the reader out of a last open; ENXIO when it has left already
        os.close(os.open(events, os.O_WRONLY | os.O_NONBLOCK))
    reader.join(5)
    assert b"node_lost" not in b"".join(lines) and any(b"rendezvous" in line for line in lines)
