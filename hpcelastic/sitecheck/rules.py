"""A site's settings against what its cluster says (:class:`~hpcelastic.sitecheck.facts.ClusterFacts`):
pure, one :class:`Finding` per thing to change, each naming the site key (or the ``slurm.conf`` parameter)
to change, and notes on what was not checked or only told.

A *problem* makes jobs fail or lose work (a partition that does not exist, more GPUs than any node has, a
grace period the signal cannot give); a *warning* is an assumption of hpcelastic the cluster breaks in a way
that costs something (a MessageTimeout above SlurmdTimeout: a node that answers late is declared DOWN).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hpcelastic.jobs.slurm import EXPEDITE_RELEASE
from hpcelastic.jobs.slurm_output import gpu_count, seconds_of
from hpcelastic.parse import parse_time
from hpcelastic.reasons import Named
from hpcelastic.sitecheck.facts import ClusterFacts

#: Slurm releases hpcelastic is tested on (22.05 and 24.11 on the testbed; 25.11 from its release notes).
TESTED_RELEASES = ((22, 5), (25, 11))
#: Seconds the agents need after the grace period to requeue the job before Slurm kills it.
REQUEUE_MARGIN_S = 15
UNLIMITED = frozenset({"UNLIMITED", "NONE", "INFINITE", ""})


class Severity(Named):
    PROBLEM = "problem"
    WARNING = "warning"


@dataclass(frozen=True)
class Finding:
    """One thing to change: ``key`` (a site key, or ``slurm.conf X``) and why."""

    key: str
    severity: Severity
    text: str

    def line(self) -> str:
        return f"{self.severity}: {self.key}: {self.text}"


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    partition: str | None = None  # where jobs go: the site's, else the cluster's default (None: neither)

    def problem(self, key: str, text: str) -> None:
        self.findings.append(Finding(key, Severity.PROBLEM, text))

    def warning(self, key: str, text: str) -> None:
        self.findings.append(Finding(key, Severity.WARNING, text))


def check(values: Mapping[str, Any], facts: ClusterFacts) -> Report:
    """Every rule below over the site's merged ``values`` (flat dotted keys)."""
    report = Report()
    partition = report.partition = _partition(values, facts, report)
    nodes = facts.nodes_of(partition)
    _accounting(values, facts, report)
    _constraint_and_exclude(values, facts, nodes, report)
    _time(values, facts.partitions.get(partition or ""), report)
    _gpus(values, facts, nodes, partition, report)
    _preemption(values, facts, partition, report)
    _slurm_config(values, facts, report)
    python = values.get("python") or sys.executable
    report.notes.append(f"the nodes run {python} (site key python; --probe checks it there)")
    return report


def _partition(values: Mapping[str, Any], facts: ClusterFacts, report: Report) -> str | None:
    """The partition jobs go to (the site's, else the cluster's default), checked to exist and be up."""
    name = values.get("partition")
    if name is None:
        name = facts.default_partition()
        if name is None:
            report.problem(
                "partition",
                f"not set, and the cluster has no default partition: set one of {_list(facts.partitions)}",
            )
            return None
    elif name not in facts.partitions:
        report.problem(
            "partition", f"no partition {name!r} on this cluster; it has {_list(facts.partitions)}"
        )
        return None
    state = facts.partitions[name].get("State", "UP")
    if state != "UP":
        report.warning("partition", f"partition {name} is {state}: jobs wait until an admin sets it UP")
    return name


def _accounting(values: Mapping[str, Any], facts: ClusterFacts, report: Report) -> None:
    for key, known in (("account", facts.accounts), ("qos", facts.qos)):
        name = values.get(key)
        if name is None:
            continue
        if known is None:
            report.notes.append(
                f"{key} {name!r} not checked: sacctmgr does not answer (no accounting database)"
            )
        elif str(name).lower() not in known:
            report.problem(key, f"no {key} {name!r} in sacctmgr; it knows {_list(known)}")


def _constraint_and_exclude(
    values: Mapping[str, Any], facts: ClusterFacts, nodes: Mapping[str, Mapping[str, str]], report: Report
) -> None:
    constraint = values.get("constraint")
    if constraint:
        features = {
            f
            for r in nodes.values()
            for f in r.get("AvailableFeatures", "").split(",")
            if f not in ("", "(null)")
        }
        wanted = [w for w in _words(constraint) if w]
        missing = [w for w in wanted if w not in features]
        if missing:
            have = _list(features) if features else "none"
            report.problem(
                "constraint",
                f"no node of the partition has feature(s) {', '.join(missing)}; they have {have}",
            )
    exclude = values.get("exclude")
    if exclude:
        import hostlist

        unknown = [n for n in hostlist.expand_hostlist(exclude) if n not in facts.nodes]
        if unknown:
            report.warning("exclude", f"no node(s) {hostlist.collect_hostlist(unknown)} on this cluster")


def _words(expression: str) -> list[str]:
    """The feature names of a ``--constraint`` expression (``a&b|c``, ``[a*2&b]``; counts left out)."""
    out, word = [], ""
    for ch in expression + "&":
        if ch.isalnum() or ch in "_-.":
            word += ch
        else:
            if word and not word.isdigit():
                out.append(word)
            word = ""
    return out


def _time(values: Mapping[str, Any], partition: Mapping[str, str] | None, report: Report) -> None:
    lead, grace = int(values.get("signal.lead_time") or 0), int(values.get("requeue.grace_period") or 0)
    if lead < grace + REQUEUE_MARGIN_S:
        report.problem(
            "signal.lead_time",
            f"{lead} s before the time limit, but workers get {grace} s to checkpoint after it "
            f"(requeue.grace_period) and the requeue needs about {REQUEUE_MARGIN_S} s more: set at least "
            f"{grace + REQUEUE_MARGIN_S}",
        )
    if partition is None:
        return
    max_time = partition.get("MaxTime", "UNLIMITED")
    limit = values.get("time") or (
        None if partition.get("DefaultTime", "NONE") in UNLIMITED else partition["DefaultTime"]
    )
    if limit is None:
        return
    seconds = _seconds(limit)
    if max_time not in UNLIMITED and seconds is not None and (most := _seconds(max_time)) and seconds > most:
        report.problem(
            "time", f"{limit} is above partition {partition.get('PartitionName')}'s MaxTime {max_time}"
        )
    if seconds is not None and seconds <= lead:
        report.problem(
            "signal.lead_time",
            f"{lead} s is not shorter than the time limit {limit}: the signal would come at once",
        )


def _seconds(text: str) -> int | None:
    try:
        return parse_time(text)
    except ValueError:
        return None


def _gpus(
    values: Mapping[str, Any],
    facts: ClusterFacts,
    nodes: Mapping[str, Mapping[str, str]],
    partition: str | None,
    report: Report,
) -> None:
    wanted = max(int(values.get("gpus_per_node") or 0), int(values.get("max_gpus_per_node") or 0))
    if not wanted or not nodes:
        return
    most = max(gpu_count(r.get("Gres")) for r in nodes.values())
    key = "max_gpus_per_node" if values.get("max_gpus_per_node") else "gpus_per_node"
    if most == 0:
        report.problem(key, f"{wanted} GPUs a node, but no node of partition {partition} has a gpu GRES")
    elif wanted > most:
        report.problem(
            key, f"{wanted} GPUs a node, but nodes of partition {partition} have at most {most} (Gres)"
        )
    request = values.get("gpu_request")
    if "gpu" not in facts.config.get("GresTypes", "").split(","):
        report.problem("gpu_request", "slurm.conf has no GresTypes=gpu: Slurm grants no GPUs to jobs")
    elif request == "gpus-per-node" and "cons_tres" not in facts.config.get("SelectType", ""):
        report.problem(
            "gpu_request",
            f"--gpus-per-node needs select/cons_tres (this cluster: {facts.config.get('SelectType')}): "
            "set gres",
        )


def _preemption(
    values: Mapping[str, Any], facts: ClusterFacts, partition: str | None, report: Report
) -> None:
    if facts.config.get("PreemptType", "preempt/none") == "preempt/none" or partition is None:
        return
    record = facts.partitions[partition]
    mode = (record.get("PreemptMode") or facts.config.get("PreemptMode", "OFF")).upper()
    if "CANCEL" in mode and values.get("requeue.mode") == "requeue":
        report.warning(
            "requeue.mode",
            f"partition {partition}'s PreemptMode is {mode}: a preempted job is cancelled, not requeued; set "
            "resubmit (hpcelastic then submits it again)",
        )
    if "REQUEUE" not in mode and "CANCEL" not in mode:
        return
    grace_time = seconds_of(record.get("GraceTime")) or 0
    grace = int(values.get("requeue.grace_period") or 0)
    if grace_time == 0:
        report.warning(
            "requeue.grace_period",
            f"partition {partition} has GraceTime=0: a preempted job is killed at once, with no time to "
            f"checkpoint (ask for a GraceTime of at least {grace + REQUEUE_MARGIN_S} s)",
        )
    elif grace_time < grace + REQUEUE_MARGIN_S:
        report.warning(
            "requeue.grace_period",
            f"{grace} s to checkpoint, but partition {partition} kills a preempted job {grace_time} s after "
            f"the signal (GraceTime): set at most {max(0, grace_time - REQUEUE_MARGIN_S)}",
        )
    # PreemptParameters=send_user_signal from 23.02; SlurmctldParameters=preempt_send_user_signal in 22.05.
    said = facts.config.get("PreemptParameters", "") + facts.config.get("SlurmctldParameters", "")
    if "send_user_signal" not in said:
        report.notes.append(
            "preemption sends SIGTERM to every process (no PreemptParameters=send_user_signal): the workers "
            f"get no {values.get('signal.name')} first"
        )


def _slurm_config(values: Mapping[str, Any], facts: ClusterFacts, report: Report) -> None:
    message, slurmd = (
        seconds_of(facts.config.get("MessageTimeout")),
        seconds_of(facts.config.get("SlurmdTimeout")),
    )
    if message and slurmd and message >= slurmd:
        report.warning(
            "slurm.conf MessageTimeout",
            f"{message} s is not below SlurmdTimeout {slurmd} s: a node that answers a ping late is set "
            "DOWN, and its jobs requeued",
        )
    if facts.config.get("JobRequeue") == "0":
        report.notes.append(
            "JobRequeue=0: fine, hpcelastic submits with --requeue (or --no-requeue to resubmit)"
        )
    if facts.release is not None:
        version = f"{facts.release[0]}.{facts.release[1]:02d}"
        if facts.release < TESTED_RELEASES[0] or facts.release > TESTED_RELEASES[1]:
            report.warning("slurm", f"Slurm {version}: hpcelastic is tested on 22.05 to 25.11")
        if values.get("requeue.expedite") and facts.release < EXPEDITE_RELEASE:
            report.notes.append(
                f"requeue.expedite: Slurm {version} has no expedited requeue; a plain one is used"
            )
    plugins = facts.config.get("TaskPlugin", "")
    if "affinity" not in plugins and "cgroup" not in plugins:
        report.notes.append(
            f"TaskPlugin={plugins or 'none'}: Slurm binds no CPUs; each agent splits its node's CPUs among "
            "its workers"
        )


def _list(names: Any) -> str:
    return ", ".join(sorted(names)) or "none"
