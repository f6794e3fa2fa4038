"""An unchanged DDP training (no hpcelastic import) for bench/steady_state.py: gloo on CPU, a compute-bound
MLP in ``DistributedDataParallel``, and with ``--save-every N`` a DCP checkpoint every N steps into
``$HPCELASTIC_CHECKPOINT_DIR`` (or ``--checkpoint-dir``). Each rank writes ``<out>/rank-<R>.json``: its pid,
the wall times of its first and last step, its steps, its CPU time (user + system) over them, and the
time its saves blocked it."""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--checkpoint-dir", type=Path, default=None)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = args.checkpoint_dir or Path(os.environ.get("HPCELASTIC_CHECKPOINT_DIR", "checkpoints"))
    torch.manual_seed(0)
    w = args.width
    model = DistributedDataParallel(
        torch.nn.Sequential(
            torch.nn.Linear(w, w),
            torch.nn.ReLU(),
            torch.nn.Linear(w, w),
            torch.nn.ReLU(),
            torch.nn.Linear(w, 1),
        )  # fmt: skip
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    first = cpu0 = None
    saving = 0.0
    for step in range(1, args.steps + 1):
        x = torch.randn(64, w, generator=g)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if first is None:  # the first step is warm-up (DDP's buckets, allocator): timed from its end
            first, cpu0 = time.time(), time.process_time()
        if args.save_every and step % args.save_every == 0:
            t0 = time.perf_counter()
            dcp.save({"model": model.state_dict()}, checkpoint_id=str(root / f"step-{step:06d}"))
            saving += time.perf_counter() - t0
    last, cpu1 = time.time(), time.process_time()
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"pid": os.getpid(), "first": first, "last": last, "steps": args.steps - 1, "cpu_s": cpu1 - cpu0}
    report["saving_s"] = saving
    (args.out / f"rank-{rank}.json").write_text(json.dumps(report))
    # DDP's reducer holds the last reference to the gloo group: freed after destroy_process_group, the group's
    # destructor joins its threads while holding the GIL one of them waits for (a hang at exit in about one
    # run in three, under torchrun as under hpcelastic, torch 2.13). Freed first, with nothing in flight.
    dist.barrier()
    del model, opt
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
