"""Cost of sampling workers for hang detection (hpcelastic.hangs), on a real torch worker.

Measures, against one CPU worker that imports torch and runs matmuls:

* CPU (user + system, of the py-spy process) and wall time of one ``py-spy dump``: non-blocking Python-only
  (the periodic progress sample), blocking, and blocking with ``--native`` (the stack taken on a stall);
* CPU of reading the ``/proc`` counters of the worker and its descendants (in the agent);
* the cost per worker, as % of one core, at the agent's sampling interval (``max(2 s, stall_timeout / 5)``);
* the worker's own slowdown while sampled every second (a pausing dump stops it for its duration).

Prints a markdown section and JSON; ``--write`` also writes the ``hang_detection`` section of
bench/RESULTS.md.

    python bench/hang_detection.py [--dumps 20] [--window 10] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._results import machine_line, update_section  # noqa: E402
from hpcelastic.agent.hangwatch import sample_interval  # noqa: E402
from hpcelastic.hangs import pyspy  # noqa: E402
from hpcelastic.hangs.progress import sample  # noqa: E402

WORKER = """
import sys, time
import torch
torch.set_num_threads(1)
a = torch.randn(256, 256)
print("ready", flush=True)
n, last = 0, time.time()
while True:
    a = torch.tanh(a @ a)
    n += 1
    now = time.time()
    if now - last >= 0.5:
        print(f"{now} {n}", flush=True)
        last = now
"""


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def dump_cost(pid: int, count: int, **kw: Any) -> dict[str, float]:
    """Mean CPU seconds (py-spy process) and wall seconds of one dump."""
    cpu0, wall0 = children_cpu(), time.perf_counter()
    for _ in range(count):
        stack = pyspy.dump(pid, **kw)
        assert stack.error is None, stack.error
    return {"cpu_s": (children_cpu() - cpu0) / count, "wall_s": (time.perf_counter() - wall0) / count}


def counters_cost(pid: int, count: int = 200) -> float:
    cpu0 = time.process_time()
    for _ in range(count):
        pyspy.counters(pid)
    return (time.process_time() - cpu0) / count


class Rate:
    """Reads the worker's ``time iterations`` lines in a thread; ``rate(t0, t1)`` in iterations/s."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.points: list[tuple[float, int]] = []
        self._proc = proc
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            t, n = line.split()
            self.points.append((float(t), int(n)))

    def rate(self, t0: float, t1: float) -> float:
        pts = [p for p in self.points if t0 <= p[0] <= t1]
        return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])


def measure(dumps: int, window: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(textwrap.dedent(WORKER))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            rate = Rate(proc)
            time.sleep(2)  # warm up
            t0 = time.time()
            time.sleep(window)
            base = rate.rate(t0, time.time())

            costs = {
                "nonblocking": dump_cost(proc.pid, dumps, nonblocking=True),
                "blocking": dump_cost(proc.pid, dumps),
                "blocking_native": dump_cost(proc.pid, max(3, dumps // 4), native=True),
            }
            counters_s = counters_cost(proc.pid)
            cpu0 = children_cpu()
            t0 = time.time()
            n = 0
            while time.time() - t0 < window:  # the progress sampler, every second
                sample(proc.pid)
                n += 1
                time.sleep(1.0)
            sampled = rate.rate(t0, time.time())
            t0 = time.time()
            time.sleep(window)
            base = (base + rate.rate(t0, time.time())) / 2  # unsampled before and after
            sample_s = (children_cpu() - cpu0) / n + counters_s
        finally:
            proc.kill()
            proc.wait()
    per_sample = costs["nonblocking"]["cpu_s"] + counters_s
    return {
        "dump": costs,
        "counters_cpu_s": counters_s,
        "sample_cpu_s": sample_s,
        "core_pct_at_interval": {
            str(timeout): 100 * per_sample / sample_interval(timeout) for timeout in (10, 60, 300, 1800)
        },
        "min_interval_for_1pct_s": per_sample / 0.01,
        "worker_rate_base": base,
        "worker_rate_sampled_1s": sampled,
        "worker_slowdown_pct_1s": 100 * (1 - sampled / base),
    }


def markdown(r: dict[str, Any]) -> str:
    d = r["dump"]
    rows = "\n".join(
        f"| {name} | {v['cpu_s'] * 1e3:.1f} | {v['wall_s'] * 1e3:.1f} |"
        for name, v in (
            ("`py-spy dump --nonblocking` (periodic sample)", d["nonblocking"]),
            ("`py-spy dump` (pauses the worker)", d["blocking"]),
            ("`py-spy dump --native` (on a stall)", d["blocking_native"]),
        )
    )
    pct = ", ".join(f"{k} s: {v:.3f} %" for k, v in r["core_pct_at_interval"].items())
    return f"""## Hang detection sampling (`bench/hang_detection.py`)

{machine_line()} One CPU torch worker (256x256 matmul loop, 1 thread).

| what | CPU ms per dump | wall ms per dump |
|---|---|---|
{rows}
| `/proc` counters of the worker and its descendants (in the agent) | {r["counters_cpu_s"] * 1e3:.2f} | |

One progress sample (non-blocking dump + counters) costs {r["sample_cpu_s"] * 1e3:.1f} ms of CPU. At the
agent's interval `max(2 s, stall_timeout / 5)` that is, per worker, as % of one core, by stall timeout:
{pct}. Below 1 % of a core needs an interval of at least {r["min_interval_for_1pct_s"]:.1f} s.
The worker sampled every second ran at {r["worker_rate_sampled_1s"]:.0f} it/s against
{r["worker_rate_base"]:.0f} it/s unsampled (mean of a window before and after;
{r["worker_slowdown_pct_1s"]:+.1f} % slowdown, noise of a shared machine included).
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dumps", type=int, default=20)
    ap.add_argument("--window", type=float, default=10.0)
    ap.add_argument("--write", action="store_true", help="write the section of bench/RESULTS.md")
    args = ap.parse_args()
    if pyspy.pyspy_path() is None:
        sys.exit("py-spy is not installed (pip install py-spy)")
    result = measure(args.dumps, args.window)
    md = markdown(result)
    print(md)
    print(json.dumps(result, indent=2))
    if args.write:
        update_section("hang_detection", md)


if __name__ == "__main__":
    main()
