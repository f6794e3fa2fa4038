"""Ranks of different speeds that all_reduce every step and stop when ``worker.should_stop()`` says so.

After each step's all_reduce rank r works 0.02 + 0.04 * r s more before its stop check, so the slowest
rank checks long after the others have entered the next step's all_reduce: a signal that arrives in
between makes ranks that decide on their own stop one step apart, and the others hang there. Each
rank writes the step it stopped after to ``OUT/rank-R.json``; rank 0 writes ``OUT/ready`` once training
runs. Run again after a Slurm requeue (``SLURM_RESTART_COUNT`` > 0), each rank writes ``OUT/again-R``
and ends.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hpcelastic import worker


def main(out: Path) -> None:
    if int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0:
        (out / f"again-{os.environ['RANK']}").write_text("")
        return
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ones = torch.ones(1)
    step = 0
    while step < 100_000:
        dist.all_reduce(ones)
        time.sleep(0.02 + 0.04 * rank)
        step += 1
        worker.heartbeat(step)
        if rank == 0 and step == 5:
            (out / "ready").write_text("")
        if worker.should_stop():
            (out / f"rank-{rank}.json").write_text(json.dumps({"step": step, "ts": time.time()}))
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
