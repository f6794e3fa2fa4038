"""Strangers on the coordinator's port (issue 10, item 1): a thousand unauthenticated sockets, idle, slow
or sending garbage, during a real job, and a coordinator out of file descriptors.

The job completes, no node is lost, and the coordinator's process stays under 100 MB of RSS (printed);
out of descriptors, ``accept`` backs off instead of spinning, and an agent can still join afterwards.
"""

from __future__ import annotations

import os
import queue
import resource
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from hpcelastic.agent import messages
from hpcelastic.agent.client import CoordinatorClient
from hpcelastic.agent.coordinator import Coordinator
from hpcelastic.agent.job_state import JobState
from hpcelastic.rundir import RunDir

STRANGERS = 1000
RSS_LIMIT = 100 * 1024 * 1024


class Strangers:
    """``n`` unauthenticated connections, a third each idle, slow (one byte at a time) and garbage."""

    def __init__(self, port: int, n: int) -> None:
        self.port, self.n = port, n
        self.socks: list[socket.socket | None] = [None] * n
        self.stop = threading.Event()
        self.connects = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _connect(self, i: int) -> None:
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", self.port))
        self.socks[i] = s
        self.connects += 1

    def _run(self) -> None:
        garbage = os.urandom(4096)
        header = struct.pack("!I", 1 << 20)  # then 1 MiB of a frame, 64 KiB a time, never completed
        chunk = b"\0" * 65536
        while not self.stop.is_set():
            for i in range(self.n):
                s = self.socks[i]
                if s is None:
                    self._connect(i)
                    continue
                kind = i % 3  # 0 idle, 1 slow, 2 garbage
                data = None
                try:
                    if kind == 1:
                        s.send(b"\0")
                    elif kind == 2:
                        s.send(garbage if i % 2 else header + chunk)
                    if kind != 0:
                        data = s.recv(65536)  # the challenge, or b"": closed by the coordinator
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if data == b"":
                    s.close()
                    self.socks[i] = None
            time.sleep(0.2)
        for s in self.socks:
            if s is not None:
                s.close()


@pytest.fixture(autouse=True)
def _enough_descriptors() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * STRANGERS)), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_thousand_strangers_during_a_job(local_job) -> None:
    job = local_job(nodes="2", nproc=1, train_args=("--step-time", "0.5"))
    job.wait_until("rendezvous", lambda: bool(job.events("rendezvous")))
    endpoint = job.agents[0].args[job.agents[0].args.index("--rdzv-endpoint") + 1]
    coordinator = psutil.Process(job.agents[0].pid)  # agent 0 hosts the coordinator
    strangers = Strangers(int(endpoint.rpartition(":")[2]), STRANGERS)
    peak = 0
    try:
        while job.agents[0].poll() is None:
            peak = max(peak, coordinator.memory_info().rss)
            time.sleep(0.1)
    except psutil.NoSuchProcess:
        pass
    finally:
        strangers.stop.set()
        strangers.thread.join(10)
    print(
        f"\ncoordinator peak RSS with {STRANGERS} strangers: {peak / 2**20:.1f} MiB "
        f"({strangers.connects} stranger connections)"
    )
    assert job.wait() == [0, 0]
    assert not job.events("node_lost")
    assert strangers.connects >= STRANGERS
    assert 0 < peak < RSS_LIMIT


class CountingListener(socket.socket):
    """The coordinator's listening socket, counting ``accept`` calls (a spinning loop makes millions)."""

    accepts = 0

    def accept(self):  # type: ignore[no-untyped-def]
        CountingListener.accepts += 1
        return super().accept()


FLOOD = """
import resource, socket, sys, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
socks = [socket.create_connection(("127.0.0.1", int(sys.argv[1]))) for _ in range(300)]
print("connected", flush=True)
time.sleep(float(sys.argv[2]))
"""


def test_out_of_descriptors_the_listener_backs_off_and_agents_still_join(tmp_path: Path) -> None:
    listener = CountingListener(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(4096)
    state = JobState(
        hosts=("n0",),
        min_nodes=1,
        max_restarts=0,
        master_addr="127.0.0.1",
        new_port=lambda: 1,
        rdzv_timeout=60,
    )
    coordinator = Coordinator(listener, "s" * 64, state, RunDir(tmp_path))
    coordinator.start()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    flood = None
    try:
        in_use = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 40, hard))  # the coordinator's process runs out
        flood = subprocess.Popen(
            [sys.executable, "-c", FLOOD, str(coordinator.port), "3"], stdout=subprocess.PIPE
        )
        assert flood.stdout is not None and flood.stdout.readline() == b"connected\n"
        before = CountingListener.accepts
        time.sleep(2.0)
        during = CountingListener.accepts - before
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        if flood is not None:
            flood.wait(10)
    print(f"\naccept calls in 2 s out of descriptors: {during}")
    assert during < 500, f"{during} accept calls in 2 s: the listener spins"
    inbox: queue.SimpleQueue[messages.Message] = queue.SimpleQueue()
    client = CoordinatorClient("127.0.0.1", coordinator.port, "s" * 64, on_message=inbox.put)
    client.connect(messages.Hello(node_rank=0, host="n0", nproc=1), timeout=30)
    client.start()
    assert isinstance(inbox.get(timeout=10), messages.Round)
    client.close()
    coordinator.stop(drain_timeout=1)
