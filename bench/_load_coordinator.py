"""The coordinator process of the control-plane load benchmark.

Runs the product's :class:`~hpcelastic.agent.coordinator.Coordinator` exactly as the group-rank-0
agent builds it (``JobState``, ``PortReservation``, the run directory's secret, ``listen`` on
127.0.0.1), alone in its own process so its CPU time and memory can be measured.
"""

from __future__ import annotations

import resource
import time
from multiprocessing.connection import Connection
from pathlib import Path

from hpcelastic.agent import coordinator, messages
from hpcelastic.agent.coordinator import PortReservation
from hpcelastic.agent.job_state import JobState
from hpcelastic.env.base import listen
from hpcelastic.rundir import RunDir

LIFETIME_S = 600.0


def coordinator_main(
    run_dir: str,
    nodes: int,
    max_restarts: int,
    hb_interval: float,
    hb_timeout: float,
    ctl: Connection,
    max_preauth: int | None = None,
    peer_watch: bool = False,
) -> None:
    """Serve ``nodes`` agents until the job finishes or the driver says ``stop``; report the result.

    ``max_preauth``: the cap of unauthenticated connections instead of the product's (tests make agents
    meet it with a few agents).
    """
    if max_preauth is not None:
        coordinator.MAX_PREAUTH = max_preauth
    run = RunDir(Path(run_dir))
    ports = PortReservation()
    state = JobState(
        hosts=[f"sim{i}" for i in range(nodes)],
        min_nodes=max(1, nodes // 2),
        max_restarts=max_restarts,
        master_addr="127.0.0.1",
        new_port=ports.new_port,
        rdzv_timeout=120.0,
    )
    coord = coordinator.Coordinator(
        listen("127.0.0.1", 0),
        run.read_secret(),
        state,
        run,
        heartbeat_timeout=hb_timeout,
        peer_watch=peer_watch,
    )
    coord.start()
    ctl.send(("port", coord.port))
    deadline = time.monotonic() + LIFETIME_S
    while not coord.finished.is_set() and time.monotonic() < deadline:
        if ctl.poll(0.05) and ctl.recv()[0] == "stop":
            break
    coord.stop(drain_timeout=5.0)
    ports.release()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    ctl.send(
        (
            "result",
            {
                "result": None if state.result is None else messages.encode(state.result),
                "round": state.round,
                "cpu_s": usage.ru_utime + usage.ru_stime,
                "maxrss_mb": usage.ru_maxrss / 1024,
            },
        )
    )
