"""Control-plane load: the hpcelastic coordinator with many simulated agents, next to torch's c10d rendezvous.

Per size N (default 64, 256, 1024), on 127.0.0.1 with the real secret and authenticated protocol:

* rendezvous round: first agent's connect -> every agent has its round-0 assignment;
* restart round: one agent reports a worker failure -> every agent got ``stop`` and then the
  round-1 assignment;
* lost agent: one agent's socket closed abruptly, and separately one agent that stops sending
  (and reading) without closing -> the coordinator's ``node_lost`` event; each loss is followed by
  the restart round it causes;
* the coordinator process's CPU time (per phase, and idle with N agents heartbeating) and RSS.

torch's c10d rendezvous (``DynamicRendezvousHandler`` on a ``TCPStore``, as torchrun builds it) runs
with N participants at each size, one round, within ``--c10d-limit`` seconds.

    python bench/control_plane_load.py [--sizes 64,256,1024] [--c10d-limit 120] [--no-c10d]

Writes the ``control_plane_load`` section of bench/RESULTS.md (unless ``--no-write``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing as mp
import os
import shutil
import statistics
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

from bench._load_agents import swarm_main  # noqa: E402
from bench._load_c10d import participants_main, store_main  # noqa: E402
from bench._load_coordinator import coordinator_main  # noqa: E402
from bench._results import machine_line, update_section  # noqa: E402
from hpcelastic.rundir import RunDir  # noqa: E402

TARGET_S = 2.0
DEFAULT_SIZES = (64, 256, 1024)
STEP_TIMEOUT_S = 60.0
MAX_RESTARTS = 10


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

    def __init__(self, port: int, secret: str, nodes: int, procs: int, hb_interval: float) -> None:
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        self.inbox: list[tuple[Any, ...]] = []
        self.owner: dict[int, Connection] = {}
        chunks = [list(range(i, nodes, procs)) for i in range(min(procs, nodes))]
        for ranks in chunks:
            parent, child = _ctx().Pipe()
            p = _ctx().Process(target=swarm_main, args=(port, secret, ranks, child, hb_interval), daemon=True)
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
        ack = {"fail": "failed", "close": "closed", "silence": "silenced"}[cmd[0]]
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
    t = p.cpu_times()
    return t.user + t.system


def run_hpcelastic(
    nodes: int,
    *,
    procs: int = 4,
    hb_interval: float = 0.5,
    hb_timeout: float = 2.0,
    idle_s: float = 2.0,
) -> dict[str, Any]:
    """Run every phase once with ``nodes`` simulated agents; returns the figures and the checks."""
    if nodes < 4:
        raise BenchError("the scenario needs at least 4 agents (rank 0, one failing, two lost)")
    tmp = Path(tempfile.mkdtemp(prefix="hpcelastic-load-"))
    run = RunDir(tmp)
    secret = run.create_secret()
    coord_conn, child = _ctx().Pipe()
    coord = _ctx().Process(
        target=coordinator_main,
        args=(str(tmp), nodes, MAX_RESTARTS, hb_interval, hb_timeout, child),
        daemon=True,
    )
    swarms: Swarms | None = None
    fail_rank, closed_rank, silent_rank = nodes - 1, nodes // 2, nodes // 3
    try:
        coord.start()
        child.close()
        port = _expect(coord_conn, "port", STEP_TIMEOUT_S)[1]
        swarms = Swarms(port, secret, nodes, procs, hb_interval)
        cp = psutil.Process(coord.pid)
        rss_idle_mb = cp.memory_info().rss / 2**20
        cpu = [_cpu(cp)]

        swarms.broadcast("connect")
        rdzv_end = swarms.round_done(0, STEP_TIMEOUT_S)
        cpu.append(_cpu(cp))
        rss_joined_mb = cp.memory_info().rss / 2**20
        time.sleep(idle_s)
        cpu.append(_cpu(cp))

        fail_ts = swarms.tell(fail_rank, "fail")[2]
        restart_end = swarms.round_done(1, STEP_TIMEOUT_S)
        cpu.append(_cpu(cp))

        close_ts = swarms.tell(closed_rank, "close")[2]
        closed_ev = _wait_node_lost(run, closed_rank, STEP_TIMEOUT_S)
        closed_restart_end = swarms.round_done(2, STEP_TIMEOUT_S)

        silent_ts = swarms.tell(silent_rank, "silence")[2]
        silent_ev = _wait_node_lost(run, silent_rank, hb_timeout + STEP_TIMEOUT_S)
        silent_restart_end = swarms.round_done(3, STEP_TIMEOUT_S)

        swarms.broadcast("done")
        final = _expect(coord_conn, "result", STEP_TIMEOUT_S)[1]
        reports = swarms.reports()
    except BenchError as e:
        raise BenchError(f"{e} ({_progress(swarms)})") from None
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
    stop0 = [a["stops"].get(0) for a in agents.values()]
    out = {
        "nodes": nodes,
        "rendezvous_s": rdzv_end - first_connect,
        "restart_s": restart_end - fail_ts,
        "stop_s": max((s for s in stop0 if s is not None), default=math.nan) - fail_ts,
        "lost_closed_s": closed_ev["ts"] - close_ts,
        "lost_closed_restart_s": closed_restart_end - close_ts,
        "lost_silent_s": silent_ev["ts"] - silent_ts,
        "lost_silent_restart_s": silent_restart_end - silent_ts,
        "cpu_rendezvous_s": cpu[1] - cpu[0],
        "cpu_idle_pct": 100 * (cpu[2] - cpu[1]) / idle_s,
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
    elif not ("closed" in lost[0][1] or "reset" in lost[0][1]) or "no heartbeat" not in lost[1][1]:
        problems.append(f"node_lost reasons {[why for _, why in lost]}")
    restarts = [e["reason"] for e in events if e["event"] == "restarting"]
    if restarts != ["worker_failed", "node_lost", "node_lost"]:
        problems.append(f"restarting events {restarts}")
    result = out["final"]["result"] or {}
    if result.get("reason") != "succeeded":
        problems.append(f"the job ended with {result or 'no result'}, expected succeeded")
    return problems


TIMES = (
    "rendezvous_s",
    "restart_s",
    "stop_s",
    "lost_closed_s",
    "lost_closed_restart_s",
    "lost_silent_s",
    "lost_silent_restart_s",
    "cpu_rendezvous_s",
    "cpu_idle_pct",
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
        repeats=repeats,
        worst_rendezvous_s=max(r["rendezvous_s"] for r in runs),
        worst_restart_s=max(r["restart_s"] for r in runs),
        reconnects=sum(r["reconnects"] for r in runs),
        problems=[f"run {i + 1}: {p}" for i, r in enumerate(runs) for p in r["problems"]],
    )
    return out


def run_c10d(nodes: int, *, limit_s: float, procs: int = 4) -> dict[str, Any]:
    """One torch c10d rendezvous round with ``nodes`` participants, bounded by ``limit_s``."""
    store_conn, child = _ctx().Pipe()
    store = _ctx().Process(target=store_main, args=(child,), daemon=True)
    parts: list[tuple[Any, Connection]] = []
    try:
        store.start()
        child.close()
        port = _expect(store_conn, "port", STEP_TIMEOUT_S)[1]
        counts = [nodes // procs + (1 if i < nodes % procs else 0) for i in range(min(procs, nodes))]
        for count in counts:
            parent, c = _ctx().Pipe()
            p = _ctx().Process(target=participants_main, args=(port, nodes, count, limit_s, c), daemon=True)
            p.start()
            c.close()
            parts.append((p, parent))
        for _p, conn in parts:
            _expect(conn, "ready", STEP_TIMEOUT_S)
        go_ts = time.time()
        for _p, conn in parts:
            conn.send(("go",))
        results = [r for _p, conn in parts for r in _expect(conn, "result", limit_s + 30)[1].values()]
    finally:
        with contextlib.suppress(OSError):
            store_conn.send(("stop",))
        _reap([p for p, _ in parts] + [store])
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


def markdown(rows: list[tuple[dict[str, Any], dict[str, Any] | None]], command: str, procs: int) -> str:
    """The RESULTS.md section for these sizes."""
    repeats = max((h.get("repeats", 1) for h, _ in rows), default=1)
    lines = [
        "## Control-plane load (`bench/control_plane_load.py`)",
        "",
        machine_line() + " The machine is shared: the 1-minute load average when each size started is "
        "in the table.",
        "",
        f"The hpcelastic side: one coordinator process (the product's `Coordinator` + `JobState`, "
        f"authenticated protocol, 127.0.0.1) and N simulated agents in {procs} processes, each agent a "
        "real TCP connection doing the real handshake, heartbeats (0.5 s) and messages; no workers. Times "
        "come from the agents' receive times and the run directory's `node_lost` events; each is the median "
        f"of {repeats} runs, [worst] for the rounds. Rendezvous: first connect -> every agent has its "
        "round-0 assignment. Restart round: one agent reports a worker failure -> every agent got `stop` "
        "(time in brackets) and then the next round's assignment. Lost agent: socket closed, or agent "
        "silent (no heartbeats, not reading; heartbeat timeout 2 s, checked every 0.5 s) -> `node_lost`; "
        "in brackets the time to the restart round that loss causes. torch c10d: torchrun's "
        "`DynamicRendezvousHandler` + `C10dRendezvousBackend` on one `TCPStore` (its own process), N "
        f"participants as threads in {procs} processes, from a common start: handler creation + one "
        f"`next_rendezvous()` each, `join_timeout` = the limit. Target: 1024 agents < {TARGET_S:g} s "
        "per round.",
        "",
        "| N | load | hpcelastic rendezvous | restart round (stop reached all) | lost: closed | lost: silent "
        "| coordinator CPU: rendezvous / restart / idle | coordinator RSS: before / joined / peak "
        "| torch c10d rendezvous | scenario checks |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for h, c in rows:
        load = f"{h['load']:.1f}"
        if "error" in h:
            lines.append(f"| {h['nodes']} | {load} |" + " n/a |" * 6 + f" {_c10d_cell(c)} | {h['error']} |")
            continue
        checks = "all passed" if not h["problems"] else "; ".join(h["problems"][:3])
        if h["reconnects"]:
            checks += f" ({h['reconnects']} agents reconnected: no challenge within 5 s)"
        lines.append(
            f"| {h['nodes']} | {load} | {_f(h['rendezvous_s'])} [{_f(h['worst_rendezvous_s'])}] "
            f"| {_f(h['restart_s'])} [{_f(h['worst_restart_s'])}] ({_f(h['stop_s'])}) "
            f"| {_f(h['lost_closed_s'], digits=3)} ({_f(h['lost_closed_restart_s'])}) "
            f"| {_f(h['lost_silent_s'])} ({_f(h['lost_silent_restart_s'])}) "
            f"| {_f(h['cpu_rendezvous_s'])} / {_f(h['cpu_restart_s'])} / {h['cpu_idle_pct']:.1f}% "
            f"| {h['rss_idle_mb']:.0f} / {h['rss_joined_mb']:.0f} / {h['maxrss_mb']:.0f} MB "
            f"| {_c10d_cell(c)} | {checks} |"
        )
    met = [h for h, _ in rows if h["nodes"] == 1024 and "error" not in h]
    if met:
        ok = met[0]["rendezvous_s"] < TARGET_S and met[0]["restart_s"] < TARGET_S
        lines += [
            "",
            f"Target (1024 agents, median rendezvous and restart round < {TARGET_S:g} s): "
            f"{'met' if ok else 'missed'}.",
        ]
    errs = {e for _, c in rows if c and c["errors"] for e in c["errors"]}
    if errs:
        lines += ["", "torch c10d errors seen: " + "; ".join(sorted(errs)[:3])]
    lines += ["", f"Reproduce: `{command}`"]
    return "\n".join(lines)


def _summary(h: dict[str, Any]) -> str:
    return (
        f"N={h['nodes']}: rendezvous {h['rendezvous_s']:.3f} s, restart {h['restart_s']:.3f} s, "
        f"lost closed {h['lost_closed_s']:.3f} s, silent {h['lost_silent_s']:.2f} s, coordinator CPU "
        f"{h['cpu_total_s']:.2f} s, peak RSS {h['maxrss_mb']:.0f} MB (medians of {h['repeats']}), "
        f"checks: {h['problems'] or 'ok'}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="comma-separated N values")
    ap.add_argument("--procs", type=int, default=4, help="processes for the simulated agents / c10d threads")
    ap.add_argument("--c10d-limit", type=float, default=120.0, help="time limit per c10d rendezvous, s")
    ap.add_argument("--repeats", type=int, default=3, help="hpcelastic runs per size (median reported)")
    ap.add_argument("--no-c10d", action="store_true", help="skip torch's c10d rendezvous")
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = ap.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--sizes {args.sizes!r}: give comma-separated integers, e.g. 64,256,1024")
    if not sizes or min(sizes) < 4:
        ap.error("--sizes: every size must be at least 4")
    if args.repeats < 1:
        ap.error("--repeats: give 1 or more")
    rows = []
    for n in sizes:
        load = os.getloadavg()[0]
        try:
            h = run_hpcelastic_repeated(n, args.repeats, procs=args.procs)
        except BenchError as e:
            h = {"nodes": n, "error": str(e), "problems": [str(e)]}
            print(f"N={n}: hpcelastic: {e}", flush=True)
        else:
            print(_summary(h), flush=True)
        h["load"] = load
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
        rows.append((h, c))
    command = "python bench/control_plane_load.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = markdown(rows, command.strip(), args.procs)
    print(text)
    if not args.no_write:
        update_section("control_plane_load", text)
    return 0 if all(not h["problems"] for h, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
