"""CPU binding and GPUs as a cluster's task plugin gives them, through ``hpcelastic submit``.

srun (Slurm 22.05 and later) does not inherit sbatch's ``--cpus-per-task``: under ``task/affinity``
with a binding to cores (``SLURM_CPU_BIND=cores`` here, as ``TaskPluginParam=Cores`` sets it at many
sites), an agent started without ``-c`` runs on one CPU, and so do all its workers. Each job here asks
for CPUs per node and 2 GPUs; every worker writes what it runs on. Asserted against Slurm's own view
(``scontrol -d show job``: CPU_IDs and GRES IDX per node): each agent runs on all the job's CPUs of its
node, each worker on its share of them (agent/cpus.py), with ``OMP_NUM_THREADS`` its share's size, and
on one of the GPUs Slurm gave the node, whose device file it can open.

Two cases: the default instance (``task/none``: nothing is bound, the agent has the host's CPUs;
workers start cold) and instance ``aff`` (``task/cgroup,task/affinity``, a cpuset per step and tasks
bound in it, as most clusters run them; 2 nodes of 2 CPUs: binding uses the host's CPU ids, so no more
than it has; warm starts). The fake GPUs have no driver (opening one gives ENXIO); no device cgroup
hides the other GPUs' files here, so only the allocated one's is asserted.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import hostlist
import pytest

from hpcelastic.jobs.slurm import ENDED_STATES, parse_scontrol_record
from tests.slurm_utils import wait_no_leaks
from tests.testbed import Testbed, own_instance

pytestmark = pytest.mark.slurm

AFFINITY = {
    "index": "21",
    "nodes": "2",
    "cpus_per_node": "2",
    "gpus_per_node": "2",
    "task_plugin": "task/cgroup,task/affinity",
}

PROBE = """
import errno, json, os, sys
out, node = sys.argv[1], os.environ["SLURMD_NODENAME"]
agent = int(os.environ["HPCELASTIC_WORKER_TREE"].split(".")[0])
devices = {}
for path in sys.argv[2:]:
    try:
        os.close(os.open(path, os.O_RDONLY))
        devices[path] = "opened"
    except OSError as e:  # a fake GPU has no driver: ENXIO; a device the cgroup denies: EPERM
        devices[path] = errno.errorcode[e.errno]
report = {
    "node": node, "local_rank": int(os.environ["LOCAL_RANK"]), "cpus": sorted(os.sched_getaffinity(0)),
    "agent_cpus": sorted(os.sched_getaffinity(agent)), "omp": os.environ.get("OMP_NUM_THREADS"),
    "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "devices": devices,
}
with open(os.path.join(out, f"{node}-{report['local_rank']}.json"), "w") as f:
    json.dump(report, f)
"""


@pytest.fixture(scope="module")
def affinity(slurm_cluster: dict[str, object]) -> Iterator[Testbed]:
    with own_instance("aff", AFFINITY) as inst:
        yield inst


def gpu_files(tb: Testbed) -> dict[str, list[str]]:
    """Each node's GPU device files, as the instance's gres.conf lists them."""
    files = {}
    for line in (Path(tb.slurm_conf).parent / "gres.conf").read_text().splitlines():
        m = re.match(r"NodeName=(\S+) Name=gpu File=(\S+)", line)
        if m:
            files[m.group(1)] = hostlist.expand_hostlist(m.group(2))
    return files


def allocation(tb: Testbed, job: str) -> Allocation:
    """Slurm's view of the job: each node's CPU ids and GPU indices (``scontrol -d show job``)."""
    out = tb.slurm("scontrol", "-d", "show", "job", job)
    found = {}
    for nodes, cpu_ids, idx in re.findall(r"Nodes=(\S+) CPU_IDs=(\S+) .*?GRES=gpu:\d+\(IDX:([^)]*)\)", out):
        for node in hostlist.expand_hostlist(nodes):
            cpus = {int(c) for c in hostlist.expand_hostlist(f"[{cpu_ids}]")}
            found[node] = (cpus, set(hostlist.expand_hostlist(f"[{idx}]")))
    return found


Allocation = dict[str, tuple[set[int], set[str]]]


def run_job(
    tb: Testbed, tmp_path: Path, cpus_per_node: int, *flags: str, config: str = ""
) -> tuple[Path, Allocation]:
    """Submit the probe on 2 nodes x 2 workers x 2 GPUs; wait until Slurm holds the allocation (read it then:
    ``-d`` details go when the job ends) and the job ends: the workers' reports' directory, the allocation."""
    out, xdg = tmp_path / "out", tmp_path / "xdg" / "hpcelastic"
    out.mkdir()
    xdg.mkdir(parents=True)
    (xdg / "config.yaml").write_text(config)
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    devices = [f for files in gpu_files(tb).values() for f in files]
    argv = [sys.executable, "-m", "hpcelastic", "submit", "--json", "--site", "testbed", "--run-dir", "run"]
    argv += ["--nodes", "2", "--gpus-per-node", "2", "--nproc-per-node", "2", "--time", "5", *flags]
    argv += [f"--sbatch-arg=--cpus-per-task={cpus_per_node}", str(probe), str(out), *devices]
    env = {**tb.slurm_env(), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job = str(json.loads(proc.stdout)["job_id"])
    deadline, rec, alloc = time.monotonic() + 180, {}, Allocation()
    while time.monotonic() < deadline:
        text = tb.slurm("scontrol", "show", "job", "-o", job, check=False)
        rec = parse_scontrol_record(text.splitlines()[0]) if text.strip() else {}
        if rec.get("JobState") == "RUNNING" and not alloc:
            alloc = allocation(tb, job)
        if rec.get("JobState") in ENDED_STATES:
            break
        time.sleep(0.3)
    assert rec.get("JobState") == "COMPLETED", (rec, (tmp_path / "run" / f"slurm-{job}.out").read_text())
    assert len(alloc) == 2, alloc
    assert not wait_no_leaks(str(tmp_path / "run"))
    return out, alloc


def check_workers(tb: Testbed, out: Path, alloc: Allocation, agent_cpus: dict[str, set[int]]) -> None:
    """Every node's 2 workers: their CPUs split the agent's (``agent_cpus[node]``) into halves, their
    OMP_NUM_THREADS agree, and each has its own one of the node's GPUs, whose device file it opens."""
    files = gpu_files(tb)
    assert sorted(alloc) == sorted(agent_cpus)
    for node, (_cpus, gpus) in alloc.items():
        reports = [json.loads((out / f"{node}-{i}.json").read_text()) for i in range(2)]
        ordered = sorted(agent_cpus[node])
        half = len(ordered) // 2
        for r in reports:
            assert set(r["agent_cpus"]) == agent_cpus[node], (node, r)
            assert r["omp"] == str(len(r["cpus"])), r
        assert {c for r in reports for c in r["cpus"]} == agent_cpus[node], reports
        assert [len(r["cpus"]) for r in reports] == [len(ordered) - half, half], reports
        assert not set(reports[0]["cpus"]) & set(reports[1]["cpus"]), reports
        assert sorted(r["cuda"] for r in reports) == sorted(gpus), (node, gpus, reports)
        for r in reports:
            mine = next(f for f in files[node] if f.endswith(f"nvidia{r['cuda']}"))
            assert r["devices"][mine] in ("opened", errno.errorcode[errno.ENXIO]), (mine, r["devices"])


def test_task_none_agents_have_the_host_and_workers_split_it(
    slurm_cluster: dict[str, object], tmp_path: Path
) -> None:
    """task/none binds nothing: each agent runs where the host's processes run, and splits that."""
    tb = Testbed()
    out, alloc = run_job(tb, tmp_path, 4, config="warm_start: false\n")
    host = set(os.sched_getaffinity(0))
    check_workers(tb, out, alloc, {node: host for node in alloc})


@pytest.mark.xdist_group(name="aff")
def test_task_affinity_agents_get_all_the_jobs_cpus_of_their_node(affinity: Testbed, tmp_path: Path) -> None:
    """task/cgroup and task/affinity binding to cores: the agent runs on every CPU Slurm gave the job on its
    node (without srun -c: on one), each worker on one of them."""
    out, alloc = run_job(affinity, tmp_path, 2, "--env", "SLURM_CPU_BIND=cores")
    assert all(len(cpus) == 2 for cpus, _ in alloc.values()), alloc
    check_workers(affinity, out, alloc, {node: cpus for node, (cpus, _) in alloc.items()})
