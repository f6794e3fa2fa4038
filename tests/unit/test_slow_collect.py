"""Collecting the slow-node evidence: the worker's arrivals file, the agent's report, NVML facts."""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from hpcelastic.agent import protocol
from hpcelastic.agent.client import CoordinatorClient
from hpcelastic.agent.messages import FROM_AGENT, Hello, decode, encode
from hpcelastic.agent.workers import worker_env
from hpcelastic.slow import arrivals
from hpcelastic.slow.collect import NodeCollector, gpu_facts, input_share, read_clock
from hpcelastic.slow.sample import HW_SLOWDOWN, SEND_KEEP, GpuFacts, subsample
from hpcelastic.tier import step_clock
from tests.unit.test_workers_env import ROUND, config

REPO = Path(__file__).resolve().parents[2]


def entry(seq: int, ns: int, pg: int = 0, p2p: bool = False) -> dict[str, object]:
    return {"pg_id": pg, "collective_seq_id": 0 if p2p else seq, "time_created_ns": ns, "is_p2p": p2p}


def test_the_file_round_trips_and_a_cut_one_reads_as_none(tmp_path: Path) -> None:
    data = arrivals.encode(12, 5_000, [(0, 1, 100), (1, 7, 200)])
    assert arrivals.decode(data) == arrivals.Dump(12, 5_000, ((0, 1, 100), (1, 7, 200)))
    assert arrivals.decode(data[:-3]) is None and arrivals.decode(b"") is None
    assert arrivals.read(tmp_path / "none") is None


def test_collectives_keeps_the_last_ones_and_no_point_to_point() -> None:
    entries = [entry(i, 10 * i) for i in range(1, 101)] + [entry(0, 5, p2p=True)]
    rows = arrivals.collectives(entries, keep=8)
    assert rows == [(0, i, 10 * i) for i in range(93, 101)]


def test_dumps_every_power_of_two_steps_about_the_interval() -> None:
    assert arrivals.next_every(1e9) == 8  # 1 s steps, 5 s interval: every 8 steps
    assert arrivals.next_every(0.1e9) == 64
    assert arrivals.next_every(30e9) == 1
    assert arrivals.next_every(1.0) == 1 << 16  # capped


def test_subsample_is_bounded_and_nodes_keep_common_collectives() -> None:
    many = [(0, s, s) for s in range(1, 200)]
    few = [(0, s, s) for s in range(150, 200)]
    a, b = subsample(many), subsample(few)
    assert len(a) <= SEND_KEEP and len(b) <= SEND_KEEP
    assert {x[1] for x in a} & {x[1] for x in b}
    assert subsample(few[:10]) == tuple(few[:10])


def test_the_collector_reports_only_whats_new(tmp_path: Path) -> None:
    clock = tmp_path / "clock-0"
    clock.write_bytes(step_clock.LAYOUT.pack(40, 9_000))
    arrivals.path(tmp_path, 0).write_bytes(arrivals.encode(32, 8_000, [(0, s, 100 * s) for s in range(1, 9)]))
    arrivals.path(tmp_path, 1).write_bytes(
        arrivals.encode(32, 8_100, [(0, s, 100 * s + 5) for s in range(1, 9)])
    )
    col = NodeCollector(tmp_path, {0: clock, 1: None})
    msg = col.sample(3, rtt_s=0.001, gpus={1: GpuFacts(1000, 2000)}, throttled={0: 0.75}, now_ns=lambda: 77)
    assert msg is not None and (msg.round, msg.sent_ns, msg.rtt_s) == (3, 77, 0.001)
    r0, r1 = msg.ranks
    assert (r0.rank, r0.steps, r0.step_ns, len(r0.arrivals)) == (0, 40, 9_000, 8)  # the clock's steps
    assert (r1.rank, r1.steps, r1.step_ns) == (1, 32, 8_100)  # no clock: the dump's
    assert r1.gpu == GpuFacts(1000, 2000)
    assert (r0.cpu_throttled, r1.cpu_throttled) == (0.75, None)
    assert decode(FROM_AGENT, encode(msg)) == msg
    assert col.sample(3) is None  # nothing new
    arrivals.path(tmp_path, 1).write_bytes(
        arrivals.encode(40, 9_100, [(0, s, 100 * s) for s in range(5, 13)])
    )
    again = col.sample(3)
    assert again is not None and [r.rank for r in again.ranks] == [1]
    assert [a[1] for a in again.ranks[0].arrivals] == [9, 10, 11, 12]


def test_read_clock(tmp_path: Path) -> None:
    (tmp_path / "c").write_bytes(step_clock.LAYOUT.pack(3, 44))
    assert read_clock(tmp_path / "c") == (3, 44)
    assert read_clock(tmp_path / "missing") is None


class FakeNvml:
    """pynvml's names for what gpu_facts asks; power in milliwatts as NVML reports it."""

    NVML_CLOCK_SM = 1
    NVML_TEMPERATURE_GPU = 0

    def nvmlDeviceGetClockInfo(self, handle: object, kind: int) -> int:  # noqa: N802 - NVML's names
        return 810

    def nvmlDeviceGetMaxClockInfo(self, handle: object, kind: int) -> int:  # noqa: N802
        return 1980

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: object) -> int:  # noqa: N802
        return HW_SLOWDOWN

    def nvmlDeviceGetPowerUsage(self, handle: object) -> int:  # noqa: N802
        return 312_500

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: object) -> int:  # noqa: N802
        return 700_000

    def nvmlDeviceGetTemperature(self, handle: object, sensor: int) -> int:  # noqa: N802
        return 91

    def nvmlDeviceGetPcieReplayCounter(self, handle: object) -> int:  # noqa: N802
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")


def test_gpu_facts_from_nvml() -> None:
    facts = gpu_facts(FakeNvml(), handle=object())
    assert facts == GpuFacts(810, 1980, HW_SLOWDOWN, 312.5, 700.0, 91, None)
    assert facts.degraded() == ["HW slowdown", "SM clock 810/1980 MHz"]
    assert GpuFacts.from_wire(json.loads(json.dumps(facts.wire()))) == facts
    older = SimpleNamespace(
        **{k: getattr(FakeNvml(), k) for k in dir(FakeNvml) if k.startswith(("nvml", "NVML"))}
    )
    del older.nvmlDeviceGetCurrentClocksEventReasons
    older.nvmlDeviceGetCurrentClocksThrottleReasons = lambda handle: 0
    assert gpu_facts(older, handle=None).reasons == 0


def test_input_share() -> None:
    assert input_share([["_next_data", "main"], ["backward", "main"]]) == 0.5
    assert input_share([]) is None


def test_the_agent_asks_workers_for_arrivals_and_a_step_clock_when_detection_is_on(tmp_path: Path) -> None:
    off = worker_env(config(tmp_path), ROUND, 1, tmp_path / "err.json")
    assert arrivals.VARIABLE not in off and step_clock.VARIABLE not in off
    cfg = dataclasses.replace(config(tmp_path), slow_dir=tmp_path / "slow")
    env = worker_env(cfg, ROUND, 1, tmp_path / "err.json")
    assert env[arrivals.VARIABLE] == str(tmp_path / "slow")
    assert env[step_clock.VARIABLE] == str(tmp_path / "slow" / "clock-3")  # global rank 3
    tier = dataclasses.replace(cfg, local_tier=True)
    env = worker_env(tier, ROUND, 1, tmp_path / "err.json")
    assert env[step_clock.VARIABLE] == str(step_clock.clock_path(tmp_path / "ckpt", 1))  # the tier's


WORKER = """
import os, sys, torch, torch.distributed as dist
from hpcelastic.slow import arrivals
assert arrivals.install_from_env()
assert os.environ["TORCH_FR_BUFFER_SIZE"] == str(arrivals.FR_ENTRIES)
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(int(sys.argv[1])):
    opt.zero_grad(); model(torch.randn(2, 4)).sum().backward(); opt.step()
dist.destroy_process_group()
"""


def test_a_worker_writes_its_ddp_collectives_after_its_optimizer_steps(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "RANK": "5", arrivals.VARIABLE: str(tmp_path)}
    subprocess.run([sys.executable, "-c", WORKER, "9"], env=env, check=True, timeout=300)
    dump = arrivals.read(arrivals.path(tmp_path, 5))
    assert dump is not None and dump.steps == 2  # every step at first; then 64 steps apart (fast steps)
    seqs = [seq for _, seq, _ in dump.entries]
    assert seqs and seqs == sorted(seqs) and all(ns > 0 for _, _, ns in dump.entries)


def test_the_agent_client_keeps_its_heartbeats_round_trip() -> None:
    """What a node reports as its link (``SlowSample.rtt_s``): a coordinator that echoes each heartbeat
    80 ms late gives a round trip of at least that."""
    secret = "k" * 64
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn = server.accept()[0]
        conn.sendall(protocol.encode_plain({"t": "challenge", "nonce": "ab" * 16, "v": 1}))
        session, _ = protocol.server_accept_hello(secret, "ab" * 16, protocol.recv_payload(conn))
        conn.sendall(session.encode({"t": "welcome", "round": -1}))
        beat = session.decode(protocol.recv_payload(conn))
        time.sleep(0.08)
        conn.sendall(session.encode({"t": "hb", "echo": beat["sent"]}))
        time.sleep(2)
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    c = CoordinatorClient("127.0.0.1", server.getsockname()[1], secret, on_message=lambda _m: None)
    try:
        c.connect(Hello(node_rank=1, host="n1"), timeout=10)
        assert c.rtt_s is None
        c.start()
        deadline = time.monotonic() + 10
        while c.rtt_s is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert c.rtt_s is not None and 0.08 <= c.rtt_s < 5
    finally:
        c.close()
        server.close()
