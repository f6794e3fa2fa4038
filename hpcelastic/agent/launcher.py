"""``hpcelastic run``: N node agents on this machine through the same code path as on a cluster.

The launcher creates the run directory and its secret, opens the coordinator's listening socket
itself (port 0: no probe-and-release race) and hands it to agent 0 as an inherited descriptor,
then waits for the agents and returns the job's exit code. Its own and the agents' process ids go to
``<run>/local.json``, so that ``status`` can tell a live run from one whose processes were killed.
Ctrl-C (SIGINT), SIGTERM or SIGHUP is the user stopping the run: it is recorded as cancelled (with
the signal) before the agents get the signal, and ``hpcelastic run`` exits 128 + the signal's number.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from hpcelastic import events
from hpcelastic.agent.spec import AgentCommand
from hpcelastic.env.base import listen
from hpcelastic.errors import EXIT_INTERNAL, EXIT_OK, EXIT_STOPPED_FOR_REQUEUE, UserError
from hpcelastic.lifecycle.cancel import mark_cancelled
from hpcelastic.rundir import RunDir, write_json_atomic

_libc = ctypes.CDLL(None, use_errno=True)
LOCAL_RDZV_TIMEOUT = 60.0  # `hpcelastic run`'s defaults: one machine finds itself fast
LOCAL_GRACE_PERIOD = 30.0
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
#: The signals by which the user stops ``hpcelastic run`` (Ctrl-C, kill, a closed terminal).
USER_STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


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
    console: str | None = None
    metrics_port: int | None = None
    #: The checkpoint tier's settings (``TierSettings.to_text``), or None.
    local_tier: str | None = None
    #: Slow-node detection's settings (``SlowSettings.to_text``), or None (the default's).
    slow: str | None = None

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
        console=spec.console,
        metrics_port=spec.metrics_port,
        local_tier=spec.local_tier,
        slow=spec.slow,
        module=spec.module,
        program=spec.program,
    )
    return command.to_argv(sys.executable, extra=spec.agent_args)


def check_local_tier(spec: LocalRun, run_dir: RunDir) -> None:
    """Every local node's checkpoint tier directory (``--local-tier``), checked before any agent starts."""
    if not spec.local_tier:
        return
    from hpcelastic.env.local import local_host
    from hpcelastic.tier.settings import TierSettings, check_node

    settings = TierSettings.parse(spec.local_tier)
    for i in range(spec.agents):
        check_node(settings, settings.local_dir(local_host(i), run_dir.path.name), run_dir.path)


def start_agents(spec: LocalRun) -> tuple[RunDir, list[subprocess.Popen[bytes]]]:
    """Create the run directory and secret, and start the agents (agent i has local node rank i)."""
    run_dir = RunDir.create(spec.run_dir or default_run_dir())
    try:
        check_local_tier(spec, run_dir)
    except UserError:
        shutil.rmtree(run_dir.path, ignore_errors=True)  # a refused setting leaves nothing behind
        raise
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
    """Start the agents, forward signals to them, wait; the job's exit code (agent 0's decision), or
    128 + the signal's number when the user stopped the run."""
    run_dir, agents = start_agents(spec)
    record_processes(run_dir, [os.getpid(), *(a.pid for a in agents)])
    print(f"hpcelastic: run directory {run_dir.path}", file=sys.stderr, flush=True)
    stops: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        if signum in USER_STOPS and not stops:
            stops.append(signum)
            stopped_by_user(run_dir, signum)  # first: the agents' decision must see the cancel
        _forward(agents, signum)

    previous = {s: signal.signal(s, on_signal) for s in FORWARDED}
    try:
        codes = [a.wait() for a in agents]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    code = job_exit_code(codes)
    where = f"events in {run_dir.events_path}"
    if stops and code != EXIT_OK:
        name = signal.Signals(stops[0]).name
        print(
            f"hpcelastic: run stopped by the user ({name}, exit code {128 + stops[0]}); {where}",
            file=sys.stderr,
        )
        return 128 + stops[0]
    if code == EXIT_STOPPED_FOR_REQUEUE:  # a stop signal: no Slurm here to bring the job back
        outcome = "stopped on the stop signal (nothing requeues a local run: run it again to resume)"
    else:
        outcome = "succeeded" if code == EXIT_OK else "failed"
    print(f"hpcelastic: job {outcome} (exit code {code}); {where}", file=sys.stderr)
    return code


def stopped_by_user(run_dir: RunDir, signum: int) -> None:
    """Record that the user stopped the run with ``signum``: cancelled, so that no decision brings it back."""
    mark_cancelled(run_dir)
    run_dir.record(events.cancelled(job_id=run_dir.local_job_id, signal=signal.Signals(signum).name))


@dataclass(frozen=True)
class LocalProcesses:
    """``<run>/local.json``: the host ``hpcelastic run`` ran on and its processes (pid, start time)."""

    host: str
    processes: tuple[tuple[int, float], ...]

    def alive(self) -> bool | None:
        """Whether any of the processes still runs; None when they ran on another host (cannot tell)."""
        if self.host != socket.gethostname():
            return None
        return any(_running(pid, started) for pid, started in self.processes)


def record_processes(run_dir: RunDir, pids: Sequence[int]) -> None:
    """Write ``<run>/local.json`` for the launcher and its agents (a pid reused later does not count)."""
    started = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            started.append([pid, psutil.Process(pid).create_time()])
    write_json_atomic(run_dir.local_path, {"host": socket.gethostname(), "processes": started})


def read_processes(run_dir: RunDir) -> LocalProcesses | None:
    """What :func:`record_processes` wrote, or None (not a local run, or written by an older version)."""
    try:
        obj = json.loads(run_dir.local_path.read_text())
        return LocalProcesses(str(obj["host"]), tuple((int(p), float(t)) for p, t in obj["processes"]))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _running(pid: int, started: float) -> bool:
    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - started) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def job_exit_code(codes: list[int]) -> int:
    """Agent 0 decides; if it was killed, the survivors' common answer; else internal error."""
    if codes and codes[0] >= 0:
        return codes[0]
    return next((c for c in codes[1:] if c >= 0), EXIT_INTERNAL)


def _forward(agents: list[subprocess.Popen[bytes]], signum: int) -> None:
    for a in agents:
        with contextlib.suppress(OSError):
            a.send_signal(signum)
