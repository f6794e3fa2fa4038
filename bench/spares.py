"""Hot spare promoted to training again, on the real Slurm testbed (scripts/testbed.sh, default instance).

Each run submits examples/ddp_train.py with ``hpcelastic submit --nodes 2 --spare-nodes 1
--nproc-per-node 2`` (3 nodes allocated, 4 gloo workers on 2 of them), SIGKILLs the agent of the
second worker node and its whole process tree once training runs, and measures from the kill to

* ``to_start``: the last of the 4 new workers started (the spare's included), and
* ``to_init``: the last of them past ``init_process_group``: training again, world size still 4.

Prints every run and the median of ``--runs`` (>= 3); writes the ``spares`` section of bench/RESULTS.md.

    python bench/spares.py [--runs 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._results import machine_line, update_section  # noqa: E402
from hpcelastic.jobs.slurm import parse_scontrol_record  # noqa: E402
from hpcelastic.rundir import RunDir  # noqa: E402

EXAMPLE = REPO / "examples" / "ddp_train.py"
TARGET_S = 5.0


def job_state(job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    return parse_scontrol_record(out.splitlines()[0]) if out.strip() else {}


def wait_until(pred: Any, timeout: float, what: str, every: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every)
    raise SystemExit(f"bench/spares.py: {what} did not happen within {timeout:g} s")


def agent_on(run: Path, node: str) -> int | None:
    """The pid of the hpcelastic agent of ``run`` on testbed node ``node``."""
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = p.info["cmdline"] or []
            if "agent" not in cmd or "hpcelastic" not in cmd:
                continue
            env = p.environ()
        except (psutil.Error, OSError):
            continue
        if env.get("HPCELASTIC_RUN_DIR") == str(run) and env.get("SLURMD_NODENAME") == node:
            return p.pid
    return None


def workers(timing: Path, after: float) -> list[dict[str, Any]]:
    recs = [json.loads(f.read_text()) for f in timing.glob("worker-*.json")]
    return [r for r in recs if r["start"] > after]


def one_run(work: Path) -> dict[str, Any]:
    run, timing = work / "run", work / "timing"
    argv = [
        sys.executable,
        "-m",
        "hpcelastic",
        "submit",
        "--json",
        "--site",
        "testbed",
        "--run-dir",
        str(run),
    ]
    argv += ["--time", "10", "--nodes", "2", "--spare-nodes", "1", "--gpus-per-node", "2"]
    argv += [str(EXAMPLE), "--steps", "200", "--step-time", "0.05", "--timing-dir", str(timing)]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=work, timeout=120)
    if proc.returncode != 0:
        raise SystemExit(f"bench/spares.py: submit failed: {proc.stderr.strip()}")
    job = str(json.loads(proc.stdout)["job_id"])
    try:
        wait_until(lambda: len(workers(timing, 0)) >= 4, 180, "the first 4 workers", every=0.2)
        time.sleep(1.0)
        pid = wait_until(lambda: agent_on(run, "node2"), 10, "finding node2's agent")
        tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        killed = time.time()
        for p in tree:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGKILL)
        new = wait_until(lambda: (w := workers(timing, killed)) and len(w) >= 4 and w, 60, "4 new workers")
        rec = wait_until(
            lambda: (r := job_state(job)).get("JobState") in ("COMPLETED", "FAILED") and r, 300, "end"
        )
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    rounds = list(RunDir(run).events())  # every host's event file, merged
    rdzv = [e for e in rounds if e["event"] == "rendezvous"]
    return {
        "job": job,
        "state": rec["JobState"],
        "hosts": rdzv[-1]["hosts"],
        "world_size": rdzv[-1]["world_size"],
        "to_start": max(w["start"] for w in new) - killed,
        "to_init": max(w["init"] for w in new) - killed,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    if args.runs < 3:
        raise SystemExit("bench/spares.py: --runs must be at least 3 (the median of 3 or more)")
    results = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="hpcelastic-bench-spares-") as tmp:
            r = one_run(Path(tmp))
        print(f"run {i + 1}: {json.dumps(r)}", flush=True)
        if r["state"] != "COMPLETED" or r["world_size"] != 4 or r["hosts"] != ["node1", "node3"]:
            raise SystemExit(f"bench/spares.py: run {i + 1} did not promote the spare cleanly: {r}")
        results.append(r)
    start = statistics.median(r["to_start"] for r in results)
    init = statistics.median(r["to_init"] for r in results)
    print(
        f"median of {len(results)}: kill -> 4 workers started {start:.2f} s, -> training again {init:.2f} s"
    )
    runs = ", ".join(f"{r['to_init']:.2f}" for r in results)
    update_section(
        "spares",
        f"""## Hot spare promoted (bench/spares.py)

{machine_line()} Slurm testbed (default instance), `hpcelastic submit --nodes 2 --spare-nodes 1
--gpus-per-node 2` of examples/ddp_train.py: 3 nodes allocated, 4 gloo workers on node1 and node2. The agent
of node2 and its whole process tree are SIGKILLed while training runs; the spare node3 takes its place in the
same allocation (world size stays 4, the job completes, Restarts=0). Median of {len(results)} runs:

| from the kill to | median | target |
|---|---|---|
| the 4 workers of the new round started (node3's included) | {start:.2f} s | |
| every worker past `init_process_group` (training again) | {init:.2f} s | < {TARGET_S:g} s |

Each run's kill -> training again: {runs} s.
""",
    )


if __name__ == "__main__":
    main()
