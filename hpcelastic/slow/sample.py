"""What a node reports to the slow-node detector about each of its ranks, and how it travels (JSON).

One :class:`RankSample` per rank in :class:`~hpcelastic.agent.messages.SlowSample`: the rank's steps (its
step clock, else its arrivals file), the collectives it issued since the last report (subsampled
alike on every node: :func:`subsample`), the share of its recent stacks in data loading, the share of its
CPU quota's periods it was throttled in (``slow/cpu_throttle.py``), and its GPU's NVML facts. Bounded: at
most :data:`SEND_KEEP` collectives per rank per report.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: Collectives per rank in one report (a report per dump: about 5 s of collectives, a 10 s window 2 reports).
SEND_KEEP = 32

# NVML's clock event (throttle) reasons (nvml.h, ``nvmlClocksEventReason*``/``nvmlClocksThrottleReason*``).
GPU_IDLE = 0x1
APPLICATIONS_CLOCKS = 0x2
SW_POWER_CAP = 0x4
HW_SLOWDOWN = 0x8
SYNC_BOOST = 0x10
SW_THERMAL = 0x20
HW_THERMAL = 0x40
HW_POWER_BRAKE = 0x80
#: Reasons that mean the GPU is held below what a healthy one runs at under the same load.
DEGRADED_REASONS = {
    HW_SLOWDOWN: "HW slowdown",
    SW_THERMAL: "SW thermal slowdown",
    HW_THERMAL: "HW thermal slowdown",
    HW_POWER_BRAKE: "HW power brake",
}


@dataclass(frozen=True)
class GpuFacts:
    """One GPU's NVML readings (``nvmlDeviceGetClockInfo``/``GetMaxClockInfo`` for the SM clock,
    ``GetCurrentClocksEventReasons``, ``GetPowerUsage``/``GetEnforcedPowerLimit``, ``GetTemperature``,
    ``GetPcieReplayCounter``); None where the device does not say."""

    sm_clock_mhz: int | None = None
    max_sm_clock_mhz: int | None = None
    reasons: int = 0
    power_w: float | None = None
    power_limit_w: float | None = None
    temperature_c: int | None = None
    pcie_replays: int | None = None

    def degraded(self) -> list[str]:
        """Why this GPU runs below a healthy one's speed, in words (empty: no sign of it)."""
        out = [text for bit, text in DEGRADED_REASONS.items() if self.reasons & bit]
        clock, top = self.sm_clock_mhz, self.max_sm_clock_mhz
        if clock and top and not self.reasons & GPU_IDLE and clock < 0.7 * top:
            out.append(f"SM clock {self.sm_clock_mhz}/{self.max_sm_clock_mhz} MHz")
        return out

    def wire(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> GpuFacts:
        def opt(name: str, kind: type) -> Any:
            value = d.get(name)
            return None if value is None else kind(value)

        return cls(
            opt("sm_clock_mhz", int),
            opt("max_sm_clock_mhz", int),
            int(d.get("reasons", 0)),
            opt("power_w", float),
            opt("power_limit_w", float),
            opt("temperature_c", int),
            opt("pcie_replays", int),
        )


Arrival = tuple[int, int, int]  # (process group id, sequence number, wall time issued in ns)


@dataclass(frozen=True)
class RankSample:
    """One rank's evidence since its node's last report (times are the node's wall clock, ns)."""

    rank: int
    steps: int = 0  # optimizer steps this round (step clock or arrivals file)
    step_ns: int = 0  # wall time of the last of them (0: none yet)
    arrivals: tuple[Arrival, ...] = ()
    input_share: float | None = None  # share of its sampled stacks in data loading
    gpu: GpuFacts | None = None
    cpu_throttled: float | None = None  # share of its cgroup's CFS periods it was throttled in

    def wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {"rank": self.rank, "steps": self.steps, "step_ns": self.step_ns}
        if self.arrivals:
            d["arrivals"] = [list(a) for a in self.arrivals]
        if self.input_share is not None:
            d["input_share"] = self.input_share
        if self.gpu is not None:
            d["gpu"] = self.gpu.wire()
        if self.cpu_throttled is not None:
            d["cpu_throttled"] = self.cpu_throttled
        return d

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> RankSample:
        arrivals = d.get("arrivals", [])
        if not isinstance(arrivals, list) or len(arrivals) > 4 * SEND_KEEP:
            raise ValueError("arrivals must be a short list")
        share = d.get("input_share")
        gpu = d.get("gpu")
        throttled = d.get("cpu_throttled")
        return cls(
            int(d["rank"]),
            int(d.get("steps", 0)),
            int(d.get("step_ns", 0)),
            tuple((int(a[0]), int(a[1]), int(a[2])) for a in arrivals),
            None if share is None else float(share),
            None if gpu is None else GpuFacts.from_wire(gpu),
            None if throttled is None else float(throttled),
        )


def subsample(arrivals: Sequence[Arrival], keep: int = SEND_KEEP) -> tuple[Arrival, ...]:
    """At most ``keep`` of ``arrivals``, the same ones on every rank that holds them: those whose sequence
    number is a multiple of the least power of two that leaves ``keep`` or fewer (powers of two nest, so
    two nodes that chose different ones still share the coarser one's), the newest if still more."""
    stride = 1
    while sum(1 for a in arrivals if a[1] % stride == 0) > keep:
        stride <<= 1
    return tuple(a for a in arrivals if a[1] % stride == 0)[-keep:]


def ranks_wire(samples: Iterable[RankSample]) -> list[dict[str, Any]]:
    return [s.wire() for s in samples]
