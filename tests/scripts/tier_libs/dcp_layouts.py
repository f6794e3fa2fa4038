"""An unchanged ``torch.distributed.checkpoint`` (DCP) training script (DDP, gloo): every rank saves with DCP
and resumes from the newest complete checkpoint (complete: DCP's ``.metadata``, which rank 0 writes last).

``--layout flat``: ``dcp.save`` of model, optimizer and RNG state into ``step_<N>/``.
``--layout nested``: ``step_<N>/model/``, then ``step_<N>/optim/``, each a DCP checkpoint of its own.
``--layout async``: ``dcp.async_save`` into ``step_<N>/`` on a gloo group of its own (as DCP's docs advise),
the previous save awaited before the next one and at the end.

The mid-save fault kills rank 0 in flat and async when every rank's shards are written but not ``.metadata``
(the storage writer's ``finish``), in nested before the second ``dcp.save`` (``model/`` complete, ``optim/``
not begun).
"""

from __future__ import annotations

import argparse
import gc
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import common
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

METADATA = ".metadata"


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layout", choices=("flat", "nested", "async"), required=True)


def complete(layout: str, where: Path) -> bool:
    parts = ("model", "optim") if layout == "nested" else ("",)
    return all((where / part / METADATA).is_file() for part in parts)


def main() -> None:
    args = common.parse(options)
    model = DistributedDataParallel(common.build_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    root: Path = args.ckpt_dir
    group = dist.new_group(backend="gloo") if args.layout == "async" else None
    pending: list[Future[Any]] = []

    def state() -> dict[str, Any]:
        model_state, optim_state = get_state_dict(model, opt)
        return {"model": model_state, "optim": optim_state, "rng": torch.get_rng_state()}

    def save(done: int) -> None:
        where = root / f"step_{done}"
        if args.layout == "nested":
            now = state()
            dcp.save({"model": now["model"], "rng": now["rng"]}, checkpoint_id=where / "model")
            with common.dying_at_call(args, done, dcp, "save", 1):
                dcp.save({"optim": now["optim"]}, checkpoint_id=where / "optim")
            return
        with common.dying_at_call(args, done, FileSystemWriter, "finish", 1):
            if args.layout == "flat":
                dcp.save(state(), checkpoint_id=where)
                return
            while pending:
                pending.pop().result()
            pending.append(dcp.async_save(state(), checkpoint_id=where, process_group=group))
            if common.dies_mid_save(args, done):
                pending[-1].result()  # the fault must strike this save's finish, in its thread

    start = 0
    found = common.newest(root, r"step_(\d+)", lambda d: complete(args.layout, d))
    if found:
        now = state()
        if args.layout == "nested":
            dcp.load({"model": now["model"], "rng": now["rng"]}, checkpoint_id=found[1] / "model")
            dcp.load({"optim": now["optim"]}, checkpoint_id=found[1] / "optim")
        else:
            dcp.load(now, checkpoint_id=found[1])
        set_state_dict(model, opt, model_state_dict=now["model"], optim_state_dict=now["optim"])
        torch.set_rng_state(now["rng"])
        start = found[0]
    common.train(args, model, opt, start, save)
    while pending:
        pending.pop().result()
    common.finish(args, model.module.state_dict().items())


if __name__ == "__main__":
    dist.init_process_group("gloo")
    main()
    # The DDP model, in a reference cycle, holds the group: freed after destroy_process_group, the group's
    # gloo threads are joined while the GIL is held and one of them may be waiting for it (a hang).
    gc.collect()
    dist.destroy_process_group()
