"""An unchanged Hugging Face ``Trainer`` training script: ``save_steps`` checkpoints ``checkpoint-<N>/`` in
the checkpoint directory (the Trainer's ``output_dir``); it resumes from the newest one, looked up as
``get_last_checkpoint`` does (the highest ``checkpoint-<N>``) among those holding ``trainer_state.json``,
the file ``_save_checkpoint`` writes after the weights, optimizer, scheduler and RNG states: a bare
``resume_from_checkpoint=True`` takes a checkpoint torn by a crash too, and the Trainer then loads its
weights and starts over from step 0 (it reads the step from that file).

The loss ignores the dataset's items: each step's batch comes from the step (``compute_loss``).
The mid-save fault kills rank 0 after ``model.safetensors``, at its first ``torch.save`` of the save
(``training_args.bin``; the optimizer's follows).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import common
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

TRAINER_STATE = "trainer_state.json"


class Items(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"idx": torch.tensor(i)}


class StepTrainer(Trainer):
    """The Trainer with the step's batch as its data (``compute_loss``: the Trainer's customization point)."""

    def __init__(self, script_args: argparse.Namespace, **kw: Any) -> None:
        super().__init__(**kw)
        self.script_args = script_args

    def compute_loss(
        self, model: torch.nn.Module, inputs: dict[str, Any], *a: Any, **kw: Any
    ) -> torch.Tensor:
        return common.loss(model, self.state.global_step)

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        done = self.state.global_step
        with common.dying_at_call(self.script_args, done, torch, "save", 1):
            super()._save_checkpoint(model, trial)


class Lines(TrainerCallback):
    """Rank 0's lines, the between-saves fault and each step's pause."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        common.resumed(state.global_step)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        common.maybe_crash(self.args, state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        time.sleep(self.args.step_time)

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        common.log("saved", state.global_step)


def main() -> None:
    args = common.parse()
    root: Path = args.ckpt_dir
    training = TrainingArguments(
        output_dir=str(root),
        max_steps=args.steps,
        save_strategy="steps",
        save_steps=args.save_every,
        per_device_train_batch_size=1,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        weight_decay=0.01,
        use_cpu=True,
        ddp_backend="gloo",
        ddp_find_unused_parameters=False,
        report_to="none",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        seed=0,
    )
    trainer = StepTrainer(
        args, model=common.build_model(), args=training, train_dataset=Items(), callbacks=[Lines(args)]
    )
    pattern = rf"{PREFIX_CHECKPOINT_DIR}-(\d+)"
    found = common.newest(root, pattern, lambda d: (d / TRAINER_STATE).is_file())
    trainer.train(resume_from_checkpoint=str(found[1]) if found else None)
    common.finish(args, trainer.model.state_dict().items())


if __name__ == "__main__":
    main()
