"""A rank's CPU quota throttling from its cgroup's ``cpu.stat`` (hpcelastic/slow/cpu_throttle.py), v1 and v2,
and through a real cgroup v1 quota on this machine (root)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcelastic.slow import cpu_throttle as ct

V1 = "nr_periods 120\nnr_throttled 90\nthrottled_time 7000000000\nnr_bursts 0\nburst_time 0\n"
V2 = "usage_usec 10\nuser_usec 5\nsystem_usec 5\nnr_periods 40\nnr_throttled 10\nthrottled_usec 900\n"


def test_cpu_stat_of_either_version() -> None:
    assert ct.parse(V1) == ct.CpuStat(120, 90)
    assert ct.parse(V2) == ct.CpuStat(40, 10)
    assert ct.parse("usage_usec 10\nuser_usec 5\n") is None  # no quota counters (v2 without cpu)
    assert ct.parse("") is None


def test_the_group_a_process_is_in_v1_cpu_controller_first_else_unified(tmp_path: Path) -> None:
    (tmp_path / "cpu,cpuacct").mkdir()
    v1 = "12:cpu,cpuacct:/slurm/uid_0/job_7/step_0\n4:memory:/x\n0::/user.slice\n"
    assert ct.stat_path(v1, tmp_path) == tmp_path / "cpu,cpuacct/slurm/uid_0/job_7/step_0/cpu.stat"
    assert (
        ct.stat_path("0::/system.slice/job.scope\n", tmp_path) == tmp_path / "system.slice/job.scope/cpu.stat"
    )
    (tmp_path / "unified").mkdir()
    (tmp_path / "unified" / "cgroup.procs").write_text("")
    assert ct.stat_path("1:name=systemd:/\n0::/a\n", tmp_path) == tmp_path / "unified/a/cpu.stat"
    assert ct.stat_path("garbage\n", tmp_path) is None


def test_shares_between_readings_per_rank() -> None:
    readings = {100: [ct.CpuStat(10, 0), ct.CpuStat(15, 5), ct.CpuStat(40, 20)], 200: [ct.CpuStat(0, 0)] * 3}
    watch = ct.ThrottleWatch(lambda pid: readings[pid].pop(0) if readings.get(pid) else None)
    assert watch.shares({3: 100, 1: 200}) == {}  # one reading: nothing yet
    assert watch.shares({3: 100, 1: 200}) == {}  # 5 periods: too few, the older reading kept
    assert watch.shares({3: 100, 1: 200}) == {3: pytest.approx(20 / 30)}  # no quota periods: no share
    readings[300] = [ct.CpuStat(500, 500), ct.CpuStat(520, 520)]
    assert watch.shares({3: 300}) == {}  # another process in rank 3's place: begins afresh
    assert watch.shares({3: 300}) == {3: 1.0}
    assert watch.shares({3: 999}) == {}  # gone


def test_a_real_quota_over_100_ms_throttles_a_busy_process(cpu_quota) -> None:  # type: ignore[no-untyped-def]
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        cpu_quota(busy.pid, 0.1)  # the kernel's default 100 ms period; 10 ms of it, even on a loaded machine
        watch = ct.ThrottleWatch()
        assert watch.shares({0: busy.pid}) == {}
        time.sleep(2.0)
        shares = watch.shares({0: busy.pid})
        assert shares[0] >= 0.5, shares  # stopped in most periods it ran in (locate.THROTTLED)
        own = ct.ThrottleWatch()  # this process's group has no quota: its periods do not move
        own.shares({0: os.getpid()})
        assert own.shares({0: os.getpid()}) == {}
    finally:
        busy.kill()
        busy.wait()
