"""An unchanged Lightning training script: ``Trainer(accelerator="cpu", strategy="ddp")`` (Lightning finds the
torchrun environment itself) with ``ModelCheckpoint(every_n_train_steps=..., save_last=True)``, which writes
``epoch=E-step=N.ckpt`` (removing the previous one) and then rewrites ``last.ckpt``; it resumes with
``fit(ckpt_path="last")``.

The loss ignores the dataloader's items: each step's batch comes from the global step.
The mid-save fault kills rank 0 between ``epoch=E-step=N.ckpt`` and ``last.ckpt`` (the checkpoint's second
``trainer.save_checkpoint``).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import common
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = common.build_model()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return common.loss(self.net, self.global_step)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Checkpoints(ModelCheckpoint):
    """``ModelCheckpoint`` with rank 0's lines, the faults and each step's pause around its own work."""

    def __init__(self, script_args: argparse.Namespace, **kw: Any) -> None:
        super().__init__(**kw)
        self.script_args = script_args

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        super().on_train_start(trainer, module)
        common.resumed(trainer.global_step)

    def on_train_batch_start(self, trainer: pl.Trainer, *a: Any, **kw: Any) -> None:
        common.maybe_crash(self.script_args, trainer.global_step)

    def on_train_batch_end(self, trainer: pl.Trainer, *a: Any, **kw: Any) -> None:
        time.sleep(self.script_args.step_time)
        done = trainer.global_step
        with common.dying_at_call(self.script_args, done, trainer, "save_checkpoint", 2):
            super().on_train_batch_end(trainer, *a, **kw)
        if done % self.script_args.save_every == 0:
            common.log("saved", done)


def main() -> None:
    args = common.parse()
    checkpoints = Checkpoints(
        args, dirpath=args.ckpt_dir, every_n_train_steps=args.save_every, save_last=True
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=common.world_size() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        max_steps=args.steps,
        callbacks=[checkpoints],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Model()
    data = torch.utils.data.DataLoader(torch.arange(100_000), batch_size=1)
    trainer.fit(model, data, ckpt_path="last")
    common.finish(args, model.net.state_dict().items())


if __name__ == "__main__":
    main()
