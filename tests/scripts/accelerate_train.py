"""An unchanged Hugging Face Accelerate training script (no hpcelastic import, no heartbeats).

It saves ``accelerator.save_state`` every ``--save-every`` steps into ``<checkpoint dir>/checkpoint_<step>``
and resumes from the newest one it finds, as Accelerate's own examples do. Its log is the truth the
lost-time ledger is checked against: each rank 0 line is ``<event> <step> <time.time()>``:
``resumed``, ``step`` (done), ``saved`` (the save returned) and ``crash``.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import time
from pathlib import Path

import torch
from accelerate import Accelerator


def log(acc: Accelerator, what: str, step: int) -> None:
    if acc.is_main_process:
        print(f"{what} {step} {time.time():.6f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--crash-at-step", type=int, default=-1)
    args = p.parse_args()
    ckpt_root = Path(os.environ.get("HPCELASTIC_CHECKPOINT_DIR", "checkpoints"))
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    start = 0
    saved = sorted(
        (int(m.group(1)), d)
        for d in ckpt_root.glob("checkpoint_*")
        if (m := re.fullmatch(r"checkpoint_(\d+)", d.name))
    )
    if saved:
        step, where = saved[-1]
        acc.load_state(str(where))
        start = step + 1
        log(acc, "resumed", step)
    for step in range(start, args.steps):
        if step == args.crash_at_step and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
            log(acc, "crash", step)
            if acc.is_main_process:
                os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 32, generator=g)
        loss = model(x).pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        time.sleep(args.step_time)
        log(acc, "step", step)
        if step % args.save_every == args.save_every - 1:
            acc.save_state(str(ckpt_root / f"checkpoint_{step}"))
            log(acc, "saved", step)
    acc.wait_for_everyone()
    acc.end_training()


if __name__ == "__main__":
    main()
