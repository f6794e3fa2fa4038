"""Each worker's share of the agent's CPUs (agent/cpus.py): the split, its order, and real workers bound to
it, cold and warm (forked by a real fork server), with ``OMP_NUM_THREADS`` agreeing."""

from __future__ import annotations

import dataclasses
import json
import os
import selectors
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpcelastic.agent import cpus
from hpcelastic.agent.forkserver import ForkServer
from hpcelastic.agent.watchdog import Watchdog
from hpcelastic.agent.workers import WorkerGroup, _child_setup, base_env, worker_env
from tests.unit.test_workers_env import ROUND, config


def test_even_contiguous_blocks_the_first_ones_larger() -> None:
    assert cpus.split(list(range(8)), 2) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert cpus.split(list(range(10)), 4) == [(0, 1, 2), (3, 4, 5), (6, 7), (8, 9)]
    assert cpus.split([5, 1, 9], 1) == [(5, 1, 9)]  # the given order is kept


def test_fewer_cpus_than_workers_one_each_in_turn() -> None:
    assert cpus.split([3, 7], 5) == [(3,), (7,), (3,), (7,), (3,)]
    assert cpus.split([], 2) == [(), ()]
    assert cpus.split([0, 1], 0) == []


@given(st.lists(st.integers(0, 511), unique=True, min_size=1, max_size=64), st.integers(1, 16))
def test_every_cpu_is_used_and_blocks_differ_by_one_at_most(given_cpus: list[int], n: int) -> None:
    shares = cpus.split(given_cpus, n)
    assert len(shares) == n and all(shares)
    assert {c for s in shares for c in s} == set(given_cpus)
    if len(given_cpus) >= n:
        assert [c for s in shares for c in s] == given_cpus  # disjoint, contiguous, in order
        assert max(map(len, shares)) - min(map(len, shares)) <= 1


def _fake_sysfs(root: Path, topology: dict[int, tuple[int, int]]) -> Path:
    for cpu, (socket, core) in topology.items():
        d = root / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "physical_package_id").write_text(f"{socket}\n")
        (d / "core_id").write_text(f"{core}\n")
    return root


def test_hyperthread_siblings_stay_in_one_block(tmp_path: Path) -> None:
    """Linux numbers the second thread of each core after all the first ones (cpu0 and cpu4 share a core):
    blocks by number would put two workers on the same cores."""
    topology = {cpu: (cpu % 4 // 2, cpu % 2) for cpu in range(8)}  # 2 sockets x 2 cores x 2 threads
    ordered = cpus.by_core(range(8), _fake_sysfs(tmp_path, topology))
    assert ordered == [0, 4, 1, 5, 2, 6, 3, 7]
    assert cpus.split(ordered, 2) == [(0, 4, 1, 5), (2, 6, 3, 7)]  # one socket each
    assert cpus.by_core([3, 1, 2], tmp_path / "missing") == [1, 2, 3]


def test_the_job_turns_the_split_off() -> None:
    assert cpus.worker_shares({cpus.SPLIT_VARIABLE: "0"}, 2) is None
    mine = sorted(os.sched_getaffinity(0))
    shares = cpus.worker_shares({}, 2)
    assert shares is not None and {c for s in shares for c in s} == set(mine)


def test_omp_num_threads_is_the_share_unless_the_job_set_it(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    assert worker_env(cfg, ROUND, 0, tmp_path / "e", share=(4, 5, 6))["OMP_NUM_THREADS"] == "3"
    assert worker_env(cfg, ROUND, 0, tmp_path / "e")["OMP_NUM_THREADS"] == "1"  # split off, 2 workers
    mine = dataclasses.replace(cfg, environ={**cfg.environ, "OMP_NUM_THREADS": "7"})
    assert worker_env(mine, ROUND, 0, tmp_path / "e", share=(4, 5, 6))["OMP_NUM_THREADS"] == "7"


REPORT = """
import json, os, sys
with open(os.path.join(sys.argv[1], "rank-" + os.environ["LOCAL_RANK"]), "w") as f:
    json.dump({"cpus": sorted(os.sched_getaffinity(0)), "omp": os.environ["OMP_NUM_THREADS"]}, f)
"""


def run_workers(
    tmp_path: Path, report: str, nproc: int, preload: tuple[str, ...] | None
) -> tuple[WorkerGroup, list[dict]]:
    """Run ``report`` (a script given the output directory) as a node's ``nproc`` workers, warm from a
    real fork server that preloads ``preload``, or cold when it is None; the group and each rank's report."""
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "report.py"
    script.write_text(report)
    argv = (sys.executable, "-u", str(script), str(out))
    cfg = dataclasses.replace(config(tmp_path), argv=argv, nproc=nproc)
    server = None
    if preload is not None:
        environ = base_env(cfg.environ, nproc)
        server = ForkServer(sys.executable, str(script), environ, preload=preload, preexec_fn=_child_setup)
    watchdog, devnull = Watchdog(), os.open(os.devnull, os.O_WRONLY)
    try:
        with selectors.DefaultSelector() as sel:
            group = WorkerGroup(cfg, sel, watchdog, out_fd=devnull, forkserver=server)
            group.start(ROUND)
            assert group.spawn == ("cold" if server is None else "warm"), group.spawn_reason
            deadline = time.monotonic() + 30
            # A report is read once it is whole: the file exists a moment before its JSON is written,
            # and stopping the group then left it empty (official CI, warm case).
            while (reports := _whole_reports(out, nproc)) is None:
                assert time.monotonic() < deadline, "the workers did not report"
                time.sleep(0.05)
            group.stop(1.0)
    finally:
        if server is not None:
            server.close()
        watchdog.close()
        os.close(devnull)
    return group, reports


def _whole_reports(out: Path, nproc: int) -> list[dict] | None:
    """Each rank's report from ``out``, or None while one is missing or not yet completely written."""
    try:
        return [json.loads((out / f"rank-{i}").read_text()) for i in range(nproc)]
    except (OSError, ValueError):
        return None


@pytest.mark.parametrize("preload", [None, ("json",)], ids=["cold", "warm"])
def test_each_worker_runs_on_its_share(tmp_path: Path, preload: tuple[str, ...] | None) -> None:
    group, reports = run_workers(tmp_path, REPORT, 2, preload)
    agent = sorted(os.sched_getaffinity(0))
    assert [tuple(r["cpus"]) for r in reports] == [tuple(sorted(s)) for s in group.cpu_shares or []]
    assert sorted({c for r in reports for c in r["cpus"]}) == agent
    if len(agent) >= 2:
        assert not set(reports[0]["cpus"]) & set(reports[1]["cpus"])
    assert [r["omp"] for r in reports] == [str(len(r["cpus"])) for r in reports]


# Stands in for torch in the fork server's preloads (found first: the server's sys.path[0] is the script's
# directory): records the thread count a worker sets, as torch.set_num_threads would.
FAKE_TORCH = """
threads = None
def set_num_threads(n):
    global threads
    threads = n
"""
TORCH_REPORT = """
import json, os, sys
with open(os.path.join(sys.argv[1], "rank-" + os.environ["LOCAL_RANK"]), "w") as f:
    json.dump({"omp": os.environ["OMP_NUM_THREADS"], "torch": sys.modules["torch"].threads}, f)
"""


def test_a_warm_workers_torch_uses_its_share_not_the_servers_thread_count(tmp_path: Path) -> None:
    """torch read the fork server's OMP_NUM_THREADS when imported; a warm worker's own (its CPU share's
    size) is applied to it, as a cold worker's import would read it."""
    (tmp_path / "torch.py").write_text(FAKE_TORCH)
    _group, (report,) = run_workers(tmp_path, TORCH_REPORT, 1, ("torch",))
    share = len(os.sched_getaffinity(0))
    assert report == {"omp": str(share), "torch": share}
