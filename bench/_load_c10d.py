"""torch's c10d rendezvous at the same sizes, for the control-plane load benchmark.

Participants take torchrun's own path: ``registry.get_rendezvous_handler`` with ``backend="c10d"``
builds a ``C10dRendezvousBackend`` on a ``TCPStore`` and a ``DynamicRendezvousHandler``; each calls
``next_rendezvous()`` once. One process hosts the store (``is_host`` is given, as with
``--rdzv-conf is_host=...``); a few processes run the participants as threads, since a process per
participant (about 200 MB each with torch) does not fit this machine. Imported only in those
child processes: the driver never imports torch.
"""

from __future__ import annotations

import os
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

STORE_LIFETIME_S = 900.0


def store_main(ctl: Connection) -> None:
    """Host the rendezvous ``TCPStore`` on 127.0.0.1 until the driver says ``stop``."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctl.send(("port", store.port))
    ctl.poll(STORE_LIFETIME_S)
    os._exit(0)


def participants_main(port: int, nodes: int, count: int, limit_s: float, ctl: Connection) -> None:
    """Run ``count`` participants of an ``nodes``-node rendezvous as threads; report when each returned.

    Threads start together on the driver's ``go``; each creates its handler (connecting to the store,
    as torchrun's agent does at start) and calls ``next_rendezvous()``. ``join_timeout`` is
    ``limit_s``, so every thread ends by then; the process exits hard afterwards because completed
    handlers keep their keep-alive timers and store connections.
    """
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    go = threading.Event()
    results: dict[int, tuple[Any, ...]] = {}
    handlers: list[Any] = []

    def participant(i: int) -> None:
        go.wait()
        try:
            params = RendezvousParameters(
                backend="c10d",
                endpoint=f"127.0.0.1:{port}",
                run_id="loadbench",
                min_nodes=nodes,
                max_nodes=nodes,
                join_timeout=int(limit_s),
                is_host=False,
            )
            handler = get_rendezvous_handler(params)
            handlers.append(handler)
            info = handler.next_rendezvous()
            results[i] = ("ok", time.time(), info.rank, info.world_size)
        except Exception as e:  # any failure of torch's rendezvous is a result to report
            results[i] = ("error", time.time(), f"{type(e).__name__}: {e}"[:300])

    threads = [threading.Thread(target=participant, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    ctl.send(("ready",))
    if ctl.poll(60.0) and ctl.recv()[0] == "go":
        go.set()
        deadline = time.monotonic() + limit_s + 10.0
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
    ctl.send(("result", results))
    os._exit(0)
