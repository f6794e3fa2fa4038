"""A slow node on the Slurm testbed, through ``hpcelastic submit --nodes 2 --spare-nodes 1`` (issue 28), on
an instance of this module's own (``slownode``: 3 nodes on 127.0.44.x).

The unchanged DDP script (``tests/faults/slow_train.py``: plain torch, its own ``torch.save`` checkpoints, or
DCP's (``torch.distributed.checkpoint``, a directory every rank writes into), two workers a node) runs on the
first two nodes; once the job's pace is known, the second node's workers are slowed the way the kernel slows
a node (a cgroup v1 CPU quota on their processes: a quarter of the CPU they used, at most 3 %). The
coordinator names that node (kind compute), and right after a checkpoint the node
leaves and the spare takes its place: the job completes inside its allocation (Slurm's view: COMPLETED,
Restarts 0, all three nodes in its NodeList), with the fault-free model, the slow node among the attempt's bad
nodes and the slow time in the ledger. With ``--slow-action exclude`` and no spare the node stays until the
job is stopped and requeued: Slurm's record of the requeued job then excludes it (ExcNodeList), and the job
completes on the two other nodes (Restarts 1) with the fault-free model.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from hpcelastic.jobs.slurm import ENDED_STATES, parse_scontrol_record
from tests.slow_job import QUOTA, SLOW_AFTER_STEP, reference_digest, resumed_steps, train_args
from tests.slurm_utils import events, named, status_json, submit_argv
from tests.testbed import Testbed, own_instance

NAME = "slownode"
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.xdist_group(name=NAME)]
STEPS = 900
#: The slowed workers' quota as a share of the CPU they used: their compute takes about 4 times as long.
USED_SHARE = 0.25


@pytest.fixture(scope="module")
def tb() -> Iterator[Testbed]:
    with own_instance(NAME, {"index": "44", "nodes": "3", "slurmd_timeout": "10"}) as inst:
        yield inst


def _record(tb: Testbed, job: str) -> dict[str, str]:
    out = tb.slurm("scontrol", "show", "job", "-o", job, check=False)
    return parse_scontrol_record(out.splitlines()[0]) if out.strip() else {}


def _submit(
    tb: Testbed, tmp_path: Path, action: str = "swap", spares: int = 1, dcp: bool = False
) -> tuple[str, Path, Path]:
    """The unchanged script on two nodes and ``spares`` (``dcp``: its checkpoints through DCP); its job id,
    run and checkpoint directories."""
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    argv = submit_argv(run) + ["--time", "15", "--nodes", "2", "--spare-nodes", str(spares)]
    argv += ["--nproc-per-node", "2", "--checkpoint-dir", str(ckpt), "--slow-action", action]
    argv += train_args(tmp_path, ckpt, STEPS, dcp=dcp)
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=tb.slurm_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    return str(json.loads(proc.stdout)["job_id"]), run, ckpt


def _wait(tb: Testbed, job: str, what: str, ready: object, deadline: float) -> None:
    """Until ``ready()``; the job must not end before."""
    while not ready():  # type: ignore[operator]
        assert _record(tb, job).get("JobState") not in ENDED_STATES, (what, _record(tb, job))
        assert time.monotonic() < deadline, f"not within the deadline: {what}"
        time.sleep(1)


def _slow_second_node(tb: Testbed, job: str, tmp_path: Path, ckpt: Path, cpu_quota, deadline: float) -> None:  # type: ignore[no-untyped-def]
    """Once the job's pace is known (its checkpoint of step ``SLOW_AFTER_STEP``), a CPU quota on the second
    node's workers (ranks 2 and 3): a share of the CPU each used over 5 s (at most ``QUOTA``, at least the
    kernel's 1 %), so their compute outgrows the steps' padding on a quiet machine as on a loaded one (a
    fixed 3 % slowed a quiet machine's job by only a quarter, and no node was named)."""
    first = ckpt / f"ckpt-{SLOW_AFTER_STEP:06d}"
    _wait(tb, job, f"{first.name}", lambda: first.exists() or first.with_suffix(".pt").exists(), deadline)
    workers = [psutil.Process(int((tmp_path / "pids" / f"rank-{rank}").read_text())) for rank in (2, 3)]
    before = [sum(w.cpu_times()[:2]) for w in workers]
    time.sleep(5)
    for w, used in zip(workers, before, strict=True):
        share = (sum(w.cpu_times()[:2]) - used) / 5 * USED_SHARE
        cpu_quota(w.pid, min(QUOTA, max(0.01, share)))


def _wait_ended(tb: Testbed, job: str, deadline: float) -> dict[str, str]:
    while (rec := _record(tb, job)).get("JobState") not in ENDED_STATES:
        assert time.monotonic() < deadline, rec
        time.sleep(2)
    return rec


@pytest.mark.parametrize("dcp", [False, True], ids=["torch-save", "dcp"])
def test_a_slow_node_is_replaced_by_the_spare_in_the_job(tb: Testbed, tmp_path: Path, cpu_quota, dcp) -> None:  # type: ignore[no-untyped-def]
    job, run, ckpt = _submit(tb, tmp_path, dcp=dcp)
    deadline = time.monotonic() + 900
    _slow_second_node(tb, job, tmp_path, ckpt, cpu_quota, deadline)
    rec = _wait_ended(tb, job, deadline)
    evs = events(run)
    rounds = named(evs, "rendezvous")
    slow_node = rounds[0]["hosts"][1]
    slow = named(evs, "node_slow")
    swaps = [e for e in slow if e["action"] == "swap"]
    assert rec["JobState"] == "COMPLETED", (rec, slow)
    assert rec["Restarts"] == "0", rec  # replaced inside the allocation: no requeue
    assert len(tb.slurm("scontrol", "show", "hostnames", rec["NodeList"]).split()) == 3, rec
    assert swaps and swaps[0]["node"] == slow_node and swaps[0]["kind"] == "compute", slow
    assert {e["node"] for e in slow} == {slow_node}, slow  # never a healthy node
    assert rounds[-1]["hosts"] == [rounds[0]["hosts"][0], swaps[0]["spare"]], rounds
    ended = named(evs, "attempt_ended")
    assert slow_node in ended[-1]["bad_nodes"], ended  # a requeue would exclude it
    resumed = resumed_steps(tmp_path)
    assert len(resumed) == 1 and resumed[0] >= SLOW_AFTER_STEP, resumed  # the swap's restart
    assert (tmp_path / "final.sha256").read_text() == reference_digest(STEPS, resumed=resumed, dcp=dcp)
    assert status_json(str(run))["ledger"]["badput_by_cause"].get("slow", 0) > 10


def test_a_slow_node_is_excluded_when_the_job_is_requeued(tb: Testbed, tmp_path: Path, cpu_quota) -> None:  # type: ignore[no-untyped-def]
    """``--slow-action exclude`` and no spare: the slow node is kept while the job runs (no swap); when the
    job is stopped and requeued (the stop signal, as a preemption sends it), Slurm's record of the requeued
    job excludes it, the job resumes on the two other nodes and completes with the fault-free model."""
    job, run, ckpt = _submit(tb, tmp_path, action="exclude", spares=0)
    deadline = time.monotonic() + 900
    _slow_second_node(tb, job, tmp_path, ckpt, cpu_quota, deadline)
    ordered = lambda: [e for e in named(events(run), "node_slow") if e["action"] == "exclude"]  # noqa: E731
    _wait(tb, job, "the exclusion ordered", ordered, deadline)
    slow_node = named(events(run), "rendezvous")[0]["hosts"][1]
    assert [e["node"] for e in ordered()] == [slow_node], ordered()
    tb.slurm("scancel", "--signal=USR2", "--batch", job)
    _wait(tb, job, "the requeued attempt", lambda: len(named(events(run), "attempt_started")) > 1, deadline)
    rec = _record(tb, job)
    assert slow_node in tb.slurm("scontrol", "show", "hostnames", rec["ExcNodeList"]).split(), rec
    rec = _wait_ended(tb, job, deadline)
    evs = events(run)
    assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "1", rec
    assert slow_node not in tb.slurm("scontrol", "show", "hostnames", rec["NodeList"]).split(), rec
    assert not [e for e in named(evs, "node_slow") if e["action"] == "swap"], named(evs, "node_slow")
    assert [e["reason"] for e in named(evs, "attempt_ended")] == ["preempted", "succeeded"]
    resumed = resumed_steps(tmp_path)
    assert len(resumed) == 1 and resumed[0] >= SLOW_AFTER_STEP, resumed  # the requeue's resume
    assert (tmp_path / "final.sha256").read_text() == reference_digest(STEPS, resumed=resumed)
