"""``sites check --probe``: one short job step on two nodes of the site's partition
(:mod:`hpcelastic.sitecheck.node` on each, started the way the batch script starts the agents: the site's
modules, setup lines, environment and interpreter) and the judgement of what they report (:func:`judge`,
pure). The probe's directory is made under the site's run root and removed after; nothing is left."""

from __future__ import annotations

import contextlib
import json
import shlex
import shutil
import subprocess
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import hpcelastic
from hpcelastic.jobs.render import site_setup
from hpcelastic.sitecheck.rules import Report
from hpcelastic.tier.settings import TierSettings

#: Seconds the step may wait for its nodes (srun --immediate), and the nodes for each other.
ALLOCATION_WAIT_S = 120
PEER_WAIT_S = 60
JOB_NAME = "hpcelastic-sites-check"


def node_spec(values: Mapping[str, Any], directory: Path, nodes: int) -> dict[str, Any]:
    """What each node checks (the argument of :mod:`hpcelastic.sitecheck.node`)."""
    tier = TierSettings.from_config(values.get)
    return {
        "dir": str(directory),
        "nodes": nodes,
        "iface": values.get("rdzv_interface"),
        "port": values.get("rdzv_port"),
        "tier": tier.to_text() if tier else None,
        "runtime": values.get("container.runtime"),
        "image": values.get("container.image"),
        "gpus": bool(values.get("gpus_per_node")),
        "wait_s": PEER_WAIT_S,
    }


def srun_argv(
    values: Mapping[str, Any], partition: str | None, nodes: int, spec: Mapping[str, Any]
) -> list[str]:
    """The probe's ``srun``: ``nodes`` nodes, one task each, the site's modules, setup and environment."""
    argv = ["srun", f"--nodes={nodes}", "--ntasks-per-node=1", "--time=5", f"--job-name={JOB_NAME}"]
    argv.append(f"--immediate={ALLOCATION_WAIT_S}")
    for option, key in (
        ("partition", None),
        ("account", "account"),
        ("qos", "qos"),
        ("constraint", "constraint"),
        ("exclude", "exclude"),
    ):
        value = partition if key is None else values.get(key)
        if value:
            argv.append(f"--{option}={value}")
    python = values.get("python") or sys.executable
    env = [(k, str(v)) for k, v in (values.get("env") or {}).items()]
    setup = site_setup("sites check --probe", values.get("modules") or [], values.get("setup") or [], env)
    node = f"exec {shlex.quote(python)} -m hpcelastic.sitecheck.node {shlex.quote(json.dumps(spec))}\n"
    return [*argv, "bash", "-c", setup + node]


def run(values: Mapping[str, Any], partition: str | None, nodes: int) -> tuple[list[dict[str, Any]], str]:
    """Run the probe; the nodes' reports and srun's last error line ("" when none)."""
    root = Path(str(values.get("run_root") or "hpcelastic-runs")).expanduser().absolute()
    created = [p for p in (root, *root.parents) if not p.exists()]
    directory = root / f".sites-check-{uuid.uuid4().hex[:8]}"
    directory.mkdir(parents=True)
    try:
        argv = srun_argv(values, partition, nodes, node_spec(values, directory, nodes))
        try:
            proc = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                timeout=ALLOCATION_WAIT_S + PEER_WAIT_S + 60,
                stdin=subprocess.DEVNULL,
            )
        except FileNotFoundError:
            return [], "srun was not found on PATH"
        except subprocess.TimeoutExpired:
            return [], f"srun did not end in {ALLOCATION_WAIT_S + PEER_WAIT_S + 60} s"
        reports = []
        for line in proc.stdout.splitlines():
            try:
                reports.append(json.loads(line))
            except ValueError:
                continue
        if not proc.returncode:
            return reports, ""
        errors = [x.strip() for x in proc.stderr.splitlines() if x.strip()]
        own = [x for x in errors if not x.startswith("srun:")]  # the interpreter's or bash's words first
        return reports, (own or errors or ["srun failed"])[-1]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        for p in created:  # the run root and its parents, when the probe made them
            with contextlib.suppress(OSError):
                p.rmdir()


def judge(
    reports: Sequence[Mapping[str, Any]],
    nodes: int,
    values: Mapping[str, Any],
    srun_error: str,
    report: Report,
) -> None:
    """Findings from the nodes' reports (pure)."""
    python = values.get("python") or sys.executable
    if len(reports) < nodes:
        why = srun_error or "no report"
        if python in why or "hpcelastic" in why or not why.startswith("srun:"):
            report.problem(
                "python", f"the probe ran on {len(reports)} of {nodes} node(s) with {python}: {why}"
            )
        else:  # Slurm's own refusal (no nodes free, an account it will not take)
            report.problem("partition", f"the probe ran on {len(reports)} of {nodes} node(s): {why}")
    names = sorted(r["node"] for r in reports)
    for r in reports:
        node = r["node"]
        if r.get("hpcelastic") != hpcelastic.__version__:
            report.problem(
                "python", f"{node} runs hpcelastic {r.get('hpcelastic')}, this host {hpcelastic.__version__}"
            )
        if str(r.get("torch", "")).startswith("error"):
            report.warning("python", f"{python} on {node} cannot import torch: {r['torch'][7:]}")
        for key, field in (
            ("rdzv_interface", "iface"),
            ("rdzv_port", "port"),
            ("container.runtime", "runtime"),
            ("gpus_per_node", "nvml"),
        ):
            value = str(r.get(field) or "")
            if value.startswith("error"):
                report.problem(key, f"on {node}: {value[7:]}")
        tier = str(r.get("tier") or "")
        if tier.startswith("error"):
            report.problem(
                "checkpoint_tier.local_checkpoint_dir", f"on {node}: {tier[7:].split(': ', 1)[-1]}"
            )
        unseen = [n for n in names if n != node and n not in r.get("seen", [])]
        if unseen:
            report.problem(
                "run_root",
                f"not shared between nodes: {node} does not see what {', '.join(unseen)} wrote there",
            )
        for peer, result in sorted((r.get("reach") or {}).items()):
            if result != "ok":
                report.problem("rdzv_interface", f"{node} cannot reach {peer}: {result[7:]}")
    if values.get("container.runtime"):
        report.notes.append(
            "the probe ran the nodes' own interpreter; in jobs the agents run container.python in the image"
        )
    if reports:
        first = reports[0]
        report.notes.append(
            f"probe on {', '.join(names)}: {first.get('python')}, hpcelastic {first.get('hpcelastic')}, "
            f"torch {first.get('torch')}, rendezvous address {str(first.get('iface'))[4:]}"
        )
