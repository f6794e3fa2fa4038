"""The node agent's main loop: a state machine driven by events (never a polling loop).

RENDEZVOUS -> RUNNING -> RESTARTING (-> RUNNING ...) | STOPPING -> DONE

The main thread owns a selector over: each worker's pidfd (exits), the heartbeat socket (worker
heartbeats), and one wake-up pipe that both signal delivery and the coordinator client's reader
thread write to. Workers are spawned only from this thread (their parent-death signal is tied to
it). Messages from the coordinator go through :func:`hpcelastic.agent.messages.dispatch`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import math
import os
import selectors
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from hpcelastic import events
from hpcelastic.agent import messages
from hpcelastic.agent.batch_host import batch_shell_dead, beat_path
from hpcelastic.agent.bootstrap import end_of_attempt
from hpcelastic.agent.hangwatch import HangWatch
from hpcelastic.agent.progress import StepReporter
from hpcelastic.agent.resume_watch import ResumeWatch, describe
from hpcelastic.agent.runtime import RESTART_KILL_GRACE, STALL_CHECK_INTERVAL, NodeRuntime
from hpcelastic.agent.stop_step import StepRate, stop_file_text, stop_grace
from hpcelastic.agent.workers import Worker, parse_heartbeat
from hpcelastic.env import slurm as slurm_env
from hpcelastic.errors import EXIT_USAGE
from hpcelastic.events import Event
from hpcelastic.reasons import Reason
from hpcelastic.slow import speed
from hpcelastic.slow.collect import NodeCollector, read_clock
from hpcelastic.slow.cpu_throttle import ThrottleWatch
from hpcelastic.slow.input_watch import InputWatch
from hpcelastic.tier.book import position_of
from hpcelastic.tier.node import SCAN_INTERVAL_S

#: How long the end of an attempt waits for the coordinator's queued events to reach the run directory.
EVENT_FLUSH_TIMEOUT = 10.0
#: While stopping: how often the agent looks for workers it must stop itself (see :func:`ignores_stop`).
STOP_CHECK_INTERVAL = 0.25
#: A worker is stopped only when no file in the checkpoint dir was open for writing for this long, on any
#: node of the job (see :func:`quiet_enough`).
STOP_QUIET_S = 0.5
#: How often a node sends its slow-node evidence (hpcelastic/slow/): the ranks dump theirs every ~5 s.
SLOW_SAMPLE_S = 5.0
#: A worker's usage error this soon after the round's workers started, before any step: the node's others
#: get this long to exit on their own before they are stopped (a usage error fails every rank at once).
STARTUP_WINDOW_S = 30.0
STARTUP_SETTLE_S = 2.0


def ignores_stop(step: int | None, stop_step: int | None, step_at_stop: int | None) -> bool:
    """A rank that trains past the job's stop step: it reported a step beyond it that it began after the
    stop step reached it (one more than where it stood when the stop file was written)."""
    if step is None or stop_step is None:
        return False
    return step > max(stop_step, -1 if step_at_stop is None else step_at_stop + 1)


def quiet_enough(
    now: float, node_last_save: float | None, job_quiet_since: float | None, coordinated: bool
) -> bool:
    """Whether the stop check may stop a worker now: no worker of this node held a checkpoint file open for
    writing for :data:`STOP_QUIET_S` (``node_last_save``: when one last did), and, while the coordinator
    hears this node's saves (``coordinated``), no worker of any node did either, by its word
    (``job_quiet_since``, this node's clock: None while some node saves or before the word came)."""
    if node_last_save is not None and now - node_last_save < STOP_QUIET_S:
        return False
    if not coordinated:
        return True
    return job_quiet_since is not None and now - job_quiet_since >= STOP_QUIET_S


class State(enum.Enum):
    RENDEZVOUS = "rendezvous"
    RUNNING = "running"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    DONE = "done"


def newest_write(directory: Path) -> float | None:
    """The newest modification time (wall clock) of ``directory`` and its entries; None: none there."""
    times = []
    with contextlib.suppress(OSError):
        times.append(directory.stat().st_mtime)
        with os.scandir(directory) as entries:
            for e in entries:
                with contextlib.suppress(OSError):
                    times.append(e.stat(follow_symlinks=False).st_mtime)
    return max(times) if times else None


class NodeLoop:
    """Runs this node's share of one attempt over a bootstrapped runtime; :meth:`run` gives the exit code."""

    def __init__(self, rt: NodeRuntime) -> None:
        self.rt = rt
        self.state = State.RENDEZVOUS
        self.round: messages.Round | None = None
        self.reported_round = -1
        self.preempting = False
        #: After a stop signal (preemption, time limit): the monotonic time by which this node's workers
        #: must have stopped, the grace period cut short by the job's time left (``stop_step.stop_grace``);
        #: until then the workers may finish a step and save a checkpoint. None when no stop is under way.
        self.stop_deadline: float | None = None
        self.exit_code: int | None = None
        self.steps = StepReporter()
        stall_timeout = rt.spec.stall_timeout
        #: Stall detection from the workers' stacks (no worker API needed); on with --stall-timeout.
        self.hangs = HangWatch(stall_timeout, rt.inbox.wake.ring) if stall_timeout else None
        self.step_rate = StepRate()
        self.steps_reported = False
        #: While stopping: ranks without a handler for the stop signal (never sent it), the stop step
        #: written into the stop file, each rank's step then, and the ranks this agent stopped itself.
        self.uncaught: set[int] = set()
        self.stop_at: int | None = None
        self.steps_at_stop: dict[int, int | None] = {}
        self.stopped_here: set[int] = set()
        #: While stopping: whether this node saves, as last told to the coordinator (None: not yet), whether
        #: that reached it, and since when the whole job is quiet by its word (``JobSaving``).
        self.saving_sent: bool | None = None
        self.saves_coordinated = False
        self.job_quiet_since: float | None = None
        #: Which checkpoint the current round opens before its first step (group rank 0 only).
        self.resume_watch: ResumeWatch | None = None
        #: The local checkpoint tier's flush at the end of the workers: what to send once the coordinator
        #: says the last checkpoint is persisted (or when ``flush_deadline`` passes), and whether
        #: ``TierFlush`` went out for this round. After every worker exited 0 (``flush_wait``: the grace
        #: period) the deadline starts at the coordinator's ``TierFlushing``: other nodes' workers may still
        #: run, and this node waits for them at the exit barrier anyway.
        self.flush_then: Callable[[], None] | None = None
        self.flush_deadline: float | None = None
        self.flush_wait: float | None = None
        self.flush_sent_round: int | None = None
        #: Slow-node detection's evidence of this node's ranks in the current round (None: off, no round),
        #: and their stacks while the pace has dropped (the ``input`` kind; None: detection off).
        self.slow: NodeCollector | None = None
        self.inputs = InputWatch() if rt.group.cfg.slow_dir is not None else None
        self.throttle = ThrottleWatch()
        self._handlers: messages.Handlers = {
            messages.Round: self._on_round,
            messages.Stop: self._on_stop,
            messages.Preempt: self._on_preempt,
            messages.StopAt: self._on_stop_at,
            messages.JobSaving: self._on_job_saving,
            messages.Finish: self._on_finish,
            messages.Lost: self._on_lost,
            messages.DumpStacks: self._on_dump_stacks,
            messages.TierQuery: self._on_tier,
            messages.TierComplete: self._on_tier,
            messages.TierSafe: self._on_tier,
            messages.TierCommit: self._on_tier,
            messages.TierRestore: self._on_tier,
            messages.TierFlushing: self._on_tier_flushing,
            messages.TierFlushed: self._on_tier_flushed,
            messages.Retire: self._on_retire,
        }

    def run(self) -> int:
        """Check the GPUs, start listening to the coordinator, run until the attempt ends."""
        self._check_health()
        if self.exit_code is None:
            self.rt.client.start()
            self._check_speed()
            if self.hangs is not None:
                self.hangs.start()
                if not self.hangs.available:
                    self.rt.say("no py-spy: hangs are seen from heartbeats only (pip install py-spy)")
            if self.inputs is not None:
                self.inputs.start()
            try:
                self._loop()
            finally:
                self._end_resume_watch()
                if self.hangs is not None:
                    self.hangs.close()
                if self.inputs is not None:
                    self.inputs.close()
        assert self.exit_code is not None
        return self.exit_code

    # ---- the loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        rt, stall_timeout = self.rt, self.rt.spec.stall_timeout
        next_stall = next_health = next_stop_check = next_scan = next_slow = time.monotonic()
        next_speed = next_slow + speed.RECHECK_S
        while self.exit_code is None:
            scanning = rt.tier is not None and self.state in (State.RUNNING, State.STOPPING)
            sampling = self.slow is not None and self.state == State.RUNNING
            # A spare (or an agent before its first round) checks its speed now and then.
            waiting = rt.group.cfg.slow_dir is not None and rt.spec.spare_nodes > 0 and self.round is None
            deadlines = [next_stall] if stall_timeout else []
            deadlines += [next_slow] if sampling else []
            deadlines += [next_speed] if waiting else []
            deadlines += [next_health] if rt.health is not None else []
            deadlines += [self.stop_deadline] if self.stop_deadline is not None else []
            deadlines += [next_stop_check] if self.state == State.STOPPING else []
            deadlines += [next_scan] if scanning else []
            deadlines += [self.flush_deadline] if self.flush_deadline is not None else []
            now = time.monotonic()
            timeout = max(0.0, min(deadlines) - now) if deadlines else None
            ready = rt.selector.select(timeout)
            # A stop signal first: Slurm signals the workers with their agent, and a worker it killed
            # is this node being stopped, not a worker failure to report.
            self._drain_signals()
            for key, _mask in ready:
                if self.exit_code is not None:
                    break
                if key.data == "wake":
                    rt.inbox.wake.drain()
                elif key.data == "hb":
                    self._read_heartbeats()
                elif key.data == "ckpt":
                    self._on_checkpoint_read()
                else:
                    self._on_worker_exit(key.data[1])
            self._drain_signals()
            self._drain_messages()
            self._send_stall_report()
            now = time.monotonic()
            if stall_timeout and now >= next_stall:
                next_stall = now + STALL_CHECK_INTERVAL
                self._check_stalls(stall_timeout)
            if rt.health is not None and now >= next_health:
                next_health = now + rt.timing.health_interval
                self._check_health()
            if self.stop_deadline is not None and now >= self.stop_deadline:
                self._finish_preempt_stop()
            if self.state == State.STOPPING and now >= next_stop_check:
                next_stop_check = now + STOP_CHECK_INTERVAL
                self._stop_when_not_saving()
            if scanning and now >= next_scan:
                next_scan = now + SCAN_INTERVAL_S
                self._scan_tier()
            if self.flush_deadline is not None and now >= self.flush_deadline:
                self._flush_missed()
            if sampling and now >= next_slow:
                next_slow = now + SLOW_SAMPLE_S
                self._sample_slow()
            if waiting and now >= next_speed:
                next_speed = now + speed.RECHECK_S
                self._check_speed()

    def _drain_messages(self) -> None:
        while self.exit_code is None and (msg := self.rt.inbox.take()) is not None:
            messages.dispatch(self._handlers, msg)

    # ---- messages from the coordinator ------------------------------------------------------
    def _on_round(self, msg: messages.Round) -> None:
        group, client = self.rt.group, self.rt.client
        if group.running():
            group.stop(RESTART_KILL_GRACE)
        self._cancel_flush()
        self.round = msg
        if self.preempting:
            self.reported_round = msg.round
            client.send(messages.Stopped(msg.round))
            return
        restored = self.rt.tier.restore(msg.round) if self.rt.tier is not None else None
        if restored is not None and restored.error:
            self._restore_failed(msg, restored.error)
            return
        self.state = State.RUNNING
        self._watch_resume(msg)
        self._clear_slow()
        spawned = group.start(msg, restored.path if restored is not None else None)
        if group.cfg.slow_dir is not None:
            self.slow = NodeCollector(
                group.cfg.slow_dir, {w.rank: group.step_clock(w) for w in group.workers}
            )
        if self.inputs is not None:
            self.inputs.watch({w.rank: w.proc.pid for w in group.workers})
        if self.hangs is not None:
            workers = [(w.rank, w.proc.pid) for w in group.workers]
            self.hangs.watch(msg.round, workers, main_thread_io=msg.num_replica_groups > 0)
        client.send(messages.Started(msg.round, spawned, group.spawn, group.spawn_reason))

    # ---- slow nodes (hpcelastic/slow/) ------------------------------------------------------
    def _check_speed(self) -> None:
        """Tell the coordinator how fast this node is now (before its first round; a spare now and then), when
        the job has spares to check."""
        if self.rt.group.cfg.slow_dir is not None and self.rt.spec.spare_nodes > 0:
            self.rt.client.send(messages.SpeedCheck(speed.measure()))

    def _clear_slow(self) -> None:
        """A new round: the last round's ranks' files go (their collectives are not this round's)."""
        self.slow = None
        directory = self.rt.group.cfg.slow_dir
        if directory is not None:
            for f in directory.iterdir():
                with contextlib.suppress(OSError):
                    f.unlink()

    def _sample_slow(self) -> None:
        """Send this node's new evidence: its ranks' steps and collectives, and whether it saves."""
        assert self.slow is not None and self.round is not None
        group = self.rt.group
        checked = time.monotonic()
        group.note_saves()
        now = time.monotonic()
        saves = [w.last_save for w in group.running() if w.last_save is not None]
        saving = any(t >= checked for t in saves)
        facts = self.rt.health.facts() if self.rt.health is not None else {}
        gpus = {w.rank: facts[w.local_rank] for w in group.workers if w.local_rank in facts}
        rtt = self.rt.client.link_rtt_s()
        shares = self.inputs.shares() if self.inputs is not None else None
        throttled = self.throttle.shares({w.rank: w.proc.pid for w in group.running()})
        sample = self.slow.sample(
            self.round.round, rtt_s=rtt, input_shares=shares, gpus=gpus, throttled=throttled
        )
        if sample is None:
            sample = messages.SlowSample(self.round.round, time.time_ns(), rtt)
        elif self.inputs is not None and sample.ranks:
            self.inputs.observe(now, max(r.steps for r in sample.ranks))
        ages = [now - max(saves)] if saves else []
        written = newest_write(group.cfg.checkpoint_dir)  # a save too quick to be caught open
        ages += [max(0.0, time.time() - written)] if written is not None else []
        age = min(ages) if ages else None
        self.rt.client.send(dataclasses.replace(sample, saving=saving, save_age_s=age))

    def _on_retire(self, msg: messages.Retire) -> None:
        """The coordinator replaces this (slow) node with a spare: leave as a bad node does."""
        rt = self.rt
        if self.round is None or msg.round != self.round.round or rt.coordinator is not None:
            return
        rt.say(f"this node leaves the job: {msg.reason}")
        rt.group.stop(RESTART_KILL_GRACE)
        rt.client.send(messages.Leave(msg.reason, unhealthy=True))
        self.state = State.DONE
        self.exit_code = Reason.NODE_UNHEALTHY.exit_code

    def _restore_failed(self, rnd: messages.Round, error: str) -> None:
        """No copy of the round's checkpoint could be placed: this node's workers fail before they start,
        and the coordinator plans the next round from what it knows then (the node that was to serve it is
        lost)."""
        self.rt.say(f"local checkpoint tier: {error}")
        failure = {
            "round": rnd.round,
            "rank": rnd.rank_offset,
            "local_rank": 0,
            "exitcode": None,
            "signal": None,
            "error": f"local checkpoint tier: {error}",
            "traceback": "",
            "ts": time.time(),
        }
        self.state = State.RESTARTING
        self.reported_round = rnd.round
        self.rt.client.send(messages.Failed(rnd.round, (failure,)))
        self.rt.client.send(messages.Stopped(rnd.round))

    def _on_stop(self, msg: messages.Stop) -> None:
        if self.round is None or msg.round != self.round.round:
            return
        if self.flush_then is not None:
            self._cancel_flush()
            self.reported_round = -1
        if self.reported_round == self.round.round:
            return
        self._stop_and_report(self.round)

    def _on_preempt(self, msg: messages.Preempt) -> None:
        self._begin_preempt(msg.signal or self.rt.spec.stop_signal.name, local=False)

    def _on_finish(self, msg: messages.Finish) -> None:
        self._end_resume_watch()
        self._cancel_flush()
        self.rt.group.stop(RESTART_KILL_GRACE)
        self.state = State.DONE
        if msg.message:
            self.rt.say(msg.message)
        self.exit_code = self._end(msg.reason, msg.bad_nodes, msg.unreachable)

    def _on_lost(self, msg: messages.Lost) -> None:
        self._end_resume_watch()
        self._cancel_flush()
        self.rt.group.stop(RESTART_KILL_GRACE)
        self.state = State.DONE
        self.rt.say(f"coordinator lost: {msg.reason}; stopping this node's workers")
        if self._batch_host_died():
            host = self.rt.ctx.hosts[0]
            self.rt.say(f"the batch shell on {host} stopped too: its node died; ending the attempt here")
            end = end_of_attempt(
                self.rt.spec,
                self.rt.environ,
                self.rt.run_dir,
                self.rt.attempt,
                Reason.NODE_UNHEALTHY,
                decides=True,  # end_attempt lets one survivor decide
                bad_nodes=(host,),
                progressed=self.rt.group.progressed,
            )
            self.exit_code = end
            return
        self.exit_code = self._end(Reason.COORDINATOR_LOST)

    def _batch_host_died(self) -> bool:
        """Under Slurm: the batch shell's heartbeat stands still, so nobody runs ``finalize`` after srun."""
        job_id = self.rt.environ.get("SLURM_JOB_ID")
        if self.rt.coordinator is not None or not job_id:
            return False
        return batch_shell_dead(beat_path(self.rt.run_dir.path, job_id))

    def _on_dump_stacks(self, msg: messages.DumpStacks) -> None:
        group = self.rt.group
        if self.hangs is None or self.round is None or msg.round != self.round.round:
            return
        workers = [(w.rank, w.local_rank, w.proc.pid) for w in group.running()]
        peers = msg.peers
        self.hangs.dump(msg.round, workers, self.rt.client.send, lambda: self.rt.client.unreachable(peers))

    def _send_stall_report(self) -> None:
        report = self.hangs.take_report() if self.hangs is not None else None
        if report is None or self.state != State.RUNNING or self.round is None:
            return
        if report.round == self.round.round:
            self.rt.client.send(report)

    # ---- workers ----------------------------------------------------------------------------
    def _on_worker_exit(self, worker: Worker) -> None:
        group, client = self.rt.group, self.rt.client
        code = group.reap(worker)
        self._flush_steps()
        if self.state == State.STOPPING:
            if not group.running():
                self._finish_preempt_stop()
            return
        if self.state != State.RUNNING or self.round is None:
            return
        if code != 0:
            client.send(messages.Failed(self.round.round, (group.failure(worker),)))
            if code == EXIT_USAGE:  # argparse's, click's and getopt's code too: the one that earns a wait
                self._let_startup_errors_show()
            self._stop_and_report(self.round)
        elif not group.running():
            self.state = State.RESTARTING  # exit barrier: wait for the coordinator's decision
            done = messages.Done(self.round.round)
            self._flush_then(lambda: client.send(done), finished=True)

    def _stop_and_report(self, rnd: messages.Round) -> None:
        """Stop every local worker, then tell the coordinator this node is stopped for the round."""
        if self.hangs is not None:
            self.hangs.unwatch()
        self._end_resume_watch()
        self._flush_steps()
        group = self.rt.group
        failures = tuple(group.failure(w) for w in group.reap_failed())
        self.state = State.RESTARTING
        group.stop(RESTART_KILL_GRACE)
        if self.rt.tier is not None:  # what the workers saved before they stopped, before the next plan
            self.rt.tier.final_scan((), position_of(rnd))
        self.reported_round = rnd.round
        self.rt.client.send(messages.Stopped(rnd.round, failures))

    def _let_startup_errors_show(self) -> None:
        """A worker exited with a usage error's code: in a round's first :data:`STARTUP_WINDOW_S`, before any
        step here, wait up to :data:`STARTUP_SETTLE_S` for this node's other workers to exit on their own
        before stopping them. A usage error fails every rank within moments, and only every rank's own exit
        tells it from one node's trouble (``JobState``: the attempt then ends at once instead of
        restarting). Any other failure stops the others at once: waiting would only turn their consequent
        errors (a peer's connection reset) into failures of their own."""
        group = self.rt.group
        running = group.running()
        began = min((w.started for w in group.workers), default=0.0)
        if not running or time.time() - began > STARTUP_WINDOW_S or self._stepped_here():
            return
        deadline = time.monotonic() + STARTUP_SETTLE_S
        while time.monotonic() < deadline and any(w.proc.poll() is None for w in running):
            time.sleep(0.05)

    def _stepped_here(self) -> bool:
        """A worker of this node took a step this round: by its heartbeats, or its step clock (an unchanged
        script's optimizer steps, when the tier or slow-node detection is on)."""
        group = self.rt.group
        if any(w.step for w in group.workers):
            return True
        clocks = [path for path in (group.step_clock(w) for w in group.workers) if path is not None]
        return any((got := read_clock(path)) is not None and got[0] > 0 for path in clocks)

    def _check_stalls(self, stall_timeout: float) -> None:
        if self.state != State.RUNNING or self.round is None:
            return
        if self.round.num_replica_groups and self.hangs is not None and self.hangs.available:
            return  # a group waits in torchft's quorum while a peer restarts: the coordinator judges groups
        group = self.rt.group
        group.note_saves()
        stalled = group.stalled(stall_timeout)
        if not stalled:
            return
        failures = []
        for w in stalled:
            w.exit_ts = time.time()
            error = (
                f"stalled: no heartbeat from any rank of this node for more than {stall_timeout:g} s "
                f"(last step {w.step})"
            )
            failures.append(group.failure(w, error=error))
        self._flush_steps()
        self.rt.client.send(messages.Failed(self.round.round, tuple(failures)))
        self._stop_and_report(self.round)

    def _read_heartbeats(self) -> None:
        while True:
            try:
                data = self.rt.heartbeats.recv(4096)
            except (BlockingIOError, InterruptedError):
                return
            beat = parse_heartbeat(data)
            if beat is not None:
                if beat[1] is not None:
                    self._end_resume_watch()  # stepping: a resume lies behind
                self.rt.group.beat(*beat)
                if self.hangs is not None:
                    self.hangs.heartbeat(*beat)
                self._report_step(*beat)
                if beat[1] is not None and self.round is not None:
                    self.step_rate.beat(self.round.round, beat[1], time.time())

    def _report_step(self, rank: int, step: int | None) -> None:
        """Forward this node's highest step to the coordinator (few messages: see ``agent/progress.py``)."""
        if step is None or self.round is None or self.state not in (State.RUNNING, State.STOPPING):
            return
        msg = self.steps.beat(self.round.round, rank, step, time.time())
        if msg is not None:
            self.rt.client.send(msg)

    def _flush_steps(self) -> None:
        """Before this node reports its workers failed, stopped or done: the steps not yet forwarded."""
        self._read_heartbeats()
        msg = self.steps.flush()
        if msg is not None:
            self.rt.client.send(msg)

    # ---- what the round resumed from (agent/resume_watch.py) ----------------------------------
    def _watch_resume(self, msg: messages.Round) -> None:
        """From the round's start until its first step: the checkpoint its workers read (one node
        watches: the round's group rank 0; torchft groups heal from a peer, not from a file)."""
        self._end_resume_watch()
        if msg.group_rank != 0 or msg.num_replica_groups:
            return
        try:
            self.resume_watch = ResumeWatch(self.rt.group.checkpoint_dir, msg.round)
        except OSError as e:  # no inotify (a container without it, the watch limit): no evidence, no harm
            self.rt.say(f"cannot watch the checkpoint directory for what this round resumes from: {e}")
            return
        self.rt.selector.register(self.resume_watch, selectors.EVENT_READ, "ckpt")

    def _on_checkpoint_read(self) -> None:
        watch = self.resume_watch
        file = watch.take() if watch is not None else None
        if watch is None or file is None:
            return
        self._end_resume_watch()
        args = (watch.root, file, watch.round)
        threading.Thread(
            target=self._report_checkpoint, args=args, name="resume-evidence", daemon=True
        ).start()

    def _report_checkpoint(self, root: str, file: str, round_: int) -> None:
        """On a thread of its own: the checkpoint read, for the coordinator (``checkpoint_opened``)."""
        opened = describe(root, file)
        self._event(
            events.checkpoint_opened(
                attempt=self.rt.attempt,
                round=round_,
                node_rank=self.rt.ctx.node_rank,
                path=opened.path,
                file=opened.file,
                completed_ts=opened.completed_ts,
                newest=opened.newest,
            )
        )

    def _end_resume_watch(self) -> None:
        watch, self.resume_watch = self.resume_watch, None
        if watch is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.rt.selector.unregister(watch)
            watch.close()

    # ---- signals, preemption, health --------------------------------------------------------
    def _drain_signals(self) -> None:
        signals = self.rt.signals
        while signals and self.exit_code is None:
            signum, ts = signals.pop(0)
            if signum == self.rt.spec.stop_signal:
                name = signal.Signals(signum).name
                self._event(events.signal_received(signal=name, node_rank=self.rt.ctx.node_rank))
                self._begin_preempt(name, local=True)
            else:
                self._terminate(signum, ts)

    def _begin_preempt(self, signame: str, *, local: bool) -> None:
        rt = self.rt
        grace = stop_grace(rt.spec.grace_period, slurm_env.time_left(rt.environ, time.time()))
        if not self.preempting:
            self.preempting = True
            self.uncaught = {w.rank for w in rt.group.signal_catching(rt.spec.stop_signal)}
            rt.say(f"{signame}: asked the workers to stop (grace {grace:.0f} s)")
            if self.uncaught:
                ranks = ", ".join(map(str, sorted(self.uncaught)))
                rt.say(f"rank(s) {ranks} have no {signame} handler: stopped when not saving a checkpoint")
        if local:
            rt.client.send(messages.PreemptSignal(signame))
        self._report_steps()
        if self.state in (State.RUNNING, State.RESTARTING) and self.stop_deadline is None:
            self.state = State.STOPPING
            self.stop_deadline = time.monotonic() + grace
            if not rt.group.running():
                self._finish_preempt_stop()

    def _report_steps(self) -> None:
        """Once per preemption: this node's highest step and rate, for the coordinator's stop step; without
        a coordinator to answer, the stop file is written at once (every worker stops at its next check)."""
        if self.steps_reported or self.round is None:
            return
        self.steps_reported = True
        rate = self.step_rate
        step = rate.step if rate.round == self.round.round else None
        if not self.rt.client.send(messages.StepReport(self.round.round, step, rate.rate)):
            self._write_stop_file(None)

    def _on_stop_at(self, msg: messages.StopAt) -> None:
        if self.round is not None and msg.round == self.round.round:
            self._write_stop_file(msg.step)

    def _write_stop_file(self, step: int | None) -> None:
        """The attempt's stop file, replaced whole (workers never read half of it); remembers the step
        (none: this node's highest, where every rank that reports steps stops now) and each rank's step."""
        self.stop_at = step if step is not None else self.step_rate.step
        self.steps_at_stop = {w.rank: w.step for w in self.rt.group.running()}
        path = self.rt.stop_file
        tmp = path.with_name(f".{path.name}.{self.rt.ctx.node_rank}.{os.getpid()}.tmp")
        with contextlib.suppress(OSError):
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(stop_file_text(step))
            os.replace(tmp, path)

    def _stop_when_not_saving(self) -> None:
        """Stop, while grace remains, the workers that will not stop on their own (no handler for the stop
        signal, or training past the stop step), once no worker of the job has held a checkpoint file open
        for writing for :data:`STOP_QUIET_S` (:func:`quiet_enough`): a rank done with its shard may be
        needed, on any node, to finish the save of another. This node's saves go to the coordinator when
        they change."""
        group = self.rt.group
        checked = time.monotonic()
        group.note_saves()
        now = time.monotonic()
        running = group.running()
        last = max((w.last_save for w in running if w.last_save is not None), default=None)
        self._report_saving(last is not None and last >= checked, None if last is None else now - last)
        if not quiet_enough(now, last, self.job_quiet_since, self.saves_coordinated):
            return
        for w in running:
            ignored = ignores_stop(w.step, self.stop_at, self.steps_at_stop.get(w.rank))
            if w.rank in self.stopped_here or not (ignored or w.rank in self.uncaught):
                continue
            if ignored and self.stop_at is not None and w.step is not None:
                self._record_stop_ignored(w.rank, w.step, self.stop_at)
            self.stopped_here.add(w.rank)
            group.terminate(w)

    def _report_saving(self, saving: bool, idle_s: float | None) -> None:
        """Tell the coordinator whether this node saves, when that changed (the first check always): without
        it (no connection) the stop check goes by this node's saves alone."""
        if saving == self.saving_sent or self.round is None:
            return
        self.saving_sent = saving
        self.saves_coordinated = self.rt.client.send(messages.Saving(self.round.round, saving, idle_s))

    def _on_job_saving(self, msg: messages.JobSaving) -> None:
        if self.round is None or msg.round != self.round.round:
            return
        if msg.saving:
            self.job_quiet_since = None
        else:
            self.job_quiet_since = -math.inf if msg.quiet_s is None else time.monotonic() - msg.quiet_s

    def _record_stop_ignored(self, rank: int, step: int, stop_step: int) -> None:
        rt = self.rt
        rt.say(f"rank {rank} trained on to step {step}, past the stop step {stop_step}: stopping it")
        rnd = self.round.round if self.round is not None else -1
        event = events.stop_ignored(
            attempt=rt.attempt,
            round=rnd,
            rank=rank,
            node_rank=rt.ctx.node_rank,
            step=step,
            stop_step=stop_step,
        )
        rt.run_dir.record(event, host=rt.ctx.host)

    def _finish_preempt_stop(self) -> None:
        """Workers are gone (or the grace period is over): report this node stopped, once the local tier has
        persisted the last checkpoint (within what is left of the grace period)."""
        self._flush_steps()
        deadline = self.stop_deadline if self.stop_deadline is not None else time.monotonic()
        self.stop_deadline = None
        self.rt.group.stop(RESTART_KILL_GRACE)
        rnd = self.round.round if self.round else -1
        self.reported_round = rnd
        stopped = messages.Stopped(rnd)
        self._flush_then(lambda: self.rt.client.send(stopped), deadline)

    # ---- the local checkpoint tier ----------------------------------------------------------
    def _on_tier(self, msg: messages.Message) -> None:
        if self.rt.tier is not None:
            self.rt.tier.on_message(msg)
            if isinstance(msg, messages.TierQuery):
                self._scan_tier()  # answer at once if this node's files of it are settled

    def _scan_tier(self) -> None:
        """The tier's scan of the checkpoint directory; the files it reads are not the workers' resume."""
        if self.rt.tier is None or self.round is None:
            return
        watch = self.resume_watch
        with watch.own_reads() if watch is not None else contextlib.nullcontext():
            self.rt.tier.scan(self.rt.group.writing(), position_of(self.round))
        if watch is not None and watch.pending:
            self._on_checkpoint_read()

    def _flush_then(
        self, then: Callable[[], None], deadline: float | None = None, finished: bool = False
    ) -> None:
        """The workers are gone: ``then`` once the job's last checkpoint is persisted (the coordinator's
        ``TierFlushed``), or at ``deadline`` at the latest; at once without a tier. ``finished``: every
        worker exited with status 0; the deadline is the grace period from the coordinator's
        ``TierFlushing``."""
        tier, rnd = self.rt.tier, self.round
        if tier is None or rnd is None:
            then()
            return
        tier.final_scan(self.rt.group.writing(), position_of(rnd), finished)
        self.flush_then = then
        self.flush_deadline = None if finished else deadline
        self.flush_wait = self.rt.spec.grace_period if finished else None
        if self.flush_sent_round != rnd.round:
            self.flush_sent_round = rnd.round
            self.rt.client.send(messages.TierFlush(rnd.round))

    def _on_tier_flushing(self, msg: messages.TierFlushing) -> None:
        if self.flush_then is not None and self.flush_wait is not None:
            self.flush_deadline = time.monotonic() + self.flush_wait

    def _on_tier_flushed(self, msg: messages.TierFlushed) -> None:
        then = self.flush_then
        if then is None:
            return
        if not msg.ok:
            self.rt.say(f"local checkpoint tier: the last checkpoint {msg.name} was not persisted: {msg.why}")
        self._cancel_flush()
        then()

    def _flush_missed(self) -> None:
        """The grace period ended before the last checkpoint was persisted: say so (the coordinator's node
        records it for the ledger), and go on."""
        then = self.flush_then
        self._cancel_flush()
        if then is None:
            return
        rt = self.rt
        book = rt.coordinator.tier if rt.coordinator is not None else None
        last = book.last_complete() if book is not None else None
        name, step = last if last is not None else ("", None)
        rt.say(f"local checkpoint tier: the last checkpoint {name or '(none)'} was not persisted in time")
        if book is not None and name:
            why = "the grace period ended before every node's files were in the checkpoint directory"
            rt.run_dir.record(
                events.tier_persist_missed(attempt=rt.attempt, checkpoint=name, step=step, why=why)
            )
        then()

    def _cancel_flush(self) -> None:
        self.flush_then = None
        self.flush_deadline = None
        self.flush_wait = None

    def _terminate(self, signum: int, ts: float) -> None:
        """SIGTERM/SIGINT/SIGHUP (delivered at ``ts``): stop the workers and leave the job."""
        name = signal.Signals(signum).name
        self.rt.say(f"{name}: stopping this node's workers")
        self.rt.group.stop(min(RESTART_KILL_GRACE, self.rt.spec.grace_period))
        self.rt.client.send(messages.Leave(f"agent received {name}", signalled_at=ts))
        self.state = State.DONE
        self.exit_code = 128 + signum

    def _check_health(self) -> None:
        rt = self.rt
        problems = rt.health.check() if rt.health is not None else []
        if not problems:
            return
        for p in problems:
            rt.run_dir.record(events.node_unhealthy(node=rt.ctx.host, gpu=p.gpu, reason=p.reason))
        gpus = ", ".join(f"GPU {p.gpu} ({p.reason})" for p in problems)
        rt.say(f"unhealthy: {gpus}; this node leaves the job")
        rt.group.stop(RESTART_KILL_GRACE)
        rt.client.send(messages.Leave(f"node unhealthy: {problems[0].reason}", unhealthy=True))
        self.state = State.DONE
        if rt.coordinator is None:
            self.exit_code = Reason.NODE_UNHEALTHY.exit_code
            return
        # This node hosts the coordinator: wait until it has told the others how the attempt ends.
        rt.coordinator.finished.wait(timeout=rt.timing.detection_s + 2 * rt.spec.grace_period)
        result = rt.coordinator.state.result
        self.exit_code = self._end(result.reason if result else Reason.NODE_UNHEALTHY, (rt.ctx.host,))

    # ---- the end ----------------------------------------------------------------------------
    def _end(self, reason: Reason, bad_nodes: tuple[str, ...] = (), unreachable: tuple[str, ...] = ()) -> int:
        """The exit code for an attempt that ended with ``reason`` (group rank 0 decides how it ends)."""
        rt = self.rt
        if rt.coordinator is not None:  # the end-of-attempt path reads the events the coordinator wrote
            rt.coordinator.events.flush(timeout=EVENT_FLUSH_TIMEOUT)
        return end_of_attempt(
            rt.spec,
            rt.environ,
            rt.run_dir,
            rt.attempt,
            reason,
            # Only the coordinator decides; a cut-off agent leaves. With the coordinator gone, finalize
            # decides after srun under Slurm; without Slurm (no finalize) the survivors record it.
            decides=rt.coordinator is not None
            or (reason is Reason.COORDINATOR_LOST and slurm_env.job_id(rt.environ) is None),
            bad_nodes=bad_nodes,
            unreachable=unreachable,
            progressed=rt.group.progressed,
        )

    def _event(self, event: Event) -> None:
        """An agent-level event: through the coordinator when connected, else written directly."""
        if not self.rt.client.send(messages.AgentEvent(event)):
            self.rt.run_dir.record(event, host=self.rt.ctx.host)
