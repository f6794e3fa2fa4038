"""An MPI job (``mpirun -np N hpcelastic agent ...``), one agent per rank.

Detected from the launcher's environment variables before mpi4py is imported; mpi4py is then used
once, for the bootstrap: rank 0 binds port 0 (no race), and broadcasts its address, the port, the
job secret and the run directory. Only byte buffers of JSON cross MPI: mpi4py's lower-case methods
(``bcast``, ``allgather``) would pickle, and the agents never unpickle anything. The workers'
environment (:meth:`~hpcelastic.env.base.Environment.worker_environ`) is cleaned of the launcher's
variables, Open MPI's and MPICH's, so a worker that uses MPI itself does not pose as the agent's
rank. Start it with ``mpirun --map-by ppr:1:node --bind-to none``: one agent per node, not pinned
to one core.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import time
from collections.abc import Mapping
from typing import Any

from hpcelastic.env import slurm
from hpcelastic.env.base import (
    BootstrapOptions,
    Environment,
    NodeContext,
    Rendezvous,
    listen,
    resolve_secret,
    routable_address,
    visible_gpus,
)
from hpcelastic.errors import UserError
from hpcelastic.rundir import RunDir


def _comm() -> Any:
    try:
        from mpi4py import MPI
    except ImportError:
        raise UserError("running under mpirun needs mpi4py: pip install 'hpcelastic[mpi]'") from None
    return MPI.COMM_WORLD


_LEN = struct.Struct("!I")
HOSTNAME_BYTES = 256  # HOST_NAME_MAX is 64 on Linux; room to spare


def bcast_json(comm: Any, obj: Any, root: int = 0) -> Any:
    """Broadcast a JSON value from ``root`` as raw bytes (length first, then the UTF-8 text)."""
    from mpi4py import MPI

    data = json.dumps(obj).encode() if comm.Get_rank() == root else b""
    size = bytearray(_LEN.pack(len(data)))
    comm.Bcast([size, MPI.BYTE], root=root)
    buf = bytearray(data) if data else bytearray(_LEN.unpack(size)[0])
    comm.Bcast([buf, MPI.BYTE], root=root)
    return json.loads(buf.decode())


def allgather_hostnames(comm: Any, name: str) -> tuple[str, ...]:
    """Every rank's host name, in rank order, gathered as fixed-size byte records."""
    from mpi4py import MPI

    mine = name.encode()[:HOSTNAME_BYTES].ljust(HOSTNAME_BYTES, b"\0")
    out = bytearray(HOSTNAME_BYTES * comm.Get_size())
    comm.Allgather([bytearray(mine), MPI.BYTE], [out, MPI.BYTE])
    records = (out[i : i + HOSTNAME_BYTES] for i in range(0, len(out), HOSTNAME_BYTES))
    return tuple(bytes(r).rstrip(b"\0").decode(errors="replace") for r in records)


class MPIEnvironment(Environment):
    """Ranks and size from MPI; node names gathered from every rank."""

    name = "mpi"
    _same_host = False

    @classmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        if environ.get("OMPI_COMM_WORLD_SIZE"):
            return True
        # srun --mpi=pmi2 also sets PMI_SIZE: inside a Slurm step the Slurm environment wins.
        return bool(environ.get("PMI_SIZE")) and slurm.variable(environ, "step_id") is None

    def context(self) -> NodeContext:
        comm = _comm()
        hosts = allgather_hostnames(comm, socket.gethostname())
        self._same_host = len(set(hosts)) == 1
        if len(os.sched_getaffinity(0)) == 1 and (os.cpu_count() or 1) > 1:
            print(
                "hpcelastic: mpirun bound this agent (and so its workers) to one CPU; "
                "start it with `mpirun --bind-to none` (Open MPI) so the workers can use the node",
                file=sys.stderr,
            )
        rank, size = comm.Get_rank(), comm.Get_size()
        names = tuple(f"{h}-{i}" if hosts.count(h) > 1 else h for i, h in enumerate(hosts))
        return NodeContext(
            environment=self.name,
            node_rank=rank,
            num_nodes=size,
            hosts=names,
            job_id=slurm.job_id(self.environ),
            restart_count=slurm.restart_count(self.environ),
            gpus=visible_gpus(self.environ),
        )

    def rendezvous(self, ctx: NodeContext, opts: BootstrapOptions) -> Rendezvous:
        comm = _comm()
        payload: dict[str, Any] | None = None
        listener = None
        error: str | None = None
        if ctx.is_coordinator:
            try:
                run_dir = self._rank0_run_dir(opts)
                secret = self._rank0_secret(run_dir)
                addr = (
                    "127.0.0.1"
                    if self._same_host and not opts.interface
                    else routable_address(opts.interface)
                )
                listener = listen("", opts.port or 0)
                payload = {
                    "host": addr,
                    "port": listener.getsockname()[1],
                    "secret": secret,
                    "run_dir": str(run_dir.path),
                }
            except UserError as e:
                error = str(e)
                payload = {"error": error}
        payload = bcast_json(comm, payload, root=0)
        if "error" in payload:
            raise UserError(error or f"MPI rank 0 could not bootstrap the job: {payload['error']}")
        return Rendezvous(
            host=payload["host"],
            port=payload["port"],
            secret=payload["secret"],
            run_dir=RunDir(payload["run_dir"]),
            master_addr=payload["host"],
            listener=listener,
        )

    def _rank0_run_dir(self, opts: BootstrapOptions) -> RunDir:
        if opts.run_dir is not None:
            rd = RunDir(opts.run_dir)
            if not rd.path.is_dir():
                return RunDir.create(rd.path)
            return rd
        stamp = time.strftime("%Y%m%d-%H%M%S")
        return RunDir.create(os.path.join("hpcelastic-runs", f"mpi-{stamp}-{os.getpid()}"))

    def _rank0_secret(self, run_dir: RunDir) -> str:
        if self.environ.get("HPCELASTIC_SECRET") or run_dir.secret_path.exists():
            return resolve_secret(run_dir, self.environ)
        return run_dir.create_secret()
