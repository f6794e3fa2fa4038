"""A small, deterministic CPU training with torchft replica groups (gloo), as torchft's examples are.

Runs under ``hpcelastic run``/``submit`` with ``--replica-groups R`` (or torchrun plus a lighthouse)::

    hpcelastic run --nodes 4 --nproc-per-node 1 --replica-groups 2 examples/torchft_train.py \\
        --steps 60 --out-dir out

torchft's :class:`~torchft.Manager` forms a quorum of the replica groups every step through the
lighthouse (``TORCHFT_LIGHTHOUSE``), its DistributedDataParallel averages gradients across the
groups, its Optimizer commits a step only when every participant succeeded, and a group that comes
back heals by fetching the live weights from a peer. Inside a group (``RANK``/``WORLD_SIZE``) the
gradients are averaged with one gloo ``all_reduce`` over the group's own world.

Each step's batch is a function of (step, replica group, rank in the group). Checkpoints go through
the worker API (``publish_checkpoint`` / ``resume_path``), so a requeued job resumes. With
``--out-dir`` rank 0 of each group writes ``group<G>.json``: the steps it committed with their
times and the final parameters. ``--crash-group G --crash-at-step S`` SIGKILLs rank
``--crash-rank`` of group G once (a marker file in ``--out-dir`` keeps it to one crash per run);
with ``--fault hang`` that rank sleeps instead, for good (a hang for ``--stall-timeout`` to find).
After a preemption or time-limit signal every rank stops after the job's one stop step
(``worker.should_stop()``); rank 0 of each group checkpoints it first.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

try:
    from hpcelastic import worker
except ImportError:  # plain torchrun without hpcelastic
    worker = None  # type: ignore[assignment]

BATCH = 16


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--timeout", type=float, default=10.0, help="torchft collective timeout (s)")
    p.add_argument("--quorum-timeout", type=float, default=30.0, help="torchft quorum timeout (s)")
    p.add_argument("--out-dir", type=Path)
    p.add_argument("--no-heartbeat", action="store_true", help="send no worker.heartbeat (stacks show hangs)")
    p.add_argument("--resume", help="a checkpoint to start from when the run has none published (a rerun)")
    p.add_argument("--crash-group", type=int, default=-1)
    p.add_argument("--crash-rank", type=int, default=0, help="rank within the group")
    p.add_argument("--crash-at-step", type=int, default=-1)
    p.add_argument(
        "--fault", choices=("kill", "hang"), default="kill", help="what happens at --crash-at-step"
    )
    return p.parse_args()


def batch(step: int, group: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch: a function of the step, the replica group and the rank in the group."""
    g = torch.Generator().manual_seed(100_000 * group + 1000 * rank + step)
    x = torch.randn(BATCH, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def average_in_group(model: torch.nn.Module, world: int) -> None:
    """Average the gradients over the group's ranks (one all_reduce of a flat buffer)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def maybe_crash(args: argparse.Namespace, group: int, rank: int, step: int) -> None:
    if group != args.crash_group or rank != args.crash_rank or step != args.crash_at_step:
        return
    marker = args.out_dir / "crashed" if args.out_dir else None
    if marker is not None:
        if marker.exists():
            return
        marker.write_text(json.dumps({"ts": time.time(), "group": group, "rank": rank, "step": step}))
    if args.fault == "hang":
        print(f"group {group} rank {rank}: hanging at step {step}", flush=True)
        time.sleep(1e6)
    print(f"group {group} rank {rank}: SIGKILL at step {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.out_dir:  # every rank may be first: each makes it, none fails on another's
        args.out_dir.mkdir(parents=True, exist_ok=True)
    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world > 1:
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    inner = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)

    def state_dict() -> dict:
        return {"model": module.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict) -> None:
        module.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.timeout)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"torchft_train_{group}",
        timeout=timedelta(seconds=args.timeout),
        quorum_timeout=timedelta(seconds=args.quorum_timeout),
    )
    resume = (worker.resume_path() if worker is not None else None) or args.resume
    resumed_at = None
    if resume:
        saved = torch.load(resume, weights_only=True)
        load_state_dict(saved["user"])
        manager.load_state_dict(saved["torchft"])
        resumed_at = manager.current_step()
        print(
            f"group {group} rank {rank}: resumed from {resume} at step {manager.current_step()}", flush=True
        )
    model = DistributedDataParallel(manager, module)
    optimizer = Optimizer(manager, inner)
    committed: list[tuple[int, float]] = []

    def checkpoint() -> None:
        path = Path(worker.checkpoint_dir()) / f"torchft-g{group}-step{manager.current_step()}.pt"
        tmp = path.with_name(f".{path.name}.tmp")
        torch.save({"user": state_dict(), "torchft": manager.state_dict()}, tmp)
        os.replace(tmp, path)
        worker.publish_checkpoint(path, manager.current_step())

    stopped = False
    while manager.current_step() < args.steps:
        step = manager.current_step()
        maybe_crash(args, group, rank, step)
        x, y = batch(step, group, rank)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if world > 1:
            average_in_group(module, world)
        optimizer.step()
        if manager.current_step() > step:
            # The step just committed: after a heal it is the peer's step, not the one this rank began.
            done = manager.current_step() - 1
            committed.append((done, time.time()))
            if worker is not None and not args.no_heartbeat:
                worker.heartbeat(done)
            stopped = worker is not None and worker.should_stop()
            if (
                rank == 0
                and worker is not None
                and (stopped or manager.current_step() % args.checkpoint_every == 0)
            ):
                checkpoint()
            if stopped:
                print(f"group {group} rank {rank}: stopping after step {done}", flush=True)
                break
        if args.step_time:
            time.sleep(args.step_time)
    params = torch.cat([p.detach().flatten() for p in module.parameters()])
    if rank == 0:
        checksum = float(params.double().sum())
        print(
            f"group {group}: final checksum {checksum:.10f} after {manager.current_step()} steps", flush=True
        )
        if args.out_dir:
            out = {
                "group": group,
                "steps": committed,
                "params": params.tolist(),
                "checksum": checksum,
                "stopped": stopped,
                "resumed_at": resumed_at,
            }
            path = args.out_dir / f"group{group}.json"
            path.with_suffix(".tmp").write_text(json.dumps(out))
            os.replace(path.with_suffix(".tmp"), path)
    manager.shutdown(wait=False)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
