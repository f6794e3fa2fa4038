"""Each worker's share of its node's CPUs: the agent's own CPU affinity, split evenly among the workers.

The batch script gives each agent every CPU the job holds on its node (srun ``--cpus-per-task``; see
docs/ARCHITECTURE.md, "Agent command line"). torchrun would leave every worker on all of them, so the
node's workers and their thread pools contend for the same CPUs. Here local rank ``i`` of ``n`` gets
the ``i``-th of ``n`` contiguous blocks of the agent's CPUs taken in (socket, core, number) order, so
hyperthread siblings stay in one block, and ``OMP_NUM_THREADS`` defaults to the block's size. With
fewer CPUs than workers each worker gets one CPU, reused in turn.

``HPCELASTIC_SPLIT_CPUS=0`` (the site's ``env:`` or ``submit --env``) turns this off: every worker
then runs on all the agent's CPUs, as under torchrun.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

#: Set to ``0`` in the job's environment to leave every worker on all of the agent's CPUs.
SPLIT_VARIABLE = "HPCELASTIC_SPLIT_CPUS"
SYSFS_CPUS = Path("/sys/devices/system/cpu")

Share = tuple[int, ...]


def split(cpus: Sequence[int], n: int) -> list[Share]:
    """``cpus``, in their order, cut into ``n`` contiguous blocks whose sizes differ by one at most
    (the first blocks are the larger); with fewer CPUs than ``n``, one CPU each, reused in turn."""
    if n <= 0 or not cpus:
        return [() for _ in range(max(n, 0))]
    if len(cpus) < n:
        return [(cpus[i % len(cpus)],) for i in range(n)]
    size, extra = divmod(len(cpus), n)
    shares, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        shares.append(tuple(cpus[start:end]))
        start = end
    return shares


def by_core(cpus: Iterable[int], sysfs: Path = SYSFS_CPUS) -> list[int]:
    """``cpus`` ordered by socket, then core, then number, from sysfs (by number where it is unreadable)."""

    def key(cpu: int) -> tuple[int, int, int]:
        topology = sysfs / f"cpu{cpu}" / "topology"
        try:
            socket = int((topology / "physical_package_id").read_text())
            return socket, int((topology / "core_id").read_text()), cpu
        except (OSError, ValueError):
            return -1, cpu, cpu

    return sorted(cpus, key=key)


def enabled(environ: Mapping[str, str]) -> bool:
    """Splitting is on unless the job's environment sets :data:`SPLIT_VARIABLE` to ``0``."""
    return environ.get(SPLIT_VARIABLE, "1").strip() != "0"


def worker_shares(environ: Mapping[str, str], nproc: int) -> list[Share] | None:
    """Each local rank's CPUs, split from this process's affinity; None when splitting is off."""
    if not enabled(environ):
        return None
    return split(by_core(os.sched_getaffinity(0)), nproc)


def apply(share: Share | Sequence[int] | None) -> None:
    """Bind the calling process to ``share`` (nothing when empty); a refusal leaves it as it was (the
    CPUs may have left the node's cgroup since the agent read them)."""
    if share:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, share)
