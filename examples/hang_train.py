"""A plain torchrun-style training script (no hpcelastic import) that can hang one rank on purpose.

Deterministic like ``reference_train.py`` (float64 MLP, per-sample gradients ``all_gather``-ed and summed in
global sample order), so the final parameters are bit-identical whatever the world size and however often
the run restarts. Rank 0 checkpoints to ``--ckpt-dir`` every ``--ckpt-every`` steps (temporary file, then
rename); every rank resumes from the newest checkpoint there.

Fault injection by environment, only in the first round (``TORCHELASTIC_RESTART_COUNT`` 0), so the
restarted job finishes:

- ``HANG_KIND``: ``sleep`` (a native sleep before the step's collective), ``busy`` (a GIL-holding Python
  loop) or ``lock`` (waits on a lock another thread holds forever);
- ``HANG_RANK`` (default 5), ``HANG_STEP`` (default 10).

Rank 0 writes ``<ckpt-dir>/final.json`` with the SHA-256 of the final parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

GLOBAL_BATCH = 24
IN, HIDDEN, OUT = 8, 16, 1


def hang(kind: str) -> None:
    """Stop making progress the way ``kind`` says (never returns)."""
    print(f"injecting a hang: {kind} at {time.time():.3f}", flush=True)
    if kind == "sleep":
        time.sleep(3600)
    elif kind == "busy":
        x = 0
        while True:
            x += 1
    elif kind == "lock":
        lock = threading.Lock()
        held = threading.Event()

        def holder() -> None:
            lock.acquire()
            held.set()
            time.sleep(3600)

        threading.Thread(target=holder, daemon=True).start()
        held.wait()
        lock.acquire()
    raise SystemExit(f"unknown HANG_KIND {kind!r}")


def batch(seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(GLOBAL_BATCH, IN, generator=g, dtype=torch.float64)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(bytes(p.detach().contiguous().reshape(-1).view(torch.uint8).tolist()))
    return h.hexdigest()


def latest(ckpt_dir: Path) -> Path | None:
    found = sorted(ckpt_dir.glob("step-*.pt"))
    return found[-1] if found else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--ckpt-dir", default=os.environ.get("HPCELASTIC_CHECKPOINT_DIR", "checkpoints"))
    args = p.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    kind = os.environ.get("HANG_KIND", "")
    hang_rank, hang_step = int(os.environ.get("HANG_RANK", "5")), int(os.environ.get("HANG_STEP", "10"))
    first_round = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)

    dist.init_process_group("gloo")
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))
    model = model.double()
    momentum = [torch.zeros_like(q) for q in model.parameters()]
    start = 0
    resume = latest(ckpt_dir)
    if resume is not None:
        state = torch.load(resume, weights_only=True)
        model.load_state_dict(state["model"])
        momentum, start = state["momentum"], state["step"]
    per_rank = GLOBAL_BATCH // world
    for step in range(start, args.steps):
        if kind and first_round and rank == hang_rank and step == hang_step:
            hang(kind)
        x, y = batch(1234, step)
        grads = []
        for i in range(rank * per_rank, (rank + 1) * per_rank):
            model.zero_grad(set_to_none=False)
            torch.nn.functional.mse_loss(model(x[i : i + 1]), y[i : i + 1], reduction="sum").backward()
            grads.append(torch.cat([q.grad.reshape(-1) for q in model.parameters()]).clone())
        local = torch.stack(grads)
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local)
        total = torch.cat(gathered).sum(dim=0) / GLOBAL_BATCH
        offset = 0
        with torch.no_grad():
            for q, m in zip(model.parameters(), momentum, strict=True):
                g = total[offset : offset + q.numel()].view_as(q)
                offset += q.numel()
                m.mul_(0.9).add_(g)
                q.sub_(0.05 * m)
        time.sleep(args.step_time)
        done = step + 1
        if done % args.ckpt_every == 0 and rank == 0:
            tmp = ckpt_dir / f"step-{done:06d}.pt.tmp"
            torch.save({"model": model.state_dict(), "momentum": momentum, "step": done}, tmp)
            os.replace(tmp, ckpt_dir / f"step-{done:06d}.pt")
        if done % args.ckpt_every == 0:
            dist.barrier()
        print(f"step {done}", flush=True)
    if rank == 0:
        result = {"sha256": digest(model), "steps": args.steps, "world_size": world}
        (ckpt_dir / "final.json").write_text(json.dumps(result) + "\n")
        print(f"final parameters sha256={result['sha256']}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
