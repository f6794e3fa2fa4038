"""The environment interface: where an agent runs and how the agents of one job find each other.

One small class per environment (Slurm step, MPI job, local ``hpcelastic run``), each in its own
file, each with a ``detect()`` classmethod that looks only at environment variables.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import socket
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from hpcelastic.errors import UserError
from hpcelastic.rundir import RunDir


@dataclass(frozen=True)
class NodeContext:
    """What one agent knows about its place in the job before any network traffic."""

    environment: str
    node_rank: int
    num_nodes: int
    hosts: tuple[str, ...]
    job_id: str | None
    restart_count: int
    gpus: tuple[str, ...] = ()  # as CUDA_VISIBLE_DEVICES names them (what workers are given)
    nvml_gpu_ids: tuple[str, ...] = ()  # the same GPUs as NVML numbers them (health checks); gpus if unset

    def __post_init__(self) -> None:
        if not self.nvml_gpu_ids:
            object.__setattr__(self, "nvml_gpu_ids", self.gpus)

    @property
    def host(self) -> str:
        """This node's name as the job's node list spells it."""
        return self.hosts[self.node_rank]

    @property
    def is_coordinator(self) -> bool:
        """Group rank 0 hosts the coordinator."""
        return self.node_rank == 0


@dataclass(frozen=True)
class BootstrapOptions:
    """The agent's rendezvous flags, as given on its command line."""

    run_dir: Path | None = None
    endpoint: str | None = None
    port: int | None = None
    interface: str | None = None
    timeout: float = 300.0


@dataclass
class Rendezvous:
    """How this agent reaches the coordinator, and (on group rank 0) the socket it serves on."""

    host: str
    port: int
    secret: str
    run_dir: RunDir
    master_addr: str
    listener: socket.socket | None = field(default=None, repr=False)


class Environment(ABC):
    """One kind of place an agent can run in."""

    name: ClassVar[str]

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self.environ: Mapping[str, str] = os.environ if environ is None else environ

    @classmethod
    @abstractmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        """True when ``environ`` looks like this environment."""

    @abstractmethod
    def context(self) -> NodeContext:
        """This node's rank, the job's nodes, job id, restart count and visible GPUs."""

    @abstractmethod
    def rendezvous(self, ctx: NodeContext, opts: BootstrapOptions) -> Rendezvous:
        """Find the coordinator (group rank 0 also opens its listening socket)."""

    def worker_environ(self) -> dict[str, str]:
        """The environment this node's workers start from: the agent's, less its launcher's variables."""
        return worker_environ(self.environ)

    def _int(self, name: str, default: int | None = None) -> int:
        value = self.environ.get(name)
        if value is None or value == "":
            if default is None:
                raise UserError(
                    f"environment variable {name} is not set; is the agent running under {self.name}?"
                )
            return default
        try:
            return int(value)
        except ValueError:
            raise UserError(f"environment variable {name}={value!r} is not an integer") from None


def visible_gpus(environ: Mapping[str, str], count: int | None = None) -> tuple[str, ...]:
    """GPU ids visible to this process: ``CUDA_VISIBLE_DEVICES``, else ``0..count-1``, else none."""
    cvd = environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        ids = tuple(x.strip() for x in cvd.split(",") if x.strip())
        return () if ids in ((), ("NoDevFiles",), ("-1",)) else ids
    return tuple(str(i) for i in range(count or 0))


# Variables that place the agent itself: an MPI launcher's rank and wire-up (Open MPI and PMIx;
# MPICH's Hydra and PMI, including its node-local rank) and `hpcelastic run`'s own. A worker that
# inherited them and used MPI itself would pose as the agent's rank.
AGENT_ONLY_VARIABLES = (
    "OMPI_",
    "PMIX_",
    "PMI_",
    "HYDRA_",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
    "HPCELASTIC_LOCAL_",
    "HPCELASTIC_COORDINATOR_",
)


def worker_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without the variables of :data:`AGENT_ONLY_VARIABLES` (names starting so)."""
    return {k: v for k, v in environ.items() if not k.startswith(AGENT_ONLY_VARIABLES)}


_ENDPOINT = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9_.-]+)):(?P<port>[0-9]{1,5})$")


def parse_endpoint(text: str) -> tuple[str, int]:
    """Parse ``HOST:PORT`` (or ``[v6]:PORT``); :class:`UserError` naming the problem otherwise."""
    m = _ENDPOINT.match(text.strip())
    if not m or not 0 < int(m["port"]) < 65536:
        raise UserError(f"cannot parse the rendezvous endpoint {text!r}; give HOST:PORT, e.g. node001:29400")
    return (m["v6"] or m["host"]), int(m["port"])


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name``; :class:`UserError` if it has none."""
    import psutil

    addrs = psutil.net_if_addrs()
    if name not in addrs:
        raise UserError(f"network interface {name!r} does not exist here; known: {', '.join(sorted(addrs))}")
    for a in addrs[name]:
        if a.family == socket.AF_INET:
            return a.address
    raise UserError(f"network interface {name!r} has no IPv4 address; pick another with --rdzv-interface")


def routable_address(interface: str | None) -> str:
    """An address other hosts can reach this host on: the interface's, else a non-loopback one."""
    if interface:
        return interface_address(interface)
    with contextlib.suppress(OSError):
        addr = socket.gethostbyname(socket.gethostname())
        if not addr.startswith("127."):
            return addr
    import psutil

    for name, addrs in sorted(psutil.net_if_addrs().items()):
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127.") and name != "lo":
                return a.address
    return "127.0.0.1"


def listen(host: str, port: int, backlog: int = 4096) -> socket.socket:
    """A listening TCP socket (``SO_REUSEADDR``) on ``host:port``; port 0 picks a free one, race free.

    The backlog holds a burst of thousands of agents connecting at once (the kernel caps it at
    ``net.core.somaxconn``).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UserError(
                f"cannot listen on {host or '*'}:{port} for the coordinator: another program holds the port; "
                "leave out --rdzv-port (the coordinator then takes a free port) or pick another"
            ) from None
        raise UserError(
            f"cannot listen on {host or '*'}:{port} for the coordinator ({e.strerror}); "
            "pick a port with --rdzv-port"
        ) from None
    sock.listen(backlog)
    sock.set_inheritable(False)
    return sock


def resolve_secret(run_dir: RunDir | None, environ: Mapping[str, str]) -> str:
    """The job secret from ``$HPCELASTIC_SECRET`` or ``<run>/secret``; :class:`UserError` if neither."""
    value = environ.get("HPCELASTIC_SECRET", "").strip()
    if value:
        return value
    if run_dir is None:
        raise UserError("no job secret: set HPCELASTIC_SECRET or pass --run-dir with a secret file")
    if not run_dir.secret_path.exists():
        raise UserError(
            f"the job secret {run_dir.secret_path} is missing; submit with `hpcelastic submit` or create it "
            "(python -c 'from hpcelastic.rundir import RunDir; RunDir(\"RUN\").create_secret()')"
        )
    return run_dir.read_secret()


def require_run_dir(opts: BootstrapOptions) -> RunDir:
    """The run directory given with --run-dir, which must exist."""
    if opts.run_dir is None:
        raise UserError("--run-dir is required here; pass the run directory `hpcelastic submit` created")
    rd = RunDir(opts.run_dir)
    if not rd.path.is_dir():
        raise UserError(f"run directory {rd.path} does not exist; pass the one `hpcelastic submit` created")
    return rd
