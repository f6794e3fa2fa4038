"""What the tier_libs training scripts share (none of it imports hpcelastic): the arguments, the tiny model
and its batch of each step, the faults, rank 0's log lines and the digest of the final parameters.

Steps count completed optimizer steps: ``saved 10`` and ``resumed 10`` mean 10 steps done (the
checkpoint's number is 10); every round of every rank prints one ``resumed N`` (0: a fresh start), rank 0
the other lines. Each step's data comes from ``torch.Generator().manual_seed(step)``, so a run ends with
the same parameters whichever checkpoint it resumed from, as long as the checkpoint held the model and
optimizer state.

Faults, by arguments only: ``--crash-at-step N`` SIGKILLs ``--crash-rank`` when N steps are done (between two
saves), only while ``TORCHELASTIC_RESTART_COUNT`` is ``--crash-restart``; ``--crash-mid-save N`` SIGKILLs rank
0 (the rank that writes the files every rank's save needs) between the files of the save of step N, on
restart count 0 only.

The testbed's node deaths (tests/slurm/tier_differential_slurm.py), by environment only: rank 0 stalls until
its node is killed from outside where the mid-save fault would kill it, in each save of
``TIER_LIBS_STALL_SAVES`` (steps, comma-separated), or before the steps of ``TIER_LIBS_STALL_STEPS``; once
each in a job (every attempt), marked by a file ``stalled-N`` in ``TIER_LIBS_STALL_DIR``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

WRITER_RANK = 0


def parse(extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """The scripts' common arguments (plus ``extra``'s)."""
    p = argparse.ArgumentParser()
    default_dir = os.environ.get("HPCELASTIC_CHECKPOINT_DIR", "checkpoints")
    p.add_argument("--ckpt-dir", type=Path, default=Path(default_dir))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--step-time", type=float, default=0.3)
    p.add_argument("--crash-at-step", type=int, default=-1)
    p.add_argument("--crash-restart", type=int, default=0)
    p.add_argument("--crash-rank", type=int, default=0)
    p.add_argument("--crash-mid-save", type=int, default=-1)
    p.add_argument("--out", type=Path, help="rank 0 writes the final parameters' digest here (JSON)")
    if extra is not None:
        extra(p)
    return p.parse_args()


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def log(what: str, step: int, every_rank: bool = False) -> None:
    """One rank-0 line ``<what> <step>`` (with ``every_rank``, one in each rank's log)."""
    if every_rank or rank() == 0:
        print(f"{what} {step}", flush=True)


def resumed(step: int) -> None:
    """Each rank's line of the step its round resumed from (0: a fresh start)."""
    log("resumed", step, every_rank=True)


def build_model() -> torch.nn.Module:
    """The tiny model, the same on every rank and in every run."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of the step after ``step`` steps done, the same on every rank: the ranks' gradients are
    equal, so their sum is the same in any order (a resumed DDP rebuilds its buckets, and the ring
    all-reduce of more than 2 ranks sums each bucket's chunks in an order that depends on where they fall)."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def loss(model: Callable[[torch.Tensor], torch.Tensor], step: int) -> torch.Tensor:
    x, y = batch(step)
    return torch.nn.functional.mse_loss(model(x), y)


def stall_mark(kind: str, done: int) -> Path | None:
    """The marker of a stall due at ``done`` steps (``kind``: ``SAVES`` or ``STEPS``), or None."""
    if rank() != WRITER_RANK or str(done) not in os.environ.get(f"TIER_LIBS_STALL_{kind}", "").split(","):
        return None
    mark = Path(os.environ["TIER_LIBS_STALL_DIR"]) / f"stalled-{done}"
    return None if mark.exists() else mark


def stall(mark: Path, done: int) -> None:
    """Mark the stall and stand still until the node is killed."""
    mark.touch()
    log("stalled", done)
    time.sleep(3600)


def die(step: int) -> None:
    """SIGKILL this process (rank 0 says so first); a stall due in this save instead stands still."""
    if (mark := stall_mark("SAVES", step)) is not None:
        stall(mark, step)
    log("crash", step)
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def maybe_crash(args: argparse.Namespace, done: int) -> None:
    """The between-saves fault (or a stall): called with the steps done before each step starts."""
    if (mark := stall_mark("STEPS", done)) is not None:
        stall(mark, done)
    if done == args.crash_at_step and restart_count() == args.crash_restart and rank() == args.crash_rank:
        die(done)


def dies_mid_save(args: argparse.Namespace, done: int) -> bool:
    """This process is to die (or stall) inside the save of ``done`` steps."""
    killed = done == args.crash_mid_save and restart_count() == 0 and rank() == WRITER_RANK
    return killed or stall_mark("SAVES", done) is not None


@contextlib.contextmanager
def dying_at_call(args: argparse.Namespace, done: int, owner: Any, name: str, nth: int) -> Iterator[None]:
    """Within the save of ``done`` steps, when it is the one to die mid-save: ``owner.name``'s ``nth`` call
    (1-based) kills this process before it writes anything (the calls before it wrote their files)."""
    if not dies_mid_save(args, done):
        yield
        return
    original = getattr(owner, name)
    calls = 0

    def wrapper(*a: Any, **kw: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == nth:
            die(done)
        return original(*a, **kw)

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


def newest(root: Path, pattern: str, complete: Callable[[Path], bool]) -> tuple[int, Path] | None:
    """The entry of ``root`` named ``pattern`` (group 1: its step) with the highest step that is
    ``complete``."""
    found = []
    with contextlib.suppress(OSError):
        for entry in root.iterdir():
            if (m := re.fullmatch(pattern, entry.name)) and complete(entry):
                found.append((int(m.group(1)), entry))
    return max(found, default=None)


def digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 of the parameters, by name."""
    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda kv: kv[0]):
        h.update(name.encode())
        h.update(t.detach().to(torch.float64).contiguous().numpy().tobytes())
    return h.hexdigest()


def finish(args: argparse.Namespace, named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Rank 0 writes the final parameters' digest to ``--out`` (the caller gives the full parameters)."""
    if rank() != 0 or args.out is None:
        return
    value = digest(named)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"sha256": value}))
    tmp.replace(args.out)
    print(f"digest {value}", flush=True)


def train(
    args: argparse.Namespace,
    model: Callable[[torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    start: int,
    save: Callable[[int], None],
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
) -> None:
    """The training loop from ``start`` steps done: each step's batch, the between-saves fault, a save every
    ``--save-every`` steps (``save(done)``), rank 0's lines."""
    resumed(start)
    for done in range(start, args.steps):
        maybe_crash(args, done)
        optimizer.zero_grad()
        backward(loss(model, done))
        optimizer.step()
        time.sleep(args.step_time)
        if (done + 1) % args.save_every == 0:
            save(done + 1)
            log("saved", done + 1)
