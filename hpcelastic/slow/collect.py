"""The agent's side of slow-node detection: its ranks' files and GPUs into one compact report.

:class:`NodeCollector` reads each rank's arrivals file (``slow/arrivals.py``) and step clock
(``tier/step_clock.py``: fresh at every read; without one the arrivals file's step count, as of its last
dump), keeps what the coordinator has not had yet, and builds a
:class:`~hpcelastic.agent.messages.SlowSample`: per rank at most
:data:`~hpcelastic.slow.sample.SEND_KEEP` new collectives (:func:`~hpcelastic.slow.sample.subsample`).
:func:`gpu_facts` reads one GPU through an NVML binding (pynvml's names), :func:`input_share` the share of
a rank's sampled stacks in data loading.
"""

from __future__ import annotations

import contextlib
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpcelastic.agent.messages import SlowSample
from hpcelastic.slow import arrivals
from hpcelastic.slow.locate import in_data_loading
from hpcelastic.slow.sample import GpuFacts, RankSample, subsample
from hpcelastic.tier import step_clock


def read_clock(path: Path) -> tuple[int, int] | None:
    """(steps, wall time of the last in ns) from a step clock, or None (none yet, unreadable)."""
    try:
        with open(path, "rb") as f:
            return step_clock.LAYOUT.unpack(f.read(step_clock.LAYOUT.size))
    except (OSError, struct.error):
        return None


class NodeCollector:
    """This node's ranks of one round: ``clocks`` maps each global rank to its step clock (None: none)."""

    def __init__(self, directory: Path, clocks: Mapping[int, Path | None]) -> None:
        self.directory = directory
        self.clocks = dict(clocks)
        self._sent_dump: dict[int, int] = {}
        self._sent_seq: dict[tuple[int, int], int] = {}  # (rank, pg) -> highest seq sent
        self._sent_steps: dict[int, int] = {}

    def sample(
        self,
        round_: int,
        rtt_s: float | None = None,
        input_shares: Mapping[int, float] | None = None,
        gpus: Mapping[int, GpuFacts] | None = None,
        throttled: Mapping[int, float] | None = None,
        now_ns: Callable[[], int] = time.time_ns,
    ) -> SlowSample | None:
        """The report to send now, or None when no rank has anything new."""
        ranks = []
        for rank, clock in sorted(self.clocks.items()):
            dump = arrivals.read(arrivals.path(self.directory, rank))
            steps = read_clock(clock) if clock is not None else None
            if steps is None and dump is not None:
                steps = (dump.steps, dump.dump_ns)
            new = self._new_arrivals(rank, dump)
            moved = steps is not None and steps[0] != self._sent_steps.get(rank)
            if not new and not moved:
                continue
            if steps is not None:
                self._sent_steps[rank] = steps[0]
            ranks.append(
                RankSample(
                    rank,
                    *(steps or (0, 0)),
                    arrivals=new,
                    input_share=(input_shares or {}).get(rank),
                    gpu=(gpus or {}).get(rank),
                    cpu_throttled=(throttled or {}).get(rank),
                )
            )
        if not ranks:
            return None
        return SlowSample(round_, now_ns(), rtt_s, tuple(ranks))

    def _new_arrivals(self, rank: int, dump: arrivals.Dump | None) -> tuple[tuple[int, int, int], ...]:
        if dump is None or dump.dump_ns == self._sent_dump.get(rank):
            return ()
        self._sent_dump[rank] = dump.dump_ns
        fresh = [e for e in dump.entries if e[1] > self._sent_seq.get((rank, e[0]), 0)]
        kept = subsample(fresh)
        for pg, seq, _ in fresh:
            self._sent_seq[(rank, pg)] = max(seq, self._sent_seq.get((rank, pg), 0))
        return kept


def input_share(stacks: Sequence[Sequence[str]]) -> float | None:
    """The share of a rank's sampled stacks (each its frames' function names) in data loading."""
    if not stacks:
        return None
    return sum(in_data_loading(tuple(s)) for s in stacks) / len(stacks)


def gpu_facts(nvml: Any, handle: Any) -> GpuFacts:
    """One GPU's facts through ``nvml`` (pynvml or a binding with its names); what it refuses stays None."""

    def ask(call: Callable[[], Any]) -> Any:
        with contextlib.suppress(Exception):
            return call()
        return None

    reasons_call = (
        getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        or nvml.nvmlDeviceGetCurrentClocksThrottleReasons  # before NVML renamed them
    )
    power = ask(lambda: nvml.nvmlDeviceGetPowerUsage(handle))
    limit = ask(lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle))
    return GpuFacts(
        sm_clock_mhz=ask(lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
        max_sm_clock_mhz=ask(lambda: nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM)),
        reasons=int(ask(lambda: reasons_call(handle)) or 0),
        power_w=None if power is None else power / 1000.0,  # NVML reports milliwatts
        power_limit_w=None if limit is None else limit / 1000.0,
        temperature_c=ask(lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
        pcie_replays=ask(lambda: nvml.nvmlDeviceGetPcieReplayCounter(handle)),
    )
