"""Each round's MASTER_PORT (agent/stores.py) with real torch TCPStores: reserved for rank 0's store until
torch is imported in the coordinator's process, then served from it, so a worker's client connects at once;
the round's message says which."""

from __future__ import annotations

import json
import socket
import threading
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from hpcelastic.agent import messages
from hpcelastic.agent.stores import VARIABLE, RoundStores, wanted
from hpcelastic.errors import UserError


def client(port: int) -> TCPStore:
    return TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))


def test_a_round_before_the_import_ends_is_rank_0_s_then_the_rounds_are_served_here(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    imported = threading.Event()
    real_import = RoundStores._import

    def slow_import(self: RoundStores) -> None:  # torch takes seconds to import on a busy node
        imported.wait(30)
        real_import(self)

    monkeypatch.setattr(RoundStores, "_import", slow_import)
    stores = RoundStores(keep=2)
    try:
        first = stores.new_port()
        assert not stores.serves(first)  # torch is still being imported: rank 0's worker serves this one
        with socket.socket() as s, pytest.raises(OSError):
            s.bind(("", first))  # ... and the port is held for it
        imported.set()
        assert stores._importing is not None
        stores._importing.join(timeout=120)
        ports = [stores.new_port() for _ in range(3)]
        assert all(stores.serves(p) for p in ports[1:]) and not stores.serves(ports[0])
        with socket.socket() as s:  # listening before any worker starts: no client waits out a backoff
            assert s.connect_ex(("127.0.0.1", ports[-1])) == 0
        client(ports[-1]).set("k", "v")
        assert client(ports[-1]).get("k") == b"v"
        with socket.socket() as s:  # the oldest store beyond ``keep`` is closed
            assert s.connect_ex(("127.0.0.1", ports[0])) != 0
    finally:
        stores.close()


def test_replica_groups_import_at_once_and_every_port_is_served() -> None:
    stores = RoundStores(keep=4, import_now=True)
    try:
        port = stores.new_port()
        assert stores.serves(port) and client(port).check(["absent"]) is False
    finally:
        stores.close()


def test_a_round_over_the_wire_keeps_whether_its_store_is_served() -> None:
    rnd = messages.Round(0, 0, 1, 0, 1, 0, 2, "n0", 41000, agent_store=True)
    assert messages.Round.from_wire(json.loads(json.dumps(messages.encode(rnd)))) == rnd
    old = {k: v for k, v in messages.encode(rnd).items() if k != "agent_store"}  # an agent of before
    assert messages.Round.from_wire(old).agent_store is False


def test_the_rank_0_store_can_be_kept_and_a_wrong_value_is_one_line() -> None:
    assert wanted({}) and wanted({VARIABLE: "1"}) and not wanted({VARIABLE: "0"})
    with pytest.raises(UserError, match=f"{VARIABLE}='yes' is not 0 or 1"):
        wanted({VARIABLE: "yes"})
    stores = RoundStores(serve=False)
    try:
        assert not any(stores.serves(stores.new_port()) for _ in range(3)) and stores._importing is None
    finally:
        stores.close()
