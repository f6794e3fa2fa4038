"""Failure detection on real (emulated) links: spurious node losses per hour on lossy and slow links, the
detection time of a cut link and of a dead node, and the fencing time, for the old and the new detection.

Needs root and the Slurm testbed script; brings up its own instance ``nbench`` (index 29) with a network
namespace per node (``TESTBED_NETNS=1``) and takes it down at the end (``--keep-up`` keeps it). No Slurm job
runs: each group of nodes gets a coordinator node and four agent nodes, ``bench/_netdet_node.py`` runs the
real ``Coordinator`` there (one per agent and mode, each with a ``JobState`` whose round never ends) and a
real ``CoordinatorClient`` per mode on each agent node. The modes:

* new: the shipped detection (``runtime.Timing``: heartbeat_timeout, then UDP probes for probe_timeout;
  ``HPCELASTIC_HEARTBEAT_TIMEOUT``/``HPCELASTIC_PROBE_TIMEOUT`` change them; a run keeps them in
  timing.json);
* old: the same with ``probe_timeout`` 0, i.e. lost after heartbeat_timeout of TCP silence, as before;
* watch: the shipped timing of a 16,384-node job (heartbeats every 8.2 s) with the peer watch
  (``agent/peerwatch.py``): the two agents of the pair watch each other across the links.

Each group's setting (``testbed.sh netem``) is on every link of the group, the coordinator's too, so a
packet crosses two impaired links (5 % loss per link is ~10 % per path). The groups run at once. Three agent
nodes of a group count spurious losses (coordinator ``node_lost``) and spurious fences (the agent's client
reporting ``Lost``) for the soak time; meanwhile the fourth agent node is the detection subject, turn about:
``cut-link NODE`` (time to ``node_lost``, and to the agent's ``Lost``: the fence) and SIGKILL of its agent
process (its connection closes). Times are from just before the ``testbed.sh cut-link`` call (an upper bound)
or the kill.

    python bench/network_detection.py [--soak-min 10] [--long-soak-min 30] [--trials 6]
    python bench/network_detection.py --summarize DIR     # the table again from a run's logs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))

from _netdet_node import MODES, WATCH_NODES, timing_of  # noqa: E402
from _results import machine_line, update_section  # noqa: E402

from hpcelastic.agent import liveness  # noqa: E402
from hpcelastic.agent.runtime import Timing  # noqa: E402
from tests.testbed import Testbed  # noqa: E402

NODE_SCRIPT = Path(__file__).resolve().parent / "_netdet_node.py"
INSTANCE = "nbench"
INSTANCE_INDEX = 29
SOAK_AGENTS = 3
#: Node layout of a group: the coordinator, the soak agents, the detection subject.
GROUP_SIZE = 1 + SOAK_AGENTS + 1
SUBJECT = SOAK_AGENTS
#: How long a cut lasts: past every detection bound measured here.
CUT_S = 10.0
#: The subject must have been joined in both modes this long before a trial.
SETTLE_S = 3.0
REJOIN_TIMEOUT = 180.0
#: How long a trial waits for the old detection to hold the subject's connection before it goes on without.
OLD_JOIN_TIMEOUT = 45.0
#: A sleep of the stall watcher this much longer than asked: the machine starved its processes of CPU.
STALL_S = 1.0
#: Spurious losses of the new detection listed one by one per setting, at most.
MAX_LISTED = 6
#: How the coordinator's ``node_lost`` reason of a silent agent begins (coordinator._drop_silent; with the
#: peer watch, coordinator._watched_lost).
SILENCE_REASON = ("no heartbeat", "its watcher")
#: A spurious loss this long after a CPU stall (or a stall up to 1 s after it) is counted as starvation.
STARVED_WINDOW = 6.0


@dataclass(frozen=True)
class Setting:
    name: str
    netem: tuple[str, ...]
    #: The issue's target: zero spurious losses over this setting's long soak.
    long: bool = False


SETTINGS = (
    Setting("no fault", ()),
    Setting("loss 1%", ("loss", "1%")),
    Setting("loss 5%", ("loss", "5%")),
    Setting("loss 20%", ("loss", "20%")),
    Setting("delay 50ms ±20ms", ("delay", "50ms", "20ms")),
    Setting("delay 300ms", ("delay", "300ms")),
    Setting("loss 5% + delay 50ms ±20ms", ("loss", "5%", "delay", "50ms", "20ms"), long=True),
)


# ---- pure: logs -> numbers -> table ------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def first_at(
    records: Iterable[Mapping[str, Any]], kind: str, mode: str, agent: int, since: float
) -> float | None:
    """The earliest time (``at``, else ``t``) of a ``kind`` record of (mode, agent) at or after ``since``."""
    times = [
        float(r.get("at", r["t"]))
        for r in records
        if r["kind"] == kind
        and r["mode"] == mode
        and r["agent"] == agent
        and float(r.get("at", r["t"])) >= since
    ]
    return min(times, default=None)


def in_window(
    records: Iterable[Mapping[str, Any]], kind: str, agents: Sequence[int], start: float, end: float
) -> list[Mapping[str, Any]]:
    return [
        r
        for r in records
        if r["kind"] == kind and r["agent"] in agents and start <= float(r.get("at", r["t"])) <= end
    ]


def starved_at(at: float, stalls: Sequence[float]) -> bool:
    """Whether a loss at ``at`` follows a CPU stall closely enough to be starvation, not the network."""
    return any(at - STARVED_WINDOW <= t <= at + 1.0 for t in stalls)


def summarize_group(
    group: Mapping[str, Any],
    coordinator: list[dict[str, Any]],
    agents: Mapping[int, list[dict[str, Any]]],
    stalls: Sequence[float] = (),
) -> dict[str, Any]:
    """Spurious losses and fences of the soak agents in the soak window (and how many follow a CPU stall);
    detection and fence times of the trials; per mode."""
    start, end = group["soak"]
    hours = SOAK_AGENTS * (end - start) / 3600
    soak_agents = list(range(SOAK_AGENTS))
    fences = [r for a in soak_agents for r in agents.get(a, [])]
    out: dict[str, Any] = {
        "setting": group["setting"],
        "soak_s": end - start,
        "soak_from": time.strftime("%H:%M", time.gmtime(start)),
        "agent_hours": hours,
    }
    for mode in MODES:
        if mode not in group.get("modes", ("old", "new")):  # runs before the peer watch had two
            continue
        lost = [r for r in in_window(coordinator, "lost", soak_agents, start, end) if r["mode"] == mode]
        fenced = [r for r in in_window(fences, "fenced", soak_agents, start, end) if r["mode"] == mode]
        detect: dict[str, list[float]] = {"cut": [], "kill": []}
        fence: list[float] = []
        #: Per cut trial: when the agent fenced itself after the coordinator declared it lost (< 0: before).
        fence_lag: list[float] = []
        missed: list[str] = []
        for trial in group["trials"]:
            t0 = float(trial["t0"])
            at = first_at(coordinator, "lost", mode, SUBJECT, t0)
            if at is None or at > t0 + CUT_S:
                missed.append(f"{mode} {trial['kind']} at {time.strftime('%H:%M:%S', time.gmtime(t0))}")
                continue
            detect[trial["kind"]].append(at - t0)
            if trial["kind"] == "cut":
                fenced_at = first_at(agents.get(SUBJECT, []), "fenced", mode, SUBJECT, t0)
                if fenced_at is not None and fenced_at <= t0 + CUT_S:
                    fence.append(fenced_at - t0)
                    fence_lag.append(fenced_at - at)
        out[mode] = {
            "spurious_lost": len(lost),
            "spurious_fenced": len(fenced),
            "spurious_starved": sum(starved_at(float(r.get("at", r["t"])), stalls) for r in lost),
            #: Lost by the coordinator's own detection (silence), not by the agent closing after its fence.
            "spurious_silent": sum(str(r.get("reason", "")).startswith(SILENCE_REASON) for r in lost),
            "lost_per_hour": len(lost) / hours if hours else None,
            "spurious": [
                {
                    "at": float(r.get("at", r["t"])),
                    "agent": r["agent"],
                    "reason": r.get("reason", ""),
                    "starved": starved_at(float(r.get("at", r["t"])), stalls),
                }
                for r in lost + fenced
            ],
            "cut_s": detect["cut"],
            "kill_s": detect["kill"],
            "fence_s": fence,
            "fence_lag": fence_lag,
            "missed_trials": missed,
        }
    return out


def median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def fmt_s(xs: Sequence[float]) -> str:
    """``median (min-max, n)`` in seconds."""
    if not xs:
        return "n/a"
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f}, n={len(xs)})"


def table(summaries: Sequence[Mapping[str, Any]]) -> str:
    """The markdown table: one row per setting and mode."""
    head = (
        "| setting (every link) | detection | soak | spurious node_lost | of which after a CPU stall "
        "| of which by silence | per hour "
        "| spurious fences "
        "| cut link -> node_lost, s | dead agent -> node_lost, s | cut link -> agent fenced, s "
        "| fence - node_lost, max s |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for s in summaries:
        for mode in MODES:
            if mode not in s:
                continue
            m = s[mode]
            per_hour = "n/a" if m["lost_per_hour"] is None else f"{m['lost_per_hour']:.1f}"
            lag = f"{max(m['fence_lag']):+.2f}" if m["fence_lag"] else "n/a"
            rows.append(
                f"| {s['setting']} | {mode_label(mode, s['timing'])} "
                f"| {s['soak_s'] / 60:.0f} min x {SOAK_AGENTS} agents "
                f"from {s['soak_from']} | {m['spurious_lost']} | {m['spurious_starved']} "
                f"| {m['spurious_silent']} | {per_hour} | {m['spurious_fenced']} "
                f"| {fmt_s(m['cut_s'])} | {fmt_s(m['kill_s'])} | {fmt_s(m['fence_s'])} | {lag} |"
            )
    return head + "\n".join(rows) + "\n"


def mode_label(mode: str, timing: Mapping[str, float]) -> str:
    """``new (2+2 s, hb 0.5 s)``: the mode, heartbeat_timeout + probe_timeout, heartbeat interval."""
    if mode == "watch":
        w = timing_of("watch")
        return (
            f"peer watch ({w.beat_timeout:g}+{w.probe_timeout:g} s, beats {w.beat_interval:g} s; "
            f"hb {w.heartbeat_interval:g} s as at {WATCH_NODES:,} nodes)"
        )
    probe = 0.0 if mode == "old" else timing["probe_timeout"]
    return f"{mode} ({timing['heartbeat_timeout']:g}+{probe:g} s, hb {timing['heartbeat_interval']:g} s)"


def markdown(
    summaries: Sequence[Mapping[str, Any]],
    machine: str,
    title: str = "Failure detection on lossy and cut links",
    note: str = "",
) -> str:
    notes = []
    for s in summaries:
        notes += [f"- {s['setting']}: {line}" for line in s.get("notes", [])]
        for mode, label in (("new", "new detection"), ("watch", "peer watch")):
            if mode not in s:
                continue
            spurious = s[mode]["spurious"]
            if len(spurious) > MAX_LISTED:
                starved = sum(r["starved"] for r in spurious)
                notes.append(
                    f"- {label}, {s['setting']}: {len(spurious)} spurious node_lost and fences, "
                    f"{starved} of them after a CPU stall"
                )
                spurious = []
            for r in spurious:
                when = time.strftime("%H:%M:%S", time.gmtime(r["at"]))
                what = (r["reason"] or "fenced") + (" (after a CPU stall)" if r["starved"] else "")
                notes.append(f"- {label}, {s['setting']}: agent {r['agent']} at {when} UTC: {what}")
        missed = [t for mode in MODES if mode in s for t in s[mode]["missed_trials"]]
        if missed:
            notes.append(f"- {s['setting']}: no node_lost within {CUT_S:g} s of trial(s) {', '.join(missed)}")
    return (
        f"## {title} (`bench/network_detection.py`)\n\n"
        + (f"{note}\n\n" if note else "")
        + f"{machine} Slurm testbed instance with a network namespace per node (veth + bridge; this "
        "kernel has no sch_netem: loss is nftables, delay an NFQUEUE process, per direction of each "
        "node's link). No Slurm job: a real `Coordinator` per agent and mode (a `JobState` whose round "
        "never ends) on a coordinator node, a real `CoordinatorClient` per mode on each agent node; each "
        "setting on every link of its group (the coordinator's too: a packet crosses two impaired "
        "links), all settings at once.\n\n"
        "Detection (the column gives heartbeat_timeout + probe_timeout and the heartbeat interval): "
        "**new** = silence for heartbeat_timeout makes a peer suspected, then UDP probes; lost after "
        "probe_timeout more with no answer; **old** = the same code with probe_timeout 0: the "
        "coordinator loses an agent after heartbeat_timeout without a frame, as before; the agent's "
        "lease then also ends after that long without an echo of its heartbeats (a round trip, where "
        "the agent before counted any frame from the coordinator), so its fences overstate the old "
        "agent's on slow links; **peer watch** = a job as large as the label says, as shipped: "
        "heartbeats to the coordinator that slow, and the peer watch (`agent/peerwatch.py`): the pair's "
        "two agents (rank 0 on the coordinator's node, the agent across the links) beat to each other every "
        "0.25 s, a watcher reports silence after 2 s, the coordinator probes for 2.75 s more.\n\n"
        "Spurious node_lost: of the healthy agents during the soak; *after a CPU stall*: within "
        f"{STARVED_WINDOW:g} s after a 0.1 s sleep of the bench overran by {STALL_S:g} s or more, or "
        "after a rank-0 client (on the coordinator's own node, no link between them) fenced itself: "
        "the shared machine, not the link; *by silence*: the coordinator's own detection (the others "
        "are the agent closing its connection after its lease ended first). Spurious fences: the "
        "agent's client reporting the coordinator lost. Detection times: cut and kill trials on a fifth "
        f"node of the group (cut for {CUT_S:g} s; time from just before the `testbed.sh cut-link` "
        "call, an upper bound, or from the SIGKILL of the agent process); median (min-max, n). "
        "*fence - node_lost*: the latest an agent fenced itself relative to the coordinator's "
        "`node_lost` (negative: before). Fence bound: the lease ends no later than the coordinator "
        "declares the agent lost (one check interval aside); its workers are gone "
        f"`fence_delay(kill_grace)` = {liveness.PROBE_INTERVAL:g} + kill_grace + "
        f"{liveness.FENCE_MARGIN:g} s after that.\n\n"
        + table(summaries)
        + ("\n" + "\n".join(notes) + "\n" if notes else "")
    )


# ---- the run ---------------------------------------------------------------------------------------
def group_nodes(instance: str, index: int) -> list[str]:
    return [f"{instance}{GROUP_SIZE * index + i + 1}" for i in range(GROUP_SIZE)]


class Group:
    """One setting's nodes and processes."""

    def __init__(self, tb: Testbed, index: int, setting: Setting, out: Path) -> None:
        self.tb, self.index, self.setting, self.out = tb, index, setting, out
        self.nodes = group_nodes(tb.name, index)
        self.addr = tb.addr(self.nodes[0])
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.trials: list[dict[str, Any]] = []
        #: Per agent: only its log lines from this time on count (a fresh process, a fresh connection).
        self.since: dict[int, float] = {}

    def log_of(self, agent: int | None) -> Path:
        return self.out / (
            f"g{self.index}-coordinator.jsonl" if agent is None else f"g{self.index}-agent{agent}.jsonl"
        )

    def spawn(self, node: str, *argv: str) -> None:
        cmd = self.tb.node_argv(node, sys.executable, str(NODE_SCRIPT), *argv)
        self.procs[node] = subprocess.Popen(
            cmd,
            env=self.tb.script_env(),
            stdin=subprocess.DEVNULL,
            stderr=(self.out / f"{node}.err").open("ab"),
        )

    def spawn_agent(self, agent: int) -> None:
        node = self.nodes[1 + agent]
        self.since[agent] = time.time()
        self.spawn(
            node,
            "agent",
            "--addr",
            self.addr,
            "--host",
            node,
            "--log",
            str(self.log_of(agent)),
            "--agents",
            str(agent),
        )

    def start(self) -> None:
        if self.setting.netem:
            for node in self.nodes:
                self.tb.netem(node, *self.setting.netem)
        runs = self.out / f"g{self.index}-runs"
        coordinator, agent_nodes = self.nodes[0], self.nodes[1:]
        self.spawn(
            coordinator,
            "coordinator",
            "--addr",
            self.addr,
            "--host",
            coordinator,
            "--log",
            str(self.log_of(None)),
            "--runs",
            str(runs),
            "--agents",
            *agent_nodes,
        )
        for agent in range(len(agent_nodes)):
            self.spawn_agent(agent)

    def joined(self, agent: int, settled: float, modes: Sequence[str]) -> bool:
        """Joined in each of ``modes`` at least ``settled`` s ago and not fenced or ended since."""
        records = [r for r in read_jsonl(self.log_of(agent)) if r["t"] >= self.since.get(agent, 0.0)]
        now = time.time()
        for mode in modes:
            last = [r for r in records if r["mode"] == mode and r["kind"] in ("joined", "fenced", "ended")]
            if not last or last[-1]["kind"] != "joined" or now - last[-1]["t"] < settled:
                return False
        return True

    def wait_joined(
        self,
        agents: Iterable[int],
        settled: float = 0.0,
        timeout: float = REJOIN_TIMEOUT,
        modes: Sequence[str] = MODES,
    ) -> None:
        deadline = time.monotonic() + timeout
        pending = set(agents)
        while pending:
            dead = {node: p.returncode for node, p in self.procs.items() if p.poll() not in (None, -9)}
            if dead:
                raise RuntimeError(f"{self.setting.name}: node process(es) ended: {dead} (see NODE.err)")
            pending = {a for a in pending if not self.joined(a, settled, modes)}
            if pending and time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.setting.name}: agent(s) {sorted(pending)} not joined in {timeout:g} s"
                )
            time.sleep(0.5)

    def cut_trial(self) -> None:
        node = self.nodes[1 + SUBJECT]
        t0 = time.time()
        self.tb.cut_link(node, CUT_S)
        self.trials.append({"kind": "cut", "t0": t0, "call_s": time.time() - t0})
        self.since[SUBJECT] = t0
        time.sleep(CUT_S + 0.5)

    def kill_trial(self) -> None:
        node = self.nodes[1 + SUBJECT]
        proc = self.procs[node]
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        if NODE_SCRIPT.name.encode() not in cmdline:
            raise RuntimeError(f"pid {proc.pid} is not the agent process: {cmdline!r}")
        t0 = time.time()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        self.trials.append({"kind": "kill", "t0": t0})
        time.sleep(1.0)
        self.spawn_agent(SUBJECT)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.setting.netem:
            for node in self.nodes:
                self.tb.netem(node, "off")


def run_group(group: Group, soak_s: float, trials: int, results: dict[int, dict[str, Any]]) -> None:
    try:
        group.start()
        # The old detection may never hold a connection on a slow link (its lease needs an echo within
        # heartbeat_timeout): the run goes on once the new one holds; old trials may then count as missed.
        group.wait_joined(range(SOAK_AGENTS + 1), modes=("new",))
        start = time.time()
        for _ in range(trials):
            for trial in (group.cut_trial, group.kill_trial):
                try:
                    group.wait_joined([SUBJECT], settled=SETTLE_S, timeout=OLD_JOIN_TIMEOUT)
                except TimeoutError:
                    group.wait_joined([SUBJECT], settled=SETTLE_S, modes=("new",))
                trial()
        time.sleep(max(0.0, start + soak_s - time.time()))
        results[group.index] = {
            "setting": group.setting.name,
            "soak": [start, time.time()],
            "modes": list(MODES),
            "trials": group.trials,
        }
    except Exception as e:  # reported with the results: the other groups go on
        results[group.index] = {"setting": group.setting.name, "error": repr(e), "trials": group.trials}
    finally:
        group.stop()


def watch_stalls(path: Path, stop: threading.Event) -> None:
    """Log ``time stall`` whenever a 0.1 s sleep overran by more than :data:`STALL_S`."""
    with path.open("a", buffering=1) as f:
        before = time.monotonic()
        while not stop.wait(0.1):
            now = time.monotonic()
            if now - before - 0.1 > STALL_S:
                f.write(f"{time.time():.2f} {now - before - 0.1:.2f}\n")
            before = now


def stall_times(out: Path, groups: Iterable[str]) -> list[float]:
    """When the machine starved the bench of CPU: the stall watcher's stalls, and every fence of a rank-0
    client, which talks to its coordinator on its own node (no link in between)."""
    path = out / "stalls.txt"
    lines = path.read_text().split("\n") if path.exists() else []
    times = [float(line.split()[0]) for line in lines if line.strip() and float(line.split()[1]) >= STALL_S]
    for index in groups:
        for r in read_jsonl(out / f"g{index}-coordinator.jsonl"):
            if r["kind"] == "disturbed" and r.get("message") == "Lost":
                times.append(float(r["t"]))
    return sorted(times)


def summarize(out: Path) -> list[dict[str, Any]]:
    groups = json.loads((out / "groups.json").read_text())
    stalls = stall_times(out, groups)
    summaries = []
    for index, group in sorted(groups.items(), key=lambda kv: int(kv[0])):
        if "soak" not in group:
            print(f"group {index} ({group['setting']}) failed: {group.get('error')}", file=sys.stderr)
            continue
        coordinator = read_jsonl(out / f"g{index}-coordinator.jsonl")
        agents = {a: read_jsonl(out / f"g{index}-agent{a}.jsonl") for a in range(SOAK_AGENTS + 1)}
        summaries.append(summarize_group(group, coordinator, agents, stalls))
    timing = json.loads((out / "timing.json").read_text())
    notes = out / "notes.txt"
    for summary in summaries:
        summary["timing"] = timing
    if summaries and notes.exists():
        summaries[-1]["notes"] = notes.read_text().strip().splitlines()
    (out / "summary.json").write_text(json.dumps(summaries, indent=1))
    return summaries


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--soak-min", type=float, default=10.0, help="soak of each setting but the long one")
    p.add_argument("--long-soak-min", type=float, default=30.0, help="soak of the issue's target setting")
    p.add_argument("--trials", type=int, default=6, help="cut and kill trials per setting, each")
    p.add_argument("--only", nargs="*", help="settings to run (names), all by default")
    p.add_argument("--out", type=Path, help="log directory (default: a new one under /tmp)")
    p.add_argument("--keep-up", action="store_true", help="leave the testbed instance up")
    p.add_argument(
        "--summarize",
        type=Path,
        nargs="+",
        metavar="DIR",
        help="only the table of earlier runs' logs (several: their rows one after the other)",
    )
    p.add_argument("--no-write", action="store_true", help="do not write bench/RESULTS.md")
    p.add_argument(
        "--section",
        nargs=2,
        metavar=("NAME", "TITLE"),
        help="write this section of bench/RESULTS.md instead (e.g. a comparison of runs with --summarize)",
    )
    p.add_argument("--note", default="", help="a paragraph under the section's title")
    p.add_argument("--instance", default=INSTANCE, help="testbed instance name (one of its own)")
    p.add_argument("--index", type=int, default=INSTANCE_INDEX, help="its TESTBED_INDEX")
    args = p.parse_args()
    if args.summarize:
        runs = args.summarize
    else:
        out = args.out or Path(f"/tmp/netdet-{time.strftime('%Y%m%d-%H%M%S')}")
        out.mkdir(parents=True, exist_ok=True)
        settings = [s for s in SETTINGS if not args.only or s.name in args.only]
        tb = Testbed(
            args.instance, {"index": str(args.index), "netns": "1", "nodes": str(GROUP_SIZE * len(settings))}
        )
        tb.up()
        machine = machine_line()
        results: dict[int, dict[str, Any]] = {}
        threads = []
        stop_watch = threading.Event()
        threading.Thread(target=watch_stalls, args=(out / "stalls.txt", stop_watch), daemon=True).start()
        try:
            for index, setting in enumerate(settings):
                soak = 60 * (args.long_soak_min if setting.long else args.soak_min)
                group = Group(tb, index, setting, out)
                t = threading.Thread(target=run_group, args=(group, soak, args.trials, results))
                t.start()
                threads.append(t)
                time.sleep(5)  # their processes start one group at a time
            for t in threads:
                t.join()
        finally:
            stop_watch.set()
            (out / "groups.json").write_text(json.dumps(results, indent=1))
            (out / "machine.txt").write_text(machine)
            timing = Timing.from_environ(os.environ)  # what the node processes ran with
            (out / "timing.json").write_text(json.dumps(dataclasses.asdict(timing)))
            if not args.keep_up:
                tb.down()
        runs = [out]
    summaries = [s for run in runs for s in summarize(run)]
    name, title = args.section or ("network_detection", "Failure detection on lossy and cut links")
    text = markdown(summaries, (runs[0] / "machine.txt").read_text(), title, args.note)
    print(text)
    if not args.no_write:
        update_section(name, text)


if __name__ == "__main__":
    main()
