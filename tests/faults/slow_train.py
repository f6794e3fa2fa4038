"""A plain DDP training on CPU (gloo) for the slow-node tests: no hpcelastic calls, only its pid for the test.

Trains for ``--seconds`` (every rank stops at the same step: rank 0 decides and broadcasts it), or for
``--steps`` with a checkpoint (``torch.save`` of model, optimizer and step, written aside and renamed;
with ``--dcp``, ``torch.distributed.checkpoint`` of the distributed state dicts, a directory each, every
rank taking part) in ``--ckpt-dir`` every ``--ckpt-every`` steps, resuming from the newest there; ``--out``
gets the final parameters' SHA-256 (each step's data depends on the step and rank only);
``--step-time`` pads each step with sleep to a steady pace (a slowed rank's compute shows beyond it), up to
``--jitter`` of it longer at random on each rank;
``--stripe-every K`` gives ``--stripe-rank`` ``--stripe-batches`` batches more to compute every K-th step
(the workload's own imbalance; the model is the same); ``--slow-input-rank R`` loads the batches through a
DataLoader, each ``--slow-input-s`` longer on rank R from step ``--slow-input-after`` on. It writes
``<pid-dir>/rank-<RANK>`` with its pid, so that the test can slow one rank's process from outside.

A resumed run ends with the same model, bit for bit, as the same script resumed from the same checkpoint
under torchrun, but not always as one never stopped (resumed from step 340 of 600 it ends with another,
from 420 with the same; the first step after a restart may reduce in another order): rank 0 appends each
step it resumed from to ``<pid-dir>/resumed``, so that a test compares with torchrun resumed there.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import random
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils.data import DataLoader, Dataset


class Batches(Dataset):
    """Step ``i``'s batch of this rank (what the loop draws without a loader); from step ``slow_from`` on,
    each takes ``slow_s`` longer to load (a slow disk or a starved loader on this rank's node)."""

    def __init__(self, rank: int, width: int, slow_from: int | None, slow_s: float) -> None:
        self.rank, self.width, self.slow_from, self.slow_s = rank, width, slow_from, slow_s

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.slow_from is not None and i >= self.slow_from:
            time.sleep(self.slow_s)
        return torch.randn(64, self.width, generator=torch.Generator().manual_seed(i * 1000 + self.rank))


def newest(ckpt_dir: Path | None, use_dcp: bool) -> Path | None:
    """The newest complete checkpoint: a ``torch.save`` file, or a DCP directory with its ``.metadata``."""
    if ckpt_dir is None or not ckpt_dir.is_dir():
        return None
    found = sorted(p for p in ckpt_dir.glob("ckpt-*") if (p / ".metadata").is_file()) if use_dcp else []
    found = found or sorted(ckpt_dir.glob("ckpt-*.pt"))
    return found[-1] if found else None


def save(args: argparse.Namespace, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    if args.dcp:  # every rank takes part; DCP writes the directory's .metadata last
        model_sd, opt_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "opt": opt_sd, "step": torch.tensor(step)}
        dcp.save(state, checkpoint_id=args.ckpt_dir / f"ckpt-{step:06d}")
        return
    if dist.get_rank() == 0:
        args.ckpt_dir.mkdir(parents=True, exist_ok=True)
        tmp = args.ckpt_dir / f".ckpt-{step:06d}.tmp"
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
        os.replace(tmp, args.ckpt_dir / f"ckpt-{step:06d}.pt")


def resume(args: argparse.Namespace, model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Load the newest checkpoint into ``model`` and ``opt``; the step it was taken at (0: none)."""
    found = newest(args.ckpt_dir, args.dcp)
    if found is None:
        return 0
    if found.is_dir():
        model_sd, opt_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "opt": opt_sd, "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=found)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["opt"])
        return int(state["step"])
    state = torch.load(found, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    return int(state["step"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--steps", type=int, default=None, help="train this many steps (not --seconds)")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--pid-dir", type=Path, required=True)
    p.add_argument("--ckpt-dir", type=Path, default=None)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--dcp", action="store_true", help="checkpoint through DCP, every rank")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--ddp-outlives-group", action="store_true", help="free DDP when main returns, as most scripts do"
    )
    p.add_argument("--step-time", type=float, default=0.0, help="a step takes at least this long (it sleeps)")
    p.add_argument("--stripe-every", type=int, default=0, help="every K-th step one rank gets more data")
    p.add_argument("--stripe-rank", type=int, default=0)
    p.add_argument("--stripe-batches", type=int, default=4, help="the batches more a stripe step gets")
    p.add_argument("--slow-input-rank", type=int, default=None, help="load batches through a DataLoader, ...")
    p.add_argument("--slow-input-after", type=int, default=0, help="... slow on this rank from this step on")
    p.add_argument("--slow-input-s", type=float, default=0.4, help="seconds more each of its batches takes")
    p.add_argument(
        "--jitter", type=float, default=0.0, help="pad each step up to this share longer, at random"
    )
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    args.pid_dir.mkdir(parents=True, exist_ok=True)
    (args.pid_dir / f"rank-{rank}").write_text(str(os.getpid()))
    torch.manual_seed(0)
    w = args.width
    model = torch.nn.Sequential(
        *(torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.Tanh()) for _ in range(4))
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step = resume(args, model, opt)  # before DDP wraps it, which then starts every rank from rank 0's state
    if step and rank == 0:
        with open(args.pid_dir / "resumed", "a") as f:
            f.write(f"{step}\n")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    jitter = random.Random(rank)
    loader = None
    if args.slow_input_rank is not None:  # the same batches through a DataLoader
        slow_from = args.slow_input_after if rank == args.slow_input_rank else None
        loader = iter(
            DataLoader(
                Batches(rank, w, slow_from, args.slow_input_s), batch_size=None, sampler=itertools.count(step)
            )
        )
    end = time.time() + args.seconds
    go = torch.ones(1)
    while go.item() > 0:
        began = time.monotonic()
        gen = torch.Generator().manual_seed(step * 1000 + rank)
        x = next(loader) if loader is not None else torch.randn(64, w, generator=gen)
        opt.zero_grad()
        ddp(x).pow(2).mean().backward()
        if args.stripe_every and step % args.stripe_every == 0 and rank == args.stripe_rank:
            with torch.no_grad():  # a workload stripe: this rank's batch is longer this step
                for _ in range(args.stripe_batches):
                    model(torch.randn(64, w, generator=gen))
        opt.step()
        step += 1
        pad = args.step_time * (1.0 + args.jitter * jitter.random())  # per-rank noise: the model is the same
        time.sleep(max(0.0, pad - (time.monotonic() - began)))
        if args.steps is not None:
            go.fill_(1.0 if step < args.steps else 0.0)
            if args.ckpt_dir is not None and step % args.ckpt_every == 0:
                save(args, model, opt, step)
        elif step % 10 == 0:
            go.fill_(1.0 if rank != 0 or time.time() < end else 0.0)
            dist.broadcast(go, 0)
    print(f"rank {rank}: {step} steps", flush=True)
    dist.barrier()
    if rank == 0 and args.out is not None:
        digest = hashlib.sha256()
        for t in model.state_dict().values():
            digest.update(t.detach().numpy().tobytes())
        args.out.write_text(digest.hexdigest())
    # DDP's reducer holds the process group, and its binding frees it holding the GIL: freed last, when
    # main returns, ProcessGroupGloo's destructor joins a gloo thread that may wait for the GIL to free a
    # DCP collective's tensors (pytorch/pytorch#56297). Under torchrun (the reference) the script frees DDP
    # first; hpcelastic's warm workers settle in destroy_process_group (agent/pg_teardown.py), which
    # tests/faults/test_exit_local.py checks with --ddp-outlives-group.
    if not args.ddp_outlives_group:
        del ddp
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
