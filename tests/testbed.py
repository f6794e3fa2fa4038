"""Fault injection on the Slurm testbed (scripts/testbed.sh) from tests.

A node of the testbed is a ``slurmd -N NODE`` plus the slurmstepd daemons it started and their
processes. :func:`kill_node` makes a node die as a whole (SIGKILL of all of them at once); Slurm
declares it DOWN after SlurmdTimeout (plus about 20 s, see scripts/testbed.sh) and acts on its jobs;
:func:`revive_node` restarts its slurmd and resumes it. On an instance with a network per node
(setting ``netns="1"``) :class:`Testbed` also cuts, degrades and partitions a node's link.

The instance is named by the node (``node3`` -> the default instance, ``dev2`` -> instance ``dev``)
or explicitly with :class:`Testbed`. Killing a node of the default instance disturbs everyone who
uses it: tests do that only on an instance of their own.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "testbed.sh"
IN_USE: set[str] = set()
"""Instances this process holds through :func:`own_instance` now (a parallel run's workers hold others)."""
#: The Slurm command wrappers of an instance of another release (scripts/testbed.sh ``TESTBED_SLURM``).
WRAPPERS = re.compile(r"/hpcelastic-testbed-[a-z0-9]+/bin$")


@dataclass
class Testbed:
    """One testbed instance; ``settings`` are TESTBED_* variables for its ``up`` (e.g. SLURMD_TIMEOUT="5")."""

    __test__ = False  # not a pytest test class

    name: str = "default"
    settings: dict[str, str] = field(default_factory=dict)

    def script_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TESTBED_") and k != "SLURM_CONF"}
        env["TESTBED_NAME"] = self.name
        env.update({f"TESTBED_{k.upper()}": str(v) for k, v in self.settings.items()})
        return env

    def run(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """``scripts/testbed.sh ARGS`` for this instance."""
        argv = ["bash", str(SCRIPT), *args]
        proc = subprocess.run(argv, env=self.script_env(), capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"testbed.sh {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc

    def exports(self) -> dict[str, str]:
        """``testbed.sh env``: ``SLURM_CONF``, and for a Slurm of its own root (``slurm="24.11"``) the
        directory of its command wrappers, which goes first on ``PATH``."""
        found = {}
        for line in self.run("env").stdout.splitlines():
            m = re.fullmatch(r'export (\w+)="?(.*?)(?::\$PATH)?"?', line.strip())
            if m and "$(" not in m.group(2):  # not the shell code that cleans PATH (env() does it)
                found[m.group(1)] = m.group(2)
        return found

    @property
    def slurm_conf(self) -> str:
        return self.exports()["SLURM_CONF"]

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with Slurm's commands (sbatch, squeue,
        scontrol, ...) talking to this instance: its ``SLURM_CONF``, and its release's commands first
        on ``PATH`` (the host's 22.05 clients cannot talk to a 24.11 slurmctld)."""
        env = dict(os.environ if base is None else base)
        exports = self.exports()
        env["SLURM_CONF"] = exports["SLURM_CONF"]
        # Another instance's wrappers would run another release's commands.
        path = [p for p in env.get("PATH", "").split(":") if not WRAPPERS.search(p)]
        env["PATH"] = ":".join([exports["PATH"], *path] if "PATH" in exports else path)
        return env

    def slurm_env(self) -> dict[str, str]:
        """An environment whose Slurm commands (sbatch, squeue, scontrol) talk to this instance."""
        return self.env()

    def slurm(self, *argv: str, check: bool = True, timeout: float = 60) -> str:
        """Run a Slurm command against this instance; its stdout."""
        env = self.slurm_env()
        proc = subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr}")
        return proc.stdout

    def up(self) -> None:
        self.run("up")

    def down(self) -> None:
        self.run("down")

    def daemon_pids(self) -> dict[str, int | None]:
        """``{"slurmctld": pid, "NODE": slurmd pid, ...}`` from ``testbed.sh status`` (None: not running)."""
        out = self.run("status", check=False).stdout
        pids: dict[str, int | None] = {}
        for line in out.splitlines():
            m = re.match(r"^slurmctld (\d+|not running)", line)
            m = m or re.match(r"^slurmd (\S+) (\d+|not running)", line)
            if not m:
                continue
            key, val = ("slurmctld", m.group(1)) if line.startswith("slurmctld") else (m.group(1), m.group(2))
            pids[key] = int(val) if val.isdigit() else None
        return pids

    def node_pids(self, node: str) -> list[int]:
        """The pids :meth:`kill_node` would kill (the node's slurmd and its job processes)."""
        return [int(p) for p in self.run("pids", node).stdout.split()]

    def kill_node(self, node: str) -> list[int]:
        """SIGKILL the node's slurmd and every process of its jobs at once; the pids killed."""
        return [int(p) for p in self.run("kill-node", node).stdout.split()]

    def revive_node(self, node: str) -> None:
        """Restart the node's slurmd and ``scontrol update State=RESUME`` it."""
        self.run("revive-node", node)

    # Network faults: instances up with settings {"netns": "1"} only (scripts/testbed.sh says how).

    def addr(self, node: str) -> str:
        """The node's address (its NodeAddr; 198.18.I.i in a netns instance)."""
        return self.run("addr", node).stdout.strip()

    def node_argv(self, node: str, *argv: str) -> list[str]:
        """The command line that runs ``argv`` in the node's network namespace (``testbed.sh exec``)."""
        return ["bash", str(SCRIPT), "exec", node, *argv]

    def cut_link(self, node: str, seconds: float = 0) -> str:
        """Drop every packet between the node and anything else, both ways, for ``seconds`` (0: until
        :meth:`heal`); returns at once, a detached process restores the link. The testbed's line."""
        return self.run("cut-link", node, f"{seconds:g}").stdout.strip()

    def netem(self, node: str, *args: str) -> str:
        """``tc netem ARGS`` on the node's link, both directions (``"off"`` removes it). Without
        sch_netem in the kernel only ``loss P%`` and ``delay TIME [JITTER]`` are emulated; else raises."""
        return self.run("netem", node, *args).stdout.strip()

    def partition(self, node: str, *peers: str) -> str:
        """The node and each peer (a node, or ``slurmctld``) exchange no packets, both ways."""
        return self.run("partition", node, *peers).stdout.strip()

    def flap(self, node: str, down_s: float, up_s: float, count: int) -> str:
        """Cut the link for ``down_s``, restore it for ``up_s``, ``count`` times, in the background."""
        return self.run("flap", node, f"{down_s:g}", f"{up_s:g}", str(count)).stdout.strip()

    def heal(self, node: str) -> str:
        """Undo every fault of the node now (cut, netem, partition, flap)."""
        return self.run("heal", node).stdout.strip()

    def node_state(self, node: str) -> str:
        """The node's state from ``scontrol show node``, lowercase: ``idle``, ``down+not_responding``..."""
        out = self.slurm("scontrol", "show", "node", "-o", node, check=False)
        m = re.search(r"\bState=(\S+)", out)
        return m.group(1).lower() if m else ""

    def wait_node_state(self, node: str, prefixes: tuple[str, ...], timeout: float = 120) -> float:
        """Wait until the node's state starts with one of ``prefixes``; the seconds it took."""
        t0 = time.monotonic()
        state = ""
        while time.monotonic() - t0 < timeout:
            state = self.node_state(node)
            if state.startswith(prefixes):
                return time.monotonic() - t0
            time.sleep(0.2)
        raise AssertionError(f"node {node} not in {prefixes} after {timeout:.0f} s: {state!r}")


def instance_of(node: str) -> Testbed:
    """The instance a node belongs to: ``nodeN`` -> default, ``NAMEN`` -> instance NAME."""
    prefix = re.sub(r"\d+$", "", node)
    return Testbed("default" if prefix == "node" else prefix)


def kill_node(name: str) -> list[int]:
    """The node dies as a whole (slurmd and all its job processes, SIGKILL at once); the pids killed."""
    return instance_of(name).kill_node(name)


def revive_node(name: str) -> None:
    """Restart the node's slurmd and resume it in Slurm."""
    instance_of(name).revive_node(name)


@contextlib.contextmanager
def own_instance(name: str, settings: Mapping[str, str]) -> Iterator[Testbed]:
    """An instance of one test module's own: brought up fresh (a leftover of an interrupted run may have
    other settings), one user at a time (a lock file), its jobs cancelled and taken down at the end."""
    lock_path = Path(f"/var/lock/hpcelastic-testbed-{name}.lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        inst = Testbed(name, dict(settings))
        inst.down()
        inst.up()
        IN_USE.add(name)
        try:
            yield inst
        finally:
            IN_USE.discard(name)
            inst.slurm("scancel", "-u", str(os.getuid()), check=False)
            inst.down()
