"""A small, deterministic CPU data-parallel training (torch.distributed, gloo) that survives faults.

Runs unchanged under torchrun and under ``hpcelastic run``/``hpcelastic agent``::

    hpcelastic run --nodes 2 --nproc-per-node 2 examples/ddp_train.py --steps 40 \\
        --crash-at-step 15 --crash-rank 3 --out final.json

Each step's global batch (48 samples) is a function of the step number only, split evenly over the
ranks, so a run that restarts from its checkpoint ends with bit-for-bit the same model as a run
without faults (on fewer ranks: the same up to float rounding). Gradients are averaged with one
``all_reduce`` of a flat buffer per step, as DDP does, but without DDP's bucket rebuild after the
first iteration, which would round a resumed run's first step differently. Faults are injected
only when ``TORCHELASTIC_RESTART_COUNT`` is 0.
"""

from __future__ import annotations

import time

T_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

try:
    from hpcelastic.worker import heartbeat
except ImportError:  # plain torchrun without hpcelastic installed

    def heartbeat(step: int | None = None) -> None:
        return None


GLOBAL_BATCH = 48


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    p.add_argument("--crash-at-step", type=int, default=-1)
    p.add_argument("--crash-rank", type=int, default=-1)
    p.add_argument("--crash-mode", choices=["exception", "exit", "sigkill", "rtsig"], default="exception")
    p.add_argument("--hang-at-step", type=int, default=-1, help="rank --crash-rank stops making progress")
    p.add_argument("--out", type=Path, help="rank 0 writes the final parameters and checksum here (JSON)")
    p.add_argument("--timing-dir", type=Path, help="each rank writes its start/init times here")
    p.add_argument("--checkpoint-dir", type=Path, default=None, help="default: $HPCELASTIC_CHECKPOINT_DIR")
    return p.parse_args()


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of the step's global batch (a function of the step only)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def average_gradients(model: torch.nn.Module, world: int) -> None:
    """Average the gradients over all ranks with one all_reduce (deterministic for a given world)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def save_checkpoint(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def inject_fault(args: argparse.Namespace, step: int, rank: int, restart: int) -> None:
    if restart != 0 or rank != args.crash_rank:
        return
    if step == args.hang_at_step:
        print(f"rank {rank}: hanging at step {step}", flush=True)
        while True:
            time.sleep(3600)
    if step != args.crash_at_step:
        return
    if args.timing_dir:
        if (args.timing_dir / "crash.json").exists():
            return  # crash once per run, even where a launcher does not count restarts (torchrun)
        write_json(args.timing_dir / "crash.json", {"ts": time.time(), "rank": rank, "step": step})
    if args.crash_mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if args.crash_mode == "rtsig":  # a real-time signal, whose default action ends the process
        os.kill(os.getpid(), signal.SIGRTMIN + 3)
    if args.crash_mode == "exit":
        sys.exit(13)
    raise RuntimeError(f"injected crash at step {step} on rank {rank}")


def main() -> None:
    args = parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if GLOBAL_BATCH % world:
        raise SystemExit(f"world size {world} must divide the global batch {GLOBAL_BATCH}")
    dist.init_process_group("gloo")
    t_init = time.time()
    if args.timing_dir:
        args.timing_dir.mkdir(parents=True, exist_ok=True)
        write_json(
            args.timing_dir / f"worker-{os.getpid()}.json",
            {"start": T_START, "init": t_init, "restart": restart, "rank": rank, "pid": os.getpid()},
        )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ckpt_dir = args.checkpoint_dir or Path(os.environ.get("HPCELASTIC_CHECKPOINT_DIR", "checkpoints"))
    ckpt = ckpt_dir / "ddp_train.pt"
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"] + 1
        print(f"rank {rank}: resumed from step {state['step']} (restart {restart})", flush=True)
    for step in range(start, args.steps):
        inject_fault(args, step, rank, restart)
        x, y = batch(step, rank, world)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        average_gradients(model, world)
        opt.step()
        heartbeat(step)
        if rank == 0:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            save_checkpoint(ckpt, model, opt, step)
        if args.step_time:
            time.sleep(args.step_time)
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    if rank == 0:
        checksum = float(params.double().sum())
        print(f"final checksum {checksum:.10f} after {args.steps} steps on {world} ranks", flush=True)
        if args.out:
            write_json(args.out, {"checksum": checksum, "params": params.tolist(), "world_size": world})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
