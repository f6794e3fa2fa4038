"""The simulated world of one week: the job, its script, the cluster and the faults, drawn from a seed.

Rates are published ones: Llama 3's 54-day pre-training saw 419 unexpected interruptions on 16,384
GPUs (one per 3 h, about 0.47 per 1,000 GPU-days), 58.7 % of them GPU faults (faulty GPU 30.1 %, HBM
17.2 %, SRAM, GSP, thermal), 13.4 % software, 11 % host (maintenance, power, chassis, disk), 10.1 %
network (switch, cable, NIC) and 1.7 % NCCL watchdog hangs. A node whose GPU failed fails again.
Time limits are daily; preemptions come with or without a grace time; a user rarely cancels.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass

from hpcelastic.agent.runtime import Timing

DAY_S = 86400.0
WEEK_S = 7 * DAY_S
GPUS_PER_NODE = 8
#: Unexpected interruptions per GPU-second (Llama 3: 419 in 54 days on 16,384 GPUs).
FAULT_RATE_PER_GPU_S = 419 / (54 * DAY_S * 16384)
#: A node whose GPU failed fails again this many times as often (while it stays faulty).
BAD_NODE_FACTOR = 200.0
#: Node counts a week is run at, and how often each is drawn (a 2,048-node week costs as much as 60
#: 8-node ones).
NODE_COUNTS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)
NODE_WEIGHTS = (46, 25, 13, 8, 5, 1.8, 0.7, 0.3, 0.12)
#: Slurm's SlurmdTimeout: a dead node is marked DOWN this long after it stopped answering.
SLURMD_TIMEOUT_S = 300.0
#: Silence on the control connection and on its probes after which a peer counts as lost (the defaults of
#: ``agent/runtime.Timing``; code without probes: after the heartbeat timeout).
DETECTION_S = Timing().detection_s if hasattr(Timing, "detection_s") else Timing.heartbeat_timeout


#: Short network drops (a link flap, a switch reboot: 2-6 s) per node-day. Not an interruption in
#: Llama 3's count (NCCL rides them out), but longer than the agents' heartbeat timeout; no published
#: rate, so a week draws one of these (none in half the weeks).
BLIP_RATES = (0.0, 0.0, 0.001, 0.005)


class Script(enum.Enum):
    """How the training script talks to hpcelastic."""

    API = "api"  # hpcelastic.worker: heartbeat, should_stop, publish_checkpoint
    HEARTBEAT = "heartbeat"  # heartbeat() only; saves checkpoints on its own (examples/ddp_train.py)
    PLAIN = "plain"  # an unchanged torchrun script that saves checkpoints on its own


class Fault(enum.Enum):
    """What interrupts training (Llama 3's taxonomy, grouped by how the job sees it)."""

    GPU = "gpu"  # a worker dies of a GPU error; the node is faulty and fails again
    SOFTWARE = "software"  # a worker raises (a bug, a dependency)
    OOM = "oom"  # a worker is OOM-killed (SIGKILL)
    HANG = "hang"  # every rank stalls (NCCL); found only with --stall-timeout
    HOST = "host"  # the node dies; Slurm marks it DOWN after SlurmdTimeout
    NETWORK = "network"  # the node's network drops for a while (at any node, the coordinator's too)


FAULT_WEIGHTS = {
    Fault.GPU: 58.7,
    Fault.SOFTWARE: 13.4,
    Fault.OOM: 4.0,
    Fault.HANG: 1.7,
    Fault.HOST: 11.0,
    Fault.NETWORK: 10.1,
}


@dataclass(frozen=True)
class Week:
    """Everything a seed fixes about one simulated week, before it is run."""

    seed: int
    nodes: int
    partition: int
    script: Script
    step_s: float
    ckpt_every: int
    save_mean_s: float
    total_steps: int
    startup_s: float
    restart_s: float
    time_limit_s: float
    signal_lead_s: float
    preempt_per_day: float
    preempt_grace_s: float
    cancel_at: float | None
    max_requeues: int
    max_restarts: int
    stall_timeout_s: float | None
    startup_bug: bool
    blips_per_node_day: float
    #: Hot spares (``--spare-nodes``): allocated beyond ``nodes``, they take a lost node's place.
    spares: int

    @property
    def fault_rate_per_node_s(self) -> float:
        return FAULT_RATE_PER_GPU_S * GPUS_PER_NODE

    #: ``nodes`` was forced (``--nodes``), not drawn from the seed.
    forced_nodes: bool = False

    def replay(self) -> str:
        """The command that runs this week alone."""
        forced = f" --nodes {self.nodes}" if self.forced_nodes else ""
        return f"python -m hpcelastic.sim --seed {self.seed}{forced} -v"


def draw_week(seed: int, nodes: int | None = None) -> Week:
    """The week of ``seed`` (``nodes`` forces the node count)."""
    rng = random.Random(seed)
    n = nodes or rng.choices(NODE_COUNTS, NODE_WEIGHTS)[0]
    step_s = rng.uniform(0.5, 6.0)
    ckpt_every_s = rng.uniform(900, 3 * 3600)
    return Week(
        seed=seed,
        nodes=n,
        partition=n + 2 + rng.choice((0, 1, 2, max(1, n // 16), max(2, n // 4), n)),
        script=rng.choice(list(Script)),
        step_s=step_s,
        ckpt_every=max(1, round(ckpt_every_s / step_s)),
        save_mean_s=rng.choice((15.0, 60.0, 180.0, 600.0)),
        total_steps=round(rng.uniform(1.0, 6.0) * DAY_S / step_s),
        startup_s=rng.uniform(60, 900),
        restart_s=rng.uniform(20, 240),
        time_limit_s=rng.choices((24 * 3600.0, 12 * 3600.0, 48 * 3600.0, 4 * 3600.0), (12, 4, 4, 1))[0],
        signal_lead_s=rng.choice((180.0, 330.0)),
        preempt_per_day=rng.choice((0.0, 0.0, 0.3, 1.0, 2.0)),
        preempt_grace_s=rng.choice((0.0, 120.0, 300.0)),
        cancel_at=rng.uniform(0, WEEK_S) if rng.random() < 0.03 else None,
        max_requeues=rng.choice((5, 5, 3, 10)),
        max_restarts=rng.choice((3, 3, 0, 10)),
        stall_timeout_s=rng.choice((None, 300.0, 900.0)),
        startup_bug=rng.random() < 0.02,
        blips_per_node_day=rng.choice(BLIP_RATES),
        spares=rng.choice((0, 0, 0, 1, 2)),
        forced_nodes=nodes is not None,
    )


def save_length(rng: random.Random, week: Week) -> float:
    """How long one checkpoint save takes (lognormal around the week's mean)."""
    return week.save_mean_s * rng.lognormvariate(0.0, 0.5)


def draw_fault(rng: random.Random) -> Fault:
    kinds = list(FAULT_WEIGHTS)
    return rng.choices(kinds, [FAULT_WEIGHTS[k] for k in kinds])[0]


def network_drop_s(rng: random.Random) -> float:
    """How long a network drop lasts: mostly a few seconds (a link flap), sometimes minutes."""
    return rng.uniform(2.0, 6.0) if rng.random() < 0.7 else rng.uniform(30.0, 600.0)


def repair_s(rng: random.Random) -> float:
    """How long a dead node stays DOWN."""
    return rng.uniform(2 * 3600, 24 * 3600)
