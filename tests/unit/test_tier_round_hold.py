"""The coordinator holds a round for the local tier at most ``TIER_SETTLE_S``: real coordinator, real
authenticated clients standing in for the agents.

The bug (issue 27, Lightning's ``last.ckpt`` under the tier): a checkpoint waited for a node's answer that
never came, and the round after a failure was held again each time its wait ended, for good.
"""

from __future__ import annotations

import queue
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcelastic.agent import messages
from hpcelastic.agent.client import CoordinatorClient
from hpcelastic.agent.coordinator import TIER_SETTLE_S, Coordinator
from hpcelastic.agent.job_state import JobState
from hpcelastic.rundir import RunDir
from hpcelastic.tier.book import TierBook
from tests.unit.test_coordinator_io import HOSTS, SECRET, Plane


class TierPlane(Plane):
    """A coordinator with a tier book on loopback and one connected client per host, each with a tier."""

    def __init__(self, rd: RunDir) -> None:  # not Plane.__init__: this coordinator has a tier
        state = JobState(
            hosts=HOSTS,
            min_nodes=len(HOSTS),
            max_restarts=1,
            master_addr="127.0.0.1",
            new_port=lambda: 29500,
            rdzv_timeout=20,
        )
        book = TierBook(replicas=1, persist_every=1, restore_mode="all")
        self.coordinator = Coordinator(socket.create_server(("127.0.0.1", 0)), SECRET, state, rd, tier=book)
        self.coordinator.start()
        self.inboxes: list[queue.SimpleQueue[messages.Message]] = []
        self.clients: list[CoordinatorClient] = []
        for rank, host in enumerate(HOSTS):
            inbox: queue.SimpleQueue[messages.Message] = queue.SimpleQueue()
            client = CoordinatorClient("127.0.0.1", self.coordinator.port, SECRET, on_message=inbox.put)
            hello = messages.Hello(node_rank=rank, host=host, nproc=1, data_port=40000 + rank)
            client.connect(hello, timeout=10)
            client.start()
            self.inboxes.append(inbox)
            self.clients.append(client)

    def expect(self, rank: int, kind: type[messages.Message], timeout: float = 20) -> messages.Message:
        """The next message of ``kind`` to agent ``rank`` (tier messages and stops before it skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self.inboxes[rank].get(timeout=max(0.01, deadline - time.monotonic()))
            if isinstance(msg, kind):
                return msg
            skipped = messages.TierRestore | messages.TierQuery | messages.Stop
            assert isinstance(msg, skipped), f"agent {rank} got {msg!r}"


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[TierPlane]:
    p = TierPlane(RunDir(tmp_path))
    yield p
    p.close()


def test_a_round_waits_for_an_answer_that_never_comes_only_so_long(plane: TierPlane) -> None:
    rounds = [plane.expect(rank, messages.Round) for rank in range(len(HOSTS))]
    for client, rnd in zip(plane.clients, rounds, strict=True):
        client.send(messages.Started(rnd.round, time.time()))
    # Node 0's part completes last.ckpt; node 1 is asked for its part and never answers.
    plane.clients[0].send(messages.TierHave("last.ckpt", "0", "own", 5, 100, marker=True))
    query = plane.expect(1, messages.TierQuery)
    assert isinstance(query, messages.TierQuery) and query.name == "last.ckpt"
    failure = {"round": 0, "rank": 0, "local_rank": 0, "exitcode": 1, "signal": None, "error": "x", "ts": 0.0}
    plane.clients[0].send(messages.Failed(0, (failure,)))
    plane.clients[0].send(messages.Stopped(0))
    plane.expect(1, messages.Stop)
    stopped = time.monotonic()
    plane.clients[1].send(messages.Stopped(0))
    for rank in range(len(HOSTS)):
        rnd = plane.expect(rank, messages.Round, timeout=TIER_SETTLE_S + 15)
        assert isinstance(rnd, messages.Round) and rnd.round == 1
    assert time.monotonic() - stopped >= TIER_SETTLE_S * 0.9  # it did wait for the answer, once
