"""A plain DDP training on CPU (gloo) for the slow-node tests: no hpcelastic calls, only its pid for the test.

Trains for ``--seconds`` (every rank stops at the same step: rank 0 decides and broadcasts it) and writes
``<pid-dir>/rank-<RANK>`` with its pid, so that the test can slow one rank's process from outside.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--pid-dir", type=Path, required=True)
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
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    end = time.time() + args.seconds
    go = torch.ones(1)
    step = 0
    while go.item() > 0:
        x = torch.randn(64, w)
        opt.zero_grad()
        ddp(x).pow(2).mean().backward()
        opt.step()
        step += 1
        if step % 10 == 0:
            go.fill_(1.0 if rank != 0 or time.time() < end else 0.0)
            dist.broadcast(go, 0)
    print(f"rank {rank}: {step} steps", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
