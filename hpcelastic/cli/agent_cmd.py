"""``hpcelastic agent`` (one per node, inside an allocation) and ``hpcelastic run`` (this machine)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
from pathlib import Path

import click

from hpcelastic.errors import UserError

# ASCII digits only: int() also takes '٣', '1_0' and ' 3 ', which no Slurm tool would.
_NODES = re.compile(r"([0-9]+)(?::([0-9]+))?")
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def parse_nodes(text: str | None) -> tuple[int | None, int | None]:
    """``N`` or ``MIN:MAX`` -> (min, max); (None, None) when not given."""
    if text is None:
        return None, None
    m = _NODES.fullmatch(text)
    if m is None:
        raise UserError(f"--nodes {text!r} is not N or MIN:MAX (e.g. 4 or 3:4)")
    lo = int(m[1])
    hi = int(m[2]) if m[2] else lo
    if lo < 1 or hi < lo:
        raise UserError(f"--nodes {text!r}: need 1 <= MIN <= MAX")
    return lo, hi


def parse_nproc(text: str) -> int | None:
    """``auto`` -> None (GPUs visible to the step, else 1), else a positive integer."""
    if text == "auto":
        return None
    if not re.fullmatch(r"[0-9]+", text) or int(text) < 1:
        raise UserError(f"--nproc-per-node {text!r} must be a positive number of workers or 'auto'")
    return int(text)


def parse_signal(text: str) -> signal.Signals:
    """``USR2``, ``SIGUSR2`` or ``12`` -> the signal."""
    name = text.upper()
    try:
        return (
            signal.Signals(int(name))
            if name.isascii() and name.isdigit()
            else signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
        )
    except (KeyError, ValueError):
        raise UserError(f"--signal {text!r} is not a signal name such as USR2") from None


def worker_argv(program: tuple[str, ...], module: bool) -> tuple[str, ...]:
    """The command each worker runs: python for scripts and modules, the program itself otherwise."""
    if not program:
        raise UserError("no training script given; add `-- train.py ARGS`")
    head, rest = program[0], program[1:]
    if module:
        if not _MODULE_NAME.fullmatch(head):
            raise UserError(f"-m {head!r} is not a Python module name (e.g. -m mypkg.train)")
        return (sys.executable, "-u", "-m", head, *rest)
    path = Path(head)
    if path.is_file():
        if path.suffix == ".py" or not os.access(path, os.X_OK):
            return (sys.executable, "-u", str(path), *rest)
        return (str(path.absolute()), *rest)
    found = shutil.which(head) if "/" not in head else None
    if found:
        return (found, *rest)
    raise UserError(f"training script {head!r} does not exist (looked in {Path.cwd()}); check the path")


_PROGRAM = click.argument("program", nargs=-1, type=click.UNPROCESSED)


@click.command(context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]})
@click.option("--run-dir", type=click.Path(path_type=Path), help="Run directory (required under Slurm).")
@click.option("--nodes", help="N or MIN:MAX; default: the nodes of the step.")
@click.option(
    "--nproc-per-node", default="auto", show_default=True, help="Workers per node, or 'auto' (GPUs)."
)
@click.option(
    "--max-restarts", type=click.IntRange(min=0), default=3, show_default=True, help="Job-wide budget."
)
@click.option("--checkpoint-dir", type=click.Path(path_type=Path), help="Default: RUN/checkpoints.")
@click.option("--rdzv-endpoint", help="HOST:PORT of the coordinator (overrides the derived one).")
@click.option(
    "--rdzv-port", type=click.IntRange(1, 65535), help="Coordinator port (default: from the job id)."
)
@click.option("--rdzv-interface", help="Network interface whose address workers use as MASTER_ADDR.")
@click.option("--rdzv-timeout", type=click.FloatRange(min=1), default=300.0, show_default=True)
@click.option("--stall-timeout", type=click.FloatRange(min=0.1), help="Fail a worker silent for this long.")
@click.option("--signal", "signame", default="USR2", show_default=True, help="Preemption signal.")
@click.option("--grace-period", type=click.FloatRange(min=0), default=60.0, show_default=True)
@click.option(
    "--requeue-mode", type=click.Choice(["requeue", "resubmit"]), default="requeue", show_default=True
)
@click.option("--max-requeues", type=click.IntRange(min=0), default=3, show_default=True)
@click.option("-m", "--module", is_flag=True, help="Run PROGRAM as a Python module.")
@_PROGRAM
def agent(
    run_dir: Path | None,
    nodes: str | None,
    nproc_per_node: str,
    max_restarts: int,
    checkpoint_dir: Path | None,
    rdzv_endpoint: str | None,
    rdzv_port: int | None,
    rdzv_interface: str | None,
    rdzv_timeout: float,
    stall_timeout: float | None,
    signame: str,
    grace_period: float,
    requeue_mode: str,
    max_requeues: int,
    module: bool,
    program: tuple[str, ...],
) -> None:
    """Node agent: start this node's workers, watch them, restart the whole job on any failure.

    \b
    Run once per node inside an allocation:
      srun --ntasks-per-node=1 hpcelastic agent --run-dir RUN --nodes 3:4 -- train.py --lr 3e-4
    """
    from hpcelastic.agent.agent import AgentSpec, run_agent
    from hpcelastic.env import BootstrapOptions, detect_environment
    from hpcelastic.env.base import parse_endpoint

    lo, hi = parse_nodes(nodes)
    if rdzv_endpoint:
        parse_endpoint(rdzv_endpoint)
    spec = AgentSpec(
        argv=worker_argv(program, module),
        min_nodes=lo,
        max_nodes=hi,
        nproc=parse_nproc(nproc_per_node),
        max_restarts=max_restarts,
        checkpoint_dir=checkpoint_dir.absolute() if checkpoint_dir else None,
        stall_timeout=stall_timeout,
        stop_signal=parse_signal(signame),
        grace_period=grace_period,
        rdzv=BootstrapOptions(
            run_dir=run_dir,
            endpoint=rdzv_endpoint,
            port=rdzv_port,
            interface=rdzv_interface,
            timeout=rdzv_timeout,
        ),
        requeue_mode=requeue_mode,
        max_requeues=max_requeues,
    )
    sys.exit(run_agent(detect_environment(), spec))


@click.command(context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]})
@click.option(
    "--nodes", default="1", show_default=True, help="N agents (or MIN:MAX: MAX agents, MIN to go on)."
)
@click.option("--nproc-per-node", default="auto", show_default=True, help="Workers per agent, or 'auto'.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=3, show_default=True)
@click.option("--run-dir", type=click.Path(path_type=Path), help="Default: ./hpcelastic-runs/local-<stamp>.")
@click.option("--stall-timeout", type=click.FloatRange(min=0.1), help="Fail a worker silent for this long.")
@click.option("--rdzv-timeout", type=click.FloatRange(min=1), default=60.0, show_default=True)
@click.option("--grace-period", type=click.FloatRange(min=0), default=30.0, show_default=True)
@click.option("-m", "--module", is_flag=True, help="Run PROGRAM as a Python module.")
@_PROGRAM
def run(
    nodes: str,
    nproc_per_node: str,
    max_restarts: int,
    run_dir: Path | None,
    stall_timeout: float | None,
    rdzv_timeout: float,
    grace_period: float,
    module: bool,
    program: tuple[str, ...],
) -> None:
    """Run N node agents on this machine (no Slurm): the same restarts as on a cluster.

    \b
    Example (2 "nodes" x 2 CPU workers):
      hpcelastic run --nodes 2 --nproc-per-node 2 examples/ddp_train.py --steps 50
    """
    from hpcelastic.agent.launcher import LocalRun, run_local

    lo, hi = parse_nodes(nodes)
    assert lo is not None and hi is not None
    parse_nproc(nproc_per_node)
    worker_argv(program, module)
    if run_dir is not None and run_dir.exists():
        raise UserError(f"run directory {run_dir} already exists; pick a new one with --run-dir")
    extra: list[str] = ["--rdzv-timeout", str(rdzv_timeout), "--grace-period", str(grace_period)]
    if stall_timeout:
        extra += ["--stall-timeout", str(stall_timeout)]
    if module:
        extra.append("-m")
    spec = LocalRun(
        min_nodes=lo,
        max_nodes=hi,
        nproc=nproc_per_node,
        max_restarts=max_restarts,
        run_dir=run_dir,
        agent_args=tuple(extra),
        program=program,
    )
    sys.exit(run_local(spec))
