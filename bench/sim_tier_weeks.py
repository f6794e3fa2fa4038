"""Simulated weeks with the checkpoint tier (hpcelastic/sim/tier.py): invariant violations, this tree's book
and node against an older tree's.

Runs seeds 0..N-1 through ``python -m hpcelastic.sim.tier --json`` in subprocesses, once with this tree and
once with the tree of ``--old`` (a directory, or a commit checked out as a git worktree; default 055b1be,
the code before issue 27), into which this tree's ``hpcelastic/sim`` is copied (the simulation drives
either version's TierBook and LocalTier). Writes the ``sim_tier_weeks`` section of bench/RESULTS.md.

    python bench/sim_tier_weeks.py [--weeks 10000] [--old 055b1be | --old /tmp/before055]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _sim_compare import compare, violation_rows  # noqa: E402

MODULE = "hpcelastic.sim.tier"
SECTION = "sim_tier_weeks"
DESCRIPTION = " ".join(
    (
        "each week is one job over up to 4 attempts, driving the tree's own TierBook and LocalTier",
        "(its messages, drops and restores; the files, copies and scans modelled): saves (DCP, a file per",
        "rank, rank 0 alone) torn by a round's end, messages delayed (each connection in order), copies to",
        "peers failing (peer gone, budget, reset), persists failing (filesystem full) or dying half-way,",
        "node deaths, worker crashes, spares, stops that flush, requeues seeded from the published",
        "checkpoint. Invariants (hpcelastic/sim/tier_invariants.py), checked at every step: `restore_holds`",
        "(a plan's sources and a node's restore hold the part whole), `published_whole` (a committed,",
        "published checkpoint is complete in every part), `last_copy_kept` (no deletion takes the last",
        "whole copy of the newest restorable checkpoint), `newest_restored` (no round restores older than",
        "the newest checkpoint restorable in fact).",
    )
)
INVARIANTS = ("restore_holds", "published_whole", "last_copy_kept", "newest_restored")


def table(by: dict[str, list[dict[str, Any]]]) -> list[str]:
    out = violation_rows(by, INVARIANTS)
    for tier in ("local", "peer", "persisted", "none"):
        cells = [str(sum(r["restores"].get(tier, 0) for r in rows)) for rows in by.values()]
        out.append(f"| node restores from `{tier}` | " + " | ".join(cells) + " |")
    return out


def main() -> int:
    return compare(
        module=MODULE,
        section=SECTION,
        title="Simulated weeks with the checkpoint tier (bench/sim_tier_weeks.py)",
        description=DESCRIPTION,
        default_old="055b1be",
        count="nodes",
        table=table,
    )


if __name__ == "__main__":
    sys.exit(main())
