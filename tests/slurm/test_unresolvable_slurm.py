"""Node names that DNS does not resolve, and a coordinator port taken by another program, on a real
Slurm instance of this module's own (``nodns``: 2 nodes on 127.0.9.x, NodeName kept out of /etc/hosts).

The agents find the coordinator through the address it publishes in the run directory, so the job
trains as anywhere else; a permanent bootstrap error ends the job within seconds, with one line
naming it, and Slurm does not run it again.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcelastic.jobs.slurm import ENDED_STATES, parse_scontrol_record
from tests.slurm_utils import REPO, TRAIN, events, named, reference_digest, train_args, wait_no_leaks
from tests.testbed import Testbed, own_instance

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.xdist_group(name="nodns")]


@pytest.fixture(scope="module")
def tb(slurm_cluster: dict[str, object]) -> Iterator[Testbed]:
    with own_instance("nodns", {"index": "9", "nodes": "2", "unresolvable": "all"}) as inst:
        yield inst


def site(tmp_path: Path, extra: str = "", max_requeues: int = 3) -> str:
    """The testbed site without ``rdzv_interface``: the coordinator must find its own address."""
    text = (REPO / "site_configs" / "testbed.yaml").read_text().replace("rdzv_interface: lo", "")
    text = text.replace("max_requeues: 3", f"max_requeues: {max_requeues}")
    path = tmp_path / "site.yaml"
    path.write_text(text + extra)
    return str(path)


def submit(tb: Testbed, tmp_path: Path, site_file: str) -> tuple[str, Path]:
    run = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "hpcelastic",
        "submit",
        "--json",
        "--site",
        site_file,
        "--run-dir",
        str(run),
    ]
    argv += ["--time", "10", "--nodes", "2", "--gpus-per-node", "2", str(TRAIN), *train_args(30)]
    argv += ["--out", str(tmp_path / "out")]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=tb.slurm_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    return str(json.loads(proc.stdout)["job_id"]), run


def wait_ended(tb: Testbed, job: str, timeout: float) -> tuple[dict[str, str], float]:
    t0 = time.monotonic()
    rec: dict[str, str] = {}
    while time.monotonic() - t0 < timeout:
        out = tb.slurm("scontrol", "show", "job", "-o", job, check=False)
        rec = parse_scontrol_record(out.splitlines()[0]) if out.strip() else {}
        if rec.get("JobState") in ENDED_STATES:
            return rec, time.monotonic() - t0
        time.sleep(0.3)
    raise AssertionError(f"job {job} did not end in {timeout} s: {rec}")


def test_job_trains_where_node_names_do_not_resolve(tb: Testbed, tmp_path: Path) -> None:
    for node in ("nodns1", "nodns2"):
        with pytest.raises(OSError):
            socket.gethostbyname(node)
    job, run = submit(tb, tmp_path, site(tmp_path))
    rec, _ = wait_ended(tb, job, 240)
    assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "0", rec
    assert rec["NodeList"] == "nodns[1-2]", rec
    (rdzv,) = named(events(run), "rendezvous")
    assert rdzv["hosts"] == ["nodns1", "nodns2"] and rdzv["world_size"] == 4
    socket.inet_aton(rdzv["master_addr"])  # an address, not a node name
    published = json.loads(next(run.glob(f"coordinator-{job}-0.json")).read_text())
    assert (published["host"], published["node"]) == (rdzv["master_addr"], "nodns1")
    assert json.loads((tmp_path / "out" / "final.json").read_text())["sha256"] == reference_digest()
    assert not wait_no_leaks(str(run))


def test_coordinator_port_taken_ends_in_seconds_with_one_line(tb: Testbed, tmp_path: Path) -> None:
    """The port is set by the site and held by another program: every agent ends at once with the
    coordinator's line; the attempt ends as a start-up failure and is not requeued although the
    requeue budget (3) is not spent: no requeue loop, no 300 s wait."""
    taken = socket.socket()
    taken.bind(("", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        job, run = submit(tb, tmp_path, site(tmp_path, f"rdzv_port: {port}\n"))
        start = wait_started(tb, job)
        rec, _ = wait_ended(tb, job, 120)
        ended = time.time()
    finally:
        taken.close()
    assert rec["JobState"] == "FAILED" and rec["Restarts"] == "0", rec
    assert ended - start < 30, f"took {ended - start:.0f} s from start to end"
    time.sleep(3)
    again = tb.slurm("scontrol", "show", "job", "-o", job, check=False)
    assert "JobState=FAILED" in again and "Restarts=0" in again, again
    (end,) = named(events(run), "attempt_ended")
    assert end["reason"] == "startup_failure", end
    log = "\n".join(p.read_text() for p in run.glob("slurm-*.out"))
    assert f"cannot listen on *:{port} for the coordinator: another program holds the port" in log, log[
        -3000:
    ]
    assert "the coordinator on nodns1 did not start" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def wait_started(tb: Testbed, job: str) -> float:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        out = tb.slurm("scontrol", "show", "job", "-o", job, check=False)
        rec = parse_scontrol_record(out.splitlines()[0]) if out.strip() else {}
        if rec.get("JobState") not in (None, "PENDING"):
            return time.time()
        time.sleep(0.2)
    raise AssertionError(f"job {job} never started")
