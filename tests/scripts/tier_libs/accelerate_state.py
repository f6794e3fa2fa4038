"""An unchanged Hugging Face Accelerate training script: saves into ``checkpoint_<N>/`` and resumes from the
newest checkpoint holding every file its save writes.

``--mode ddp``: ``accelerator.save_state``/``load_state`` of the prepared (DDP) model and optimizer:
``model.safetensors``, ``optimizer.bin`` (rank 0), ``random_states_<rank>.pkl`` (each rank).
``--mode fsdp-sharded`` / ``fsdp-full``: the model sharded with FSDP2's ``fully_shard`` and saved with the
functions ``save_state`` calls under FSDP (``save_fsdp_model``, ``save_fsdp_optimizer``, the RNG states):
sharded, ``pytorch_model_fsdp_0/`` and ``optimizer_0/``, each a DCP directory below the top of the checkpoint;
full, ``pytorch_model_fsdp.bin`` and ``optimizer.bin`` (rank 0). Accelerate's own FSDP plugin cannot run here:
``AcceleratorState`` selects ``DistributedType.FSDP`` only on an accelerator (MULTI_GPU, MULTI_XPU, ...) and
leaves a CPU run ``MULTI_CPU`` (plain DDP), so ``save_state`` would never take its FSDP branch on CPU.

The mid-save fault kills rank 0 after the model's files, before the optimizer's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import common
import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.checkpointing import load_accelerator_state, save_accelerator_state
from accelerate.utils import (
    FullyShardedDataParallelPlugin,
    load_fsdp_model,
    load_fsdp_optimizer,
    save_fsdp_model,
    save_fsdp_optimizer,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import StateDictType, fully_shard


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=("ddp", "fsdp-sharded", "fsdp-full"), required=True)


def files_of(mode: str, world: int) -> tuple[str, ...]:
    """What one save writes (the checkpoint is complete with all of them)."""
    rng = tuple(f"random_states_{r}.pkl" for r in range(world))
    if mode == "ddp":
        return ("model.safetensors", "optimizer.bin", *rng)
    if mode == "fsdp-sharded":
        return ("pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata", *rng)
    return ("pytorch_model_fsdp.bin", "optimizer.bin", *rng)


def load_model(
    plugin: FullyShardedDataParallelPlugin, acc: Accelerator, model: torch.nn.Module, where: Path
) -> None:
    """``load_fsdp_model``; for a full state dict, every rank reads the file and loads it through torch's
    ``set_model_state_dict`` instead: ``load_fsdp_model`` takes the model for FSDP2 only when the
    Accelerator is in ``DistributedType.FSDP`` (never on CPU, see above), so every rank but 0 returns and
    rank 0 waits forever in the broadcast it expects from the others."""
    if plugin.state_dict_type == StateDictType.FULL_STATE_DICT:
        full = torch.load(where / "pytorch_model_fsdp.bin", weights_only=True)
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
    else:
        load_fsdp_model(plugin, acc, model, str(where))


def main() -> None:
    args = common.parse(options)
    acc = Accelerator(cpu=True)
    model = common.build_model()
    plugin = None
    if args.mode == "ddp":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = acc.prepare(model, opt)
    else:
        state_dict_type = "SHARDED_STATE_DICT" if args.mode == "fsdp-sharded" else "FULL_STATE_DICT"
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=state_dict_type)
        mesh = init_device_mesh("cpu", (acc.num_processes,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    root: Path = args.ckpt_dir
    # The optimizer's file is rank 0's first torch.save of a DDP save, its first dcp.save (the model's was
    # first) of a sharded one, its second torch.save (after the model's) of a full one.
    target, nth = {"ddp": (torch, 1), "fsdp-sharded": (dist.checkpoint, 2), "fsdp-full": (torch, 2)}[
        args.mode
    ]

    def save(done: int) -> None:
        where = str(root / f"checkpoint_{done}")
        with common.dying_at_call(args, done, target, "save", nth):
            if plugin is None:
                acc.save_state(where)
                return
            save_fsdp_model(plugin, acc, model, where)
            save_fsdp_optimizer(plugin, acc, opt, model, where)
            save_accelerator_state(where, [], [], [], [], acc.process_index, done)
        acc.wait_for_everyone()

    start = 0
    names = files_of(args.mode, acc.num_processes)
    found = common.newest(root, r"checkpoint_(\d+)", lambda d: all((d / n).is_file() for n in names))
    if found:
        if plugin is None:
            acc.load_state(str(found[1]))
        else:
            load_model(plugin, acc, model, found[1])
            load_fsdp_optimizer(plugin, acc, opt, model, str(found[1]))
            load_accelerator_state(str(found[1]), [], [], [], [], acc.process_index)
        start = found[0]
    common.train(args, model, opt, start, save, acc.backward)
    full = get_model_state_dict(acc.unwrap_model(model), options=StateDictOptions(full_state_dict=True))
    common.finish(args, full.items())
    acc.wait_for_everyone()
    acc.end_training()


if __name__ == "__main__":
    main()
