"""The differential harness of issue 27: one unchanged training script (``tests/scripts/tier_libs``) under one
fault, run twice through ``hpcelastic run``'s code path (2 local nodes x 2 workers, 2 restarts), once with its
checkpoints in the shared directory and once with the local checkpoint tier, both at the same time.

With the tier a script must see at least what it sees without it, less the saves proven torn: every restarted
round resumes from a step at least as late, the run ends with the same final model, and a later job finds a
complete checkpoint at least as new in the shared checkpoint directory.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch  # imported up front, as tests/faults/localjob.py does

from hpcelastic.agent.launcher import LocalRun, start_agents
from hpcelastic.lifecycle.evidence import torn_zip
from hpcelastic.rundir import RunDir
from hpcelastic.tier.settings import TierSettings
from tests.slurm_utils import leaked_processes

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts" / "tier_libs"
STEPS, SAVE_EVERY, STEP_TIME = 20, 5, 0.4
#: Both runs of a pair together, from the agents' start to their end (a machine shared and loaded).
TIMEOUT_S = 480
#: Files that may be ``torch.save`` archives: a complete one has its zip end record.
ARCHIVES = (".pt", ".pth", ".bin", ".ckpt")

#: A checkpoint directory's entry -> its step when it is a complete checkpoint, else None.
Judge = Callable[[Path], "int | None"]


def holding(pattern: str, *files: str) -> Judge:
    """Entries named ``pattern`` (group 1: the step) holding every one of ``files`` (globs; ``{world}``: one
    file a rank, ``{rank}`` in its name), none of them a torn archive; no ``files``: the entry is a file."""

    def judge(entry: Path) -> int | None:
        m = re.fullmatch(pattern, entry.name)
        if m is None:
            return None
        if not files:
            return None if torn(entry) else int(m.group(1))
        for name in files:
            names = [name.replace("{rank}", str(r)) for r in range(WORLD)] if "{rank}" in name else [name]
            for n in names:
                found = list(entry.glob(n))
                if not found or any(torn(f) for f in found):
                    return None
        return int(m.group(1))

    return judge


def torn(path: Path) -> bool:
    """A file that is empty, or a ``torch.save`` archive without its end record."""
    try:
        size = path.stat().st_size
    except OSError:
        return True
    return size == 0 or (path.suffix in ARCHIVES and torn_zip(path, size))


def lightning(entry: Path) -> int | None:
    """Lightning's ``epoch=E-step=N[-vK].ckpt`` and ``last.ckpt`` (its step read from it)."""
    if m := re.fullmatch(r"epoch=\d+-step=(\d+)(-v\d+)?\.ckpt", entry.name):
        return None if torn(entry) else int(m.group(1))
    if entry.name == "last.ckpt" and not torn(entry):
        with contextlib.suppress(Exception):
            return int(torch.load(entry, map_location="cpu", weights_only=False)["global_step"])
    return None


NODES, NPROC = 2, 2
WORLD = NODES * NPROC


@dataclass(frozen=True)
class Layout:
    """A script and how its complete checkpoints look."""

    name: str
    script: str
    args: tuple[str, ...]
    judge: Judge


@dataclass(frozen=True)
class Fault:
    """The script's fault arguments and the rounds' resume steps they give without the tier."""

    name: str
    args: tuple[str, ...]
    resumed: tuple[int, ...]


#: Rank 3 (node 1) killed 4 steps after the save of step 10.
BETWEEN = Fault("between-saves", ("--crash-at-step", "14", "--crash-rank", "3"), (0, 10))
#: Rank 0 killed between the files of the save of step 10 (restart 0), then rank 3 killed 4 steps after the
#: save of step 15 (restart 1).
MID_SAVE_THEN_BETWEEN = Fault(
    "mid-save-then-between",
    ("--crash-mid-save", "10", "--crash-at-step", "19", "--crash-restart", "1", "--crash-rank", "3"),
    (0, 5, 15),
)


@dataclass
class Outcome:
    """What one run left: the agents' exit codes, rank 0's resume step of each round (and every rank's), the
    final digest, the events, the complete checkpoints in the shared checkpoint directory (name -> step),
    rank 0's log."""

    codes: list[int | None]
    resumed: list[int]
    #: Every rank's resume steps, one a round (all ranks of a round must resume from one checkpoint).
    ranks_resumed: dict[int, list[int]]
    digest: str | None
    events: list[dict[str, Any]]
    checkpoints: dict[str, int]
    log: str

    def brief(self) -> str:
        tier = [
            {k: e.get(k) for k in ("event", "node", "round", "checkpoint", "step", "tier", "why") if k in e}
            for e in self.events
            if str(e["event"]).startswith("tier_") or e["event"] == "worker_failed"
        ]
        return (
            f"codes={self.codes} resumed={self.resumed} by rank={self.ranks_resumed} digest={self.digest} "
            f"checkpoints={self.checkpoints}\nrank 0:\n{self.log[-1500:]}\ntier events: {tier[-25:]}"
        )


def shm_prefix(tmp_path: Path) -> str:
    """The tier directories' name, unique to the test (pytest cuts ``tmp_path.name`` to 30 characters, the
    same in every xdist worker: its parent, ``popen-gwN``, tells them apart)."""
    return f"hpce27-{tmp_path.parent.name}-{tmp_path.name}"


def spec(tmp_path: Path, layout: Layout, fault: Fault, tier: bool) -> LocalRun:
    """``hpcelastic run`` of the layout's script under the fault, with the tier or without."""
    where = tmp_path / ("tier" if tier else "shared")
    template = f"/dev/shm/{shm_prefix(tmp_path)}-{{node}}"
    program = (
        str(SCRIPTS / layout.script), *layout.args, "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
        "--step-time", str(STEP_TIME), "--out", str(where / "final.json"), *fault.args,
    )  # fmt: skip
    return LocalRun(
        min_nodes=NODES,
        max_nodes=NODES,
        nproc=str(NPROC),
        max_restarts=2,
        run_dir=where / "run",
        local_tier=TierSettings(template).to_text() if tier else None,
        agent_args=("--rdzv-timeout", "30", "--grace-period", "10"),
        program=program,
    )


def outcome(run: RunDir, codes: list[int | None], out: Path, layout: Layout) -> Outcome:
    logs = {r: read(run.rank_log_path(0, r)) for r in range(WORLD)}
    ranks_resumed = {
        r: [int(m) for m in re.findall(r"^resumed (\d+)$", text, re.M)] for r, text in logs.items()
    }
    digest = json.loads(out.read_text())["sha256"] if out.exists() else None
    checkpoints: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for entry in sorted((run.path / "checkpoints").iterdir()):
            if (step := layout.judge(entry)) is not None:
                checkpoints[entry.name] = step
    events = list(run.events())
    return Outcome(codes, ranks_resumed[0], ranks_resumed, digest, events, checkpoints, logs[0])


def read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def run_pair(tmp_path: Path, layout: Layout, fault: Fault) -> tuple[Outcome, Outcome]:
    """The script under the fault without the tier and with it (both at once): their outcomes."""
    specs = [spec(tmp_path, layout, fault, tier) for tier in (False, True)]
    started = [start_agents(s) for s in specs]
    deadline = time.monotonic() + TIMEOUT_S
    codes: list[list[int | None]] = []
    try:
        for _run, agents in started:
            mine: list[int | None] = []
            for a in agents:
                try:
                    mine.append(a.wait(timeout=max(0.1, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    mine.append(None)
            codes.append(mine)
    finally:
        for run, agents in started:
            for a in agents:
                if a.poll() is None:
                    a.kill()
                    a.wait()
            for p in leaked_processes(run.path):
                with contextlib.suppress(Exception):
                    p.kill()
        for leftover in Path("/dev/shm").glob(f"{shm_prefix(tmp_path)}-*"):
            shutil.rmtree(leftover, ignore_errors=True)
    without, with_tier = (
        outcome(RunDir(run.path), c, run.path.parent / "final.json", layout)
        for (run, _), c in zip(started, codes, strict=True)
    )
    return without, with_tier


def check(layout: Layout, fault: Fault, without: Outcome, with_tier: Outcome) -> None:
    """Issue 27's differential: with the tier, at least what the script sees without it."""
    both = f"{layout.name} / {fault.name}\n--- without: {without.brief()}\n--- with:{with_tier.brief()}"
    assert without.codes == [0] * NODES and tuple(without.resumed) == fault.resumed, (
        f"the run without the tier did not go as the fault designs (the test itself is off)\n{both}"
    )
    assert with_tier.codes == [0] * NODES, f"with the tier the run failed\n{both}"
    assert len(with_tier.resumed) == len(without.resumed), f"a different number of rounds\n{both}"
    later = [w >= n for w, n in zip(with_tier.resumed, without.resumed, strict=True)]
    assert all(later), f"with the tier a round resumed from an older step than without\n{both}"
    assert all(r == with_tier.resumed for r in with_tier.ranks_resumed.values()), (
        f"with the tier the ranks of a round resumed from different steps\n{both}"
    )
    assert without.digest is not None and with_tier.digest == without.digest, (
        f"the final models differ\n{both}"
    )
    newest = max(without.checkpoints.values(), default=-1)
    assert max(with_tier.checkpoints.values(), default=-1) >= newest, (
        f"with the tier the shared directory holds no complete checkpoint as new as without\n{both}"
    )
