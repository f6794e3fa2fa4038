"""A Slurm job step (``srun ... hpcelastic agent``): ranks and nodes from the step's variables.

Hostlists are expanded with python-hostlist, never with ``scontrol``. The coordinator runs on the
step's first node at a port derived from the job id and restart count, so every agent can compute
the endpoint on its own; ``--rdzv-endpoint``/``--rdzv-port`` override it.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import hostlist

from hpcelastic.env.base import (
    BootstrapOptions,
    Environment,
    NodeContext,
    Rendezvous,
    interface_address,
    listen,
    parse_endpoint,
    require_run_dir,
    resolve_secret,
    visible_gpus,
)
from hpcelastic.errors import UserError

PORT_BASE = 20000
PORT_SPAN = 10000


def job_id(environ: Mapping[str, str]) -> str | None:
    """The id that names this allocation to Slurm: ``<array job>_<task>`` for an array task, else
    ``SLURM_JOB_ID``; None outside Slurm. The one job id used to requeue, resubmit and key attempts."""
    array_job, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and task:
        return f"{array_job}_{task}"
    return environ.get("SLURM_JOB_ID") or None


def restart_count(environ: Mapping[str, str]) -> int:
    """How many times Slurm requeued this job (``SLURM_RESTART_COUNT``; 0 when unset or not a number)."""
    value = environ.get("SLURM_RESTART_COUNT", "0")
    return int(value) if value.isascii() and value.isdigit() else 0


def derived_port(job_id: str | None, restart_count: int) -> int:
    """The coordinator port every agent of one job attempt computes alike (20000-29999)."""
    key = f"{job_id or 'nojob'}:{restart_count}".encode()
    return PORT_BASE + zlib.crc32(key) % PORT_SPAN


class SlurmEnvironment(Environment):
    """Inside an ``srun`` step, one task per node."""

    name = "slurm"

    @classmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        return bool(
            environ.get("SLURM_STEP_NODELIST")
            or environ.get("SLURM_JOB_ID")
            and environ.get("SLURM_NODELIST")
        )

    def context(self) -> NodeContext:
        e = self.environ
        nodelist = e.get("SLURM_STEP_NODELIST") or e.get("SLURM_NODELIST", "")
        try:
            hosts = tuple(hostlist.expand_hostlist(nodelist))
        except hostlist.BadHostlist as err:
            raise UserError(f"cannot expand the Slurm node list {nodelist!r}: {err}") from None
        num_nodes = self._int("SLURM_STEP_NUM_NODES", len(hosts))
        tasks = self._int("SLURM_STEP_NUM_TASKS", num_nodes)
        if tasks != num_nodes:
            raise UserError(
                f"the step runs {tasks} tasks on {num_nodes} nodes; start one agent per node "
                "(srun --ntasks-per-node=1 hpcelastic agent ...)"
            )
        if len(hosts) != num_nodes:
            raise UserError(f"SLURM_STEP_NUM_NODES={num_nodes} disagrees with the node list {nodelist!r}")
        node_rank = self._int("SLURM_NODEID")
        if not 0 <= node_rank < num_nodes:
            raise UserError(f"SLURM_NODEID={node_rank} is outside the step's {num_nodes} nodes")
        return NodeContext(
            environment=self.name,
            node_rank=node_rank,
            num_nodes=num_nodes,
            hosts=hosts,
            job_id=e.get("SLURM_JOB_ID"),
            restart_count=self._int("SLURM_RESTART_COUNT", 0),
            gpus=visible_gpus(e, "SLURM_GPUS_ON_NODE"),
        )

    def rendezvous(self, ctx: NodeContext, opts: BootstrapOptions) -> Rendezvous:
        run_dir = require_run_dir(opts)
        secret = resolve_secret(run_dir, self.environ)
        if opts.endpoint:
            host, port = parse_endpoint(opts.endpoint)
        else:
            host, port = ctx.hosts[0], opts.port or derived_port(ctx.job_id, ctx.restart_count)
        master = interface_address(opts.interface) if opts.interface and ctx.is_coordinator else host
        listener = listen("", port) if ctx.is_coordinator else None
        return Rendezvous(
            host=host, port=port, secret=secret, run_dir=run_dir, master_addr=master, listener=listener
        )
