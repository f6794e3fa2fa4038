"""What the cluster says about itself, gathered once for the rules (:mod:`hpcelastic.sitecheck.rules`):
``scontrol show config``, ``show partition``, ``show node``, ``sbatch --version`` and, where an accounting
database answers, ``sacctmgr``'s accounts and QOS. The only module of the check that runs commands."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hpcelastic.jobs import slurm_output
from hpcelastic.jobs.slurm import SlurmError, release, run_slurm


@dataclass(frozen=True)
class ClusterFacts:
    """The cluster as its Slurm commands describe it."""

    release: tuple[int, int] | None
    config: Mapping[str, str]  # scontrol show config: key -> value text ("60 sec")
    partitions: Mapping[str, Mapping[str, str]]  # PartitionName -> its record
    nodes: Mapping[str, Mapping[str, str]]  # NodeName -> its record
    accounts: frozenset[str] | None = None  # None: sacctmgr did not answer (no accounting database)
    qos: frozenset[str] | None = None

    def nodes_of(self, partition: str | None) -> dict[str, Mapping[str, str]]:
        """The nodes of ``partition`` (by their ``Partitions``)."""
        return {
            n: r
            for n, r in self.nodes.items()
            if partition in (p.strip() for p in r.get("Partitions", "").split(","))
        }

    def default_partition(self) -> str | None:
        return next((p for p, r in self.partitions.items() if r.get("Default") == "YES"), None)


def _names(argv: list[str]) -> frozenset[str] | None:
    """The first column of ``sacctmgr -n -P`` output, lowercased (Slurm's account and QOS names are
    case-insensitive); None when sacctmgr does not answer."""
    try:
        out = run_slurm(argv, timeout=20)
    except SlurmError:
        return None
    return frozenset(line.split("|", 1)[0].strip().lower() for line in out.splitlines() if line.strip())


def gather() -> ClusterFacts:
    """Ask this host's Slurm (raises :class:`SlurmError` when slurmctld does not answer)."""
    config = slurm_output.parse_config(run_slurm(["scontrol", "show", "config"]))
    partitions = slurm_output.parse_records(run_slurm(["scontrol", "show", "partition", "-o"]))
    nodes = slurm_output.parse_records(run_slurm(["scontrol", "show", "node", "-o"]))
    return ClusterFacts(
        release=release(),
        config=config,
        partitions={p["PartitionName"]: p for p in partitions if "PartitionName" in p},
        nodes={n["NodeName"]: n for n in nodes if "NodeName" in n},
        accounts=_names(["sacctmgr", "-n", "-P", "show", "account", "format=account"]),
        qos=_names(["sacctmgr", "-n", "-P", "show", "qos", "format=name"]),
    )
