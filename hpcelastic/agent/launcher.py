"""``hpcelastic run``: N node agents on this machine through the same code path as on a cluster.

The launcher creates the run directory and its secret, opens the coordinator's listening socket
itself (port 0: no probe-and-release race) and hands it to agent 0 as an inherited descriptor,
then waits for the agents and returns the job's exit code.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hpcelastic.agent.spec import AgentCommand
from hpcelastic.env.base import listen
from hpcelastic.errors import EXIT_INTERNAL, EXIT_OK
from hpcelastic.rundir import RunDir

_libc = ctypes.CDLL(None, use_errno=True)
LOCAL_RDZV_TIMEOUT = 60.0  # `hpcelastic run`'s defaults: one machine finds itself fast
LOCAL_GRACE_PERIOD = 30.0
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _libc.prctl(1, signal.SIGKILL, 0, 0, 0)


@dataclass(frozen=True)
class LocalRun:
    """What ``hpcelastic run`` was asked to do (already validated).

    ``agent_args``: further agent options, as words (tests and benchmarks pass some this way).
    """

    min_nodes: int
    max_nodes: int
    nproc: str
    max_restarts: int
    run_dir: Path | None
    agent_args: tuple[str, ...] = ()
    program: tuple[str, ...] = ()
    rdzv_timeout: float | None = None
    grace_period: float | None = None
    stall_timeout: float | None = None
    module: bool = False
    spare_nodes: int = 0
    replica_groups: int | None = None
    min_replica_groups: int | None = None

    @property
    def agents(self) -> int:
        """Agents started: MAX of --nodes plus the hot spares."""
        return self.max_nodes + self.spare_nodes


def default_run_dir() -> Path:
    """``./hpcelastic-runs/local-<stamp>``."""
    return Path("hpcelastic-runs") / f"local-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def agent_command(spec: LocalRun, run_dir: RunDir, port: int) -> tuple[str, ...]:
    """The ``python -m hpcelastic agent`` command line every local agent gets."""
    command = AgentCommand(
        run_dir=run_dir.path,
        nodes=f"{spec.min_nodes}:{spec.max_nodes}",
        spare_nodes=spec.spare_nodes or None,
        nproc_per_node=spec.nproc,
        max_restarts=spec.max_restarts,
        rdzv_endpoint=f"127.0.0.1:{port}",
        rdzv_timeout=spec.rdzv_timeout,
        stall_timeout=spec.stall_timeout,
        grace_period=spec.grace_period,
        replica_groups=spec.replica_groups,
        min_replica_groups=spec.min_replica_groups,
        module=spec.module,
        program=spec.program,
    )
    return command.to_argv(sys.executable, extra=spec.agent_args)


def start_agents(spec: LocalRun) -> tuple[RunDir, list[subprocess.Popen[bytes]]]:
    """Create the run directory and secret, and start the agents (agent i has local node rank i)."""
    run_dir = RunDir.create(spec.run_dir or default_run_dir())
    run_dir.create_secret()
    listener = listen("127.0.0.1", 0)
    cmd = agent_command(spec, run_dir, listener.getsockname()[1])
    agents: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(spec.agents):
            env = dict(os.environ)
            env.update(
                HPCELASTIC_LOCAL_NODE_RANK=str(i),
                HPCELASTIC_LOCAL_NUM_NODES=str(spec.agents),
                HPCELASTIC_RUN_DIR=str(run_dir.path),
            )
            env.pop("HPCELASTIC_COORDINATOR_FD", None)
            pass_fds: tuple[int, ...] = ()
            if i == 0:
                env["HPCELASTIC_COORDINATOR_FD"] = str(listener.fileno())
                pass_fds = (listener.fileno(),)
            agents.append(subprocess.Popen(cmd, env=env, pass_fds=pass_fds, preexec_fn=_die_with_parent))
    except BaseException:
        for a in agents:
            a.kill()
            a.wait()
        raise
    finally:
        listener.close()
    return run_dir, agents


def run_local(spec: LocalRun) -> int:
    """Start the agents, forward signals to them, wait; the job's exit code (agent 0's decision)."""
    run_dir, agents = start_agents(spec)
    print(f"hpcelastic: run directory {run_dir.path}", file=sys.stderr, flush=True)
    previous = {s: signal.signal(s, lambda signum, _f: _forward(agents, signum)) for s in FORWARDED}
    try:
        codes = [a.wait() for a in agents]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    code = job_exit_code(codes)
    outcome = "succeeded" if code == EXIT_OK else "failed"
    print(f"hpcelastic: job {outcome} (exit code {code}); events in {run_dir.events_path}", file=sys.stderr)
    return code


def job_exit_code(codes: list[int]) -> int:
    """Agent 0 decides; if it was killed, the survivors' common answer; else internal error."""
    if codes and codes[0] >= 0:
        return codes[0]
    return next((c for c in codes[1:] if c >= 0), EXIT_INTERNAL)


def _forward(agents: list[subprocess.Popen[bytes]], signum: int) -> None:
    for a in agents:
        with contextlib.suppress(OSError):
            a.send_signal(signum)
