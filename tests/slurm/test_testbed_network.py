"""The testbed's network per node (TESTBED_NETNS=1) and its network faults, with real traffic.

One instance of this module's own (``net``: 3 nodes, 198.18.19.i, task/affinity with 2 CPUs per
node, net3 left out of /etc/hosts). A small agent runs in each node's network namespace: it answers
UDP datagrams on ECHO_PORT and, on request, probes another address (UDP echo, or a TCP connect to
slurmctld's port) from inside its node, so every check is packets between namespaces.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.testbed import Testbed, own_instance

pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group(name="net")]

NAME = "net"
INDEX = 19
NODES = [f"{NAME}{i}" for i in (1, 2, 3)]
SETTINGS = {
    "index": str(INDEX),
    "nodes": str(len(NODES)),
    "netns": "1",
    "task_plugin": "task/affinity",
    "cpus_per_node": "2",  # task/affinity binds to host CPU ids: no more than the host has
    "unresolvable": "net3",
}
CTLD_ADDR = f"198.18.{INDEX}.254"
CTLD_PORT = 6817 + 100 * (INDEX - 1)
ECHO_PORT = 9719

AGENT = r"""
import socket, sys, threading

echo = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
echo.bind(("0.0.0.0", int(sys.argv[1])))

def serve():
    while True:
        data, peer = echo.recvfrom(64)
        echo.sendto(data, peer)

threading.Thread(target=serve, daemon=True).start()
print("ready", flush=True)
for seq, line in enumerate(sys.stdin):
    kind, host, port, count, timeout = line.split()
    ok = 0
    if kind == "tcp":
        try:
            socket.create_connection((host, int(port)), timeout=float(timeout)).close()
            ok = 1
        except OSError:
            pass
    else:
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        probe.settimeout(float(timeout))
        for i in range(int(count)):
            token = b"%d-%d" % (seq, i)
            probe.sendto(token, (host, int(port)))
            try:
                while probe.recv(64) != token:
                    pass
                ok += 1
            except OSError:
                pass
        probe.close()
    print(ok, flush=True)
"""


class Agent:
    """The agent in one node's namespace."""

    def __init__(self, tb: Testbed, node: str) -> None:
        argv = tb.node_argv(node, sys.executable, "-c", AGENT, str(ECHO_PORT))
        self.proc = subprocess.Popen(
            argv, env=tb.script_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout and self.proc.stdout.readline().strip() == "ready"

    def ask(self, kind: str, host: str, port: int, count: int, timeout: float) -> int:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(f"{kind} {host} {port} {count} {timeout}\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


class Net:
    """The instance and its agents: ``echoes(a, b)`` counts the datagrams node ``a`` got back from ``b``."""

    def __init__(self, tb: Testbed) -> None:
        self.tb = tb
        self.addrs = {node: tb.addr(node) for node in NODES}
        self.agents = {node: Agent(tb, node) for node in NODES}

    def echoes(self, src: str, dst: str, count: int = 5, timeout: float = 0.2) -> int:
        return self.agents[src].ask("udp", self.addrs[dst], ECHO_PORT, count, timeout)

    def reaches_slurmctld(self, node: str) -> bool:
        return self.agents[node].ask("tcp", CTLD_ADDR, CTLD_PORT, 1, 0.5) == 1

    def restart_agent(self, node: str) -> None:
        self.agents[node].stop()
        self.agents[node] = Agent(self.tb, node)

    def wait_echoes(self, src: str, dst: str, timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while self.echoes(src, dst, 1) != 1:
            assert time.monotonic() < deadline, f"{src} -> {dst}: no echo after {timeout} s"


@pytest.fixture(scope="module")
def net() -> Iterator[Net]:
    with own_instance(NAME, SETTINGS) as tb:
        state = Net(tb)
        try:
            yield state
        finally:
            for agent in state.agents.values():
                agent.stop()


@pytest.fixture
def healed(net: Net) -> Iterator[Net]:
    """The instance with no fault left behind by a test."""
    yield net
    for node in NODES:
        net.tb.heal(node)


def _netns_id(tb: Testbed, node: str) -> str:
    argv = tb.node_argv(node, "readlink", "/proc/self/ns/net")
    proc = subprocess.run(argv, env=tb.script_env(), capture_output=True, text=True, check=True)
    return proc.stdout.strip()


def test_each_node_its_own_address_and_namespace(net: Net) -> None:
    """198.18.19.i per node (NodeAddr, /etc/hosts but for net3), each slurmd in the node's namespace."""
    tb = net.tb
    assert [tb.addr(n) for n in NODES] == [f"198.18.{INDEX}.{i}" for i in (1, 2, 3)]
    conf = Path(tb.slurm_conf).read_text()
    assert f"SlurmctldHost={os.uname().nodename.split('.')[0]}({CTLD_ADDR})" in conf
    assert "TaskPlugin=task/affinity" in conf
    assert socket.gethostbyname("net1") == tb.addr("net1")
    with pytest.raises(OSError):
        socket.gethostbyname("net3")
    ours = os.readlink("/proc/self/ns/net")
    ids = {n: _netns_id(tb, n) for n in NODES}
    assert len(set(ids.values())) == len(NODES) and ours not in ids.values()
    for node, pid in tb.daemon_pids().items():
        if node in NODES:
            assert pid and os.readlink(f"/proc/{pid}/ns/net") == ids[node]


def test_nodes_reach_each_other_and_slurmctld(net: Net) -> None:
    for src in NODES:
        assert net.reaches_slurmctld(src)
        for dst in NODES:
            assert net.echoes(src, dst) == 5, (src, dst)


def test_sinfo_idle_and_srun_across_nodes(net: Net) -> None:
    tb = net.tb
    states = tb.slurm("sinfo", "-h", "-N", "-o", "%N %T").split("\n")
    assert sorted(line for line in states if line) == [f"{n} idle" for n in NODES]
    out = tb.slurm("srun", "-N3", "bash", "-c", "echo $SLURMD_NODENAME $(readlink /proc/self/ns/net)")
    seen = dict(line.split() for line in out.splitlines())
    assert seen == {n: _netns_id(tb, n) for n in NODES}


def test_task_affinity_binds_each_task(net: Net) -> None:
    """task/affinity: two 1-CPU tasks on a 2-CPU node get one CPU each; a 2-CPU task gets both."""
    show = "import os; print(sorted(os.sched_getaffinity(0)))"
    out = net.tb.slurm("srun", "-N1", "-w", "net1", "-n2", "-c1", sys.executable, "-c", show)
    assert sorted(out.split()) == ["[0]", "[1]"]
    out = net.tb.slurm("srun", "-N1", "-w", "net1", "-n1", "-c2", sys.executable, "-c", show)
    assert out.split() == ["[0,", "1]"]


def test_cut_link_stops_traffic_then_heals_itself(healed: Net) -> None:
    net = healed
    line = net.tb.cut_link("net2", 3)
    assert line.startswith("cut-link net2:") and "for 3 s" in line
    assert net.echoes("net1", "net2", count=2) == 0
    assert net.echoes("net2", "net3", count=2) == 0
    assert not net.reaches_slurmctld("net2")
    assert net.echoes("net1", "net3") == 5, "only net2's link is cut"
    net.wait_echoes("net1", "net2")
    net.wait_echoes("net2", "net3")  # ARP entries that failed during the cut resolve again
    assert net.echoes("net2", "net3") == 5 and net.reaches_slurmctld("net2")


def test_partition_blocks_only_the_pair(healed: Net) -> None:
    net = healed
    net.tb.partition("net2", "net1")
    assert net.echoes("net1", "net2") == 0 and net.echoes("net2", "net1") == 0
    assert net.echoes("net2", "net3") == 5 and net.echoes("net3", "net1") == 5
    assert net.reaches_slurmctld("net2") and net.reaches_slurmctld("net1")


def test_netem_loss_loses_some_datagrams(healed: Net) -> None:
    """20 % each way: about 64 % of round trips come back."""
    net = healed
    net.tb.netem("net2", "loss", "20%")
    back = net.echoes("net1", "net2", count=100, timeout=0.05)
    assert 30 < back < 95, back
    assert net.tb.netem("net2", "off") == "netem net2: off"
    assert net.echoes("net1", "net2", count=50) == 50


def test_netem_delay_holds_packets_back(healed: Net) -> None:
    """200 ms each way: no echo within 0.1 s, every echo within 1.5 s; off: prompt again."""
    net = healed
    net.tb.netem("net2", "delay", "200ms", "10ms")
    assert net.echoes("net1", "net2", count=2, timeout=0.1) == 0
    assert net.echoes("net1", "net2", count=3, timeout=1.5) == 3
    net.tb.netem("net2", "off")
    assert net.echoes("net1", "net2", count=5, timeout=0.1) == 5


def test_flap_cuts_and_restores_repeatedly(healed: Net) -> None:
    net = healed
    net.tb.flap("net3", 0.5, 0.5, 3)
    outcomes = set()
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        outcomes.add(net.echoes("net1", "net3", count=1, timeout=0.05))
    assert outcomes == {0, 1}
    net.wait_echoes("net1", "net3")


def test_heal_clears_every_fault(net: Net) -> None:
    tb = net.tb
    tb.cut_link("net3")
    tb.partition("net3", "net1", "slurmctld")
    tb.netem("net3", "loss", "50%")
    assert net.echoes("net2", "net3") == 0
    assert tb.heal("net3").startswith("heal net3:")
    net.wait_echoes("net1", "net3")
    net.wait_echoes("net2", "net3")
    assert net.echoes("net1", "net3", count=50) == 50 and net.echoes("net2", "net3", count=50) == 50
    assert net.reaches_slurmctld("net3")
    tb.flap("net3", 30, 1, 1)
    assert net.echoes("net2", "net3") == 0
    tb.heal("net3")
    net.wait_echoes("net2", "net3")
    assert net.echoes("net2", "net3") == 5


def test_faults_need_a_netns_instance() -> None:
    """The default instance has no network per node: a one-line error, exit 2, nothing done."""
    proc = Testbed().run("cut-link", "node1", "1", check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_kill_and_revive_namespaced_node(net: Net) -> None:
    """kill-node kills everything in the node's namespace (its job, our agent); revive-node
    restarts its slurmd there and it runs steps again."""
    tb = net.tb
    job = tb.slurm("sbatch", "--parsable", "-o", "/dev/null", "-w", "net3", "--wrap", "srun sleep 300")
    job = job.strip()
    deadline = time.monotonic() + 20
    while len(tb.node_pids("net3")) < 7:  # slurmd, agent, batch stepd, script, srun, step stepd, sleep
        assert time.monotonic() < deadline, tb.node_pids("net3")
        time.sleep(0.3)
    agent = net.agents["net3"].proc
    killed = tb.kill_node("net3")
    assert agent.pid in killed
    assert tb.daemon_pids()["net3"] is None and tb.node_pids("net3") == []
    assert agent.wait(5) == -9
    tb.slurm("scancel", job)
    tb.revive_node("net3")
    pid = tb.daemon_pids()["net3"]
    assert pid and os.readlink(f"/proc/{pid}/ns/net") == _netns_id(tb, "net3")
    tb.wait_node_state("net3", ("idle",), 60)
    assert tb.slurm("srun", "-w", "net3", "printenv", "SLURMD_NODENAME").strip() == "net3"
    net.restart_agent("net3")
    assert net.echoes("net1", "net3") == 5
