"""Simulated weeks with torchft replica groups (hpcelastic/sim/replicas.py): invariant violations, this tree's
ReplicaJobState and replica ledger against an older tree's.

Runs seeds 0..N-1 through ``python -m hpcelastic.sim.replicas --json`` in subprocesses, once with this tree
and once with the tree of ``--old`` (a directory, or a commit checked out as a git worktree; default fab7191,
the code before issue 31's replica work), into which this tree's ``hpcelastic/sim`` is copied. Writes the
``sim_replica_weeks`` section of bench/RESULTS.md.

    python bench/sim_replica_weeks.py [--weeks 10000] [--old fab7191 | --old /tmp/before]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _sim_compare import compare, violation_rows  # noqa: E402

from hpcelastic.sim.replica_invariants import INVARIANTS  # noqa: E402

MODULE = "hpcelastic.sim.replicas"
SECTION = "sim_replica_weeks"
DESCRIPTION = " ".join(
    (
        "each week is one job of 2-8 replica groups of 1-4 nodes, 0-2 hot spares and --min-replica-groups 1",
        "to all, over attempts (time limits, preemptions, requeues decided by the real policy), driving the",
        "tree's own ReplicaJobState and replica ledger. Faults at 0.05-1.5 per node-day: a rank fails (a",
        "third leave the node unhealthy), a node dies, a node's link is cut (its workers run on until its",
        "lease ends; a third of the cuts are shorter than the detection bound), a switch cuts 2 to a",
        "group's size + 1 consecutive nodes off together, a group's link to the lighthouse is cut (its",
        "quorum fails after 60 s), the coordinator's node dies or is cut off.",
        "Invariants (hpcelastic/sim/replica_invariants.py): `group_isolated` (a group restart never stops",
        "another group's workers), `left_out_not_training` (the ledger never counts a group productive",
        "while its workers are stopped, dead or left out), `fence_holds` (no group round starts while a",
        "lost node's workers of that group live on), `job_wide_once` (below --min-replica-groups the",
        "job-wide path takes over, with one count of the job-wide budget per job-wide restart),",
        "`progress_kept`, `node_evidence`, `time_adds_up`.",
    )
)


def table(by: dict[str, list[dict[str, Any]]]) -> list[str]:
    out = violation_rows(by, INVARIANTS)
    for key, label in (
        ("group_restarts", "group restarts"),
        ("drops", "groups left out"),
        ("job_wide_stops", "job-wide stops"),
        ("attempts", "attempts"),
    ):
        out.append(
            f"| {label} | " + " | ".join(str(sum(r[key] for r in rows)) for rows in by.values()) + " |"
        )
    finished = [str(sum(1 for r in rows if r["outcome"] == "finished")) for rows in by.values()]
    out.append("| jobs finished within the week | " + " | ".join(finished) + " |")
    return out


def main() -> int:
    return compare(
        module=MODULE,
        section=SECTION,
        title="Simulated weeks with torchft replica groups (bench/sim_replica_weeks.py)",
        description=DESCRIPTION,
        default_old="fab7191",
        count="groups",
        table=table,
    )


if __name__ == "__main__":
    sys.exit(main())
