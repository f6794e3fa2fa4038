"""The agent command line: one builder (AgentCommand.to_argv), one parser (the `agent` command)."""

from __future__ import annotations

import dataclasses
import signal
from pathlib import Path

import click
import pytest

from hpcelastic import sites
from hpcelastic.agent.launcher import LocalRun, agent_command
from hpcelastic.agent.spec import AgentCommand, AgentSpec
from hpcelastic.cli.agent_cmd import agent
from hpcelastic.rundir import RunDir


def parsed(argv: tuple[str, ...]) -> AgentCommand:
    """What the `agent` click command makes of ``argv`` (after ``PYTHON -m hpcelastic agent``)."""
    assert argv[1:4] == ("-m", "hpcelastic", "agent")
    with click.Context(agent) as ctx:
        agent.parse_args(ctx, list(argv[4:]))
        return AgentCommand(**ctx.params)


FULL = AgentCommand(
    run_dir=Path("/runs/a b"),
    nodes="2:4",
    nproc_per_node="8",
    max_restarts=7,
    checkpoint_dir=Path("/ckpt"),
    rdzv_endpoint="head:29400",
    rdzv_port=29400,
    rdzv_interface="ib0",
    rdzv_timeout=30.0,
    stall_timeout=12.5,
    signal="USR1",
    grace_period=45.0,
    requeue_mode="resubmit",
    max_requeues=2,
    no_warm_start=True,
    local_tier='{"local_checkpoint_dir":"/dev/shm/c-{job}-{node}","replicas":2}',
    module=True,
    program=("pkg.train", "--lr", "3e-4", "--", "-m"),
)


@pytest.mark.parametrize("command", [FULL, AgentCommand(program=("train.py",))])
def test_what_to_argv_builds_the_agent_command_parses_back(command: AgentCommand) -> None:
    assert parsed(command.to_argv("/usr/bin/python3")) == command


def test_unset_options_are_left_out_and_whole_numbers_print_plain() -> None:
    argv = AgentCommand(grace_period=60.0, program=("t.py",)).to_argv("py")
    assert argv == ("py", "-m", "hpcelastic", "agent", "--nproc-per-node", "auto", "--max-restarts", "3",
                    "--grace-period", "60", "--", "t.py")  # fmt: skip


def test_defaults_come_from_the_site_schema(tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text("")
    spec = AgentCommand(program=(str(script),)).to_spec()
    assert spec.max_requeues == sites.default("requeue.max_requeues") == 5
    assert spec.max_restarts == sites.default("max_restarts")
    assert spec.grace_period == sites.default("requeue.grace_period")
    assert spec.requeue_mode == sites.default("requeue.mode")
    assert spec.stop_signal is signal.SIGUSR2
    assert spec.rdzv.timeout == 300.0
    assert {f.name for f in dataclasses.fields(spec)} == {
        "argv", "min_nodes", "max_nodes", "spare_nodes", "nproc", "max_restarts", "checkpoint_dir",
        "stall_timeout", "stop_signal", "grace_period", "rdzv", "requeue_mode", "max_requeues", "warm_start",
        "replica_groups", "min_replica_groups", "console", "metrics_port", "metrics_textfile_dir",
        "local_tier", "slow",
    }  # fmt: skip


def test_to_spec_validates_every_value(tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text("")
    spec = dataclasses.replace(FULL, module=False, program=(str(script), "x")).to_spec()
    assert isinstance(spec, AgentSpec)
    assert (spec.min_nodes, spec.max_nodes, spec.nproc, spec.stop_signal) == (2, 4, 8, signal.SIGUSR1)
    assert (spec.rdzv.endpoint, spec.rdzv.port, spec.rdzv.timeout) == ("head:29400", 29400, 30.0)
    assert spec.argv[1:] == ("-u", str(script), "x")


def test_hpcelastic_run_builds_its_agents_line_with_the_same_builder(tmp_path: Path) -> None:
    run = LocalRun(
        min_nodes=1,
        max_nodes=2,
        nproc="2",
        max_restarts=1,
        run_dir=None,
        program=("train.py", "--steps", "5"),
        rdzv_timeout=60.0,
        grace_period=30.0,
        module=False,
    )
    argv = agent_command(run, RunDir(tmp_path), 4242)
    assert parsed(argv) == AgentCommand(
        run_dir=tmp_path,
        nodes="1:2",
        nproc_per_node="2",
        max_restarts=1,
        rdzv_endpoint="127.0.0.1:4242",
        rdzv_timeout=60.0,
        grace_period=30.0,
        program=("train.py", "--steps", "5"),
    )
    raw = agent_command(dataclasses.replace(run, agent_args=("--stall-timeout", "9")), RunDir(tmp_path), 1)
    assert parsed(raw).stall_timeout == 9.0
