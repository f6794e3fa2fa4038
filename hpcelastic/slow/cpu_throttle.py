"""How much of the time the kernel held a rank back by its CPU quota: its cgroup's ``cpu.stat``.

A CFS quota (a container's or cgroup's CPU limit, a neighbour's share) stops a group's processes for the
rest of a period once they used their quota in it. With the kernel's default 100 ms period a rank so
limited computes at full speed, then stands still: late at one step of two or three and on time at the
others, which its collectives alone cannot tell from a workload stripe (``slow/locate.py``). The kernel
counts it: ``nr_periods`` (periods in which the group ran) and ``nr_throttled`` (of those, periods it was
stopped in), in ``cpu.stat`` of the cgroup v1 ``cpu`` controller's group or of the unified (v2) group.
:class:`ThrottleWatch` turns two readings into the share of a rank's periods it was throttled in since
the last one. Hand-written: psutil does not read cgroups; the file is three ``key value`` lines.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

#: Where cgroup hierarchies are mounted: v1's ``cpu`` controller (alone or as ``cpu,cpuacct``), and v2.
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: Periods a reading must span before its share says anything (a tenth of a second at the 10 ms least).
MIN_PERIODS = 10


@dataclass(frozen=True)
class CpuStat:
    """A group's CFS counters: periods it had runnable tasks in, and those it was throttled in."""

    periods: int
    throttled: int


def parse(text: str) -> CpuStat | None:
    """``cpu.stat``'s counters, or None when it has none (no quota mechanism: no ``nr_periods``)."""
    values = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            values[key] = int(value)
    if "nr_periods" not in values or "nr_throttled" not in values:
        return None
    return CpuStat(values["nr_periods"], values["nr_throttled"])


def stat_path(proc_cgroup: str, root: Path = CGROUP_ROOT) -> Path | None:
    """The ``cpu.stat`` of the group a process is in, from its ``/proc/PID/cgroup``: the v1 ``cpu``
    controller's group if it has one, else the unified group's."""
    unified = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, group = parts
        relative = group.lstrip("/")
        if "cpu" in controllers.split(","):
            for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                if (root / mount).is_dir():
                    return root / mount / relative / "cpu.stat"
        elif controllers == "":
            unified = relative
    if unified is None:
        return None
    base = root / "unified" if (root / "unified" / "cgroup.procs").exists() else root
    return base / unified / "cpu.stat"


def read(pid: int, root: Path = CGROUP_ROOT) -> CpuStat | None:
    """Process ``pid``'s group's counters now, or None (it ended, no such file, no quota counters)."""
    try:
        path = stat_path(Path(f"/proc/{pid}/cgroup").read_text(), root)
        return None if path is None else parse(path.read_text())
    except OSError:
        return None


class ThrottleWatch:
    """Each rank's throttled share between two readings (``reader``: a pid's counters, :func:`read`)."""

    def __init__(self, reader: Callable[[int], CpuStat | None] = read) -> None:
        self._reader = reader
        self._last: dict[int, tuple[int, CpuStat]] = {}  # rank -> (pid, its last reading)

    def shares(self, pids: Mapping[int, int]) -> dict[int, float]:
        """rank -> share of its periods since the last call in which its group was throttled, for the ranks
        (``pids``: rank -> pid) read twice over at least :data:`MIN_PERIODS` periods."""
        out: dict[int, float] = {}
        for rank, pid in pids.items():
            now = self._reader(pid)
            last = self._last.get(rank)
            if now is None:
                self._last.pop(rank, None)
                continue
            if last is not None and last[0] == pid:
                periods = now.periods - last[1].periods
                if periods < MIN_PERIODS:
                    continue  # keep the older reading: the next call spans more
                out[rank] = max(0.0, min(1.0, (now.throttled - last[1].throttled) / periods))
            self._last[rank] = (pid, now)
        for rank in set(self._last) - set(pids):
            del self._last[rank]
        return out
