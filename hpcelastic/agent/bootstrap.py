"""Set a node agent up: rendezvous, the coordinator on group rank 0, the connection, the workers' group.

:func:`bootstrap` returns the :class:`~hpcelastic.agent.runtime.NodeRuntime`, or the agent's exit
code when the attempt already ended (the coordinator could not be reached). Every resource it opens
is closed by the caller's exit stack, in reverse order.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hpcelastic import events, handoff
from hpcelastic.agent import liveness, messages
from hpcelastic.agent.client import CoordinatorClient, CoordinatorUnreachable
from hpcelastic.agent.coordinator import Coordinator, PortReservation
from hpcelastic.agent.health import GpuHealth
from hpcelastic.agent.job_state import JobState
from hpcelastic.agent.lighthouse import replica_state_factory
from hpcelastic.agent.runtime import RESTART_KILL_GRACE, Inbox, NodeRuntime, Timing, Wake, say
from hpcelastic.agent.spec import AgentSpec
from hpcelastic.agent.watchdog import Watchdog
from hpcelastic.agent.workers import WorkerConfig, WorkerGroup, start_forkserver
from hpcelastic.env import slurm
from hpcelastic.env.base import Environment, NodeContext, Rendezvous
from hpcelastic.errors import EXIT_CANCELLED, UserError
from hpcelastic.lifecycle.attempt_end import Deferred, defer, end_attempt
from hpcelastic.lifecycle.cancel import refuse_cancelled_start
from hpcelastic.reasons import Reason
from hpcelastic.rundir import RunDir
from hpcelastic.slow.watch import SlowWatch
from hpcelastic.tier.book import TierBook
from hpcelastic.tier.node import LocalTier, published_size
from hpcelastic.tier.settings import NodeTier, check_node, key
from hpcelastic.worker import DEFAULT_CHECKPOINT_SUBDIR

#: The agent's exit code when the run was cancelled before its attempt started (128 + SIGTERM).


def bootstrap(env: Environment, spec: AgentSpec, stack: contextlib.ExitStack) -> NodeRuntime | int:
    """Build this node's runtime, registering every clean-up on ``stack``; an exit code if it ended."""
    ctx = env.context()
    timing = Timing.from_environ(os.environ, nodes=len(ctx.hosts))
    min_nodes = node_range(spec, ctx)[0]
    nproc = worker_count(spec, ctx)
    if cancelled_before_start(spec, ctx, env.environ):
        return EXIT_CANCELLED
    node_tier = check_tier(spec, ctx)
    rdzv = env.rendezvous(ctx, spec.rdzv)
    run_dir = rdzv.run_dir
    attempt = begin_attempt(run_dir, ctx, env.environ)
    selector = stack.enter_context(selectors.DefaultSelector())
    # Started first: the fork server imports torch while the agents meet (agent/forkserver.py).
    forkserver, cold_reason = start_forkserver(spec.argv, env.worker_environ(), nproc, spec.warm_start)
    if forkserver is not None:
        stack.callback(forkserver.close)
    wake = Wake()
    stack.callback(wake.close)
    selector.register(wake.r, selectors.EVENT_READ, "wake")
    checkpoint_dir = spec.checkpoint_dir or run_dir.path / DEFAULT_CHECKPOINT_SUBDIR
    tier = local_tier(spec, node_tier, ctx, rdzv, checkpoint_dir, attempt, stack)
    coordinator = (
        host_coordinator(spec, ctx, rdzv, min_nodes, timing, stack, attempt=attempt)
        if ctx.is_coordinator
        else None
    )
    if coordinator is not None:
        export_metrics(spec, ctx, rdzv, env.environ, stack, coordinator.state.live)
    inbox = Inbox(wake)
    client = CoordinatorClient(
        "127.0.0.1" if coordinator is not None else rdzv.host,
        rdzv.port,
        rdzv.secret,
        on_message=inbox.post,
        heartbeat_interval=timing.heartbeat_interval,
        heartbeat_timeout=timing.heartbeat_timeout,
        probe_timeout=timing.probe_timeout,
        beat_interval=timing.beat_interval,
        beat_timeout=timing.beat_timeout,
    )
    stack.callback(client.close)
    hello = messages.Hello(
        node_rank=ctx.node_rank,
        host=ctx.host,
        nproc=nproc,
        pid=os.getpid(),
        data_port=tier.port if tier is not None else 0,
    )
    try:
        client.connect(hello, timeout=spec.rdzv.timeout)
    except CoordinatorUnreachable as e:  # refusals included: they are not authenticated (issue 10)
        say(ctx.node_rank, str(e))
        # Not this agent's decision: the coordinator goes on without it, or finalize decides after srun.
        return end_of_attempt(spec, env.environ, run_dir, attempt, Reason.COORDINATOR_LOST, decides=False)

    hb_path = heartbeat_socket_path(stack)
    heartbeats = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM))
    heartbeats.bind(hb_path)
    heartbeats.setblocking(False)
    selector.register(heartbeats, selectors.EVENT_READ, "hb")
    checkpoint_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    if tier is not None:
        tier.send = client.send
    stop_file = run_dir.path / f"stop-attempt-{attempt}"
    cfg = WorkerConfig(
        argv=spec.argv,
        nproc=nproc,
        gpus=ctx.gpus,
        run_dir=run_dir,
        attempt=attempt,
        run_id=ctx.job_id or run_dir.path.name,
        checkpoint_dir=tier.live if tier is not None else checkpoint_dir,
        heartbeat_socket=hb_path,
        stop_file=stop_file,
        stop_signal=spec.stop_signal.name.removeprefix("SIG"),
        environ=env.worker_environ(),
        node_rank=ctx.node_rank,
        console=spec.console,
        local_tier=tier is not None,
        slow_dir=slow_dir(spec, hb_path),
    )
    watchdog = Watchdog()
    stack.callback(watchdog.close)
    if tier is not None:
        tier.clean_on_death(watchdog)
    group = WorkerGroup(cfg, selector, watchdog, forkserver=forkserver, cold_reason=cold_reason)
    stack.callback(group.stop, RESTART_KILL_GRACE)
    health = GpuHealth.open(ctx.nvml_gpu_ids)
    if health is not None:
        stack.callback(health.close)
    rt = NodeRuntime(
        spec=spec,
        environ=env.environ,
        ctx=ctx,
        run_dir=run_dir,
        attempt=attempt,
        timing=timing,
        selector=selector,
        inbox=inbox,
        client=client,
        coordinator=coordinator,
        group=group,
        heartbeats=heartbeats,
        stop_file=stop_file,
        health=health,
        tier=tier,
    )
    install_signals(rt, wake, stack)
    return rt


def detects_slow(spec: AgentSpec) -> bool:
    """Slow-node detection runs (``--slow``), but not with torchft replica groups (a slow group is one a
    quorum leaves behind: torchft's own business)."""
    return spec.slow is not None and spec.replica_groups < 2


def slow_watch(spec: AgentSpec, ctx: NodeContext) -> SlowWatch | None:
    """The coordinator's slow-node watch (None: detection off); the time left from Slurm's end time."""
    if not detects_slow(spec) or spec.slow is None:  # (the second test narrows the type)
        return None
    return SlowWatch(spec.slow, ctx.hosts[0], time_left=lambda now: slurm.time_left(os.environ, now))


def slow_dir(spec: AgentSpec, hb_path: str) -> Path | None:
    """The node-local directory of slow-node detection's files, beside the heartbeat socket (None: off)."""
    if not detects_slow(spec):
        return None
    path = Path(hb_path).parent / "slow"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def check_tier(spec: AgentSpec, ctx: NodeContext) -> NodeTier | None:
    """This node's local checkpoint tier (``--local-tier``) checked before the rendezvous; None when off.

    A setting this node refuses ends the agent with one line (exit 2); under Slurm the coordinator's node
    publishes it as its start-up error first, so every agent ends at once and the job is not requeued.
    """
    settings = spec.local_tier
    if settings is None:
        return None
    run_dir = spec.rdzv.run_dir
    if run_dir is None or not run_dir.is_dir():
        return None  # the rendezvous says what is wrong
    root = settings.local_dir(ctx.host, ctx.job_id or run_dir.name)
    try:
        return check_node(settings, root, run_dir, published_size(RunDir(run_dir)))
    except UserError as e:
        if ctx.is_coordinator and ctx.job_id is not None:
            path = slurm.coordinator_file(RunDir(run_dir), ctx.job_id, ctx.restart_count)
            slurm.publish_coordinator(path, {"error": str(e), "node": ctx.host})
        raise


def local_tier(
    spec: AgentSpec,
    node: NodeTier | None,
    ctx: NodeContext,
    rdzv: Rendezvous,
    checkpoint_dir: Path,
    attempt: int,
    stack: contextlib.ExitStack,
) -> LocalTier | None:
    """Set this node's tier up in the directory :func:`check_tier` accepted."""
    if spec.local_tier is None or node is None:
        return None
    try:
        tier = LocalTier(
            spec.local_tier,
            node,
            run_dir=rdzv.run_dir,
            checkpoint_dir=checkpoint_dir,
            secret=rdzv.secret,
            host=ctx.host,
            node_rank=ctx.node_rank,
            attempt=attempt,
            say=lambda text: say(ctx.node_rank, text),
        )
    except OSError as e:
        raise UserError(f"{key('local_checkpoint_dir')}: cannot set up {node.root}: {e}") from None
    stack.callback(tier.close)
    return tier


def cancelled_before_start(spec: AgentSpec, ctx: NodeContext, environ: Mapping[str, str]) -> bool:
    """True when the run was cancelled before this attempt started: the agent then leaves at once.

    Looked at before the rendezvous, so every agent leaves and none waits for another; group rank 0
    scancels the job, which a requeue or resubmission racing the cancel brought back.
    """
    if spec.rdzv.run_dir is None or not spec.rdzv.run_dir.is_dir():
        return False  # the rendezvous says what is wrong
    job_id = slurm.job_id(environ) if ctx.is_coordinator else None
    if not refuse_cancelled_start(RunDir(spec.rdzv.run_dir), job_id):
        return False
    say(ctx.node_rank, "the run was cancelled; this attempt does not start")
    return True


#: The longest path a Unix socket address holds (``sun_path`` is 108 bytes with its NUL).
MAX_SOCKET_PATH = 107
SOCKET_NAME = "hb.sock"


def heartbeat_socket_path(stack: contextlib.ExitStack) -> str:
    """A fresh private directory for the workers' heartbeat socket; its path fits a socket address.

    ``$TMPDIR`` first; when that path is too long (deep job-specific TMPDIRs), ``/tmp``, then ``/dev/shm``.
    """
    default = tempfile.gettempdir()
    for base in dict.fromkeys((default, "/tmp", "/dev/shm")):
        # mkdtemp adds 8 random characters to the prefix
        if len(os.fsencode(os.path.join(base, "hpcelastic-agent-12345678", SOCKET_NAME))) > MAX_SOCKET_PATH:
            continue
        try:
            tmp = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="hpcelastic-agent-", dir=base, ignore_cleanup_errors=True)
            )
        except OSError:
            continue
        return os.path.join(tmp, SOCKET_NAME)
    raise UserError(
        f"no directory for the heartbeat socket: TMPDIR {default} is too long for a socket path and "
        "/tmp and /dev/shm are not writable; set TMPDIR to a short writable directory"
    )


def node_range(spec: AgentSpec, ctx: NodeContext) -> tuple[int, int]:
    """The job's node range (``--nodes MIN:MAX``, default: the step's nodes less the spares); the step
    must fit in it plus ``--spare-nodes``."""
    spares = spec.spare_nodes
    lo = spec.min_nodes or max(1, ctx.num_nodes - spares)
    hi = spec.max_nodes or max(1, ctx.num_nodes - spares)
    if ctx.num_nodes > hi + spares:
        raise UserError(
            f"{ctx.num_nodes} agents started but --nodes allows at most {hi} (+ {spares} spare); "
            "start one agent per node"
        )
    if ctx.num_nodes < lo:
        raise UserError(f"only {ctx.num_nodes} node(s) in this step, fewer than the minimum {lo} of --nodes")
    return lo, hi


def round_size(spec: AgentSpec, ctx: NodeContext) -> int:
    """Nodes each round runs on: the step's nodes less the spares, at most MAX, at least MIN."""
    lo, hi = node_range(spec, ctx)
    return max(lo, min(hi, ctx.num_nodes - spec.spare_nodes))


def worker_count(spec: AgentSpec, ctx: NodeContext) -> int:
    """Workers on this node: ``--nproc-per-node``, else one per visible GPU, else one."""
    nproc = spec.nproc or len(ctx.gpus) or 1
    if ctx.gpus and nproc > len(ctx.gpus):
        raise UserError(
            f"--nproc-per-node {nproc} exceeds the {len(ctx.gpus)} GPU(s) visible to this step; "
            "ask for more GPUs or run fewer workers"
        )
    return nproc


def host_coordinator(
    spec: AgentSpec,
    ctx: NodeContext,
    rdzv: Rendezvous,
    min_nodes: int,
    timing: Timing,
    stack: contextlib.ExitStack,
    *,
    attempt: int = 0,
) -> Coordinator:
    """Start the job's coordinator on this (group rank 0) node's listening socket."""
    assert rdzv.listener is not None, "the environment opens the listener on group rank 0"
    ports = PortReservation()
    stack.callback(ports.release)
    make_state = JobState if spec.replica_groups < 2 else replica_state_factory(spec, rdzv, stack)
    state = make_state(
        hosts=ctx.hosts,
        min_nodes=min_nodes,
        max_restarts=spec.max_restarts,
        master_addr=rdzv.master_addr,
        new_port=ports.new_port,
        rdzv_timeout=spec.rdzv.timeout,
        stop_timeout=max(RESTART_KILL_GRACE, spec.grace_period),
        round_size=round_size(spec, ctx),
        attempt=attempt,
        fence_s=fence_bound(timing),
    )
    coordinator = Coordinator(
        rdzv.listener,
        rdzv.secret,
        state,
        rdzv.run_dir,
        heartbeat_timeout=timing.heartbeat_timeout,
        probe_timeout=timing.probe_timeout,
        tier=tier_book(spec, rdzv.run_dir, attempt),
        slow=slow_watch(spec, ctx),
        peer_watch=timing.peer_watch,
        beat_timeout=timing.beat_timeout,
    )
    coordinator.start()
    stack.callback(coordinator.stop, drain_timeout=RESTART_KILL_GRACE + 2.0)
    return coordinator


def export_metrics(
    spec: AgentSpec,
    ctx: NodeContext,
    rdzv: Rendezvous,
    environ: Mapping[str, str],
    stack: contextlib.ExitStack,
    live: Callable[[], Mapping[str, float]],
) -> None:
    """The run's OpenMetrics endpoint beside the coordinator (and its textfile); a port that cannot be
    had costs the figures, never the job."""
    if spec.metrics_port is None:
        return
    from hpcelastic.record.metrics import Exporter, Identity

    ident = Identity(rdzv.run_dir.run_id, ctx.job_id or rdzv.run_dir.local_job_id, slurm.sluid(environ))
    try:
        exporter = Exporter(
            rdzv.run_dir, ident, rdzv.host, spec.metrics_port, spec.metrics_textfile_dir, live
        )
    except OSError as e:
        say(
            ctx.node_rank,
            f"no OpenMetrics endpoint on {rdzv.host}:{spec.metrics_port} ({e.strerror or e}); training "
            "goes on",
        )
        return
    stack.callback(exporter.close)
    say(ctx.node_rank, f"metrics: http://{exporter.host}:{exporter.port}/metrics")


def tier_book(spec: AgentSpec, run_dir: RunDir, attempt: int) -> TierBook | None:
    """The coordinator's book of the local checkpoint tier, seeded with the checkpoint published last (what a
    new attempt restores when no node's memory holds one), then the others earlier attempts persisted that
    are still in the checkpoint directory (every node sees them too, as without the tier)."""
    settings = spec.local_tier
    if settings is None:
        return None
    book = TierBook(settings.replicas, settings.persist_every, settings.restore, attempt=attempt)
    published = handoff.load(run_dir).checkpoint
    if published is not None and Path(published["path"]).exists():
        path = Path(published["path"])
        step = published.get("step")
        book.seed(path.name, step if isinstance(step, int) else None, str(path))
    if attempt > 0:
        persisted = {e["checkpoint"]: e for e in run_dir.events().of(events.TIER_PERSISTED)}
        for name, e in persisted.items():
            if name not in book.checkpoints and Path(e["path"]).exists():
                book.seed(name, e["step"] if isinstance(e["step"], int) else None, str(e["path"]))
    return book


def fence_bound(timing: Timing) -> float:
    """How long after the coordinator lost a silent agent that agent may still run workers: its lease ended
    no later than that, and it stops its workers (``liveness.fence_delay``)."""
    return liveness.fence_delay(RESTART_KILL_GRACE)


def install_signals(rt: NodeRuntime, wake: Wake, stack: contextlib.ExitStack) -> None:
    """Deliver the stop signal and SIGTERM/SIGINT/SIGHUP to the main loop through the wake pipe."""

    def on_signal(signum: int, _frame: Any) -> None:
        rt.signals.append((signum, time.time()))

    signal.set_wakeup_fd(wake.w, warn_on_full_buffer=False)
    stack.callback(_clear_wakeup_fd)
    for sig in {rt.spec.stop_signal, signal.SIGTERM, signal.SIGINT, signal.SIGHUP}:
        signal.signal(sig, on_signal)


def _clear_wakeup_fd() -> None:
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)


def end_of_attempt(
    spec: AgentSpec,
    environ: Mapping[str, str],
    run_dir: RunDir,
    attempt: int,
    reason: Reason,
    *,
    decides: bool,
    bad_nodes: tuple[str, ...] = (),
    unreachable: tuple[str, ...] = (),
    progressed: bool = False,
) -> int:
    """This agent's exit code for an attempt that ended with ``reason``.

    Only the agent hosting the coordinator (group rank 0) ends the attempt; the others exit with the
    reason's code, and with the coordinator gone ``hpcelastic finalize`` decides after the step.
    """
    if not decides:
        return reason.exit_code
    if reason is not Reason.SUCCEEDED and slurm.job_id(environ) and shutil.which("scontrol") is None:
        # In a container without Slurm's commands: finalize decides after the step, on the host.
        defer(run_dir, attempt, Deferred(reason, bad_nodes, unreachable, progressed))
        say(
            0, f"{reason}: no scontrol in this container; hpcelastic finalize ends the attempt after the step"
        )
        return reason.exit_code
    outcome = end_attempt(
        run_dir,
        attempt,
        reason,
        job_id=slurm.job_id(environ),
        bad_nodes=bad_nodes,
        unreachable=unreachable,
        progressed=progressed,
        requeue_mode=spec.requeue_mode,
        max_requeues=spec.max_requeues,
    )
    return outcome.exit_code


def begin_attempt(run_dir: RunDir, ctx: NodeContext, environ: Mapping[str, str]) -> int:
    """This allocation's attempt number, from the handoff record.

    Every agent calls it; under the record's lock the first caller of a new allocation
    (job id + Slurm restart count) bumps the number and the others read the same one.
    """
    job = slurm.job_id(environ) or run_dir.local_job_id
    return handoff.begin_attempt(run_dir, job, ctx.restart_count, list(ctx.hosts))
