"""A Slurm job step (``srun ... hpcelastic agent``): ranks and nodes from the step's variables.

Every ``SLURM_*`` variable hpcelastic reads is in one table (:data:`VARIABLES`, fact -> variables),
read into one typed record (:class:`SlurmFacts`); nothing outside ``env/`` reads them.

Hostlists are expanded with python-hostlist, never with ``scontrol``. The coordinator runs on the
step's first node, listens on a free port (or ``--rdzv-port``) and publishes the address it really
listens on in the run directory (:func:`coordinator_file`, one file per job id and restart count,
written atomically); the other agents read it there and never resolve a Slurm node name (NodeName
need not be in DNS). A coordinator that cannot start publishes its error instead, so every agent
ends within seconds with the same line. ``--rdzv-endpoint`` overrides all of this.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import get_args, get_type_hints

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
    routable_address,
    visible_gpus,
)
from hpcelastic.errors import UserError
from hpcelastic.jobs.container import CONTAINER_ENV
from hpcelastic.parse import ASCII_INT
from hpcelastic.rundir import RunDir, write_json_atomic

#: How often an agent looks for the coordinator's address file while it waits.
ADDRESS_POLL_S = 0.1


@dataclass(frozen=True)
class SlurmFacts:
    """What Slurm tells a process about its job and step (None: the variable is not set)."""

    job_id: str | None = None
    array_job_id: str | None = None
    array_task_id: str | None = None
    node_list: str | None = None
    step_id: str | None = None
    step_node_list: str | None = None
    step_num_nodes: int | None = None
    step_num_tasks: int | None = None
    node_id: int | None = None
    proc_id: int | None = None
    restart_count: int | None = None
    gpus_on_node: int | None = None
    step_gpus: str | None = None
    job_gpus: str | None = None
    #: Slurm 25.11: the job's id unique across the cluster's job id reuse (metrics label runs with it).
    sluid: str | None = None
    #: When the job's time limit ends, epoch seconds (Slurm 23.02 and later; a year ahead when UNLIMITED).
    job_end_time: int | None = None


# Each fact and the variable(s) Slurm sets it in, the first set one wins (as submitit's JobEnvironment).
VARIABLES: dict[str, tuple[str, ...]] = {
    "job_id": ("SLURM_JOB_ID", "SLURM_JOBID"),
    "array_job_id": ("SLURM_ARRAY_JOB_ID",),
    "array_task_id": ("SLURM_ARRAY_TASK_ID",),
    "node_list": ("SLURM_NODELIST", "SLURM_JOB_NODELIST"),
    "step_id": ("SLURM_STEP_ID", "SLURM_STEPID"),
    "step_node_list": ("SLURM_STEP_NODELIST",),
    "step_num_nodes": ("SLURM_STEP_NUM_NODES",),
    "step_num_tasks": ("SLURM_STEP_NUM_TASKS",),
    "node_id": ("SLURM_NODEID",),
    "proc_id": ("SLURM_PROCID",),
    "restart_count": ("SLURM_RESTART_COUNT",),
    "gpus_on_node": ("SLURM_GPUS_ON_NODE",),
    "step_gpus": ("SLURM_STEP_GPUS",),
    "job_gpus": ("SLURM_JOB_GPUS",),
    "sluid": ("SLURM_JOB_SLUID",),
    "job_end_time": ("SLURM_JOB_END_TIME",),
}
_INTS = frozenset(name for name, hint in get_type_hints(SlurmFacts).items() if int in get_args(hint))


def variable(environ: Mapping[str, str], fact: str) -> tuple[str, str] | None:
    """``(name, value)`` of the first non-empty variable that carries ``fact``; None when none is set."""
    for name in VARIABLES[fact]:
        value = environ.get(name)
        if value:
            return name, value
    return None


def read(environ: Mapping[str, str]) -> SlurmFacts:
    """Every fact of :data:`VARIABLES` from ``environ``; :class:`UserError` for a number that is not one."""
    values: dict[str, str | int | None] = {}
    for fact in VARIABLES:
        found = variable(environ, fact)
        if found is not None and fact in _INTS:
            name, text = found
            if not ASCII_INT.fullmatch(text.strip()):
                raise UserError(f"environment variable {name}={text!r} is not an integer")
            values[fact] = int(text)
        else:
            values[fact] = found[1] if found else None
    return SlurmFacts(**values)


def job_id(environ: Mapping[str, str]) -> str | None:
    """The id that names this allocation to Slurm: ``<array job>_<task>`` for an array task, else
    ``SLURM_JOB_ID``; None outside Slurm. The one job id used to requeue, resubmit and key attempts."""
    array_job, task = variable(environ, "array_job_id"), variable(environ, "array_task_id")
    if array_job and task:
        return f"{array_job[1]}_{task[1]}"
    found = variable(environ, "job_id")
    return found[1] if found else None


def sluid(environ: Mapping[str, str]) -> str | None:
    """``SLURM_JOB_SLUID`` (Slurm 25.11 and later): the job's cluster-unique id; None before 25.11."""
    found = variable(environ, "sluid")
    return found[1] if found else None


def outside_job(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without the job's ``SLURM_*`` variables (``SLURM_CONF`` kept): what a command that submits
    a new job from inside this one must run with, so the new job inherits nothing of this allocation."""
    return {k: v for k, v in environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}


def restart_count(environ: Mapping[str, str]) -> int:
    """How many times Slurm requeued this job (``SLURM_RESTART_COUNT``; 0 when unset or not a number)."""
    found = variable(environ, "restart_count")
    value = found[1] if found else "0"
    return int(value) if value.isascii() and value.isdigit() else 0


def task_rank(environ: Mapping[str, str]) -> int:
    """This task's rank in its step (``SLURM_PROCID``; 0 when unset or not a number)."""
    found = variable(environ, "proc_id")
    value = found[1] if found else "0"
    return int(value) if value.isascii() and value.isdigit() else 0


def time_left(environ: Mapping[str, str], now: float) -> float | None:
    """Seconds from ``now`` (epoch) to the end of the job's time limit (``SLURM_JOB_END_TIME``); None
    outside Slurm, before 23.02, or when the value is not a number. The variable is fixed when the job
    starts: a preemption's GraceTime, or a time limit changed later, is not in it."""
    found = variable(environ, "job_end_time")
    value = found[1].strip() if found else ""
    return float(value) - now if ASCII_INT.fullmatch(value) else None


def gpu_ids(ids: str | None) -> tuple[str, ...]:
    """``"0,2"`` -> ("0", "2"): a Slurm GPU index list (``SLURM_STEP_GPUS``/``SLURM_JOB_GPUS``)."""
    return tuple(x.strip() for x in (ids or "").split(",") if x.strip())


def nvml_gpu_ids(facts: SlurmFacts, visible: tuple[str, ...]) -> tuple[str, ...]:
    """NVML's ids of this node's GPUs: the step's (else the job's) global ids when they count as many
    as the visible GPUs (``CUDA_VISIBLE_DEVICES`` renumbers from 0 inside a cgroup), else the visible ids."""
    for ids in (gpu_ids(facts.step_gpus), gpu_ids(facts.job_gpus)):
        if ids and len(ids) == len(visible):
            return ids
    return visible


class SlurmEnvironment(Environment):
    """Inside an ``srun`` step, one task per node."""

    name = "slurm"

    @classmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        return bool(
            variable(environ, "step_node_list")
            or variable(environ, "job_id")
            and variable(environ, "node_list")
        )

    def context(self) -> NodeContext:
        facts = read(self.environ)
        nodelist = facts.step_node_list or facts.node_list or ""
        try:
            hosts = tuple(hostlist.expand_hostlist(nodelist))
        except hostlist.BadHostlist as err:
            raise UserError(f"cannot expand the Slurm node list {nodelist!r}: {err}") from None
        num_nodes = len(hosts) if facts.step_num_nodes is None else facts.step_num_nodes
        tasks = num_nodes if facts.step_num_tasks is None else facts.step_num_tasks
        if tasks != num_nodes:
            raise UserError(
                f"the step runs {tasks} tasks on {num_nodes} nodes; start one agent per node "
                "(srun --ntasks-per-node=1 hpcelastic agent ...)"
            )
        if len(hosts) != num_nodes:
            raise UserError(f"SLURM_STEP_NUM_NODES={num_nodes} disagrees with the node list {nodelist!r}")
        if facts.node_id is None:
            if self.environ.get(CONTAINER_ENV) == "oci":
                raise UserError(
                    "SLURM_NODEID is not set in the container: this Slurm's OCI mode (srun --container) does "
                    "not pass the per-task variables (22.05 does not, 24.11 does); use container.runtime "
                    "podman, apptainer or pyxis"
                )
            raise UserError("environment variable SLURM_NODEID is not set; is the agent running under slurm?")
        if not 0 <= facts.node_id < num_nodes:
            raise UserError(f"SLURM_NODEID={facts.node_id} is outside the step's {num_nodes} nodes")
        gpus = visible_gpus(self.environ, facts.gpus_on_node)
        return NodeContext(
            environment=self.name,
            node_rank=facts.node_id,
            num_nodes=num_nodes,
            hosts=hosts,
            job_id=job_id(self.environ),
            restart_count=facts.restart_count or 0,
            gpus=gpus,
            nvml_gpu_ids=nvml_gpu_ids(facts, gpus),
        )

    def rendezvous(self, ctx: NodeContext, opts: BootstrapOptions) -> Rendezvous:
        run_dir = require_run_dir(opts)
        secret = resolve_secret(run_dir, self.environ)
        if opts.endpoint:
            host, port = parse_endpoint(opts.endpoint)
            check_resolves(host)
            master = interface_address(opts.interface) if opts.interface and ctx.is_coordinator else host
            listener = listen("", port) if ctx.is_coordinator else None
            return Rendezvous(host, port, secret, run_dir, master, listener)
        path = coordinator_file(run_dir, ctx.job_id, ctx.restart_count)
        if not ctx.is_coordinator:
            host, port = wait_for_coordinator(path, opts.timeout)
            return Rendezvous(host, port, secret, run_dir, host)
        try:
            address = coordinator_address(ctx.host, opts.interface)
            listener = listen("", opts.port or 0)
        except UserError as e:
            publish_coordinator(path, {"error": str(e), "node": ctx.host})
            raise
        port = listener.getsockname()[1]
        publish_coordinator(path, {"host": address, "port": port, "node": ctx.host, "pid": os.getpid()})
        return Rendezvous(address, port, secret, run_dir, address, listener)


def coordinator_file(run_dir: RunDir, job_id: str | None, restart_count: int) -> Path:
    """Where group rank 0 publishes the coordinator's address for one allocation (job id + restart count)."""
    return run_dir.path / f"coordinator-{job_id or 'nojob'}-{restart_count}.json"


def check_resolves(host: str) -> None:
    """:class:`UserError` when ``host`` is a name that does not exist (a lookup that may succeed later,
    EAI_AGAIN, passes: the connection is retried)."""
    try:
        socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as e:
        if e.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            raise UserError(
                f"the rendezvous host {host!r} does not resolve ({e.strerror}); give an address or a "
                "name in DNS with --rdzv-endpoint, or leave it out (the agents then read the coordinator's "
                "address from the run directory)"
            ) from None


def coordinator_address(node: str, interface: str | None) -> str:
    """The address this (group rank 0) node's coordinator is reached at: ``--rdzv-interface``'s, else
    what the node's own name resolves to, else a routable address of this host (names not in DNS)."""
    if interface:
        return interface_address(interface)
    with contextlib.suppress(OSError, UnicodeError):
        return socket.gethostbyname(node)
    return routable_address(None)


def publish_coordinator(path: Path, record: dict[str, object]) -> None:
    """Write the coordinator's address (or its start-up error) for the other agents, atomically."""
    try:
        write_json_atomic(path, {**record, "ts": time.time()})
    except OSError as e:
        raise UserError(f"cannot write {path} ({e.strerror}); the run directory must be writable") from None


def wait_for_coordinator(path: Path, timeout: float) -> tuple[str, int]:
    """The coordinator's ``(address, port)`` from its file, waiting up to ``timeout`` s; :class:`UserError`
    when the coordinator published an error or never published (the run directory must be shared)."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            record = json.loads(path.read_text())
            if "error" in record:
                raise UserError(
                    f"the coordinator on {record.get('node', 'node 0')} did not start: {record['error']}"
                )
            return str(record["host"]), int(record["port"])
        if time.monotonic() >= deadline:
            raise UserError(
                f"the coordinator's address {path} did not appear within {timeout:g} s; the run directory "
                "must be shared by every node, and group rank 0's agent must have started"
            )
        time.sleep(ADDRESS_POLL_S)
