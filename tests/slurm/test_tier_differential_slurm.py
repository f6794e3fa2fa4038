"""Issue 27 on the testbed: with the local checkpoint tier an unchanged script sees at least what it sees
without it when a node dies whole inside a save (the spare takes its place) and, in a later save, the node
holding rank 0 dies whole (the batch host: a requeue). The harness is tests/slurm/tier_differential_slurm.py.
Two layouts run here, both pairs at once (4.5 minutes on two loaded cores; one pair alone takes 2.5 to 3.5)
on an instance of this module's own (``tierdiff``: 10 nodes a pair on 127.0.52.x, SlurmdTimeout 10 s);
bench/tier_differential_slurm.py runs every layout.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.faults.test_tier_differential import LAYOUTS
from tests.faults.tier_differential import Layout
from tests.slurm.tier_differential_slurm import SlurmOutcome, check, run_pairs, settings
from tests.testbed import Testbed, own_instance

NAME = "tierdiff"
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.xdist_group(name=NAME)]

#: Every rank's DCP shards in directories below the top of an Accelerate checkpoint; files written seconds
#: apart by rank 0 alone (the other node holds no part of its own): their pairs at once.
CI_LAYOUTS = [lay for lay in LAYOUTS if lay.name in ("accelerate-fsdp-sharded", "torch-save-two-files")]


@pytest.fixture(scope="module")
def tb() -> Iterator[Testbed]:
    with own_instance(NAME, settings(52, len(CI_LAYOUTS))) as inst:
        yield inst


@pytest.fixture(scope="module")
def outcomes(
    tb: Testbed, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[SlurmOutcome, SlurmOutcome]]:
    return run_pairs(tb, tmp_path_factory.mktemp("tierdiff"), CI_LAYOUTS)


@pytest.mark.parametrize("layout", CI_LAYOUTS, ids=lambda lay: lay.name)
def test_after_a_node_death_in_a_save_and_a_requeue_the_tier_resumes_no_older(
    tb: Testbed, outcomes: dict[str, tuple[SlurmOutcome, SlurmOutcome]], layout: Layout
) -> None:
    check(tb, layout, *outcomes[layout.name])
