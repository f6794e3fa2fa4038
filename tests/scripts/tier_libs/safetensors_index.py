"""An unchanged training script that saves its model as a sharded safetensors checkpoint (DDP, gloo), the
way ``save_pretrained(max_shard_size=...)`` lays one out: rank 0 writes
``step_<N>/model-0000K-of-0000M.safetensors`` (one shard per layer), ``optimizer.pt`` (optimizer and RNG
state), then ``model.safetensors.index.json`` last,
whose ``weight_map`` names each tensor's shard. Every rank resumes from the newest checkpoint whose index and
the shards it names exist, as the loaders of sharded checkpoints read them.

The mid-save fault kills rank 0 between the first shard and the second.
"""

from __future__ import annotations

import json
from pathlib import Path

import common
import safetensors.torch
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

INDEX, OPTIMIZER = "model.safetensors.index.json", "optimizer.pt"


def shards(state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """The state split by layer (the name's first part), as shard file name -> tensors."""
    layers = sorted({name.split(".")[0] for name in state})
    return {
        f"model-{i + 1:05d}-of-{len(layers):05d}.safetensors": {
            name: t.contiguous() for name, t in state.items() if name.split(".")[0] == layer
        }
        for i, layer in enumerate(layers)
    }


def complete(where: Path) -> bool:
    try:
        names = set(json.loads((where / INDEX).read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError):
        return False
    return (where / OPTIMIZER).is_file() and all((where / n).is_file() for n in names)


def main() -> None:
    args = common.parse()
    dist.init_process_group("gloo")
    model = DistributedDataParallel(common.build_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    root: Path = args.ckpt_dir

    def save(done: int) -> None:
        if common.rank() == 0:
            where = root / f"step_{done}"
            where.mkdir(parents=True, exist_ok=True)
            weight_map = {}
            with common.dying_at_call(args, done, safetensors.torch, "save_file", 2):
                for name, part in shards(model.module.state_dict()).items():
                    safetensors.torch.save_file(part, where / name, metadata={"format": "pt"})
                    weight_map.update(dict.fromkeys(part, name))
            torch.save({"optimizer": opt.state_dict(), "rng": torch.get_rng_state()}, where / OPTIMIZER)
            index = {"metadata": {"total_size": sum(t.nbytes for t in model.module.state_dict().values())}}
            (where / INDEX).write_text(json.dumps({**index, "weight_map": weight_map}, indent=2))
        dist.barrier()

    start = 0
    found = common.newest(root, r"step_(\d+)", complete)
    if found:
        weight_map = json.loads((found[1] / INDEX).read_text())["weight_map"]
        state = {}
        for name in sorted(set(weight_map.values())):
            state.update(safetensors.torch.load_file(found[1] / name))
        model.module.load_state_dict(state)
        rest = torch.load(found[1] / OPTIMIZER, weights_only=True)
        opt.load_state_dict(rest["optimizer"])
        torch.set_rng_state(rest["rng"])
        start = found[0]
    common.train(args, model, opt, start, save)
    common.finish(args, model.module.state_dict().items())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
