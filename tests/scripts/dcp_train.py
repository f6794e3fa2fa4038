"""An unchanged torch.distributed.checkpoint (DCP) training script (no hpcelastic import, no heartbeats).

Every ``--save-every`` steps each rank writes its shard with ``dcp.save`` into ``<checkpoint dir>/step-<n>``
(complete once DCP writes ``.metadata``); it resumes from the newest complete one. Rank 0's log lines
``<event> <step> <time.time()>`` (``resumed``, ``step``, ``saved``, ``crash``) are the truth the
lost-time ledger is checked against.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


def log(what: str, step: int) -> None:
    if dist.get_rank() == 0:
        print(f"{what} {step} {time.time():.6f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--crash-at-step", type=int, default=-1)
    args = p.parse_args()
    dist.init_process_group("gloo")
    root = Path(os.environ.get("HPCELASTIC_CHECKPOINT_DIR", "checkpoints"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    done = sorted(
        (int(m.group(1)), d)
        for d in root.glob("step-*")
        if (m := re.fullmatch(r"step-(\d+)", d.name)) and (d / ".metadata").exists()
    )
    if done:
        step, where = done[-1]
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=str(where))
        model.load_state_dict(state["model"])
        start = step + 1
        log("resumed", step)
    for step in range(start, args.steps):
        if step == args.crash_at_step and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
            log("crash", step)
            if dist.get_rank() == dist.get_world_size() - 1:
                os.kill(os.getpid(), signal.SIGKILL)
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for prm in model.parameters():
            dist.all_reduce(prm.grad)
        opt.step()
        time.sleep(args.step_time)
        log("step", step)
        if step % args.save_every == args.save_every - 1:
            dcp.save({"model": model.state_dict()}, checkpoint_id=str(root / f"step-{step}"))
            log("saved", step)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
