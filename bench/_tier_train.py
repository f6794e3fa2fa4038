"""The training of bench/checkpoint_tiers.py: each rank holds ``--mb`` MB of state of its own (sharded, as
FSDP holds it), steps for ``--step-time`` s and checkpoints it every ``--ckpt-every`` steps with
``torch.distributed.checkpoint`` into ``--ckpt-dir`` (``save``, or ``async_save`` with ``--async``),
resuming from the newest complete checkpoint there. An unchanged script: no hpcelastic import.

Appends to ``<out>/times-<rank>.jsonl``: the memory copy of its state (``copy_s``), each checkpoint's
blocked time (``blocked_s``; of it, ``waited_s`` for the previous async save to finish writing), and when it
had loaded and trained its first step after a (re)start.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

TENSOR_MB = 64


def newest(ckpt_dir: Path) -> Path | None:
    found = sorted(p for p in ckpt_dir.glob("step-*") if (p / ".metadata").exists())
    return found[-1] if found else None


def evict(path: Path) -> None:
    """Drop ``path``'s files from the page cache: the load reads them as from a network filesystem."""
    for folder, _dirs, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(folder, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--step-time", type=float, default=0.2)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--async", dest="use_async", action="store_true")
    p.add_argument("--cold-load", action="store_true", help="evict the checkpoint from the page cache first")
    args = p.parse_args()
    t_start = time.time()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / f"times-{rank}.jsonl", "a")  # noqa: SIM115

    def note(**fields: object) -> None:
        log.write(json.dumps({"ts": time.time(), "rank": rank, **fields}) + "\n")
        log.flush()

    n = max(1, args.mb // TENSOR_MB)
    state = {f"r{rank}.t{i}": torch.full((TENSOR_MB << 18,), float(i)) for i in range(n)}
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        t0 = time.perf_counter()
        copy = {k: v.clone() for k, v in state.items()}
        note(copy_s=time.perf_counter() - t0)
        del copy
    ckpt_dir = Path(args.ckpt_dir)
    start = 0
    resume = newest(ckpt_dir)
    if resume is not None:
        if args.cold_load:
            evict(resume)
        t0 = time.perf_counter()
        dcp.load(state, checkpoint_id=str(resume))
        start = int(resume.name.split("-")[-1])
        note(loaded_s=time.perf_counter() - t0, resumed=start, since_start_s=time.time() - t_start)
    # async_save's collectives run on a thread of their own: a group of their own keeps them apart from
    # the training's (gloo runs one collective at a time per group).
    save_group = dist.new_group(backend="gloo") if args.use_async else None
    pending = None
    for step in range(start, args.steps):
        time.sleep(args.step_time)
        for v in state.values():
            v[:1] += 1.0
        dist.barrier()
        if step == start:
            note(first_step=step + 1, restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
        done = step + 1
        if done % args.ckpt_every == 0:
            path = str(ckpt_dir / f"step-{done:06d}")
            t0 = time.perf_counter()
            waited = 0.0
            if args.use_async:
                if pending is not None:
                    pending.result()  # the previous save still writing: the training waits for it
                    waited = time.perf_counter() - t0
                pending = dcp.async_save(state, checkpoint_id=path, process_group=save_group)
            else:
                dcp.save(state, checkpoint_id=path)
            note(blocked_s=time.perf_counter() - t0, waited_s=waited, step=done)
    if pending is not None:
        pending.result()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
