"""Deterministic reference training: the measure of "nothing lost".

A small MLP trained with SGD + momentum on synthetic data, in float64, on CPU with
torch.distributed (gloo). The result is bit-for-bit the same whatever the world size
and however often the run is interrupted, because:

* the data of step ``s`` is a pure function of (seed, s): a resumed run sees the same
  samples in the same order;
* every rank computes per-sample gradients for its share of the fixed global batch,
  all ranks ``all_gather`` them, and each sums them in global sample order (a fixed
  reduction order, unlike a ring all-reduce whose order depends on the world size);
* rank 0 checkpoints (parameters, momentum, step) at step boundaries, writes to a
  temporary file, renames it into place, and only then publishes it.

It runs unchanged under torchrun, ``hpcelastic run`` and ``hpcelastic agent``. With ``--plain`` it is
an unchanged torchrun script: it does not use ``hpcelastic.worker`` at all (no heartbeat, no published
checkpoint, no stop request), saves into ``--ckpt-dir`` and resumes from the newest file there itself:
``--format pt`` (rank 0's ``torch.save``, through a temporary file unless ``--direct-save``) or
``--format dcp`` (every rank, ``torch.distributed.checkpoint`` directories, the newest with a
``.metadata`` resumed).
Fault injection (for the tests) is driven by ``--fault`` and fires only in the chosen
attempt and restart round, so the recovered run can finish.

Output: rank 0 writes ``<out>/final.json`` with the SHA-256 of the final parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

worker: Any = None  # hpcelastic.worker, imported in main() unless --bare

GLOBAL_BATCH = 24  # divisible by every world size the tests use (1, 2, 3, 4, 6, 8, 12)
IN, HIDDEN, OUT = 8, 16, 1
FAULTS = (
    "none",
    "exit",
    "raise",
    "sigkill",
    "hang",
    "grandchild",
    "ckpt-crash",
    "kill-agent",
    "startup",
    "init",
    "slow-save",
    "late-exit",
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--step-time", type=float, default=0.0, help="sleep per step, seconds")
    p.add_argument("--out", default=None, help="where rank 0 writes final.json (default: checkpoint dir)")
    p.add_argument("--plain", action="store_true", help="an unchanged script: no hpcelastic.worker calls")
    p.add_argument("--ckpt-dir", default=None, help="with --plain: where checkpoints are saved and found")
    p.add_argument(
        "--bare",
        action="store_true",
        help="with --plain: do not even import hpcelastic (its import installs a handler for the stop "
        "signal; a script that never heard of hpcelastic has none, and its agent stops it when not saving)",
    )
    p.add_argument(
        "--format", choices=("pt", "dcp"), default="pt", help="with --plain: how checkpoints are saved"
    )
    p.add_argument("--direct-save", action="store_true", help="torch.save straight to the file (no rename)")
    p.add_argument(
        "--save-delay",
        type=float,
        default=3.0,
        help="seconds a slow-save fault stalls the save (late-exit: the exit)",
    )
    p.add_argument("--fault", choices=FAULTS, default="none")
    p.add_argument("--fault-step", type=int, default=10)
    p.add_argument("--fault-rank", default="1", help="rank(s) that inject the fault, e.g. 1 or 1,3")
    p.add_argument("--fault-attempt", type=int, default=0, help="attempt in which the fault fires (-1: all)")
    p.add_argument("--fault-restart", type=int, default=0, help="restart round in which it fires (-1: all)")
    return p.parse_args(argv)


def fault_armed(args: argparse.Namespace, rank: int) -> bool:
    """True when this rank should inject the configured fault in this attempt and round."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return (
        args.fault != "none"
        and rank in {int(r) for r in str(args.fault_rank).split(",")}
        and args.fault_attempt in (-1, int(os.environ.get("HPCELASTIC_ATTEMPT", "0") or 0))
        and args.fault_restart in (-1, restart)
    )


def inject(kind: str) -> None:
    """Break this worker the way ``kind`` says."""
    sys.stdout.flush()
    if kind == "exit":
        os._exit(13)
    if kind == "raise":
        raise RuntimeError("injected failure")
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        while True:
            time.sleep(1)
    if kind == "grandchild":
        # A grandchild that outlives its parent unless the agent kills the whole tree.
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=False)
        os._exit(14)
    if kind == "kill-agent":
        os.kill(agent_pid(), signal.SIGKILL)
        while True:
            time.sleep(1)


def agent_pid() -> int:
    """The node agent: the parent, or the grandparent when a warm fork server started this worker."""
    parent = os.getppid()
    with open(f"/proc/{parent}/cmdline", "rb") as f:
        if b"forkserver" not in f.read():
            return parent
    with open(f"/proc/{parent}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT)
    ).double()


def batch(seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: a pure function of (seed, step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(GLOBAL_BATCH, IN, generator=g, dtype=torch.float64)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    return x, y


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def params_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        # The raw bytes of the float64 values, without NumPy (torch does not require it).
        h.update(bytes(p.detach().contiguous().reshape(-1).view(torch.uint8).tolist()))
    return h.hexdigest()


def save_checkpoint(path: Path, model: torch.nn.Module, momentum: list[torch.Tensor], step: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"model": model.state_dict(), "momentum": momentum, "step": step}, tmp)
    os.replace(tmp, path)


def newest_checkpoint(ckpt_dir: Path, fmt: str = "pt") -> Path | None:
    """What an unchanged script resumes from: the newest ``step-*.pt`` it saved itself, or the newest DCP
    directory with its ``.metadata``."""
    if fmt == "dcp":
        found = sorted(p for p in ckpt_dir.glob("step-*") if (p / ".metadata").exists())
    else:
        found = sorted(ckpt_dir.glob("step-*.pt"))
    return found[-1] if found else None


class SlowFile:
    """A file that stalls for ``delay`` seconds after its first write (a slow filesystem), for the
    slow-save fault: the save is in progress, its file open for writing, while the test acts."""

    def __init__(self, path: Path, delay: float) -> None:
        self._f = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._delay = delay

    def write(self, data: bytes) -> int:
        n = self._f.write(data)
        if self._delay:
            self._f.flush()
            time.sleep(self._delay)
            self._delay = 0.0
        return n

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def save_direct(path: Path, state: dict, delay: float) -> None:
    """``torch.save`` straight to ``path`` (an unchanged script's habit), slowly with ``delay``."""
    f = SlowFile(path, delay)
    try:
        torch.save(state, f)
    finally:
        f.close()


def dcp_state(model: torch.nn.Module, momentum: list[torch.Tensor], step: int) -> dict:
    return {
        "model": model.state_dict(),
        "momentum": {f"m{i}": m for i, m in enumerate(momentum)},
        "step": torch.tensor([step]),
    }


def save_dcp(path: Path, state: dict, delay: float) -> None:
    """Every rank writes its share of ``state`` into the DCP directory ``path``; rank 0 writes ``.metadata``
    last. ``delay``: each rank's writes stall that long first (a slow filesystem)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    class SlowWriter(FileSystemWriter):
        def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
            time.sleep(delay)
            return super().write_data(plan, planner)

    writer = SlowWriter(str(path)) if delay else FileSystemWriter(str(path))
    dcp.save(state, storage_writer=writer)


def load_dcp(path: Path, model: torch.nn.Module, momentum: list[torch.Tensor]) -> int:
    import torch.distributed.checkpoint as dcp

    state = dcp_state(model, momentum, 0)
    dcp.load(state, checkpoint_id=str(path))
    model.load_state_dict(state["model"])
    return int(state["step"].item())


def main(argv: list[str]) -> int:
    global worker
    args = parse_args(argv)
    if args.plain and not args.ckpt_dir:
        raise SystemExit("--plain needs --ckpt-dir")
    if args.bare and not args.plain:
        raise SystemExit("--bare needs --plain")
    if not args.bare:
        from hpcelastic import worker
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if args.fault == "startup" and fault_armed(args, rank):
        raise ImportError("injected start-up failure: no module named 'missing_dependency'")
    if args.fault == "init" and fault_armed(args, rank):
        os._exit(17)  # dies while the others wait in init_process_group (rendezvous of the round)
    if GLOBAL_BATCH % world:
        raise SystemExit(f"world size {world} does not divide the global batch {GLOBAL_BATCH}")
    dist.init_process_group("gloo")
    model = make_model(args.seed)
    momentum = [torch.zeros_like(p) for p in model.parameters()]
    start = 0
    ckpt_dir = Path(args.ckpt_dir) if args.plain else Path(worker.checkpoint_dir())
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    resume = newest_checkpoint(ckpt_dir, args.format) if args.plain else worker.resume_path()
    if resume and args.plain and args.format == "dcp":
        start = load_dcp(Path(resume), model, momentum)
        print(f"resuming from {resume} at step {start}", flush=True)
    elif resume:
        state = torch.load(resume, weights_only=True)
        model.load_state_dict(state["model"])
        momentum = state["momentum"]
        start = state["step"]
        print(f"resuming from {resume} at step {start}", flush=True)
    per_rank = GLOBAL_BATCH // world
    for step in range(start, args.steps):
        in_step_fault = args.fault not in ("ckpt-crash", "startup", "init")
        if step == args.fault_step and in_step_fault and fault_armed(args, rank):
            inject(args.fault)
        x, y = batch(args.seed, step)
        mine = range(rank * per_rank, (rank + 1) * per_rank)
        grads = []
        for i in mine:
            model.zero_grad(set_to_none=False)
            loss = torch.nn.functional.mse_loss(model(x[i : i + 1]), y[i : i + 1], reduction="sum")
            loss.backward()
            grads.append(flat_grad(model).clone())
        local = torch.stack(grads)
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local)
        total = torch.cat(gathered).sum(dim=0) / GLOBAL_BATCH  # fixed order: global sample index
        offset = 0
        with torch.no_grad():
            for p, m in zip(model.parameters(), momentum, strict=True):
                g = total[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                m.mul_(0.9).add_(g)
                p.sub_(args.lr * m)
        if not args.plain:
            worker.heartbeat(step + 1)
        if args.step_time:
            time.sleep(args.step_time)
        done = step + 1
        # Ranks must agree on stopping at the same step, or the next collective hangs.
        stop_flag = torch.tensor([1 if not args.plain and worker.should_stop() else 0])
        dist.all_reduce(stop_flag, op=dist.ReduceOp.MAX)
        stop = bool(stop_flag.item())
        if done % args.ckpt_every == 0 or done == args.steps or stop:
            slow = args.fault == "slow-save" and done == args.fault_step and fault_armed(args, rank)
            delay = args.save_delay if slow else 0.0
            if args.plain and args.format == "dcp":
                save_dcp(ckpt_dir / f"step-{done:06d}", dcp_state(model, momentum, done), delay)
            elif rank == 0:
                path = ckpt_dir / f"step-{done:06d}.pt"
                if args.fault == "ckpt-crash" and done == args.fault_step and fault_armed(args, 0):
                    torn = path if args.direct_save else path.with_name(path.name + ".tmp")
                    torn.write_bytes(b"PK\x03\x04torn")  # half-written, never published
                    os._exit(15)
                state = {"model": model.state_dict(), "momentum": momentum, "step": done}
                if args.direct_save:
                    save_direct(path, state, delay)
                else:
                    save_checkpoint(path, model, momentum, done)
                if not args.plain:
                    worker.publish_checkpoint(path, done)
            dist.barrier()
        if stop:
            print(f"stopping at step {done} on request; checkpoint published", flush=True)
            break
    else:
        stop = False
    if rank == 0 and not stop:
        out = Path(args.out or ckpt_dir)
        out.mkdir(parents=True, exist_ok=True)
        result = {"sha256": params_digest(model), "steps": args.steps, "world_size": world}
        (out / "final.json").write_text(json.dumps(result) + "\n")
        print(f"final parameters sha256={result['sha256']}", flush=True)
    dist.destroy_process_group()
    if args.fault == "late-exit" and fault_armed(args, rank):
        time.sleep(args.save_delay)  # this rank's process outlives the others' (a slow teardown)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
