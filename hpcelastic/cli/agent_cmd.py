"""``hpcelastic agent`` (one per node, inside an allocation) and ``hpcelastic run`` (this machine).

The ``agent`` command is the one parser of the agent command line: its parameters are the fields of
:class:`~hpcelastic.agent.spec.AgentCommand`, whose ``to_argv`` builds that line everywhere.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from hpcelastic import sites
from hpcelastic.agent.launcher import LOCAL_GRACE_PERIOD, LOCAL_RDZV_TIMEOUT
from hpcelastic.agent.spec import (
    DEFAULT_CONSOLE,
    DEFAULT_GRACE_PERIOD,
    DEFAULT_MAX_REQUEUES,
    DEFAULT_MAX_RESTARTS,
    DEFAULT_REQUEUE_MODE,
    DEFAULT_SIGNAL,
    REQUEUE_MODES,
    AgentCommand,
    worker_argv,
)
from hpcelastic.env.base import BootstrapOptions
from hpcelastic.errors import UserError
from hpcelastic.parse import (
    AUTO,
    CONSOLE_MODES,
    MAX_GRACE_PERIOD_S,
    MIN_STALL_TIMEOUT_S,
    parse_nodes,
    parse_nproc,
)
from hpcelastic.reasons import Reason

_CONTEXT = {"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]}
_STALL_HELP = "Seconds without progress = hang."
_PROGRAM = click.argument("program", nargs=-1, type=click.UNPROCESSED)
_LOCAL_TIER_HELP = (
    "Node-local checkpoint tier: a JSON object of checkpoint_tier settings, e.g. "
    '\'{"local_checkpoint_dir": "/dev/shm/ckpt-{job}-{node}"}\' (docs/ARCHITECTURE.md).'
)


_SLOW_HELP = (
    "Slow-node detection: ACTION,MIN_SLOWDOWN,WINDOWS (off, report, exclude or swap), e.g. swap,0.2,5"
)


def _slow_options(f: Any) -> Any:
    """``hpcelastic run``'s slow-node flags (the site keys ``slow.*``: hpcelastic/sites.py)."""
    for name in reversed(("action", "min_slowdown", "windows")):
        k = sites.SCHEMA[f"slow.{name}"]
        kind = click.Choice(k.choices) if k.choices else k.type
        f = click.option(
            sites.FLAG_OF[f"slow.{name}"], f"slow_{name}", type=kind, help=f"{k.doc} [default: {k.default}]."
        )(f)
    return f


def _slow_text(action: str | None, min_slowdown: float | None, windows: int | None) -> str:
    """The agent's ``--slow`` from ``run``'s flags (unset: the defaults); a bad value is one line."""
    from hpcelastic.slow.policy import SlowSettings

    d = SlowSettings()
    return SlowSettings.parse(
        action or str(d.action),
        d.min_slowdown if min_slowdown is None else min_slowdown,
        d.windows if windows is None else windows,
    ).to_text()


def _default(value: Any) -> str:
    """``[default: X]`` for options whose unset value (None) means the schema's default."""
    return f"  [default: {value.name.removeprefix('SIG') if hasattr(value, 'name') else value}]"


_CONSOLE = click.option(
    "--console",
    type=click.Choice(CONSOLE_MODES),
    help="Worker output shown: every rank's, rank 0's, or failures only (all of it is in the rank logs)."
    + _default(DEFAULT_CONSOLE),
)
_METRICS_PORT = click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    help="The coordinator's OpenMetrics port [default: a free one, in RUN/metrics.json].",
)


@click.command(context_settings=_CONTEXT)
@click.option("--run-dir", type=click.Path(path_type=Path), help="Run directory (required under Slurm).")
@click.option("--nodes", help="N or MIN:MAX; default: the nodes of the step.")
@click.option(
    "--spare-nodes", type=click.IntRange(min=0), help="Of the step's nodes, this many are hot spares."
)
@click.option("--nproc-per-node", default=AUTO, show_default=True, help="Workers per node, or 'auto' (GPUs).")
@click.option(
    "--max-restarts",
    type=click.IntRange(min=0),
    default=DEFAULT_MAX_RESTARTS,
    show_default=True,
    help="Job-wide budget.",
)
@click.option("--checkpoint-dir", type=click.Path(path_type=Path), help="Default: RUN/checkpoints.")
@click.option("--rdzv-endpoint", help="HOST:PORT of the coordinator (overrides the published one).")
@click.option("--rdzv-port", type=click.IntRange(1, 65535), help="Coordinator port (default: a free one).")
@click.option("--rdzv-interface", help="Network interface whose address workers use as MASTER_ADDR.")
@click.option(
    "--rdzv-timeout",
    type=click.FloatRange(min=1),
    help="Rendezvous time-out." + _default(BootstrapOptions.timeout),
)
@click.option(
    "--stall-timeout", type=click.FloatRange(min=MIN_STALL_TIMEOUT_S), help="Seconds without progress = hang."
)
@click.option("--signal", help="Preemption signal." + _default(DEFAULT_SIGNAL))
@click.option(
    "--grace-period",
    type=click.FloatRange(min=0, max=MAX_GRACE_PERIOD_S),
    help="Seconds to checkpoint." + _default(DEFAULT_GRACE_PERIOD),
)
@click.option(
    "--requeue-mode", type=click.Choice(REQUEUE_MODES), help="After a stop." + _default(DEFAULT_REQUEUE_MODE)
)
@click.option(
    "--max-requeues",
    type=click.IntRange(min=0),
    help="Requeues after failures." + _default(DEFAULT_MAX_REQUEUES),
)
@click.option("--replica-groups", type=click.IntRange(min=1), help="torchft replica groups [default: 1].")
@click.option("--min-replica-groups", type=click.IntRange(min=1), help="Fewest groups to go on [default: 1].")
@click.option("--no-warm-start", is_flag=True, help="Start each worker in a new interpreter.")
@_CONSOLE
@_METRICS_PORT
@click.option("--no-metrics", is_flag=True, help="Serve no OpenMetrics endpoint.")
@click.option(
    "--metrics-textfile-dir",
    type=click.Path(path_type=Path, file_okay=False),
    help="Write hpcelastic_<run id>.prom there (node-exporter's textfile collector).",
)
@click.option("--local-tier", help=_LOCAL_TIER_HELP)
@click.option("--slow", help=_SLOW_HELP)
@click.option("-m", "--module", is_flag=True, help="Run PROGRAM as a Python module.")
@_PROGRAM
def agent(**params: Any) -> None:
    """Node agent: start this node's workers, watch them, restart the whole job on any failure.

    \b
    Run once per node inside an allocation:
      srun --ntasks-per-node=1 hpcelastic agent --run-dir RUN --nodes 3:4 -- train.py --lr 3e-4
    """
    spec = AgentCommand(**params).to_spec()
    from hpcelastic.agent.agent import run_agent
    from hpcelastic.env import detect_environment

    sys.exit(run_agent(detect_environment(), spec))


@click.command(context_settings=_CONTEXT)
@click.option(
    "--nodes", default="1", show_default=True, help="N agents (or MIN:MAX: MAX agents, MIN to go on)."
)
@click.option(
    "--spare-nodes", type=click.IntRange(min=0), default=0, help="Hot spare agents on top of --nodes."
)
@click.option("--nproc-per-node", default=AUTO, show_default=True, help="Workers per agent, or 'auto'.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=DEFAULT_MAX_RESTARTS, show_default=True)
@click.option("--run-dir", type=click.Path(path_type=Path), help="Default: ./hpcelastic-runs/local-<stamp>.")
@click.option(
    "--stall-timeout", type=click.FloatRange(min=MIN_STALL_TIMEOUT_S), help="Seconds without progress = hang."
)
@click.option("--rdzv-timeout", type=click.FloatRange(min=1), default=LOCAL_RDZV_TIMEOUT, show_default=True)
@click.option(
    "--grace-period",
    type=click.FloatRange(min=0, max=MAX_GRACE_PERIOD_S),
    default=LOCAL_GRACE_PERIOD,
    show_default=True,
)
@click.option("--replica-groups", type=click.IntRange(min=1), help="torchft replica groups [default: 1].")
@click.option("--min-replica-groups", type=click.IntRange(min=1), help="Fewest groups to go on [default: 1].")
@click.option("--no-warm-start", is_flag=True, help="Start each worker in a new interpreter.")
@_CONSOLE
@_METRICS_PORT
@click.option(
    "--local-checkpoint-dir",
    help=sites.SCHEMA["checkpoint_tier.local_checkpoint_dir"].option,
)
@click.option(
    "--local-checkpoint-mb",
    type=click.IntRange(min=1),
    help=sites.SCHEMA["checkpoint_tier.local_checkpoint_mb"].option,
)
@click.option("--local-tier", help=_LOCAL_TIER_HELP + " Every setting; or --local-checkpoint-dir.")
@_slow_options
@click.option("-m", "--module", is_flag=True, help="Run PROGRAM as a Python module.")
@_PROGRAM
def run(
    nodes: str,
    spare_nodes: int,
    nproc_per_node: str,
    max_restarts: int,
    run_dir: Path | None,
    stall_timeout: float | None,
    rdzv_timeout: float,
    grace_period: float,
    replica_groups: int | None,
    min_replica_groups: int | None,
    no_warm_start: bool,
    console: str | None,
    metrics_port: int | None,
    local_checkpoint_dir: str | None,
    local_checkpoint_mb: int | None,
    local_tier: str | None,
    slow_action: str | None,
    slow_min_slowdown: float | None,
    slow_windows: int | None,
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
    parse_nproc(nproc_per_node)
    worker_argv(program, module)
    local_tier = _local_tier(local_tier, local_checkpoint_dir, local_checkpoint_mb)
    if run_dir is not None and run_dir.exists():
        raise UserError(f"run directory {run_dir} already exists; pick a new one with --run-dir")
    if replica_groups or min_replica_groups:
        from hpcelastic.agent.replicas import check_groups

        problem = check_groups(hi, replica_groups or 1, min_replica_groups or 1)
        if problem:
            raise UserError(problem)
    spec = LocalRun(
        min_nodes=lo,
        max_nodes=hi,
        nproc=nproc_per_node,
        max_restarts=max_restarts,
        run_dir=run_dir,
        program=program,
        rdzv_timeout=rdzv_timeout,
        grace_period=grace_period,
        stall_timeout=stall_timeout,
        module=module,
        spare_nodes=spare_nodes,
        replica_groups=replica_groups,
        min_replica_groups=min_replica_groups,
        agent_args=("--no-warm-start",) if no_warm_start else (),
        console=console,
        metrics_port=metrics_port,
        local_tier=local_tier,
        slow=_slow_text(slow_action, slow_min_slowdown, slow_windows),
    )
    code = run_local(spec)
    if code == Reason.STARTUP_FAILURE.exit_code:
        hint = misplaced_options(program, click.get_current_context().command)
        if hint:
            click.echo(f"hpcelastic: hint: {hint}", err=True)
    sys.exit(code)


def _local_tier(text: str | None, directory: str | None, mb: int | None) -> str | None:
    """``run``'s local tier as the agents' ``--local-tier`` JSON: from that option, or from the options
    ``submit`` has (``--local-checkpoint-dir``, ``--local-checkpoint-mb``); checked here."""
    from hpcelastic.tier.settings import TierSettings

    if text and (directory or mb):
        raise UserError(
            "--local-tier and --local-checkpoint-dir/--local-checkpoint-mb: give one or the other"
        )
    if mb and not directory:
        raise UserError("--local-checkpoint-mb needs --local-checkpoint-dir (the tier is off without it)")
    if directory:
        return TierSettings(local_checkpoint_dir=directory, local_checkpoint_mb=mb).to_text()
    if text:
        TierSettings.parse(text)
    return text


def misplaced_options(program: tuple[str, ...], command: click.Command) -> str | None:
    """When the script's arguments hold ``command``'s own options (``hpcelastic run train.py --nodes 2``):
    what to say, since they went to the script."""
    own = {opt for p in command.params for opt in getattr(p, "opts", ()) if opt.startswith("--")}
    found = [a.split("=", 1)[0] for a in program[1:] if a.split("=", 1)[0] in own]
    if not found or not program:
        return None
    return (
        f"{', '.join(dict.fromkeys(found))} came after {program[0]}, so the script got "
        f"{'it' if len(set(found)) == 1 else 'them'}: hpcelastic's options go before the script "
        f"(hpcelastic {command.name} {found[0]} ... {program[0]} ARGS)"
    )
