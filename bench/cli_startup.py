"""Median wall time of `hpcelastic --help` and `hpcelastic submit --dry-run` (targets: 150 ms, 250 ms).

Each command runs in a fresh interpreter with ``-X importtime``; the script fails if torch (or, for
``--help``, Jinja2/PyYAML) was imported. Writes the "cli_startup" section of bench/RESULTS.md.

    python bench/cli_startup.py [--runs 15] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import machine_line, update_section  # noqa: E402

TARGETS_MS = {"--help": 150.0, "submit --dry-run": 250.0}


def imported_modules(stderr: str) -> set[str]:
    """Module names from ``-X importtime`` output."""
    return {
        line.rsplit("|", 1)[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")
    }


def measure(argv: list[str], cwd: str, runs: int, forbidden: tuple[str, ...]) -> list[float]:
    """Wall times in ms of ``python -m hpcelastic ARGV``; asserts on forbidden imports once."""
    check = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "hpcelastic", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stderr[-2000:]
    mods = imported_modules(check.stderr)
    bad = sorted(m for m in mods if m.split(".")[0] in forbidden)
    assert not bad, f"`hpcelastic {' '.join(argv)}` imported {bad[:5]}"
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "hpcelastic", *argv], cwd=cwd, capture_output=True, check=True)
        times.append((time.perf_counter() - start) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "train.py").write_text("print('hi')\n")
        os.environ["XDG_CONFIG_HOME"] = tmp
        cases = {
            "--help": measure(["--help"], tmp, args.runs, ("torch", "jinja2", "yaml")),
            "submit --dry-run": measure(
                ["submit", "--dry-run", "--site", "testbed", "--nodes", "2", "train.py", "--lr", "3e-4"],
                tmp,
                args.runs,
                ("torch",),
            ),
        }
        baseline = measure_python(tmp, args.runs)
    rows = ["| command | median ms | min ms | max ms | target ms | met |", "|---|---|---|---|---|---|"]
    for name, times in cases.items():
        med = statistics.median(times)
        rows.append(
            f"| `hpcelastic {name}` | {med:.0f} | {min(times):.0f} | {max(times):.0f} | "
            f"{TARGETS_MS[name]:.0f} | {'yes' if med < TARGETS_MS[name] else 'no'} |"
        )
    rows.append(f"| `python -c pass` (floor) | {statistics.median(baseline):.0f} | {min(baseline):.0f} | "
                f"{max(baseline):.0f} | | |")  # fmt: skip
    text = "\n".join(
        [
            "## CLI start-up (`bench/cli_startup.py`)",
            "",
            f"{machine_line()} {args.runs} runs each, fresh interpreter per run; torch never imported "
            "(checked with `-X importtime`; `--help` also loads neither Jinja2 nor PyYAML).",
            "",
            *rows,
        ]
    )
    print(text)
    if not args.no_write:
        update_section("cli_startup", text)


def measure_python(cwd: str, runs: int) -> list[float]:
    """The interpreter's own start-up, for reference."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], cwd=cwd, check=True)
        times.append((time.perf_counter() - start) * 1000)
    return times


if __name__ == "__main__":
    main()
