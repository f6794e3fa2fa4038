"""The lost-time ledger under the local checkpoint tier against the unchanged script's own log (issue 27,
item 8): ``hpcelastic run --local-tier`` of ``examples/reference_train.py --plain`` (no hpcelastic calls, a
``torch.save`` every 5 steps of 0.1 s) on 2 local nodes, rank 1 SIGKILLed once. Its rank 0 logs the step the
restarted round resumed from (``resuming from ... at step N``; nothing: from step 0)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hpcelastic.record.ledger import build_ledger
from hpcelastic.rundir import RunDir
from tests.faults.test_checkpoint_tier_local import start_agents, tier_run
from tests.slurm_utils import TRAIN

pytestmark = [pytest.mark.slow]
STEP_S = 0.1


@pytest.mark.parametrize("crash", [22, 3], ids=["resumed-step-20", "restored-nothing"])
def test_redone_work_is_what_the_script_s_log_proves(tmp_path: Path, crash: int) -> None:
    spec = tier_run(
        tmp_path, f"/dev/shm/hpce-ledger-{tmp_path.name}-{{node}}", 2, 2,
        (
            str(TRAIN), "--plain", "--ckpt-dir", "{checkpoint_dir}", "--steps", "30",
            "--step-time", str(STEP_S), "--out", str(tmp_path / "out"),
            "--fault", "sigkill", "--fault-rank", "1", "--fault-step", str(crash),
        ),
    )  # fmt: skip
    run_dir, agents = start_agents(spec)
    assert [a.wait(timeout=240) for a in agents] == [0, 0]
    rank0 = RunDir(run_dir.path).rank_log_path(0, 0).read_text()
    found = re.search(r"resuming from \S+/(step-\d+\.pt) at step (\d+)", rank0)
    resumed, name = (int(found.group(2)), found.group(1)) if found else (0, None)
    # the SIGKILL's incident (a later one may follow: a rank that loses its peer at the end of the run)
    inc = build_ledger(RunDir(run_dir.path).events()).incidents[0]
    assert "SIGKILL" in inc.cause and inc.unknown_s == 0
    redone_steps = crash - resumed  # steps resumed..crash-1 done twice, and part of the step in flight
    if name is None:
        # from scratch: all of round 0 since its (estimated: no heartbeats) first step, its start-up included
        assert (crash, inc.redone_source, inc.resumed_from) == (3, "tier_restored", "nothing")
        assert "redone_work_s" in inc.estimated and inc.redone_work_s > redone_steps * STEP_S
        return
    assert (resumed, inc.redone_source, inc.resumed_from) == (20, "checkpoint_opened", name)
    # each step took 0.1 s (the sleep) plus its compute and, every 5 steps, a save; the failure is dated when
    # the agent saw the exit; the tier knows a save complete up to a scan (0.5 s) later than its file's mtime
    assert redone_steps * STEP_S - 0.05 < inc.redone_work_s < redone_steps * STEP_S + 0.6, inc
