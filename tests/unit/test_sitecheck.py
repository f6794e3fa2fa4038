"""``hpcelastic sites check``'s rules and the probe's judgement, over what a cluster says (pure). Against
the real testbed, good and wrong sites: tests/slurm/test_sites_check_slurm.py."""

from __future__ import annotations

import sys
from typing import Any

import pytest

import hpcelastic
from hpcelastic import sites
from hpcelastic.jobs import slurm_output
from hpcelastic.sitecheck.facts import ClusterFacts
from hpcelastic.sitecheck.probe import judge, srun_argv
from hpcelastic.sitecheck.rules import Report, Severity, check

PARTITION = (
    "PartitionName=gpu AllowGroups=ALL Default=YES DefaultTime=NONE GraceTime=0 MaxTime=1-00:00:00 "
    "Nodes=g[1-2] PreemptMode=OFF State=UP TotalNodes=2"
)
NODE = (
    "NodeName={name} Arch=x86_64 CPUTot=8 AvailableFeatures=a100,ib Gres=gpu:a100:4(S:0-1) Partitions=gpu  "
    "State=IDLE"  # two spaces, as scontrol prints them
)
CONFIG = {
    "SlurmdTimeout": "300 sec",
    "MessageTimeout": "10 sec",
    "JobRequeue": "1",
    "PreemptType": "preempt/none",
    "PreemptMode": "OFF",
    "SelectType": "select/cons_tres",
    "TaskPlugin": "task/affinity,task/cgroup",
    "GresTypes": "gpu",
}


def facts(partition: str = PARTITION, **config: str) -> ClusterFacts:
    parts = slurm_output.parse_records(partition)
    nodes = [slurm_output.parse_record(NODE.format(name=n)) for n in ("g1", "g2")]
    return ClusterFacts(
        release=(24, 11),
        config={**CONFIG, **config},
        partitions={p["PartitionName"]: p for p in parts},
        nodes={n["NodeName"]: n for n in nodes},
        accounts=frozenset({"proj1"}),
        qos=frozenset({"normal"}),
    )


def values(**overrides: Any) -> dict[str, Any]:
    flat = sites.flatten(sites.defaults())
    flat.update({k.replace("__", "."): v for k, v in overrides.items()})
    return flat


def keys(report: Report) -> list[tuple[str, str]]:
    return [(f.key, str(f.severity)) for f in report.findings]


def test_a_site_that_fits_the_cluster_has_no_findings() -> None:
    report = check(
        values(partition="gpu", account="proj1", qos="normal", gpus_per_node=4, time="12:00:00"), facts()
    )
    assert report.findings == []
    assert any(sys.executable in n for n in report.notes)  # which Python the nodes run


@pytest.mark.parametrize(
    ("overrides", "config", "partition", "expected", "words"),
    [
        (
            {"partition": "gpus"},
            {},
            PARTITION,
            ("partition", "problem"),
            "no partition 'gpus' on this cluster; it has gpu",
        ),
        ({"account": "proj2"}, {}, PARTITION, ("account", "problem"), "no account 'proj2'"),
        ({"qos": "high"}, {}, PARTITION, ("qos", "problem"), "no qos 'high'"),
        ({"constraint": "h100&ib"}, {}, PARTITION, ("constraint", "problem"), "feature(s) h100"),
        ({"exclude": "g[2-3]"}, {}, PARTITION, ("exclude", "warning"), "no node(s) g3"),
        ({"time": "2-00:00:00"}, {}, PARTITION, ("time", "problem"), "above partition gpu's MaxTime"),
        ({"max_gpus_per_node": 8}, {}, PARTITION, ("max_gpus_per_node", "problem"), "at most 4"),
        (
            {"gpus_per_node": 4},
            {"SelectType": "select/linear"},
            PARTITION,
            ("gpu_request", "problem"),
            "cons_tres",
        ),
        ({"gpus_per_node": 4}, {"GresTypes": ""}, PARTITION, ("gpu_request", "problem"), "GresTypes=gpu"),
        ({"signal__lead_time": 30}, {}, PARTITION, ("signal.lead_time", "problem"), "set at least 75"),
        (
            {},
            {"MessageTimeout": "300 sec", "SlurmdTimeout": "60 sec"},
            PARTITION,
            ("slurm.conf MessageTimeout", "warning"),
            "not below SlurmdTimeout 60 s",
        ),
        (
            {},
            {"PreemptType": "preempt/partition_prio"},
            PARTITION.replace("PreemptMode=OFF", "PreemptMode=CANCEL").replace(
                "GraceTime=0", "GraceTime=120"
            ),
            ("requeue.mode", "warning"),
            "cancelled, not requeued",
        ),
        (
            {},
            {"PreemptType": "preempt/partition_prio"},
            PARTITION.replace("PreemptMode=OFF", "PreemptMode=REQUEUE").replace(
                "GraceTime=0", "GraceTime=30"
            ),
            ("requeue.grace_period", "warning"),
            "kills a preempted job 30 s after the signal (GraceTime): set at most 15",
        ),
        (
            {},
            {"PreemptType": "preempt/partition_prio"},
            PARTITION.replace("PreemptMode=OFF", "PreemptMode=REQUEUE"),
            ("requeue.grace_period", "warning"),
            "GraceTime=0",
        ),
        ({}, {}, PARTITION.replace("State=UP", "State=DRAIN"), ("partition", "warning"), "DRAIN"),
        (
            {},
            {},
            PARTITION.replace("Default=YES", "Default=NO"),
            ("partition", "problem"),
            "no default partition",
        ),
    ],
)
def test_each_wrong_setting_is_one_finding_naming_its_key(
    overrides: dict[str, Any], config: dict[str, str], partition: str, expected: tuple[str, str], words: str
) -> None:
    report = check(values(**overrides), facts(partition, **config))
    assert keys(report) == [expected], report.findings
    assert words in report.findings[0].text and "\n" not in report.findings[0].line()


def test_what_cannot_be_checked_is_said_not_found() -> None:
    cluster = facts()
    cluster = ClusterFacts(cluster.release, cluster.config, cluster.partitions, cluster.nodes)  # no sacctmgr
    report = check(values(account="anything", qos="any"), cluster)
    assert report.findings == []
    assert any("account 'anything' not checked" in n for n in report.notes)


def test_slurm_outputs_parse() -> None:
    assert slurm_output.gpu_count("gpu:a100:4(S:0-1),gpu:v100:2") == 6
    assert slurm_output.gpu_count("(null)") == 0 and slurm_output.gpu_count("gpu:4,shard:8") == 4
    assert slurm_output.seconds_of("300 sec") == 300 and slurm_output.seconds_of("UNLIMITED") is None
    config = slurm_output.parse_config(
        "Configuration data as of 2026-11-28T21:00:00\nSlurmdTimeout = 300 sec\n\n"
    )
    assert config == {"SlurmdTimeout": "300 sec"}


def node_report(node: str, **fields: Any) -> dict[str, Any]:
    base = {
        "node": node,
        "python": "/opt/py/bin/python",
        "hpcelastic": hpcelastic.__version__,
        "torch": "2.13.0",
        "iface": "ok: 10.0.0.1",
        "port": None,
        "tier": None,
        "runtime": None,
        "nvml": None,
        "seen": ["g2" if node == "g1" else "g1"],
        "reach": {"g2" if node == "g1" else "g1": "ok"},
    }
    return {**base, **fields}


def test_the_probe_judges_what_each_node_reports() -> None:
    good = Report()
    judge([node_report("g1"), node_report("g2")], 2, values(), "", good)
    assert good.findings == [] and "probe on g1, g2" in good.notes[-1]
    bad = Report()
    reports = [
        node_report("g1", seen=[], reach={}, iface="error: network interface 'ib9' does not exist here"),
        node_report(
            "g2",
            hpcelastic="0.0.1",
            torch="error: No module named 'torch'",
            reach={"g1": "error: 10.0.0.1:4000: Connection refused"},
            tier="error: checkpoint_tier.local_checkpoint_dir: /nvme does not exist on this node; create it",
            runtime="error: apptainer or singularity not found on PATH",
            port="error: port 29400 is in use here (Address already in use)",
        ),
    ]
    judge(reports, 2, values(), "", bad)
    found = {(f.key, f.severity) for f in bad.findings}
    assert found == {
        ("rdzv_interface", Severity.PROBLEM),
        ("run_root", Severity.PROBLEM),
        ("python", Severity.PROBLEM),
        ("python", Severity.WARNING),
        ("checkpoint_tier.local_checkpoint_dir", Severity.PROBLEM),
        ("container.runtime", Severity.PROBLEM),
        ("rdzv_port", Severity.PROBLEM),
    }, bad.findings
    assert any("g1 does not see what g2 wrote there" in f.text for f in bad.findings)
    lost = Report()
    judge([], 2, values(python="/no/python"), "srun: error: /no/python: No such file or directory", lost)
    assert [f.line() for f in lost.findings] == [
        "problem: python: the probe ran on 0 of 2 node(s) with /no/python: srun: error: /no/python: No such "
        "file or directory"
    ]


def test_the_probe_runs_the_nodes_as_the_batch_script_does() -> None:
    argv = srun_argv(
        values(account="proj1", modules=["pytorch/2.3"], setup=["source /opt/env.sh"], env={"NCCL_X": "a b"}),
        "gpu",
        2,
        {"dir": "/runs/x"},
    )
    assert argv[:6] == [
        "srun",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--time=5",
        "--job-name=hpcelastic-sites-check",
        "--immediate=120",
    ]
    assert "--partition=gpu" in argv and "--account=proj1" in argv
    script = [line for line in argv[-1].splitlines() if line and not line.startswith("#")]
    assert script[:3] == ["module load pytorch/2.3", "source /opt/env.sh", "export NCCL_X='a b'"]
    assert script[3].startswith(f"exec {sys.executable} -m hpcelastic.sitecheck.node ")
