"""The node agent: one per node, a state machine driven by events (never a polling loop).

INIT -> RENDEZVOUS -> RUNNING -> RESTARTING (-> RUNNING ...) | STOPPING -> DONE

The main thread owns a selector over: each worker's pidfd (exits), the heartbeat socket (worker
heartbeats), and one wake-up pipe that both signal delivery and the coordinator client's reader
thread write to. Workers are spawned only from this thread (their parent-death signal is tied to
it). Group rank 0 also hosts the :class:`~hpcelastic.agent.coordinator.Coordinator`.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import queue
import selectors
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcelastic import handoff
from hpcelastic.agent import protocol
from hpcelastic.agent.client import CoordinatorClient, CoordinatorUnreachable
from hpcelastic.agent.coordinator import Coordinator, PortReservation
from hpcelastic.agent.health import GpuHealth
from hpcelastic.agent.job_state import JobState
from hpcelastic.agent.watchdog import Watchdog
from hpcelastic.agent.workers import RoundInfo, Worker, WorkerConfig, WorkerGroup
from hpcelastic.env.base import BootstrapOptions, Environment, NodeContext, Rendezvous
from hpcelastic.errors import (
    EXIT_COORDINATOR_LOST,
    EXIT_NODE_UNHEALTHY,
    UserError,
)
from hpcelastic.requeue import RequeuePolicy, classify_stop_signal, current_job_id
from hpcelastic.rundir import RunDir

RESTART_KILL_GRACE = 3.0
STALL_CHECK_INTERVAL = 0.5


class State(enum.Enum):
    INIT = "init"
    RENDEZVOUS = "rendezvous"
    RUNNING = "running"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    DONE = "done"


@dataclass(frozen=True)
class AgentSpec:
    """The agent's command line, validated."""

    argv: tuple[str, ...]
    min_nodes: int | None = None
    max_nodes: int | None = None
    nproc: int | None = None
    max_restarts: int = 3
    checkpoint_dir: Path | None = None
    stall_timeout: float | None = None
    stop_signal: signal.Signals = signal.SIGUSR2
    grace_period: float = 60.0
    rdzv: BootstrapOptions = BootstrapOptions()
    requeue_mode: str = "requeue"
    max_requeues: int = 3


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        raise UserError(f"{name}={os.environ[name]!r} is not a number") from None


class Agent:
    """Runs this node's share of one job attempt; :meth:`run` returns the process exit code."""

    def __init__(self, env: Environment, spec: AgentSpec) -> None:
        self.env = env
        self.spec = spec
        self.state = State.INIT
        self.hb_interval = _env_float("HPCELASTIC_HEARTBEAT_INTERVAL", 0.5)
        self.hb_timeout = _env_float("HPCELASTIC_HEARTBEAT_TIMEOUT", 2.0)
        self.health_interval = _env_float("HPCELASTIC_HEALTH_INTERVAL", 30.0)
        self._messages: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._signals: list[int] = []
        self._exit_code: int | None = None
        self._round: RoundInfo | None = None
        self._reported_round = -1
        self._preempting = False
        self._stop_deadline: float | None = None
        self.coordinator: Coordinator | None = None
        self.client: CoordinatorClient | None = None
        self.group: WorkerGroup | None = None
        self._watchdog: Watchdog | None = None
        self._health: GpuHealth | None = None
        self._tmp: str | None = None

    # ---- set-up -----------------------------------------------------------------------------
    def run(self) -> int:
        """Rendezvous, run rounds until the job ends, clean up; returns the exit code."""
        try:
            return self._run()
        finally:
            self._cleanup()

    def _run(self) -> int:
        ctx = self.env.context()
        self.ctx = ctx
        min_nodes, max_nodes = self._node_range(ctx)
        nproc = self._nproc(ctx)
        rdzv = self.env.rendezvous(ctx, self.spec.rdzv)
        self.run_dir = rdzv.run_dir
        self.attempt = begin_attempt(self.run_dir, ctx, self.env.environ)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        if ctx.is_coordinator:
            self._start_coordinator(ctx, rdzv, min_nodes)
        self.state = State.RENDEZVOUS
        self._connect(ctx, rdzv, nproc)
        self._prepare_workers(ctx, nproc)
        self._install_signals()
        self._check_health(first=True)
        assert self.client is not None
        self.client.start()
        return self._loop()

    def _node_range(self, ctx: NodeContext) -> tuple[int, int]:
        lo = self.spec.min_nodes or ctx.num_nodes
        hi = self.spec.max_nodes or ctx.num_nodes
        if ctx.num_nodes > hi:
            raise UserError(
                f"{ctx.num_nodes} agents started but --nodes allows at most {hi}; start one agent per node"
            )
        if ctx.num_nodes < lo:
            raise UserError(
                f"only {ctx.num_nodes} node(s) in this step, fewer than the minimum {lo} of --nodes"
            )
        return lo, hi

    def _nproc(self, ctx: NodeContext) -> int:
        nproc = self.spec.nproc or len(ctx.gpus) or 1
        if ctx.gpus and nproc > len(ctx.gpus):
            raise UserError(
                f"--nproc-per-node {nproc} exceeds the {len(ctx.gpus)} GPU(s) visible to this step; "
                "ask for more GPUs or run fewer workers"
            )
        return nproc

    def _start_coordinator(self, ctx: NodeContext, rdzv: Rendezvous, min_nodes: int) -> None:
        assert rdzv.listener is not None
        self._ports = PortReservation()
        state = JobState(
            hosts=ctx.hosts,
            min_nodes=min_nodes,
            max_restarts=self.spec.max_restarts,
            master_addr=rdzv.master_addr,
            new_port=self._ports.new_port,
            rdzv_timeout=self.spec.rdzv.timeout,
            stop_timeout=max(RESTART_KILL_GRACE, self.spec.grace_period),
        )
        self.coordinator = Coordinator(
            rdzv.listener,
            rdzv.secret,
            state,
            self.run_dir,
            heartbeat_interval=self.hb_interval,
            heartbeat_timeout=self.hb_timeout,
        )
        self.coordinator.start()

    def _connect(self, ctx: NodeContext, rdzv: Rendezvous, nproc: int) -> None:
        host = "127.0.0.1" if self.coordinator is not None else rdzv.host
        self.client = CoordinatorClient(
            host,
            rdzv.port,
            rdzv.secret,
            on_message=self._post,
            heartbeat_interval=self.hb_interval,
            heartbeat_timeout=self.hb_timeout,
        )
        hello = {"node_rank": ctx.node_rank, "host": ctx.host, "nproc": nproc, "pid": os.getpid()}
        try:
            self.client.connect(hello, timeout=self.spec.rdzv.timeout)
        except protocol.AuthError as e:
            raise UserError(
                f"the coordinator at {rdzv.host}:{rdzv.port} rejected this agent ({e}); every node must read "
                f"the same secret ({rdzv.run_dir.secret_path} or $HPCELASTIC_SECRET)"
            ) from None
        except protocol.ProtocolError as e:
            raise UserError(f"the coordinator at {rdzv.host}:{rdzv.port} refused this agent: {e}") from None
        except CoordinatorUnreachable as e:
            self._say(str(e))
            self._exit_code = self._on_attempt_end("coordinator_lost", EXIT_COORDINATOR_LOST, [])
            raise _Finished from None

    def _prepare_workers(self, ctx: NodeContext, nproc: int) -> None:
        self._tmp = tempfile.mkdtemp(prefix="hpcelastic-agent-")
        hb_path = os.path.join(self._tmp, "hb.sock")
        self._hb_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._hb_sock.bind(hb_path)
        self._hb_sock.setblocking(False)
        self._sel.register(self._hb_sock, selectors.EVENT_READ, "hb")
        checkpoint_dir = self.spec.checkpoint_dir or self.run_dir.path / "checkpoints"
        checkpoint_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.stop_file = self.run_dir.path / f"stop-attempt-{self.attempt}"
        cfg = WorkerConfig(
            argv=self.spec.argv,
            nproc=nproc,
            gpus=ctx.gpus,
            run_dir=self.run_dir,
            attempt=self.attempt,
            run_id=ctx.job_id or self.run_dir.path.name,
            checkpoint_dir=checkpoint_dir,
            heartbeat_socket=hb_path,
            stop_file=self.stop_file,
            stop_signal=self.spec.stop_signal.name.removeprefix("SIG"),
            environ=dict(self.env.environ),
            node_rank=ctx.node_rank,
        )
        self._watchdog = Watchdog()
        self.group = WorkerGroup(cfg, self._sel, self._watchdog)
        self._health = GpuHealth.open(nvml_gpu_ids(self.env.environ, ctx))

    def _install_signals(self) -> None:
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in {self.spec.stop_signal, signal.SIGTERM, signal.SIGINT, signal.SIGHUP}:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._signals.append(signum)

    def _post(self, msg: dict[str, Any]) -> None:
        """Called from the client's reader thread: queue the message and wake the main loop."""
        self._messages.put(msg)
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")

    # ---- main loop --------------------------------------------------------------------------
    def _loop(self) -> int:
        next_stall = next_health = time.monotonic()
        while self._exit_code is None:
            now = time.monotonic()
            timeout = None
            if self.spec.stall_timeout:
                timeout = max(0.0, next_stall - now)
            if self._health is not None:
                timeout = min(timeout if timeout is not None else 1e9, max(0.0, next_health - now))
            if self._stop_deadline is not None:
                timeout = min(timeout if timeout is not None else 1e9, max(0.0, self._stop_deadline - now))
            for key, _mask in self._sel.select(timeout):
                if key.data == "wake":
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                elif key.data == "hb":
                    self._read_heartbeats()
                else:
                    self._on_worker_exit(key.data[1])
                if self._exit_code is not None:
                    break
            self._drain_signals()
            self._drain_messages()
            now = time.monotonic()
            if self.spec.stall_timeout and now >= next_stall:
                next_stall = now + STALL_CHECK_INTERVAL
                self._check_stalls()
            if self._health is not None and now >= next_health:
                next_health = now + self.health_interval
                self._check_health(first=False)
            if self._stop_deadline is not None and now >= self._stop_deadline:
                self._finish_preempt_stop()
        return self._exit_code

    def _drain_messages(self) -> None:
        while self._exit_code is None:
            try:
                msg = self._messages.get_nowait()
            except queue.Empty:
                return
            handler = getattr(self, f"_msg_{msg['t']}", None)
            if handler is not None:
                handler(msg)

    def _msg_round(self, msg: dict[str, Any]) -> None:
        assert self.group is not None and self.client is not None
        if self.group.running():
            self.group.stop(RESTART_KILL_GRACE)
        self._round = RoundInfo.from_message(msg)
        if self._preempting:
            self._reported_round = self._round.round
            self.client.send({"t": "stopped", "round": self._round.round, "failures": []})
            return
        self.state = State.RUNNING
        spawned = self.group.start(self._round)
        self.client.send({"t": "started", "round": self._round.round, "ts": spawned})

    def _msg_stop(self, msg: dict[str, Any]) -> None:
        if (
            self._round is None
            or msg["round"] != self._round.round
            or self._reported_round == self._round.round
        ):
            return
        self._stop_and_report([])

    def _msg_preempt(self, msg: dict[str, Any]) -> None:
        self._begin_preempt(str(msg.get("signal") or self.spec.stop_signal.name), local=False)

    def _msg_finish(self, msg: dict[str, Any]) -> None:
        assert self.group is not None
        self.group.stop(RESTART_KILL_GRACE)
        self.state = State.DONE
        reason, code = str(msg["reason"]), int(msg["exit_code"])
        if msg.get("message"):
            self._say(str(msg["message"]))
        self._exit_code = self._on_attempt_end(reason, code, list(msg.get("bad_nodes", [])))

    def _msg_lost(self, msg: dict[str, Any]) -> None:
        assert self.group is not None
        self.group.stop(RESTART_KILL_GRACE)
        self.state = State.DONE
        self._say(f"coordinator lost: {msg['reason']}; stopping this node's workers")
        self._exit_code = self._on_attempt_end("coordinator_lost", EXIT_COORDINATOR_LOST, [])

    # ---- workers ----------------------------------------------------------------------------
    def _on_worker_exit(self, worker: Worker) -> None:
        assert self.group is not None and self.client is not None
        code = self.group.reap(worker)
        if self.state == State.STOPPING:
            if not self.group.running():
                self._finish_preempt_stop()
            return
        if self.state != State.RUNNING or self._round is None:
            return
        if code != 0:
            failure = self.group.failure(worker)
            self.client.send({"t": "failed", "round": self._round.round, "failures": [failure]})
            self._stop_and_report([])
        elif not self.group.running():
            self.client.send({"t": "done", "round": self._round.round})
            self.state = State.RESTARTING  # exit barrier: wait for the coordinator's decision

    def _stop_and_report(self, failures: list[dict[str, Any]]) -> None:
        """Stop every local worker, then tell the coordinator this node is stopped for the round."""
        assert self.group is not None and self.client is not None and self._round is not None
        failures = failures + [self.group.failure(w) for w in self.group.reap_failed()]
        self.state = State.RESTARTING
        self.group.stop(RESTART_KILL_GRACE)
        self._reported_round = self._round.round
        self.client.send({"t": "stopped", "round": self._round.round, "failures": failures})

    def _check_stalls(self) -> None:
        assert self.group is not None and self.client is not None
        if self.state != State.RUNNING or self._round is None or not self.spec.stall_timeout:
            return
        stalled = self.group.stalled(self.spec.stall_timeout)
        if not stalled:
            return
        failures = []
        for w in stalled:
            w.exit_ts = time.time()
            error = f"stalled: no heartbeat for more than {self.spec.stall_timeout:g} s (last step {w.step})"
            failures.append(self.group.failure(w, error=error))
        self.client.send({"t": "failed", "round": self._round.round, "failures": failures})
        self._stop_and_report([])

    def _read_heartbeats(self) -> None:
        assert self.group is not None
        while True:
            try:
                data = self._hb_sock.recv(4096)
            except (BlockingIOError, InterruptedError):
                return
            with contextlib.suppress(ValueError, TypeError, KeyError):
                beat = json.loads(data)
                step = beat.get("step")
                self.group.beat(int(beat["rank"]), int(step) if step is not None else None)

    # ---- signals, preemption, health --------------------------------------------------------
    def _drain_signals(self) -> None:
        while self._signals and self._exit_code is None:
            signum = self._signals.pop(0)
            if signum == self.spec.stop_signal:
                self._event(
                    "signal_received", signal=signal.Signals(signum).name, node_rank=self.ctx.node_rank
                )
                self._begin_preempt(signal.Signals(signum).name, local=True)
            else:
                self._terminate(signum)

    def _begin_preempt(self, signame: str, *, local: bool) -> None:
        assert self.group is not None and self.client is not None
        if not self._preempting:
            self._preempting = True
            self.group.signal_all(self.spec.stop_signal)
            with contextlib.suppress(OSError):
                self.stop_file.touch(mode=0o600)
            self._say(f"{signame}: asked the workers to stop (grace {self.spec.grace_period:g} s)")
        if local:
            self.client.send({"t": "preempt", "signal": signame})
        if self.state in (State.RUNNING, State.RESTARTING) and self._stop_deadline is None:
            self.state = State.STOPPING
            self._stop_deadline = time.monotonic() + self.spec.grace_period
            if not self.group.running():
                self._finish_preempt_stop()

    def _finish_preempt_stop(self) -> None:
        """Workers are gone (or the grace period is over): report this node stopped."""
        assert self.group is not None and self.client is not None
        self._stop_deadline = None
        self.group.stop(RESTART_KILL_GRACE)
        rnd = self._round.round if self._round else -1
        self._reported_round = rnd
        self.client.send({"t": "stopped", "round": rnd, "failures": []})

    def _terminate(self, signum: int) -> None:
        """SIGTERM/SIGINT/SIGHUP: stop the workers and leave the job."""
        assert self.group is not None and self.client is not None
        name = signal.Signals(signum).name
        self._say(f"{name}: stopping this node's workers")
        self.group.stop(min(RESTART_KILL_GRACE, self.spec.grace_period))
        self.client.send({"t": "leave", "reason": f"agent received {name}"})
        self.state = State.DONE
        self._exit_code = 128 + signum

    def _check_health(self, *, first: bool) -> None:
        if self._health is None:
            return
        problems = self._health.check()
        if not problems:
            return
        assert self.client is not None
        for p in problems:
            self.run_dir.append_event("node_unhealthy", node=self.ctx.host, gpu=p.gpu, reason=p.reason)
            self._say(f"GPU {p.gpu} is unhealthy: {p.reason}; this node leaves the job")
        if self.group is not None:
            self.group.stop(RESTART_KILL_GRACE)
        self.client.send({"t": "leave", "reason": f"node unhealthy: {problems[0].reason}", "unhealthy": True})
        self.state = State.DONE
        code = EXIT_NODE_UNHEALTHY
        if self.coordinator is not None:
            # This node hosts the coordinator: wait until it has told the others how the attempt ends.
            self.coordinator.finished.wait(timeout=self.hb_timeout + 2 * self.spec.grace_period)
            result = self.coordinator.state.result or {"reason": "node_unhealthy", "exit_code": code}
            code = self._on_attempt_end(result["reason"], result["exit_code"], [self.ctx.host])
        self._exit_code = code
        if first:
            raise _Finished

    # ---- the end ----------------------------------------------------------------------------
    def _on_attempt_end(self, reason: str, exit_code: int, bad_nodes: list[str]) -> int:
        """The one end-of-attempt decision: record how this attempt ended, requeue if it must.

        Group rank 0 decides; when the coordinator is gone, the first surviving agent to claim
        it does (``finalize`` in the batch script is the last resort). The requeue policy writes
        ``attempt_ended`` and the job-level events and returns the exit code of the agent.
        """
        run_dir = getattr(self, "run_dir", None)
        if run_dir is None:
            return exit_code
        # When the coordinator is gone every survivor asks; decide() lets exactly one of them decide.
        if self.coordinator is None and reason != "coordinator_lost":
            return exit_code
        job_id = current_job_id(self.env.environ)
        if reason == "preempted" and job_id:
            reason = classify_stop_signal(job_id)
        progressed = self.group is not None and any(w.step is not None for w in self.group.workers)
        policy = RequeuePolicy(self.spec.requeue_mode, self.spec.max_requeues)
        outcome = policy.decide(
            run_dir,
            self.attempt,
            reason,
            exit_code,
            bad_nodes,
            job_id,
            last_root_cause(run_dir),
            progressed=progressed,
        )
        self._say(f"attempt {self.attempt} ended: {reason}; {outcome.message}")
        return outcome.exit_code

    def _event(self, name: str, **fields: Any) -> None:
        """An agent-level event: through the coordinator when connected, else written directly."""
        if self.client is None or not self.client.send({"t": "event", "event": name, "fields": fields}):
            self.run_dir.append_event(name, host=self.ctx.host, **fields)

    def _say(self, text: str) -> None:
        rank = getattr(getattr(self, "ctx", None), "node_rank", "?")
        print(f"hpcelastic[agent {rank}]: {text}", file=sys.stderr, flush=True)

    def _cleanup(self) -> None:
        if self.group is not None:
            self.group.stop(RESTART_KILL_GRACE)
        if self.client is not None:
            self.client.close()
        if self.coordinator is not None:
            self.coordinator.stop(drain_timeout=RESTART_KILL_GRACE + 2.0)
            self._ports.release()
        if self._watchdog is not None:
            self._watchdog.close()
        if self._health is not None:
            self._health.close()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(-1)


class _Finished(Exception):
    """Raised during set-up when the attempt already ended (exit code recorded on the agent)."""


def run_agent(env: Environment, spec: AgentSpec) -> int:
    """Run one agent to the end and return its exit code."""
    agent = Agent(env, spec)
    try:
        return agent.run()
    except _Finished:
        assert agent._exit_code is not None
        return agent._exit_code


def begin_attempt(run_dir: RunDir, ctx: NodeContext, environ: Mapping[str, str]) -> int:
    """This allocation's attempt number, from the handoff record.

    Every agent calls it; under the record's lock the first caller of a new allocation
    (job id + Slurm restart count) bumps the number and the others read the same one.
    """
    job = current_job_id(environ) or f"local-{run_dir.path.name}"
    return handoff.begin_attempt(run_dir, job, ctx.restart_count, list(ctx.hosts))


def last_root_cause(run_dir: RunDir) -> dict[str, Any] | None:
    """The newest ``root_cause`` event of the current attempt, or None."""
    for ev in reversed(run_dir.events()):
        if ev.get("event") == "root_cause":
            return ev
        if ev.get("event") == "attempt_started":
            return None
    return None


def nvml_gpu_ids(environ: Any, ctx: NodeContext) -> tuple[str, ...]:
    """NVML's ids of this node's GPUs: Slurm's global ids when known, else the visible ids."""
    for var in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        ids = tuple(x for x in environ.get(var, "").split(",") if x.strip())
        if ids and len(ids) == len(ctx.gpus):
            return ids
    return ctx.gpus
