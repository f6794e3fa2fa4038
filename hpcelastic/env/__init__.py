"""Where the agent runs: Slurm step, MPI job or this machine, behind one interface.

``detect_environment()`` picks the first environment whose ``detect()`` accepts the process's
variables; ``HPCELASTIC_ENVIRONMENT=slurm|mpi|local`` forces one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from hpcelastic.env.base import BootstrapOptions, Environment, NodeContext, Rendezvous
from hpcelastic.env.local import LocalEnvironment
from hpcelastic.env.mpi import MPIEnvironment
from hpcelastic.env.slurm import SlurmEnvironment
from hpcelastic.errors import UserError

__all__ = [
    "BootstrapOptions",
    "Environment",
    "LocalEnvironment",
    "MPIEnvironment",
    "NodeContext",
    "Rendezvous",
    "SlurmEnvironment",
    "detect_environment",
]

# Order matters: `hpcelastic run` agents may inherit Slurm variables from a login shell inside an
# allocation, and mpirun may run inside one.
ENVIRONMENTS: tuple[type[Environment], ...] = (LocalEnvironment, MPIEnvironment, SlurmEnvironment)


def detect_environment(environ: Mapping[str, str] | None = None) -> Environment:
    """The environment this process runs in; a single local node when nothing else matches."""
    env = os.environ if environ is None else environ
    forced = env.get("HPCELASTIC_ENVIRONMENT")
    if forced:
        for cls in ENVIRONMENTS:
            if cls.name == forced:
                return cls(env)
        names = ", ".join(c.name for c in ENVIRONMENTS)
        raise UserError(f"HPCELASTIC_ENVIRONMENT={forced!r} is not one of {names}")
    for cls in ENVIRONMENTS:
        if cls.detect(env):
            return cls(env)
    return LocalEnvironment(env)
