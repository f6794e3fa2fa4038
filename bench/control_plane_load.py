"""Control-plane load: the hpcelastic coordinator with many simulated agents, next to torch's c10d rendezvous.

Per size N (default 1024, 4096, 16384), on loopback with the real secret and authenticated protocol:

* joined / rendezvous: first agent's connect -> every agent has its welcome / its round-0 assignment
  (agents retry like ``CoordinatorClient.connect`` when their connection brings no challenge);
* restart round: one agent reports a worker failure -> every agent got ``stop`` and then the
  round-1 assignment;
* lost agent: one agent's socket closed abruptly, and separately one agent that stops sending
  (and reading) without closing -> the coordinator's ``node_lost`` event; each loss is followed by
  the restart round it causes;
* the coordinator process's CPU time (per phase; idle with N agents heartbeating, over ``--idle``
  seconds, also per heartbeat) and RSS; ``--profile DIR`` samples it with py-spy instead;
* a burst of N real ``CoordinatorClient.connect`` calls (N <= ``--real-max``) and its retries.

torch's c10d rendezvous (``DynamicRendezvousHandler`` on a ``TCPStore``, as torchrun builds it) runs
with N participants at each size, one round, within ``--c10d-limit`` seconds.

    python bench/control_plane_load.py [--sizes 1024,4096,16384] [--repeats 3,3,1]
        [--heartbeat-interval 0.5] [--heartbeat-timeout 2,2,10] [--c10d-limit 120] [--no-c10d]

Runs the ``hpcelastic`` package beside this ``bench`` directory: to measure a changed copy, run the
bench of that copy (a git worktree). Writes the ``control_plane_load`` section of bench/RESULTS.md
(unless ``--no-write``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._load_agents import real_clients_main, swarm_main  # noqa: E402
from bench._load_c10d import participants_main, store_main  # noqa: E402
from bench._load_coordinator import coordinator_main  # noqa: E402
from bench._results import machine_line, update_section  # noqa: E402
from hpcelastic.rundir import RunDir  # noqa: E402

TARGET_S = 2.0
TARGET_IDLE_PCT = 10.0
#: How the coordinator's ``node_lost`` reason of the silent agent begins, without and with the peer watch.
#: (With the peer watch the heartbeats may find it as fast where they are frequent: either counts.)
SILENT_REASON = {False: ("no heartbeat",), True: ("no heartbeat", "its watcher")}
PEER_WATCH_TEXT = (
    "Each size twice, one after the other: the heartbeats alone (as the section above), then with the peer "
    "watch (`agent/peerwatch.py`): the agents join a ring the coordinator assigns (`watch` / `watching`), "
    "and the silent agent is found by its watcher's `peer_silent` and the coordinator's probes. The "
    "simulated agents have a probe port and answer probes; only the silent agent beats (every 0.25 s, to "
    "its watcher, a simulated agent that echoes and reports as the real client does), since beats never "
    "reach the coordinator: its load is what it would be with every agent beating."
)
TARGET_NODES = 16384
DEFAULT_SIZES = (1024, 4096, 16384)
STEP_TIMEOUT_S = 60.0
MAX_RESTARTS = 10


#: One size's figures: hpcelastic's simulated agents, the burst of real clients, torch c10d.
Row = tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]


class BenchError(Exception):
    """A phase of the benchmark did not happen within its time limit, or went wrong."""


def _ctx() -> mp.context.SpawnContext:
    return mp.get_context("spawn")


def _expect(conn: Connection, kind: str, timeout: float) -> tuple[Any, ...]:
    """The next message of type ``kind`` from ``conn`` (others are dropped), within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not conn.poll(left):
            raise BenchError(f"no {kind!r} message within {timeout:g} s")
        msg = conn.recv()
        if msg[0] == kind:
            return msg


class Swarms:
    """The simulated-agent processes and the messages they sent the driver."""

    def __init__(
        self, port: int, secret: str, nodes: int, procs: int, hb_interval: float, peer_watch: bool = False
    ) -> None:
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        self.inbox: list[tuple[Any, ...]] = []
        self.owner: dict[int, Connection] = {}
        chunks = [list(range(i, nodes, procs)) for i in range(min(procs, nodes))]
        for ranks in chunks:
            parent, child = _ctx().Pipe()
            args = (port, secret, ranks, child, hb_interval, peer_watch)
            p = _ctx().Process(target=swarm_main, args=args, daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
            self.owner.update(dict.fromkeys(ranks, parent))
        for c in self.conns:
            _expect(c, "ready", STEP_TIMEOUT_S)

    def broadcast(self, *cmd: Any) -> None:
        for c in self.conns:
            c.send(cmd)

    def tell(self, rank: int, *cmd: Any) -> tuple[Any, ...]:
        """Send a command about one agent; returns its acknowledgement (carrying a timestamp)."""
        conn = self.owner[rank]
        conn.send((*cmd, rank))
        ack = {"fail": "failed", "close": "closed", "silence": "silenced", "beat": "beating"}[cmd[0]]
        return _expect(conn, ack, STEP_TIMEOUT_S)

    def round_done(self, rnd: int, timeout: float) -> float:
        """When the last agent got round ``rnd``'s assignment (every process reports its own last)."""
        deadline = time.monotonic() + timeout
        seen: dict[int, float] = {}
        while len(seen) < len(self.conns):
            left = deadline - time.monotonic()
            ready = wait([c for i, c in enumerate(self.conns) if i not in seen], timeout=max(0.0, left))
            if not ready:
                raise BenchError(f"round {rnd} did not reach every agent within {timeout:g} s")
            for c in ready:
                msg = c.recv()
                if msg[0] == "round" and msg[1] == rnd:
                    seen[self.conns.index(c)] = msg[2]
        return max(seen.values())

    def heartbeat_counts(self) -> tuple[int, int]:
        """Heartbeats the agents sent and received so far (received and sent by the coordinator)."""
        self.broadcast("counts")
        counts = [_expect(c, "counts", STEP_TIMEOUT_S)[1:] for c in self.conns]
        return sum(sent for sent, _ in counts), sum(received for _, received in counts)

    def reports(self) -> list[dict[str, Any]]:
        self.broadcast("report")
        return [_expect(c, "report", STEP_TIMEOUT_S)[1] for c in self.conns]

    def close(self) -> None:
        for c in self.conns:
            with contextlib.suppress(OSError):
                c.send(("exit",))
        _reap(self.procs)


def _reap(procs: list[Any], grace: float = 5.0) -> None:
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def _wait_node_lost(run: RunDir, node_rank: int, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ev in run.events():
            if ev["event"] == "node_lost" and ev.get("node_rank") == node_rank:
                return ev
        time.sleep(0.005)
    raise BenchError(f"no node_lost event for node {node_rank} within {timeout:g} s")


def _progress(swarms: Swarms | None) -> str:
    """How far the agents got, for a phase that timed out."""
    if swarms is None:
        return "the agents never started"
    try:
        agents = [a for rep in swarms.reports() for a in rep["agents"].values()]
    except BenchError:
        return "the agent processes stopped answering"
    errors = sorted({a["error"] for a in agents if a["error"]})
    joined = sum(1 for a in agents if a["welcome_ts"])
    return f"{joined} of {len(agents)} agents joined; errors: {'; '.join(errors[:3]) or 'none'}"


def _cpu(p: psutil.Process) -> float:
    """The process's CPU time so far (user + system, from /proc/PID/stat)."""
    t = p.cpu_times()
    return t.user + t.system


class _Profile:
    """py-spy sampling one process into ``path`` (collapsed stacks, one per line) until :meth:`stop`."""

    def __init__(self, pid: int, path: Path | None) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        if path is not None:
            cmd = [str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(pid)]
            cmd += ["--rate", "500", "--nonblocking", "--threads", "--format", "raw", "--output", str(path)]
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # py-spy attaches before the phase starts

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(30)


def _coordinator_process(
    nodes: int, hb_interval: float, hb_timeout: float, max_preauth: int | None, peer_watch: bool = False
) -> tuple[Path, RunDir, str, Any, Connection, Connection]:
    """A fresh run directory with its secret, and the (not yet started) coordinator process serving it
    with its pipe: ``(tmp, run, secret, process, driver's end, child's end)``."""
    tmp = Path(tempfile.mkdtemp(prefix="hpcelastic-load-"))
    run = RunDir(tmp)
    secret = run.create_secret()
    coord_conn, child = _ctx().Pipe()
    args = (str(tmp), nodes, MAX_RESTARTS, hb_interval, hb_timeout, child, max_preauth, peer_watch)
    coord = _ctx().Process(target=coordinator_main, args=args, daemon=True)
    return tmp, run, secret, coord, coord_conn, child


def run_hpcelastic(
    nodes: int,
    *,
    procs: int = 4,
    hb_interval: float = 0.5,
    hb_timeout: float = 2.0,
    idle_s: float = 10.0,
    profile_dir: Path | None = None,
    max_preauth: int | None = None,
    peer_watch: bool = False,
) -> dict[str, Any]:
    """Run every phase once with ``nodes`` simulated agents; returns the figures and the checks.

    ``profile_dir``: py-spy samples the coordinator during the join burst and the idle phase
    (``join-N.txt``, ``idle-N.txt``); its sampling costs the coordinator CPU, so profile in a run of its own.
    ``max_preauth``: the coordinator's cap of unauthenticated connections, if not the product's.
    ``peer_watch``: the agents watch each other (``agent/peerwatch.py``); the silent agent is found by its
    watcher, which it beats to until it falls silent.
    """
    if nodes < max(4, 2 * procs):
        raise BenchError(
            "the scenario needs at least 4 agents (rank 0, one failing, two lost) and two per process "
            "(a process left without a live agent never reports a round)"
        )
    tmp, run, secret, coord, coord_conn, child = _coordinator_process(
        nodes, hb_interval, hb_timeout, max_preauth, peer_watch
    )
    swarms: Swarms | None = None
    reached: list[str] = []
    fail_rank, closed_rank, silent_rank = nodes - 1, nodes // 2, nodes // 3
    try:
        coord.start()
        child.close()
        port = _expect(coord_conn, "port", STEP_TIMEOUT_S)[1]
        swarms = Swarms(port, secret, nodes, procs, hb_interval, peer_watch)
        cp = psutil.Process(coord.pid)
        rss_idle_mb = cp.memory_info().rss / 2**20
        cpu = [_cpu(cp)]

        profile = _Profile(coord.pid, profile_dir and profile_dir / f"join-{nodes}.txt")
        connect_ts = time.time()
        swarms.broadcast("connect")
        rdzv_end = swarms.round_done(0, STEP_TIMEOUT_S)
        reached = [f"rendezvous {rdzv_end - connect_ts:.2f} s"]
        profile.stop()
        cpu.append(_cpu(cp))
        rss_joined_mb = cp.memory_info().rss / 2**20
        time.sleep(2 * hb_interval)  # the round's start-up traffic is over
        profile = _Profile(coord.pid, profile_dir and profile_dir / f"idle-{nodes}.txt")
        hb_before, idle_cpu_before = swarms.heartbeat_counts(), _cpu(cp)
        time.sleep(idle_s)
        hb_after, idle_cpu_after = swarms.heartbeat_counts(), _cpu(cp)
        reached.append(f"idle coordinator {100 * (idle_cpu_after - idle_cpu_before) / idle_s:.1f} %")
        profile.stop()
        cpu.append(_cpu(cp))

        fail_ts = swarms.tell(fail_rank, "fail")[2]
        restart_end = swarms.round_done(1, STEP_TIMEOUT_S)
        reached.append(f"restart round {restart_end - fail_ts:.2f} s")
        cpu.append(_cpu(cp))

        close_ts = swarms.tell(closed_rank, "close")[2]
        closed_ev = _wait_node_lost(run, closed_rank, STEP_TIMEOUT_S)
        closed_restart_end = swarms.round_done(2, STEP_TIMEOUT_S)

        if peer_watch:
            swarms.broadcast("beat", silent_rank)
            for c in swarms.conns:
                _expect(c, "beating", STEP_TIMEOUT_S)
            time.sleep(1.0)  # its watcher hears it
        silent_ts = swarms.tell(silent_rank, "silence")[2]
        silent_ev = _wait_node_lost(run, silent_rank, hb_timeout + STEP_TIMEOUT_S)
        silent_restart_end = swarms.round_done(3, STEP_TIMEOUT_S)

        swarms.broadcast("done")
        final = _expect(coord_conn, "result", STEP_TIMEOUT_S)[1]
        reports = swarms.reports()
    except BenchError as e:
        before = ", ".join(reached) or "nothing"
        raise BenchError(f"{e} ({_progress(swarms)}; before that: {before})") from None
    finally:
        if swarms is not None:
            swarms.close()
        with contextlib.suppress(OSError):
            coord_conn.send(("stop",))
        _reap([coord])
        events = run.events()
        shutil.rmtree(tmp, ignore_errors=True)

    agents = {int(r): a for rep in reports for r, a in rep["agents"].items()}
    first_connect = min(rep["connect_ts"] for rep in reports)
    welcomes = [a["welcome_ts"] for a in agents.values()]
    hb_received, hb_sent = (after - before for before, after in zip(hb_before, hb_after, strict=True))
    idle_cpu_s = idle_cpu_after - idle_cpu_before
    stop0 = [a["stops"].get(0) for a in agents.values()]
    out = {
        "nodes": nodes,
        "peer_watch": peer_watch,
        "joined_s": max(w for w in welcomes if w is not None) - first_connect if any(welcomes) else math.nan,
        "joined_median_s": statistics.median(w for w in welcomes if w is not None) - first_connect
        if any(welcomes)
        else math.nan,
        "rendezvous_s": rdzv_end - first_connect,
        "restart_s": restart_end - fail_ts,
        "stop_s": max((s for s in stop0 if s is not None), default=math.nan) - fail_ts,
        "lost_closed_s": closed_ev["ts"] - close_ts,
        "lost_closed_restart_s": closed_restart_end - close_ts,
        "lost_silent_s": silent_ev["ts"] - silent_ts,
        "lost_silent_restart_s": silent_restart_end - silent_ts,
        "cpu_rendezvous_s": cpu[1] - cpu[0],
        "cpu_idle_pct": 100 * idle_cpu_s / idle_s,
        "hb_per_s": (hb_received + hb_sent) / idle_s,
        "us_per_hb": 1e6 * idle_cpu_s / max(1, hb_received + hb_sent),
        "cpu_restart_s": cpu[3] - cpu[2],
        "cpu_total_s": final["cpu_s"],
        "rss_idle_mb": rss_idle_mb,
        "rss_joined_mb": rss_joined_mb,
        "maxrss_mb": final["maxrss_mb"],
        "final": final,
        "reconnects": sum(a["retries"] for a in agents.values()),
        "lost_events": [(e["node_rank"], e["reason"]) for e in events if e["event"] == "node_lost"],
    }
    out["problems"] = _check(out, agents, events, (fail_rank, closed_rank, silent_rank))
    return out


def _check(
    out: dict[str, Any], agents: dict[int, Any], events: list[dict[str, Any]], ranks: tuple[int, int, int]
) -> list[str]:
    """What went differently from the scenario (empty when every phase did what it should)."""
    fail_rank, closed_rank, silent_rank = ranks
    nodes = out["nodes"]
    problems = [f"agent {r}: {a['error']}" for r, a in sorted(agents.items()) if a["error"]]
    expected = {0: set(range(nodes)), 1: set(range(nodes))}
    expected[2] = expected[1] - {closed_rank}
    expected[3] = expected[2] - {silent_rank}
    for rnd, ranks_in in expected.items():
        got = {r for r, a in agents.items() if rnd in a["rounds"]}
        if got != ranks_in:
            problems.append(f"round {rnd} reached {len(got)} agents, expected {len(ranks_in)}")
    if {r for r, a in agents.items() if 0 in a["stops"]} != set(range(nodes)):
        problems.append("the restart's stop did not reach every other agent")
    finished = {r for r, a in agents.items() if a["finish"]}
    if finished != expected[3]:
        problems.append(f"{len(finished)} agents got finish, expected {len(expected[3])}")
    lost = out["lost_events"]
    if [r for r, _ in lost] != [closed_rank, silent_rank]:
        problems.append(f"node_lost events {lost}, expected nodes {closed_rank} then {silent_rank}")
    elif not ("closed" in lost[0][1] or "reset" in lost[0][1]) or not lost[1][1].startswith(
        SILENT_REASON[out["peer_watch"]]
    ):
        problems.append(f"node_lost reasons {[why for _, why in lost]}")
    restarts = [e["reason"] for e in events if e["event"] == "restarting"]
    if restarts != ["worker_failed", "node_lost", "node_lost"]:
        problems.append(f"restarting events {restarts}")
    result = out["final"]["result"] or {}
    if result.get("reason") != "succeeded":
        problems.append(f"the job ended with {result or 'no result'}, expected succeeded")
    return problems


TIMES = (
    "joined_s",
    "joined_median_s",
    "rendezvous_s",
    "restart_s",
    "stop_s",
    "lost_closed_s",
    "lost_closed_restart_s",
    "lost_silent_s",
    "lost_silent_restart_s",
    "cpu_rendezvous_s",
    "cpu_idle_pct",
    "hb_per_s",
    "us_per_hb",
    "cpu_restart_s",
    "cpu_total_s",
    "rss_idle_mb",
    "rss_joined_mb",
    "maxrss_mb",
)


def run_hpcelastic_repeated(nodes: int, repeats: int, **kwargs: Any) -> dict[str, Any]:
    """Run ``run_hpcelastic`` ``repeats`` times: every figure's median, the worst rounds, all problems."""
    runs = [run_hpcelastic(nodes, **kwargs) for _ in range(repeats)]
    out = {k: statistics.median([r[k] for r in runs]) for k in TIMES}
    out.update(
        nodes=nodes,
        peer_watch=kwargs.get("peer_watch", False),
        repeats=repeats,
        hb_interval=kwargs.get("hb_interval", 0.5),
        hb_timeout=kwargs.get("hb_timeout", 2.0),
        worst_rendezvous_s=max(r["rendezvous_s"] for r in runs),
        worst_restart_s=max(r["restart_s"] for r in runs),
        reconnects=sum(r["reconnects"] for r in runs),
        problems=[f"run {i + 1}: {p}" for i, r in enumerate(runs) for p in r["problems"]],
    )
    return out


def _run_together(target: Any, args: list[tuple[Any, ...]], limit_s: float) -> tuple[float, list[Any]]:
    """One process per ``args`` tuple runs ``target(*args, limit_s, ctl)``; all start work on one ``go``.

    Each process says ``ready``, then gets ``go``, then sends ``result`` (a dict); returns the time of
    ``go`` and every result's values. The processes are told ``exit`` and reaped afterwards.
    """
    procs: list[tuple[Any, Connection]] = []
    try:
        for a in args:
            parent, child = _ctx().Pipe()
            p = _ctx().Process(target=target, args=(*a, limit_s, child), daemon=True)
            p.start()
            child.close()
            procs.append((p, parent))
        for _p, conn in procs:
            _expect(conn, "ready", STEP_TIMEOUT_S)
        go_ts = time.time()
        for _p, conn in procs:
            conn.send(("go",))
        return go_ts, [r for _p, conn in procs for r in _expect(conn, "result", limit_s + 30)[1].values()]
    finally:
        for _p, conn in procs:
            with contextlib.suppress(OSError):
                conn.send(("exit",))
        _reap([p for p, _ in procs])


def run_real_clients(
    nodes: int, *, procs: int = 4, timeout: float = STEP_TIMEOUT_S, max_preauth: int | None = None
) -> dict[str, Any]:
    """A burst of ``nodes`` real ``CoordinatorClient.connect`` calls (threads in ``procs`` processes) at once.

    Times from the common ``go`` to the last welcome; ``attempts`` counts connections, so
    ``attempts - nodes`` is how many the client retried (the coordinator's cap of unauthenticated
    connections closed them, or no challenge came in time).
    """
    tmp, _run, secret, coord, coord_conn, child = _coordinator_process(nodes, 0.5, 2.0, max_preauth)
    try:
        coord.start()
        child.close()
        port = _expect(coord_conn, "port", STEP_TIMEOUT_S)[1]
        args = [(port, secret, list(range(i, nodes, procs))) for i in range(min(procs, nodes))]
        go_ts, results = _run_together(real_clients_main, args, timeout)
    finally:
        with contextlib.suppress(OSError):
            coord_conn.send(("stop",))
        _reap([coord])
        shutil.rmtree(tmp, ignore_errors=True)
    joined = [ts for ts, _attempts, _error in results if ts is not None]
    return {
        "nodes": nodes,
        "joined": len(joined),
        "seconds": max(joined) - go_ts if len(joined) == nodes else None,
        "retries": sum(attempts for _ts, attempts, _error in results) - nodes,
        "errors": sorted({error for _ts, _attempts, error in results if error})[:3],
    }


def run_c10d(nodes: int, *, limit_s: float, procs: int = 4) -> dict[str, Any]:
    """One torch c10d rendezvous round with ``nodes`` participants, bounded by ``limit_s``."""
    store_conn, child = _ctx().Pipe()
    store = _ctx().Process(target=store_main, args=(child,), daemon=True)
    try:
        store.start()
        child.close()
        port = _expect(store_conn, "port", STEP_TIMEOUT_S)[1]
        counts = [nodes // procs + (1 if i < nodes % procs else 0) for i in range(min(procs, nodes))]
        go_ts, results = _run_together(participants_main, [(port, nodes, count) for count in counts], limit_s)
    finally:
        with contextlib.suppress(OSError):
            store_conn.send(("stop",))
        _reap([store])
    ok = [r for r in results if r[0] == "ok"]
    errors = sorted({r[2] for r in results if r[0] == "error"})
    ranks = sorted(r[2] for r in ok)
    return {
        "nodes": nodes,
        "limit_s": limit_s,
        "completed": len(ok) == nodes and ranks == list(range(nodes)),
        "seconds": max(r[1] for r in ok) - go_ts if ok else None,
        "joined": len(ok),
        "errors": errors[:3],
    }


def _f(x: float | None, unit: str = " s", digits: int = 2) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:.{digits}f}{unit}"


def _c10d_cell(c: dict[str, Any] | None) -> str:
    if c is None:
        return "not run"
    if c["completed"]:
        return _f(c["seconds"])
    return f"did not complete within {c['limit_s']:g} s ({c['joined']} of {c['nodes']} returned)"


def _real_cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return "not run"
    if r["seconds"] is None:
        return f"{r['joined']} of {r['nodes']} joined ({'; '.join(r['errors']) or 'no error'})"
    return f"{_f(r['seconds'])} ({r['retries']} retries)"


def markdown(rows: list[Row], command: str, procs: int, idle_s: float, peer_watch: bool = False) -> str:
    """The RESULTS.md section for these sizes (``peer_watch``: the section that sets the peer watch beside
    the heartbeats alone)."""
    lines = [
        "## Control-plane load with the peer watch (`bench/control_plane_load.py --peer-watch`)"
        if peer_watch
        else "## Control-plane load (`bench/control_plane_load.py`)",
        "",
        PEER_WATCH_TEXT if peer_watch else "",
        "",
        machine_line() + " The machine is shared: the 1-minute load average when each size started is "
        "in the table.",
        "",
        f"The hpcelastic side: one coordinator process (the product's `Coordinator` + `JobState`, "
        f"authenticated protocol, 127.0.0.1) and N simulated agents in {procs} processes, each agent a "
        "real TCP connection (from one of 128 loopback addresses) doing the real handshake, heartbeats "
        "(both ways, at the interval in the table) and messages; no workers. An agent whose connection "
        "brings no challenge (closed at the coordinator's cap of unauthenticated connections, refused, "
        "or silent for 5 s) connects again after 0.1 s, as `CoordinatorClient.connect` does. Times come "
        "from the agents' receive times and the run directory's `node_lost` events; each is the median of "
        "the runs (how many: in the table), [worst] for the rounds. Joined: first connect -> every agent "
        "has its welcome (half of them: in brackets); rendezvous: -> every "
        "agent has its round-0 assignment. Restart round: one agent reports a worker failure -> every agent "
        "got `stop` (time in brackets) and then the next round's assignment. Lost agent: socket closed, or "
        "agent silent (no heartbeats, not reading) -> `node_lost`; in brackets the time to the restart "
        f"round that loss causes. Idle: the coordinator's CPU time (user + system, `/proc/PID/stat`) over "
        f"{idle_s:g} s after the round started, as % of one core, and divided by the heartbeats it received "
        "and sent in that time (µs per heartbeat). Real clients: N threads in "
        f"{procs} processes call the real `CoordinatorClient.connect` at once -> the last welcome (its "
        "retries in brackets). torch c10d: torchrun's `DynamicRendezvousHandler` + `C10dRendezvousBackend` "
        f"on one `TCPStore` (its own process), N participants as threads in {procs} processes, from a "
        "common start: handler creation + one `next_rendezvous()` each, `join_timeout` = the limit. "
        f"Targets at {TARGET_NODES} agents: joined and restart round < {TARGET_S:g} s, idle coordinator "
        f"< {TARGET_IDLE_PCT:g} % of a core.",
        "",
        "| N | runs | load | joined | rendezvous | restart round (stop reached all) | lost: closed "
        "| lost: silent (timeout) | heartbeat interval | idle coordinator CPU | µs per heartbeat "
        "| coordinator CPU: rendezvous / restart | peak RSS | real clients joined | torch c10d rendezvous "
        "| scenario checks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for h, r, c in rows:
        load = f"{h['load']:.1f}"
        if "error" in h:
            lines.append(
                f"| {h['nodes']} | 0 | {load} |"
                + " n/a |" * 10
                + f" {_real_cell(r)} | {_c10d_cell(c)} | {h['error']} |"
            )
            continue
        checks = "all passed" if not h["problems"] else "; ".join(h["problems"][:3])
        if h["reconnects"]:
            checks += f" ({h['reconnects']} reconnections over the runs)"
        size = f"{h['nodes']}, peer watch" if h.get("peer_watch") else str(h["nodes"])
        lines.append(
            f"| {size} | {h['repeats']} | {load} | {_f(h['joined_s'])} ({_f(h['joined_median_s'])}) "
            f"| {_f(h['rendezvous_s'])} "
            f"[{_f(h['worst_rendezvous_s'])}] "
            f"| {_f(h['restart_s'])} [{_f(h['worst_restart_s'])}] ({_f(h['stop_s'])}) "
            f"| {_f(h['lost_closed_s'], digits=3)} ({_f(h['lost_closed_restart_s'])}) "
            f"| {_f(h['lost_silent_s'])} ({_f(h['lost_silent_restart_s'])}) ({h['hb_timeout']:g} s) "
            f"| {h['hb_interval']:g} s "
            f"| {h['cpu_idle_pct']:.1f} % | {h['us_per_hb']:.0f} µs "
            f"| {_f(h['cpu_rendezvous_s'])} / {_f(h['cpu_restart_s'])} | {h['maxrss_mb']:.0f} MB "
            f"| {_real_cell(r)} | {_c10d_cell(c)} | {checks} |"
        )
    met = [h for h, _, _ in rows if h["nodes"] == TARGET_NODES and "error" not in h]
    if met:
        h = met[0]
        ok = h["joined_s"] < TARGET_S and h["restart_s"] < TARGET_S and h["cpu_idle_pct"] < TARGET_IDLE_PCT
        lines += ["", f"Targets at {TARGET_NODES} agents: {'met' if ok else 'missed'}."]
    errs = {e for _, _, c in rows if c and c["errors"] for e in c["errors"]}
    if errs:
        lines += ["", "torch c10d errors seen: " + "; ".join(sorted(errs)[:3])]
    lines += ["", f"Reproduce: `{command}`"]
    return "\n".join(lines)


def _summary(h: dict[str, Any]) -> str:
    return (
        f"N={h['nodes']}: joined {h['joined_s']:.3f} s (half by {h['joined_median_s']:.3f} s), "
        f"rendezvous {h['rendezvous_s']:.3f} s, restart "
        f"{h['restart_s']:.3f} s, lost closed {h['lost_closed_s']:.3f} s, silent {h['lost_silent_s']:.2f} s, "
        f"idle coordinator {h['cpu_idle_pct']:.1f} % of a core ({h['us_per_hb']:.1f} µs per heartbeat), "
        f"peak RSS {h['maxrss_mb']:.0f} MB (medians of {h['repeats']}), checks: {h['problems'] or 'ok'}"
    )


def _per_size(text: str, sizes: list[int], what: str) -> list[float]:
    """One value per size from ``text``: a single value for all, or one per size, comma-separated."""
    values = [float(v) for v in text.split(",") if v.strip()]
    if len(values) == 1:
        return values * len(sizes)
    if len(values) != len(sizes):
        raise ValueError(f"{what}: give one value, or one per size ({len(sizes)})")
    return values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="comma-separated N values")
    ap.add_argument("--procs", type=int, default=4, help="processes for the simulated agents / c10d threads")
    ap.add_argument("--c10d-limit", type=float, default=120.0, help="time limit per c10d rendezvous, s")
    ap.add_argument(
        "--repeats",
        default="3",
        help="hpcelastic runs per size (median reported): one for all, or one per size",
    )
    ap.add_argument("--idle", type=float, default=10.0, help="seconds the idle coordinator's CPU is measured")
    ap.add_argument(
        "--heartbeat-interval",
        default="0.5",
        help="heartbeat interval (both ways), s: one for all sizes or one per size (comma-separated)",
    )
    ap.add_argument(
        "--heartbeat-timeout",
        default="2",
        help="the coordinator's heartbeat timeout, s: one for all sizes or one per size (comma-separated)",
    )
    ap.add_argument(
        "--real-max", type=int, default=1024, help="largest N for the burst of real clients (a thread each)"
    )
    ap.add_argument("--profile", type=Path, help="write py-spy profiles of the coordinator here (one run)")
    ap.add_argument("--no-c10d", action="store_true", help="skip torch's c10d rendezvous")
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    ap.add_argument(
        "--peer-watch",
        action="store_true",
        help="run each size with the heartbeats alone and with the peer watch (agent/peerwatch.py), one "
        "after the other; writes the control_plane_peer_watch section",
    )
    args = ap.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
        hb_timeouts = _per_size(args.heartbeat_timeout, sizes, "--heartbeat-timeout")
        hb_intervals = _per_size(args.heartbeat_interval, sizes, "--heartbeat-interval")
        repeats = [int(r) for r in _per_size(args.repeats, sizes, "--repeats")]
    except ValueError as e:
        ap.error(f"{e} (sizes and timeouts are comma-separated numbers, e.g. --sizes 1024,4096)")
    if not sizes or min(sizes) < 4:
        ap.error("--sizes: every size must be at least 4")
    if min(repeats) < 1:
        ap.error("--repeats: give 1 or more")
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    for n, n_repeats, hb_interval, hb_timeout in zip(sizes, repeats, hb_intervals, hb_timeouts, strict=True):
        for watch in (False, True) if args.peer_watch else (False,):
            load = os.getloadavg()[0]
            try:
                h = run_hpcelastic_repeated(
                    n,
                    n_repeats,
                    procs=args.procs,
                    hb_interval=hb_interval,
                    hb_timeout=hb_timeout,
                    idle_s=args.idle,
                    profile_dir=args.profile,
                    peer_watch=watch,
                )
            except BenchError as e:
                h = {"nodes": n, "peer_watch": watch, "error": str(e), "problems": [str(e)]}
                print(f"N={n}: hpcelastic: {e}", flush=True)
            else:
                print(_summary(h), flush=True)
            h["load"] = load
            if watch:
                rows.append((h, None, None))
                continue
            r = None
            if n <= args.real_max:
                try:
                    r = run_real_clients(n, procs=args.procs)
                except BenchError as e:
                    r = {"nodes": n, "joined": 0, "seconds": None, "retries": 0, "errors": [str(e)]}
                print(f"N={n}: real clients: {_real_cell(r)}", flush=True)
            c = None
            if not args.no_c10d:
                try:
                    c = run_c10d(n, limit_s=args.c10d_limit, procs=args.procs)
                except BenchError as e:
                    c = {
                        "nodes": n,
                        "limit_s": args.c10d_limit,
                        "completed": False,
                        "joined": 0,
                        "errors": [str(e)],
                    }
                print(f"N={n}: torch c10d: {_c10d_cell(c)} {c['errors'] or ''}", flush=True)
            rows.append((h, r, c))
    command = "python bench/control_plane_load.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = markdown(rows, command.strip(), args.procs, args.idle, args.peer_watch)
    print(text)
    if not args.no_write:
        update_section("control_plane_peer_watch" if args.peer_watch else "control_plane_load", text)
    return 0 if all(not h["problems"] for h, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
