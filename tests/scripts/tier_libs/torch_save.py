"""An unchanged ``torch.save`` training script (DDP, gloo): rank 0 saves; every rank resumes from the newest
checkpoint it finds in the checkpoint directory.

``--layout single``: one file a save, ``step_<N>.pt`` (model, optimizer, RNG state).
``--layout multi``: a directory a save, ``step_<N>/``: rank 0 writes ``model.pt`` (model, RNG state), then
``--gap`` seconds later ``optimizer.pt``, its last file (a directory without it is a save not finished); the
mid-save fault kills rank 0 in that gap.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import common
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

MODEL, OPTIMIZER = "model.pt", "optimizer.pt"


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layout", choices=("single", "multi"), required=True)
    p.add_argument("--gap", type=float, default=2.0, help="seconds between the multi layout's two files")


def main() -> None:
    args = common.parse(options)
    dist.init_process_group("gloo")
    model = DistributedDataParallel(common.build_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    root: Path = args.ckpt_dir

    def save(done: int) -> None:
        if common.rank() == 0:
            root.mkdir(parents=True, exist_ok=True)
            state = {"model": model.state_dict(), "rng": torch.get_rng_state()}
            if args.layout == "single":
                torch.save({**state, "optimizer": opt.state_dict()}, root / f"step_{done}.pt")
            else:
                where = root / f"step_{done}"
                where.mkdir(exist_ok=True)
                torch.save(state, where / MODEL)
                time.sleep(args.gap * 0.75)
                if common.dies_mid_save(args, done):
                    common.die(done)
                time.sleep(args.gap * 0.25)
                torch.save({"optimizer": opt.state_dict()}, where / OPTIMIZER)
        dist.barrier()

    start = 0
    if args.layout == "single":
        found = common.newest(root, r"step_(\d+)\.pt", Path.is_file)
        files = (found[1],) if found else ()
    else:
        found = common.newest(root, r"step_(\d+)", lambda d: (d / OPTIMIZER).is_file())
        files = (found[1] / MODEL, found[1] / OPTIMIZER) if found else ()
    if found:
        state = {k: v for f in files for k, v in torch.load(f, weights_only=True).items()}
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        start = found[0]
    common.train(args, model, opt, start, save)
    common.finish(args, model.module.state_dict().items())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
