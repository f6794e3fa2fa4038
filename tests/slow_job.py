"""The unchanged DDP script of the slow-node tests (``tests/faults/slow_train.py``) and its fault-free model.

``slow_train.py --steps N --step-time T`` pads each step to a steady pace with sleep (a rank slowed on the
CPU shows beyond it), saves a ``torch.save`` checkpoint every ``--ckpt-every`` steps into ``--ckpt-dir``,
resumes from the newest there (and appends the step to ``out/pids/resumed``), and writes its final
parameters' SHA-256 to ``--out``.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = Path(__file__).parent / "faults" / "slow_train.py"
#: Steps padded to 0.2 s (the healthy pace stays the same on a loaded machine), a checkpoint every 20.
STEP_TIME, CKPT_EVERY = 0.2, 20
#: A slowed worker's share of one CPU: its compute takes about 30 times as long.
QUOTA = 0.03
#: The detector's baseline needs three healthy 10 s windows after the warm-up: slow a node after this step.
SLOW_AFTER_STEP = 200


def train_args(
    out: Path,
    ckpt: Path | str,
    steps: int,
    step_time: float = STEP_TIME,
    script: Path = SCRIPT,
    dcp: bool = False,
) -> list[str]:
    """The script and its arguments; it writes its pid to ``out/pids/rank-R`` and its model's digest to
    ``out/final.sha256``; ``dcp``: its checkpoints are DCP directories (``--dcp``)."""
    return [
        str(script),
        "--steps",
        str(steps),
        "--step-time",
        str(step_time),
        "--ckpt-dir",
        str(ckpt),
        "--ckpt-every",
        str(CKPT_EVERY),
        "--pid-dir",
        str(out / "pids"),
        "--out",
        str(out / "final.sha256"),
        *(["--dcp"] if dcp else []),
    ]


def resumed_steps(out: Path) -> tuple[int, ...]:
    """The steps the script resumed from, in order (``out/pids/resumed``, written by rank 0)."""
    f = out / "pids" / "resumed"
    return tuple(int(line) for line in f.read_text().split()) if f.exists() else ()


@functools.cache
def reference_digest(steps: int, ranks: int = 4, resumed: tuple[int, ...] = (), dcp: bool = False) -> str:
    """The fault-free model: the same script under plain torchrun, no padding, stopped after each step of
    ``resumed`` and resumed there (a restart's first step may reduce in another order: see the script)."""
    out = Path(tempfile.mkdtemp(prefix="hpcelastic-slow-reference-"))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    for stop in (*resumed, steps):
        args = train_args(out, out / "ckpt", stop, 0.0, dcp=dcp)
        subprocess.run([*argv, *args], check=True, capture_output=True, timeout=600)
    assert resumed_steps(out) == resumed, (resumed_steps(out), resumed)
    return (out / "final.sha256").read_text()
