"""The job of bench/tier_restore_scale.py and tests/faults/test_tier_restore_scale.py: no torch (64 agents'
workers on one small machine), one worker per node, a DCP-shaped checkpoint the local tier judges complete by
its format.

First round (``TORCHELASTIC_RESTART_COUNT`` 0): each rank writes ``step-NNNNNN/__R_0.distcp`` (``--kb`` KB,
bytes derived from (rank, step)) into ``$HPCELASTIC_CHECKPOINT_DIR``, says so with a file in ``--out``, and
rank 0 writes ``.metadata`` once every rank's shard is there (DCP writes it last, on one rank). Rank
``--fault-rank`` then waits until the tier replicated and persisted that checkpoint (its events), notes the
time in ``<out>/failed.json`` and exits 1; the others wait to be stopped. Second round: every rank checks
that the restored checkpoint holds every rank's shard, byte-exact, and its ``.metadata``, writes
``<out>/verified-R.json`` and exits 0 (1 on a mismatch: the job's one restart is spent, it fails).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

WAIT_S = 600.0


def shard_bytes(rank: int, step: int, size: int) -> bytes:
    """Rank ``rank``'s shard at ``step``: ``size`` bytes that differ per rank and step."""
    seed = hashlib.sha256(f"{rank}:{step}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def wait_for(what: str, ready: object, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not ready():  # type: ignore[operator]
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {what}")
        time.sleep(0.1)


def tier_done(run_dir: Path, name: str) -> bool:
    """The run's events say ``name`` was replicated and persisted."""
    seen: set[str] = set()
    for path in run_dir.glob("events*.jsonl"):
        for line in path.read_text(errors="replace").splitlines():
            if name in line and ('"tier_replicated"' in line or '"tier_persisted"' in line):
                try:
                    seen.add(json.loads(line)["event"])
                except (ValueError, KeyError, TypeError):
                    continue
    return {"tier_replicated", "tier_persisted"} <= seen


def save(ckpt: Path, out: Path, rank: int, world: int, step: int, size: int) -> Path:
    """This rank's shard of ``step``; rank 0 writes ``.metadata`` after every rank's."""
    entry = ckpt / f"step-{step:06d}"
    entry.mkdir(parents=True, exist_ok=True)
    (entry / f"__{rank}_0.distcp").write_bytes(shard_bytes(rank, step, size))
    (out / f"saved-{step}-{rank}").touch()
    if rank == 0:
        wait_for(
            "every rank's shard", lambda: all((out / f"saved-{step}-{r}").exists() for r in range(world))
        )
        (entry / ".metadata").write_text(json.dumps({"world": world, "step": step, "size": size}))
    return entry


def verify(ckpt: Path, world: int, step: int, size: int) -> list[str]:
    """What is wrong with the restored checkpoint (nothing: [])."""
    entry = ckpt / f"step-{step:06d}"
    problems = []
    try:
        meta = json.loads((entry / ".metadata").read_text())
        if meta != {"world": world, "step": step, "size": size}:
            problems.append(f".metadata says {meta}")
    except (OSError, ValueError) as e:
        problems.append(f".metadata: {e}")
    for r in range(world):
        try:
            if (entry / f"__{r}_0.distcp").read_bytes() != shard_bytes(r, step, size):
                problems.append(f"__{r}_0.distcp differs")
        except OSError as e:
            problems.append(f"__{r}_0.distcp: {e}")
    return problems


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="a directory every node can reach (this machine's)")
    p.add_argument("--kb", type=int, default=1024, help="each rank's shard")
    p.add_argument("--step", type=int, default=10, help="the checkpoint's step")
    p.add_argument("--fault-rank", type=int, default=1)
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ckpt, out = Path(os.environ["HPCELASTIC_CHECKPOINT_DIR"]), Path(args.out)
    size = args.kb * 1024
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        problems = verify(ckpt, world, args.step, size)
        record = {
            "rank": rank,
            "world": world,
            "ok": not problems,
            "problems": problems[:5],
            "ts": time.time(),
        }
        (out / f"verified-{rank}.json").write_text(json.dumps(record))
        sys.exit(1 if problems else 0)
    entry = save(ckpt, out, rank, world, args.step, size)
    if rank == args.fault_rank:
        wait_for("the tier's copies", lambda: tier_done(Path(os.environ["HPCELASTIC_RUN_DIR"]), entry.name))
        (out / "failed.json").write_text(json.dumps({"rank": rank, "ts": time.time()}))
        sys.exit(1)
    time.sleep(WAIT_S)  # stopped by the agent when the fault rank fails
    sys.exit("never stopped")


if __name__ == "__main__":
    main()
