"""The lost-time ledger's redone time against the truth in the scripts' own logs, before and after.

Each case (``tests/scripts/truth.py``) is one ``hpcelastic run`` of an unchanged script with one crash: the
shipped DDP example SIGKILLed at step 25 (its heartbeats), the demo's crash at step 15, an unchanged
Hugging Face Accelerate script and an unchanged torch.distributed.checkpoint script (no heartbeats). The
event log of each run is read by the ledger of this checkout ("after") and by the ledger of commit BEFORE
(566b925, the code the issue was filed against: ``git archive`` into a scratch directory) ("before"). The
truth: the example logs the step it resumed from (heartbeat scripts redo at most the step in flight); the
other two log the time of each save and of the crash (redone = crash - save of the resumed step).
Medians of RUNS runs. Writes the ``ledger_truth`` section of bench/RESULTS.md.

    python bench/ledger_truth.py [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._results import machine_line, update_section  # noqa: E402
from tests.scripts import truth as T  # noqa: E402

BEFORE = "566b925"
_OLD_LEDGER = (
    "import json, sys\n"
    "from hpcelastic.rundir import RunDir\n"
    "from hpcelastic.record.ledger import build_ledger\n"
    "(inc,) = build_ledger(RunDir(sys.argv[1]).events()).incidents\n"
    "print(json.dumps({'redone_work_s': inc.redone_work_s, 'redone_steps': inc.redone_steps}))\n"
)


def old_code(scratch: Path) -> Path:
    """The package as it was at BEFORE."""
    out = scratch / "before"
    out.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", BEFORE, "hpcelastic"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return out


def before(old: Path, run_dir: Path) -> dict[str, float | None]:
    proc = subprocess.run(
        [sys.executable, "-c", _OLD_LEDGER, str(run_dir)],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(old), "PATH": "/usr/bin:/bin"},
        cwd=old,  # not this checkout: `python -c` puts the working directory first on sys.path
    )
    return json.loads(proc.stdout)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="ledger-truth-") as tmp:
        scratch = Path(tmp)
        old = old_code(scratch)
        for n, case in enumerate(T.cases(scratch / "timing-0")):
            got: dict[str, list[float]] = {"truth": [], "before": [], "after": []}
            steps: dict[str, list[str]] = {"truth": [], "before": [], "after": []}
            sources = set()
            for k in range(args.runs):
                timing = scratch / f"timing-{n}-{k}"
                case_k = T.cases(timing)[n]
                run_dir = scratch / f"run-{n}-{k}"
                proc = T.run(case_k, run_dir)
                if proc.returncode != 0:
                    raise SystemExit(f"{case.name}: hpcelastic run failed:\n{proc.stderr[-2000:]}")
                truth = T.truth(case_k, run_dir, timing)
                inc, old_inc = T.incident(run_dir), before(old, run_dir)
                if truth.redone_s is not None:
                    got["truth"].append(truth.redone_s)
                steps["truth"].append(str(truth.crashed - truth.resumed - 1))
                got["before"].append(float(old_inc["redone_work_s"] or 0.0))
                steps["before"].append(
                    str(old_inc["redone_steps"] if old_inc["redone_steps"] is not None else "-")
                )
                if inc["redone_work_s"] is not None:
                    got["after"].append(inc["redone_work_s"])
                steps["after"].append(str(inc["redone_steps"] if inc["redone_steps"] is not None else "-"))
                sources.add(str(inc["redone_source"]))
                print(f"{case.name} run {k}: truth {truth}, before {old_inc}, after {inc['redone_work_s']}")
            truth_s = (
                f"{median(got['truth']):.2f} s"
                if got["truth"]
                else f"< 1 step ({T.STEP_TIME:g} s + the save)"
            )
            rows.append(
                f"| {case.name} | {'yes' if case.heartbeats else 'no'} | {truth_s}; "
                f"{'/'.join(sorted(set(steps['truth'])))} full step(s) | "
                f"{median(got['before']):.2f} s ({'/'.join(sorted(set(steps['before'])))} steps) | "
                f"{median(got['after']):.2f} s ({'/'.join(sorted(set(steps['after'])))} steps; "
                f"{', '.join(sorted(sources))}) |"
            )
    text = "\n".join(
        [
            "## Lost-time ledger: redone work against the scripts' own logs (`bench/ledger_truth.py`)",
            "",
            machine_line(),
            f"One `hpcelastic run` per case and run (2 nodes; medians of {args.runs} runs), one crash each. "
            f"'before' is the ledger of commit {BEFORE} over the same event log, 'after' this checkout's. "
            "Truth: the step the restarted round resumed after (the scripts' `resumed` lines) and, for the "
            "scripts without heartbeats, crash time - the time the resumed checkpoint's save returned. "
            "Steps '-': no step count is claimed (the old ledger never had one; the new one only where "
            "heartbeats back it).",
            "",
            "| script | heartbeats | truth (redone) | before | after (evidence) |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )
    print(text)
    update_section("ledger_truth", text)


if __name__ == "__main__":
    main()
