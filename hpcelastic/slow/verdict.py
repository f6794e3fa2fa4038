"""What the slow-node detector tells the policy: one shared vocabulary for ``locate`` and ``policy``."""

from __future__ import annotations

from dataclasses import dataclass

from hpcelastic.reasons import Named


class SlowKind(Named):
    """Why a node is slow, as far as the evidence goes."""

    COMPUTE = "compute"  # its ranks arrive last at the collectives: busy while the others wait for it
    NETWORK = "network"  # its collectives (and its link's round trips) slow while its compute is not
    INPUT = "input"  # its ranks arrive last and their stacks sit in data loading
    JOB_WIDE = "job-wide"  # the job is slower than its own pace, but no node stands out


@dataclass(frozen=True)
class PaceWindow:
    """The job's pace over one detection window (seconds on the coordinator's clock)."""

    start: float
    end: float
    steps_per_s: float  # this window's rate
    baseline_steps_per_s: float  # the job's own recent healthy pace (0: not known yet)

    @property
    def ratio(self) -> float:
        """This window's rate over the baseline (1.0 while the baseline is not known)."""
        return self.steps_per_s / self.baseline_steps_per_s if self.baseline_steps_per_s > 0 else 1.0


@dataclass(frozen=True)
class SlowVerdict:
    """One window's finding: the job is slow (``ratio`` < 1), and who, if the evidence names anyone."""

    window: PaceWindow
    kind: SlowKind
    node: str | None = None  # None for JOB_WIDE
    rank: int | None = None
    detail: str = ""  # the evidence in a few words, for people ("rank 3 arrives 180 ms last at 97% of ...")
    #: The share of the job's pace the named node costs by itself (its lateness over the time between
    #: collectives); None: not known, the window's whole slowdown is charged to it (under a job-wide load
    #: that overstates what a swap would gain).
    own_slowdown: float | None = None

    @property
    def slowdown(self) -> float:
        """What this verdict charges its node (or the job): its own share when known, at most the window's."""
        job = max(0.0, 1.0 - self.window.ratio)
        return job if self.own_slowdown is None else min(job, max(0.0, self.own_slowdown))
