"""Capture what real Slurm prints for the jobs hpcelastic asks about, into ``<release>/`` beside this file.

Run as root against a running testbed instance (scripts/testbed.sh) of the release to capture, with 3 nodes
and a short SlurmdTimeout (its last node is killed and revived)::

    TESTBED_NAME=next TESTBED_INDEX=30 TESTBED_SLURM=24.11 TESTBED_NODES=3 TESTBED_SLURMD_TIMEOUT=10 \
        scripts/testbed.sh up
    python tests/unit/slurm_outputs/capture.py next     # 24.11
    python tests/unit/slurm_outputs/capture.py oldv     # 22.05, the host's (an instance up likewise)

It submits sleeping jobs and brings each into a state hpcelastic must read (running on 2 nodes with
GPUs, pending again after a requeue with ExcNodeList, an array task, completed, failed, cancelled,
time limit, a node's death), then saves ``scontrol show job -o`` and ``--json``, ``squeue -o`` and
``--json``, ``scontrol show node``, ``scontrol show config`` and ``sbatch --version``. The unit tests
(tests/unit/test_slurm_outputs.py) parse these files; nothing here runs in CI.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.testbed import Testbed  # noqa: E402

HERE = Path(__file__).resolve().parent


def keep(path: Path, text: str) -> None:
    """Write ``text`` unless it is empty (22.05's scontrol has no ``--json``: nothing to keep)."""
    if text.strip():
        path.write_text(text)


def main(name: str) -> None:
    tb = Testbed(name)
    env = tb.env()

    def run(*argv: str, check: bool = True) -> str:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, cwd="/tmp", timeout=60)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {proc.stderr}")
        return proc.stdout

    release = run("sbatch", "--version").split()[-1].rsplit(".", 1)[0]
    out = HERE / release
    out.mkdir(exist_ok=True)
    (out / "sbatch_version.txt").write_text(run("sbatch", "--version"))
    nodes = [line.split()[0] for line in run("sinfo", "-h", "-N", "-o", "%N").split()]

    def submit(*args: str) -> str:
        return run("sbatch", "--parsable", "-o", "/dev/null", *args).strip().split(";")[0]

    def state(job: str) -> str:
        rec = run("scontrol", "show", "job", "-o", job, check=False)
        return rec.split("JobState=", 1)[1].split()[0] if "JobState=" in rec else ""

    def wait(job: str, *states: str, timeout: float = 200) -> None:
        deadline = time.monotonic() + timeout
        while state(job) not in states:
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job} not in {states}: {state(job)}")
            time.sleep(0.5)

    def save(case: str, job: str) -> None:
        (out / f"job_{case}.txt").write_text(run("scontrol", "show", "job", "-o", job))
        keep(out / f"job_{case}.json", run("scontrol", "--json", "show", "job", job, check=False))
        fmt = "%i|%T|%r|%N"
        (out / f"squeue_{case}.txt").write_text(run("squeue", "-h", "-r", "-t", "all", "-j", job, "-o", fmt))
        (out / f"squeue_{case}.json").write_text(run("squeue", "--json", "-j", job, check=False))

    # Slow ones first, in the background of the others: a time limit of 1 minute, a node's death.
    timeout_job = submit("-N1", "--time=1", "-w", nodes[0], "--wrap", "sleep 600")
    victim = nodes[-1]
    node_fail = submit("-N1", "--no-requeue", "-w", victim, "--wrap", "sleep 600")
    pair = ",".join(nodes[:2])
    running = submit("-N2", "--gres=gpu:1", "--time=30", "--requeue", "-w", pair, "--wrap", "sleep 600")
    array = submit("-N1", "--array=3", "--time=30", "--wrap", "sleep 600")
    wait(running, "RUNNING")
    wait(node_fail, "RUNNING")
    tb.kill_node(victim)
    save("running", running)
    wait(f"{array}_3", "RUNNING")
    save("array_task", f"{array}_3")
    run("scontrol", "requeue", running)
    wait(running, "PENDING")
    run("scontrol", "update", f"JobId={running}", f"ExcNodeList={nodes[0]}")
    save("requeued_pending", running)
    run("scancel", running)
    run("scancel", array)
    wait(running, "CANCELLED")
    save("cancelled", running)
    done = submit("-N1", "--wrap", "true")
    failed = submit("-N1", "--wrap", "exit 3")
    wait(done, "COMPLETED")
    wait(failed, "FAILED")
    save("completed", done)
    save("failed", failed)
    (out / "node.txt").write_text(run("scontrol", "show", "node", "-o", nodes[0]))
    keep(out / "node.json", run("scontrol", "--json", "show", "node", nodes[0], check=False))
    wait(timeout_job, "TIMEOUT")
    save("timeout", timeout_job)
    wait(node_fail, "NODE_FAIL")
    save("node_fail", node_fail)
    (out / "node_down.txt").write_text(run("scontrol", "show", "node", "-o", victim))
    tb.revive_node(victim)
    (out / "config.txt").write_text(run("scontrol", "show", "config"))
    print(f"captured Slurm {release} into {out}")


if __name__ == "__main__":
    main(sys.argv[1])
