"""Issue 27's differential under the testbed's node deaths for every layout of
tests/faults/test_tier_differential.py: each layout's unchanged script submitted twice (without the tier and
with ``--local-checkpoint-dir``) with ``--nodes 2 --spare-nodes 1``, a node killed whole inside a save (the
spare takes its place), then the node holding rank 0 (the batch host) killed whole inside a later save (a
requeue); the harness and its checks are tests/slurm/tier_differential_slurm.py. ``--at-once`` layouts' pairs
run at the same time on an instance of this bench's own (``tdbench``, 10 nodes a pair). Writes the
``tier_differential_slurm`` section of bench/RESULTS.md (about 5 minutes a batch).

    python bench/tier_differential_slurm.py [--at-once 3] [--layouts dcp-async,hf-trainer]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._results import machine_line, update_section  # noqa: E402
from tests.faults.test_tier_differential import LAYOUTS  # noqa: E402
from tests.faults.tier_differential import Layout  # noqa: E402
from tests.slurm.tier_differential_slurm import SlurmOutcome, check, run_pairs, settings  # noqa: E402
from tests.testbed import Testbed, own_instance  # noqa: E402

SECTION = "tier_differential_slurm"
NAME, INDEX = "tdbench", 53
#: Three pairs at once took up to 420 s on two loaded cores.
TIMEOUT_S = 720
TITLE = "## Checkpoint tier differential under node deaths on the testbed (bench/tier_differential_slurm.py)"
EXPLAIN = """\
Each layout's unchanged script (tests/scripts/tier_libs) submitted twice at once, without the tier and with
`--local-checkpoint-dir /dev/shm/...`, `--nodes 2 --spare-nodes 1 --nproc-per-node 2`, 20 steps, a save
every 5: rank 0 stands still inside the save of step 10 and the node of ranks 2-3 is killed whole (the spare
takes its place), then inside the save of step 15 and rank 0's node, the batch host, is killed whole (a
requeue); `torch.save` of one file has no point inside its save, so before steps 12 and 17. Resumed: rank
0's resume step of each round (attempt 0's two rounds, then attempt 1's). Result: `ok` when, with the tier,
every round resumed no older, every rank of a round from one step, the final model is the same, the
checkpoint directory holds a complete checkpoint as new, and Slurm shows COMPLETED after one requeue on
nodes without a killed one; else the first check that failed (tests/slurm/tier_differential_slurm.py)."""
HEAD = (
    "| layout | resumed without | resumed with | same final model | JobState without / with "
    "| Restarts without / with | seconds without / with | result |",
    "|---|---|---|---|---|---|---|---|",
)


def commit() -> str:
    """The commit the numbers are of: this tree's (a copy without git: the ``COMMIT`` file beside it)."""
    proc = subprocess.run(
        ["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True
    )
    if proc.returncode == 0:
        return proc.stdout.strip()
    marker = REPO / "COMMIT"
    return marker.read_text().strip() if marker.exists() else "unknown"


def verdict(tb: Testbed, layout: Layout, without: SlurmOutcome, with_tier: SlurmOutcome) -> str:
    """``ok``, or the first line of the check that failed."""
    try:
        check(tb, layout, without, with_tier)
    except AssertionError as e:
        return str(e).splitlines()[0]
    return "ok"


def row(name: str, without: SlurmOutcome, with_tier: SlurmOutcome, result: str) -> str:
    def steps(o: SlurmOutcome) -> str:
        return ", ".join(map(str, o.resumed)) or "-"

    same = "yes" if without.digest is not None and without.digest == with_tier.digest else "no"
    restarts = f"{without.record.get('Restarts', '?')} / {with_tier.record.get('Restarts', '?')}"
    states = f"{without.record.get('JobState', '?')} / {with_tier.record.get('JobState', '?')}"
    seconds = f"{without.seconds:.0f} / {with_tier.seconds:.0f}"
    return (
        f"| {name} | {steps(without)} | {steps(with_tier)} | {same} | {states} | {restarts} | {seconds} "
        f"| {result} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--at-once", type=int, default=3, help="layouts whose pairs run at the same time")
    parser.add_argument("--layouts", default="", help="comma-separated layout names (default: all)")
    args = parser.parse_args()
    wanted = [n for n in args.layouts.split(",") if n]
    unknown = sorted(set(wanted) - {lay.name for lay in LAYOUTS})
    if unknown:
        sys.exit(f"bench/tier_differential_slurm.py: unknown layout {unknown[0]!r}")
    layouts = [lay for lay in LAYOUTS if not wanted or lay.name in wanted]
    root = Path(tempfile.mkdtemp(prefix="hpcelastic-tierdiff-"))
    rows: list[str] = []
    started = time.monotonic()
    with own_instance(NAME, settings(INDEX, min(args.at_once, len(layouts)))) as tb:
        for i in range(0, len(layouts), args.at_once):
            batch = layouts[i : i + args.at_once]
            try:
                outcomes = run_pairs(tb, root / f"batch-{i}", batch, timeout=TIMEOUT_S)
            except AssertionError as e:  # processes left behind: the batch's outcomes are not trusted
                rows += [f"| {lay.name} | | | | | | | {str(e).splitlines()[0]} |" for lay in batch]
                continue
            for lay in batch:
                without, with_tier = outcomes[lay.name]
                rows.append(row(lay.name, without, with_tier, verdict(tb, lay, without, with_tier)))
                print(rows[-1], flush=True)
    took = (
        f" Code {commit()}; {len(layouts)} layouts, {args.at_once} pairs at once, "
        f"{time.monotonic() - started:.0f} s in all."
    )
    md = "\n".join([TITLE, "", machine_line() + took, EXPLAIN, "", *HEAD, *rows])
    update_section(SECTION, md)
    print(md)
    return 0 if all(r.endswith("| ok |") for r in rows) else 1


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("bench/tier_differential_slurm.py: run as root (it brings a testbed instance up)")
    sys.exit(main())
