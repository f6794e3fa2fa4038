"""This machine only: the N agents of ``hpcelastic run`` (or one agent started by hand).

``hpcelastic run`` sets ``HPCELASTIC_LOCAL_NODE_RANK``/``HPCELASTIC_LOCAL_NUM_NODES`` for each agent
it spawns, passes the coordinator endpoint with ``--rdzv-endpoint`` and hands agent 0 the already
listening socket as an inherited descriptor (``HPCELASTIC_COORDINATOR_FD``), so no port is ever
probed and released. Without those variables the agent is a single local node.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping

from hpcelastic.env.base import (
    BootstrapOptions,
    Environment,
    NodeContext,
    Rendezvous,
    listen,
    parse_endpoint,
    require_run_dir,
    resolve_secret,
    visible_gpus,
)
from hpcelastic.errors import UserError

LOOPBACK = "127.0.0.1"


class LocalEnvironment(Environment):
    """N agents on one machine, all on the loopback interface."""

    name = "local"

    @classmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        return "HPCELASTIC_LOCAL_NODE_RANK" in environ

    def context(self) -> NodeContext:
        rank = self._int("HPCELASTIC_LOCAL_NODE_RANK", 0)
        size = self._int("HPCELASTIC_LOCAL_NUM_NODES", 1)
        if not 0 <= rank < size:
            raise UserError(f"HPCELASTIC_LOCAL_NODE_RANK={rank} is outside 0..{size - 1}")
        gpus = visible_gpus(self.environ)
        per_node = len(gpus) // size
        return NodeContext(
            environment=self.name,
            node_rank=rank,
            num_nodes=size,
            hosts=tuple(local_host(i) for i in range(size)),
            job_id=None,
            restart_count=0,
            gpus=gpus[rank * per_node : (rank + 1) * per_node],
        )

    def rendezvous(self, ctx: NodeContext, opts: BootstrapOptions) -> Rendezvous:
        run_dir = require_run_dir(opts)
        secret = resolve_secret(run_dir, self.environ)
        listener = None
        fd = self.environ.get("HPCELASTIC_COORDINATOR_FD")
        if ctx.is_coordinator and fd:
            listener = socket.socket(fileno=int(fd))
            listener.set_inheritable(False)
        if opts.endpoint:
            host, port = parse_endpoint(opts.endpoint)
        elif ctx.num_nodes == 1:
            host, port = LOOPBACK, opts.port or 0
        else:
            raise UserError("several local agents need --rdzv-endpoint HOST:PORT (hpcelastic run passes it)")
        if ctx.is_coordinator and listener is None:
            listener = listen(LOOPBACK, port)
            port = listener.getsockname()[1]
        return Rendezvous(
            host=host, port=port, secret=secret, run_dir=run_dir, master_addr=LOOPBACK, listener=listener
        )


def local_host(node_rank: int) -> str:
    """The name of local node ``node_rank`` (``hpcelastic run``'s agents on this machine)."""
    return f"local{node_rank}"
