"""Training in containers on the real testbed: podman (rootful, runc) on a 22.05 instance and Slurm's own
OCI support (``srun --container``, runc) on a 24.11 one, with the image ``scripts/testbed.sh image`` builds
from Debian's packages (no Slurm in it; the host's Python and .venv are mounted, as the site's
``container.mounts`` would mount a software stack).

Each runs a 2-node job of the reference training: a worker is SIGKILLed (restart in the allocation), then
the batch shell gets the stop signal (``scancel --signal=USR2 --batch``): every rank stops at one step, the
agent finds no ``scontrol`` in the image and leaves the decision to ``hpcelastic finalize`` outside, which
requeues; the job completes with the fault-free model. While it trains, each worker is checked from the
host: it runs in the container's root, on its own share of the agent's CPUs, with its own GPU of the step.
Slurm 22.05's OCI mode passes no per-task variables into the container: submitting to it is refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.slurm_utils import (
    CKPT_EVERY,
    REPO,
    TRAIN,
    events,
    named,
    reference_digest,
    status_json,
    submit_argv,
    train_args,
    wait_for_event,
    wait_job_finished,
    wait_no_leaks,
)
from tests.testbed import Testbed, own_instance

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.xdist_group(name="containers")]

IMAGE = "localhost/hpcelastic-testbed:trixie"
ROOTS = Path(os.environ.get("TESTBED_ROOTS", "/var/lib/hpcelastic-testbed-roots"))
BUNDLE = ROOTS / "oci-bundle"
STEPS = 40
#: podman runs on the host's Slurm (22.05); Slurm's OCI mode on 24.11, where the per-task variables
#: reach the container.
INSTANCES = {
    "podman": ("pod", {"index": "33", "nodes": "2", "gpus_per_node": "2"}),
    "oci": ("oci", {"index": "32", "nodes": "2", "gpus_per_node": "2", "slurm": "24.11", "oci": "1"}),
}


def python_mounts() -> list[str]:
    """The host's Python and the repository (with its .venv), read-only: the image's software stack."""
    prefixes = {os.path.realpath(sys.base_prefix), str(REPO)}
    return [f"{p}:{p}:ro" for p in sorted(prefixes)]


def site_file(tmp_path: Path, runtime: str) -> Path:
    """The testbed site with a container section for ``runtime``."""
    image = str(BUNDLE) if runtime == "oci" else IMAGE
    section = {"runtime": runtime, "image": image, "mounts": python_mounts(), "python": sys.executable}
    site = tmp_path / f"site-{runtime}.yaml"
    text = (REPO / "site_configs" / "testbed.yaml").read_text()
    # Cold workers (warm_start: false): their environment (rank, GPU) is readable from the host in
    # /proc/PID/environ, which a warm worker's (forked, its environment set after the fork) is not.
    site.write_text(f"{text}\nwarm_start: false\ncontainer: {json.dumps(section)}\n")
    return site


@pytest.fixture(scope="module")
def image() -> None:
    """podman, the image and the OCI bundle (built once; CI's setup builds them)."""
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "testbed.sh"), "image"], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr


@pytest.fixture(params=list(INSTANCES), scope="module")
def instance(request: pytest.FixtureRequest, image: None) -> Iterator[tuple[str, Testbed]]:
    name, settings = INSTANCES[request.param]
    with own_instance(name, settings) as tb:
        yield request.param, tb


def workers(run: Path) -> list[psutil.Process]:
    """The run's training workers (they carry ``RANK``; agents do not)."""
    found = []
    for p in psutil.process_iter():
        try:
            env = p.environ()
            if env.get("HPCELASTIC_RUN_DIR") == str(run) and "RANK" in env and "python" in p.name():
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def check_workers_in_container(run: Path) -> None:
    """From the host: each worker runs in the container (its own mount namespace, an image without Slurm's
    commands), on its own share of its agent's CPUs,
    with its own one of the step's GPUs (as outside a container)."""
    found = workers(run)
    assert len(found) == 4, [p.environ().get("RANK") for p in found]
    by_node: dict[str, list[tuple[int, set[int], str]]] = {}
    for p in found:
        env = p.environ()
        in_container = os.readlink(f"/proc/{p.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
        assert in_container and not os.path.exists(f"/proc/{p.pid}/root/usr/bin/scontrol")
        cpus = set(p.cpu_affinity())
        by_node.setdefault(env["SLURMD_NODENAME"], []).append(
            (int(env["LOCAL_RANK"]), cpus, env["CUDA_VISIBLE_DEVICES"])
        )
    for node, ranks in by_node.items():
        ranks.sort()
        assert [r[0] for r in ranks] == [0, 1], (node, ranks)
        assert not ranks[0][1] & ranks[1][1], f"{node}: workers share CPUs {ranks}"
        gpus = [r[2] for r in ranks]
        assert all(g.isdigit() for g in gpus) and len(set(gpus)) == 2, f"{node}: GPUs {gpus}"


def test_container_job_survives_a_crash_and_a_requeue(
    tmp_path: Path, instance: tuple[str, Testbed], monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime, tb = instance
    env = tb.env()
    monkeypatch.setenv("SLURM_CONF", env["SLURM_CONF"])
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    run = tmp_path / "run"
    mount_point = (BUNDLE / "rootfs").resolve().joinpath(tmp_path.relative_to("/"))
    if mount_point.is_dir():  # an earlier run's (pytest reuses its temporary directories' names)
        mount_point.rmdir()
    argv = submit_argv(run, str(site_file(tmp_path, runtime)))
    argv += ["--time", "10", "--nodes", "2", "--gpus-per-node", "2", str(TRAIN)]
    argv += [*train_args(STEPS), "--step-time", "0.2", "--out", str(tmp_path / "out")]
    argv += ["--fault", "sigkill", "--fault-step", "8", "--fault-rank", "1"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    job = str(json.loads(proc.stdout)["job_id"])
    script = (run / "job.sbatch").read_text()
    # submit made the job's mount points in the shared rootfs, so no two nodes' runc race to make them
    assert mount_point.is_dir() == (runtime == "oci")
    assert ("podman run --rm --network host" in script) == (runtime == "podman")
    assert (f"--container={run}/oci-bundle" in script) == (runtime == "oci")

    wait_for_event(run, "restarting", 180, round=1)  # the worker crash: restarted in the allocation
    wait_for_event(run, "checkpoint_published", 120, attempt=0, step=3 * CKPT_EVERY)
    check_workers_in_container(run)
    tb.slurm("scancel", "--signal=USR2", "--batch", job)
    rec = wait_job_finished(job, timeout=300)

    assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "1", rec
    evs = events(run)
    assert named(evs, "restarting")[0]["reason"] == "worker_failed"
    ended = named(evs, "attempt_ended")
    assert [e["reason"] for e in ended] == ["preempted", "succeeded"], ended
    (requeued,) = named(evs, "requeued")
    assert requeued["by"] == "hpcelastic" and requeued["reason"] == "preempted"
    assert (run / "deferred-attempt-0.json").is_file()  # no scontrol in the image: finalize decided
    first, second = (
        [e["step"] for e in named(evs, "checkpoint_published") if e["attempt"] == a] for a in (0, 1)
    )
    assert second and min(second) > max(first)  # resumed after the stop step's checkpoint
    assert json.loads((tmp_path / "out" / "final.json").read_text())["sha256"] == reference_digest(STEPS)
    assert not wait_no_leaks(str(run))
    assert status_json(str(run))["outcome"] == "succeeded"


def test_oci_on_22_05_is_refused_at_submit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's sbatch is 22.05, whose OCI mode drops SLURM_PROCID/NODEID/LOCALID/SLURMD_NODENAME in the
    container (measured): one line, exit 2, nothing created or submitted."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv(
        "PATH", ":".join(p for p in os.environ["PATH"].split(":") if "hpcelastic-testbed" not in p)
    )
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "hpcelastic", "submit", "--site", str(site_file(tmp_path, "oci"))]
    proc = subprocess.run(
        [*argv, "--run-dir", str(run), str(TRAIN)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "22.05's OCI mode" in proc.stderr and "SLURM_NODEID" in proc.stderr
    assert not run.exists()
