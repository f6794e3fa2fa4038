"""A plain DDP training on CPU (gloo) for the slow-node tests: no hpcelastic calls, only its pid for the test.

Trains for ``--seconds`` (every rank stops at the same step: rank 0 decides and broadcasts it), or for
``--steps`` with a checkpoint (``torch.save`` of model, optimizer and step, written aside and renamed) in
``--ckpt-dir`` every ``--ckpt-every`` steps, resuming from the newest there; ``--out`` gets the final
parameters' SHA-256 (each step's data depends on the step and rank only: a resumed run ends the same);
``--step-time`` pads each step with sleep to a steady pace (a slowed rank's compute shows beyond it);
``--stripe-every K`` gives ``--stripe-rank`` ``--stripe-batches`` batches more to compute every K-th step
(the workload's own imbalance; the model is the same). It
writes ``<pid-dir>/rank-<RANK>`` with its pid, so that the test can slow one rank's process from outside.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def newest(ckpt_dir: Path | None) -> Path | None:
    found = sorted(ckpt_dir.glob("ckpt-*.pt")) if ckpt_dir is not None and ckpt_dir.is_dir() else []
    return found[-1] if found else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--steps", type=int, default=None, help="train this many steps (not --seconds)")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--pid-dir", type=Path, required=True)
    p.add_argument("--ckpt-dir", type=Path, default=None)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--step-time", type=float, default=0.0, help="a step takes at least this long (it sleeps)")
    p.add_argument("--stripe-every", type=int, default=0, help="every K-th step one rank gets more data")
    p.add_argument("--stripe-rank", type=int, default=0)
    p.add_argument("--stripe-batches", type=int, default=4, help="the batches more a stripe step gets")
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
    step = 0
    resume = newest(args.ckpt_dir)
    if resume is not None:
        state = torch.load(resume, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = int(state["step"])
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    end = time.time() + args.seconds
    go = torch.ones(1)
    while go.item() > 0:
        began = time.monotonic()
        gen = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(64, w, generator=gen)
        opt.zero_grad()
        ddp(x).pow(2).mean().backward()
        if args.stripe_every and step % args.stripe_every == 0 and rank == args.stripe_rank:
            with torch.no_grad():  # a workload stripe: this rank's batch is longer this step
                for _ in range(args.stripe_batches):
                    model(torch.randn(64, w, generator=gen))
        opt.step()
        step += 1
        time.sleep(max(0.0, args.step_time - (time.monotonic() - began)))
        if args.steps is not None:
            go.fill_(1.0 if step < args.steps else 0.0)
            if args.ckpt_dir is not None and step % args.ckpt_every == 0 and rank == 0:
                args.ckpt_dir.mkdir(parents=True, exist_ok=True)
                tmp = args.ckpt_dir / f".ckpt-{step:06d}.tmp"
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
                os.replace(tmp, args.ckpt_dir / f"ckpt-{step:06d}.pt")
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
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
