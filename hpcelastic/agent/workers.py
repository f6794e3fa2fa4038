"""The node's worker processes: spawn with the torchrun environment, tee logs, see exits, kill trees.

Exits are seen as they happen: each worker's ``pidfd`` (a pipe where there is none: :func:`exit_fd`)
sits in the agent's selector. Each worker runs
in its own session with ``PR_SET_PDEATHSIG`` = SIGKILL (set in the child between fork and exec; it
fires when the forking *thread* dies, so the agent spawns only from its main thread), and the
:class:`~hpcelastic.agent.watchdog.Watchdog` kills grandchildren if the agent itself is killed. The
agent is the child subreaper, and stopping kills the workers' sessions and every descendant that
carries the workers' environment marker (:func:`tree_marker`, also in the fork server's environment, so
``/proc/PID/environ`` of a warm worker and of its forks shows it): a grandchild that called ``setsid``
dies too. Workers start with the stop signal ignored: a script without a handler for it is not killed
by it (Slurm signals every process of the step), and the agent stops it when it is not saving.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import psutil

from hpcelastic import handoff
from hpcelastic.agent import cpus
from hpcelastic.agent.console import WorkerConsole
from hpcelastic.agent.forkserver import ForkServer, ForkServerError, WarmProc, warm_script
from hpcelastic.agent.messages import Round
from hpcelastic.agent.watchdog import Watchdog, session_pids
from hpcelastic.parse import parse_signal
from hpcelastic.rundir import RunDir
from hpcelastic.slow import arrivals
from hpcelastic.tier import step_clock
from hpcelastic.worker import ENV_CHECKPOINT_TIER

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_PTRACER = 0x59616D61  # "Yama"; EINVAL (ignored) without Yama
TAIL_LINES = 200
TRACEBACK_LINES = 60
#: How long the agent waits for a SIGKILLed worker to go (one in uninterruptible I/O may not, for long).
KILL_WAIT_S = 5.0
#: The variable whose value (:func:`tree_marker`) marks every process of this agent's workers' trees.
TREE_VARIABLE = "HPCELASTIC_WORKER_TREE"
_libc = ctypes.CDLL(None, use_errno=True)


def _child_setup(ignore: tuple[int, ...] = (), share: cpus.Share | None = None) -> None:
    """Runs in the child between fork and exec: parent-death signal, ptracer, ``ignore`` ignored, and
    the worker's CPUs (:mod:`hpcelastic.agent.cpus`)."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # Yama ptrace_scope 1: let the agent's py-spy (a sibling) read this worker (hpcelastic.hangs.pyspy).
    _libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(os.getppid()), 0, 0, 0)
    for sig in ignore:  # an ignored signal stays ignored across exec, until the script handles it
        signal.signal(sig, signal.SIG_IGN)
    cpus.apply(share)


def tree_marker() -> str:
    """This agent's mark on its workers' environment: its pid and start time (unique on the node)."""
    return f"{os.getpid()}.{int(psutil.Process().create_time() * 100)}"


def catches(pid: int, sig: int) -> bool:
    """Process ``pid`` has a handler for ``sig``: its bit in ``SigCgt`` of ``/proc/PID/status``."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def open_for_writing(pid: int, directory: str) -> list[str]:
    """Files under ``directory`` (a real path) that process ``pid`` holds open for writing, from the
    links in ``/proc/PID/fd`` and the flags in ``/proc/PID/fdinfo``."""
    prefix = directory.rstrip("/") + "/"
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    found = []
    for fd in fds:
        with contextlib.suppress(OSError, ValueError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith(prefix) and _writable(pid, fd):
                found.append(target)
    return found


def _writable(pid: int, fd: str) -> bool:
    for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
        if line.startswith("flags:"):
            return int(line.split()[1], 8) & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)
    return False


def node_stalled(activity: list[float | None], timeout: float, now: float) -> bool:
    """A node's workers stall together: every worker that has shown activity (a heartbeat, a save) did so
    more than ``timeout`` ago. One that still works means the others wait for it in a collective."""
    seen = [t for t in activity if t is not None]
    return bool(seen) and len(seen) == len(activity) and all(now - t > timeout for t in seen)


def signal_name(signum: int) -> str:
    """``SIGKILL``, or ``SIGRTMIN+3`` for a real-time signal (which ``signal.Signals`` does not name)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        if signal.SIGRTMIN < signum < signal.SIGRTMAX:
            return f"SIGRTMIN+{signum - signal.SIGRTMIN}"
        return f"signal {signum}"


def parse_heartbeat(data: bytes) -> tuple[int, int | None] | None:
    """(rank, step) from a worker's heartbeat datagram, or None for anything else (never raises)."""
    try:
        beat = json.loads(data)
        if not isinstance(beat, dict):
            return None
        rank, step = beat.get("rank"), beat.get("step")
        if type(rank) is not int or not (step is None or type(step) is int):
            return None
        return rank, step
    except (ValueError, RecursionError):  # not JSON, an integer too long to convert, nested too deeply
        return None


def exit_fd(pid: int) -> int:
    """A descriptor that turns readable when child ``pid`` exits: its pidfd, else a pipe.

    Without ``pidfd_open`` (kernels before 5.3, seccomp filters) a thread waits for the child with
    ``waitid(WNOWAIT)`` (the exit status stays for ``Popen.wait``) and then closes the pipe's write end.
    """
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        pass
    r, w = os.pipe2(os.O_CLOEXEC)

    def wait() -> None:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        os.close(w)

    threading.Thread(target=wait, daemon=True, name=f"exit-watch-{pid}").start()
    return r


@dataclass(frozen=True)
class WorkerConfig:
    """What the agent's flags fix for every round."""

    argv: tuple[str, ...]
    nproc: int
    gpus: tuple[str, ...]
    run_dir: RunDir
    attempt: int
    run_id: str
    checkpoint_dir: Path
    heartbeat_socket: str
    stop_file: Path
    stop_signal: str
    environ: Mapping[str, str]
    node_rank: int
    console: str = "all"  # which workers' output reaches the console (agent/console.py)
    #: ``checkpoint_dir`` is the node-local checkpoint tier's directory (hpcelastic/tier/).
    local_tier: bool = False
    #: The node's directory for slow-node detection's files (hpcelastic/slow/); None: detection is off.
    slow_dir: Path | None = None


#: Set for workers whose checkpoint dir is the node-local tier: ``worker.publish_checkpoint`` marks the
#: checkpoint complete for the agent, which publishes its persisted copy (hpcelastic/tier/).
TIER_VARIABLE = ENV_CHECKPOINT_TIER
TIER_LOCAL = "local"
#: Never handed to workers (the launcher's own variables are already gone: ``Environment.worker_environ``).
AGENT_SECRET_VARIABLE = "HPCELASTIC_SECRET"


def step_clock_path(cfg: WorkerConfig, rank: int, local_rank: int) -> Path | None:
    """The file a worker's step clock writes (the tier's, else slow-node detection's; None: neither)."""
    if cfg.local_tier:
        return step_clock.clock_path(cfg.checkpoint_dir, local_rank)
    if cfg.slow_dir is not None:
        return arrivals.clock_path(cfg.slow_dir, rank)
    return None


def worker_env(
    cfg: WorkerConfig,
    rnd: Round,
    local_rank: int,
    error_file: Path,
    resume: str | None = None,
    share: cpus.Share | None = None,
) -> dict[str, str]:
    """The full torchrun environment contract plus the ``HPCELASTIC_*`` variables for one worker.

    ``resume`` is the published checkpoint handed to this round (``HPCELASTIC_RESUME_FROM``);
    ``share``: the worker's CPUs, whose count is its ``OMP_NUM_THREADS`` unless the job set one.
    """
    env = base_env(cfg.environ, cfg.nproc)
    rank = rnd.rank_offset + local_rank
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
        GROUP_RANK=str(rnd.group_rank),
        ROLE_RANK=str(rank),
        ROLE_NAME="default",
        LOCAL_WORLD_SIZE=str(cfg.nproc),
        WORLD_SIZE=str(rnd.world_size),
        GROUP_WORLD_SIZE=str(rnd.group_world_size),
        ROLE_WORLD_SIZE=str(rnd.world_size),
        MASTER_ADDR=rnd.master_addr,
        MASTER_PORT=str(rnd.master_port),
        TORCHELASTIC_RESTART_COUNT=str(rnd.restart_count),
        TORCHELASTIC_MAX_RESTARTS=str(rnd.max_restarts),
        TORCHELASTIC_RUN_ID=cfg.run_id,
        TORCHELASTIC_USE_AGENT_STORE="False",
        TORCHELASTIC_ERROR_FILE=str(error_file),
        HPCELASTIC_RUN_DIR=str(cfg.run_dir.path),
        HPCELASTIC_ATTEMPT=str(cfg.attempt),
        HPCELASTIC_CHECKPOINT_DIR=str(cfg.checkpoint_dir),
        HPCELASTIC_HEARTBEAT_SOCKET=cfg.heartbeat_socket,
        HPCELASTIC_STOP_FILE=str(cfg.stop_file),
        HPCELASTIC_STOP_SIGNAL=cfg.stop_signal,
        HPCELASTIC_NODE_RANK=str(cfg.node_rank),
    )
    if cfg.local_tier:
        env[TIER_VARIABLE] = TIER_LOCAL
    else:
        env.pop(TIER_VARIABLE, None)
    clock = step_clock_path(cfg, rank, local_rank)
    if clock is not None:
        env[step_clock.VARIABLE] = str(clock)
    else:
        env.pop(step_clock.VARIABLE, None)
    if cfg.slow_dir is not None:  # the collectives' arrivals
        env[arrivals.VARIABLE] = str(cfg.slow_dir)
    if cfg.gpus:
        env["CUDA_VISIBLE_DEVICES"] = cfg.gpus[local_rank]
    if share and "OMP_NUM_THREADS" not in cfg.environ:
        env["OMP_NUM_THREADS"] = str(len(share))
    if rnd.num_replica_groups:
        # torchft (hpcelastic.agent.replicas): the group's store is served by the coordinator's agent.
        env.update(
            REPLICA_GROUP_ID=str(rnd.replica_group),
            NUM_REPLICA_GROUPS=str(rnd.num_replica_groups),
            TORCHFT_LIGHTHOUSE=rnd.lighthouse,
            TORCHELASTIC_USE_AGENT_STORE="True",
        )
    if resume:
        env["HPCELASTIC_RESUME_FROM"] = resume
    else:
        env.pop("HPCELASTIC_RESUME_FROM", None)
    return env


def base_env(environ: Mapping[str, str], nproc: int) -> dict[str, str]:
    """What every worker of this node gets before its own variables (and the fork server gets), with
    this agent's tree marker."""
    env = {k: v for k, v in environ.items() if k != AGENT_SECRET_VARIABLE}
    env[TREE_VARIABLE] = tree_marker()
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def start_forkserver(
    argv: tuple[str, ...], environ: Mapping[str, str], nproc: int, enabled: bool
) -> tuple[ForkServer | None, str]:
    """This node's fork server for warm starts (it imports torch now), or (None, why workers start cold)."""
    if not enabled:
        return None, "warm starts are off (--no-warm-start)"
    script, why = warm_script(argv)
    if script is None:
        return None, why
    try:
        return ForkServer(argv[0], script, base_env(environ, nproc), preexec_fn=_child_setup), ""
    except OSError as e:
        return None, f"the fork server did not start: {e}"


def read_error_file(path: Path) -> tuple[str, str] | None:
    """(error, traceback) from a torch ``record`` error file, or None when there is none."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        extra = message.get("extraInfo") or {}
        return str(message.get("message", "")), str(extra.get("py_callstack", ""))
    if isinstance(message, str):
        return message, ""
    return None


_TORCH_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?")


def traceback_from_tail(lines: list[str]) -> tuple[str, str] | None:
    """(error, traceback) from the last Python traceback in a worker's output, or None.

    torch.distributed prefixes an uncaught exception's lines with ``[rankN]:``; that is removed.
    """
    lines = [_TORCH_RANK_PREFIX.sub("", line) for line in lines]
    marker = "Traceback (most recent call last)"
    start = max((i for i, line in enumerate(lines) if line.startswith(marker)), default=-1)
    if start < 0:
        return None
    tb = lines[start : start + TRACEBACK_LINES]
    error = next((line for line in reversed(tb) if line.strip() and not line.startswith(" ")), tb[-1])
    return error.strip(), "\n".join(tb)


@dataclass(eq=False)
class Worker:
    """One running (or just exited) worker process."""

    local_rank: int
    rank: int
    proc: subprocess.Popen[bytes] | WarmProc
    pidfd: int
    error_file: Path
    started: float
    reader: threading.Thread | None = None
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    last_beat: float | None = None
    #: When the agent last saw it (or a descendant) hold a file in the checkpoint dir open for writing.
    last_save: float | None = None
    step: int | None = None
    exit_ts: float | None = None
    console: WorkerConsole | None = None

    @property
    def activity(self) -> float | None:
        """When it last showed it works: a heartbeat or a save (monotonic), None before either."""
        seen = [t for t in (self.last_beat, self.last_save) if t is not None]
        return max(seen) if seen else None


class WorkerGroup:
    """This node's workers for one round at a time, registered in the agent's selector."""

    def __init__(
        self,
        cfg: WorkerConfig,
        selector: selectors.BaseSelector,
        watchdog: Watchdog,
        out_fd: int = 1,
        forkserver: ForkServer | None = None,
        cold_reason: str = "",
    ):
        self.cfg = cfg
        self._sel = selector
        self._watchdog = watchdog
        self._out_fd = out_fd
        self._forkserver = forkserver
        adopt_orphans()
        self._marker = tree_marker()
        watchdog.mark(f"{TREE_VARIABLE}={self._marker}")
        self._stop_signal = int(parse_signal(cfg.stop_signal))
        self._checkpoint_dir = os.path.realpath(cfg.checkpoint_dir)
        #: How the last round's workers were started: "warm" (forked by the fork server) or "cold",
        #: and why cold (``spawn_reason``).
        self.spawn = "cold"
        self.spawn_reason = cold_reason
        self.workers: list[Worker] = []
        self.round: Round | None = None
        #: A worker reported a training step in this attempt (kept when the workers are stopped).
        self.progressed = False
        #: Each local rank's CPUs (agent/cpus.py), None when the job turned the split off.
        self.cpu_shares = cpus.worker_shares(cfg.environ, cfg.nproc)

    def start(self, rnd: Round, restored: Path | None = None) -> float:
        """Spawn this node's workers for ``rnd``; returns the time the last one was spawned.

        ``restored``: the checkpoint the local tier placed for this round (their ``HPCELASTIC_RESUME_FROM``).
        """
        self.round = rnd
        # Only a published checkpoint that still exists is handed to the workers (handoff.py).
        resume = str(restored) if restored is not None else handoff.resume_path(self.cfg.run_dir)
        argv = handoff.expand_args(self.cfg.argv, resume, self.cfg.checkpoint_dir)
        log_dir = self.cfg.run_dir.attempt_log_dir(self.cfg.attempt)
        for local_rank in range(self.cfg.nproc):
            rank = rnd.rank_offset + local_rank
            error_file = log_dir / f"error-round{rnd.round}-rank{rank}.json"
            with contextlib.suppress(FileNotFoundError):
                error_file.unlink()
            share = self.cpu_shares[local_rank] if self.cpu_shares else None
            env = worker_env(self.cfg, rnd, local_rank, error_file, resume, share)
            proc, pidfd = self._spawn(argv, env, share, first=local_rank == 0)
            self._watchdog.add(proc.pid)
            worker = Worker(local_rank, rank, proc, pidfd, error_file, time.time())
            worker.console = WorkerConsole(self.cfg.console, rank, rnd.replica_group, self._out_fd)
            worker.reader = threading.Thread(
                target=self._tee, args=(worker,), daemon=True, name=f"tee-rank{rank}"
            )
            worker.reader.start()
            self._sel.register(worker.pidfd, selectors.EVENT_READ, ("worker", worker))
            self.workers.append(worker)
        return time.time()

    def _spawn(
        self, argv: tuple[str, ...], env: dict[str, str], share: cpus.Share | None, first: bool
    ) -> tuple[subprocess.Popen[bytes] | WarmProc, int]:
        """One worker on ``share`` and the descriptor that turns readable at its exit: forked warm when
        possible."""
        server = self._forkserver
        if first:
            self.spawn = "cold"
            if server is not None and not server.ready():
                self.spawn_reason = f"fork server: {server.problem}"
                server = self._forkserver = None
        elif self.spawn == "cold":
            server = None
        if server is not None:
            r, w = os.pipe2(os.O_CLOEXEC)
            try:
                pid, pidfd = server.spawn(
                    list(argv[2:]),
                    env,
                    w,
                    list(argv),
                    os.getpid(),
                    ignore_signals=(self._stop_signal,),
                    cpus=share or (),
                )
            except ForkServerError as e:
                os.close(r)
                self.spawn, self.spawn_reason = "cold", f"fork server: {e}"
            else:
                self.spawn, self.spawn_reason = "warm", ""
                return WarmProc(server, pid, open(r, "rb"), pidfd), pidfd
            finally:
                os.close(w)
        proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=functools.partial(_child_setup, (self._stop_signal,), share),
        )
        return proc, exit_fd(proc.pid)

    def running(self) -> list[Worker]:
        """Workers that have not exited yet."""
        return [w for w in self.workers if w.exit_ts is None]

    def reap(self, worker: Worker) -> int:
        """Collect an exited worker (its pidfd was readable); returns its return code."""
        worker.exit_ts = time.time()
        code = worker.proc.wait()
        self._unregister(worker)
        self._end_console(worker, failed=code != 0)
        return code

    @staticmethod
    def _end_console(worker: Worker, failed: bool) -> None:
        """The worker's output is all read (or 1 s passed): its held traceback is shown or left to the
        root cause (agent/console.py)."""
        if worker.reader is not None:
            worker.reader.join(timeout=1.0)
        if worker.console is not None:
            worker.console.finish(failed)

    def reap_failed(self) -> list[Worker]:
        """Collect workers that already exited non-zero on their own but whose exit is not processed yet.

        A stop from the coordinator can arrive between a worker's death and the agent seeing its
        pidfd: that worker failed too (two ranks crashing at once), it was not stopped.
        """
        failed = []
        for w in self.running():
            code = w.proc.poll()
            if code not in (None, 0):
                self.reap(w)
                failed.append(w)
        return failed

    def failure(self, worker: Worker, error: str | None = None) -> dict[str, Any]:
        """What the coordinator and the event log need to know about a failed worker."""
        assert self.round is not None
        if worker.reader is not None:
            worker.reader.join(timeout=1.0)
        code = worker.proc.returncode
        sig = signal_name(-code) if code is not None and code < 0 else None
        found = read_error_file(worker.error_file) or traceback_from_tail(list(worker.tail))
        if error is None:
            how = f"killed by {sig}" if sig else f"exited with code {code}"
            error = f"{how}: {found[0]}" if found and found[0] else how
        return {
            "round": self.round.round,
            "rank": worker.rank,
            "local_rank": worker.local_rank,
            "exitcode": code if code is None or code >= 0 else None,
            "signal": sig,
            "error": error,
            "traceback": found[1] if found else "",
            "ts": worker.exit_ts or time.time(),
        }

    def signal_catching(self, sig: int) -> list[Worker]:
        """Send ``sig`` to every process of the running workers' trees that has a handler for it (the worker
        itself, as torchrun does, or the script a wrapper started); returns the workers whose trees have
        none: the signal would kill them wherever they are."""
        uncaught = []
        for w in self.running():
            catching = [pid for pid in [w.proc.pid, *_descendants(w.proc.pid)] if catches(pid, sig)]
            if not catching:
                uncaught.append(w)
            for pid in catching:
                with contextlib.suppress(OSError):
                    if pid == w.proc.pid:
                        w.proc.send_signal(sig)
                    else:
                        os.kill(pid, sig)
        return uncaught

    @property
    def checkpoint_dir(self) -> str:
        """The workers' checkpoint directory (a real path)."""
        return self._checkpoint_dir

    def saving(self, worker: Worker) -> list[str]:
        """Files in the checkpoint dir that ``worker`` or a descendant holds open for writing."""
        files = []
        for pid in [worker.proc.pid, *_descendants(worker.proc.pid)]:
            files += open_for_writing(pid, self._checkpoint_dir)
        return files

    def writing(self) -> list[str]:
        """Files in the checkpoint dir that any running worker's tree holds open for writing."""
        return [path for w in self.running() for path in self.saving(w)]

    def step_clock(self, worker: Worker) -> Path | None:
        """The file ``worker``'s step clock writes (None: it has none)."""
        return step_clock_path(self.cfg, worker.rank, worker.local_rank)

    def note_saves(self) -> None:
        """Record which running workers are writing a checkpoint now (a save is activity, never a stall)."""
        now = time.monotonic()
        for w in self.running():
            if self.saving(w):
                w.last_save = now

    def terminate(self, worker: Worker) -> None:
        """SIGTERM ``worker`` and its descendants, without waiting (its exit shows on its pidfd)."""
        with contextlib.suppress(OSError):
            worker.proc.send_signal(signal.SIGTERM)
        for pid in _descendants(worker.proc.pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)

    def stop(self, grace: float) -> None:
        """Stop every worker and all their descendants: SIGTERM, then SIGKILL after ``grace`` seconds."""
        sids = {w.proc.pid for w in self.workers}
        if not sids:
            return
        self._signal_tree(sids, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for w in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        if any(w.proc.poll() is None for w in self.workers) or self._tree(sids):
            self._signal_tree(sids, signal.SIGKILL)
            self._wait_killed()
            others = [p for p in _processes(self._tree(sids))]
            psutil.wait_procs(others, timeout=2.0)  # reaps the orphans this agent adopted
        for w in self.workers:
            if w.exit_ts is None:
                w.exit_ts = time.time()
            self._unregister(w)
            self._end_console(w, failed=w.proc.returncode != 0)
            self._watchdog.remove(w.proc.pid)
        self.workers = []

    def _wait_killed(self) -> None:
        """Wait for SIGKILLed workers, :data:`KILL_WAIT_S` at most: one stuck in uninterruptible I/O is
        logged and left (the agent's loop goes on; its exit is never reported)."""
        deadline = time.monotonic() + KILL_WAIT_S
        for w in self.workers:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(
                    f"hpcelastic[agent {self.cfg.node_rank}]: rank {w.rank} (pid {w.proc.pid}) is still "
                    f"there {KILL_WAIT_S:g} s after SIGKILL (uninterruptible I/O?); going on without it",
                    file=sys.stderr,
                    flush=True,
                )

    def beat(self, rank: int, step: int | None) -> None:
        """A heartbeat datagram from the worker of global ``rank``.

        Keyed by rank, not pid: a script started through a wrapper (a shell, ``python -m``
        launchers) beats from a descendant of the process the agent spawned.
        """
        for w in self.workers:
            if w.rank == rank:
                w.last_beat = time.monotonic()
                w.step = step
                self.progressed = self.progressed or step is not None

    def stalled(self, timeout: float) -> list[Worker]:
        """Every running worker when all of them stalled (:func:`node_stalled`; armed by the first
        heartbeat, a save counts as activity), else none."""
        running = self.running()
        armed = [w for w in running if w.last_beat is not None]
        if not node_stalled([w.activity for w in armed], timeout, time.monotonic()):
            return []
        return running

    def _tree(self, sids: set[int]) -> list[int]:
        """Every process of the workers' trees: their sessions, and descendants that left them.

        A worker's child that called ``setsid`` leaves the session; with this agent as the child
        subreaper it stays a descendant even when its parent dies, and it carries the workers'
        environment (their heartbeat socket names this agent's workers alone).
        """
        server = {self._forkserver.pid} if self._forkserver is not None else set()
        return sorted((set(session_pids(sids)) | set(marked_descendants(self._marker))) - server)

    def _signal_tree(self, sids: set[int], sig: int) -> None:
        """The workers through their handles (a warm one by pidfd), the rest of their trees by pid."""
        for w in self.workers:
            with contextlib.suppress(OSError):
                w.proc.send_signal(sig)
        for pid in set(self._tree(sids)) - sids:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)

    def _unregister(self, worker: Worker) -> None:
        if worker.pidfd >= 0:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(worker.pidfd)
            os.close(worker.pidfd)
            worker.pidfd = -1

    def _tee(self, worker: Worker) -> None:
        """Copy the worker's output to its rank log and, as its console allows, to the agent's output."""
        assert worker.proc.stdout is not None and self.round is not None and worker.console is not None
        log_path = self.cfg.run_dir.rank_log_path(self.cfg.attempt, worker.rank, self.round.replica_group)
        with open(os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab") as log:
            header = (
                f"=== round {self.round.round} restart {self.round.restart_count} pid {worker.proc.pid} ===\n"
            )
            log.write(header.encode())
            log.flush()  # the round's worker pid is in the log at once, even while the script is silent
            _copy_lines(worker.proc.stdout, log, worker.tail, worker.console)
        worker.proc.stdout.close()


def _copy_lines(src: BinaryIO, log: BinaryIO, tail: collections.deque[str], console: WorkerConsole) -> None:
    for line in iter(src.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"
        log.write(line)
        log.flush()
        tail.append(line.decode(errors="replace").rstrip("\n"))
        console.line(line)


def adopt_orphans() -> None:
    """Become the child subreaper: orphaned descendants (a worker's setsid child) are re-parented here."""
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def marked_descendants(marker: str) -> list[int]:
    """Descendants of this process whose environment (``/proc/PID/environ``) has ``TREE_VARIABLE=marker``."""
    found = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if p.environ().get(TREE_VARIABLE) == marker:
                found.append(p.pid)
    return found


def _descendants(pid: int) -> list[int]:
    with contextlib.suppress(psutil.Error):
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    return []


def _processes(pids: list[int]) -> list[psutil.Process]:
    out = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            out.append(psutil.Process(pid))
    return out
