"""The run's figures as OpenMetrics (hpcelastic/record/metrics.py): pure over the log, parsed by a real
parser, served and written where Prometheus and node-exporter read them."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from hpcelastic.env import slurm
from hpcelastic.events import EventLog
from hpcelastic.record.ledger import build_ledger
from hpcelastic.record.metrics import Exporter, Identity, families
from hpcelastic.rundir import RunDir
from tests.unit.test_ledger import worker_failure_run

IDENT = Identity("0123456789abcdef", "11", "sluid-1")


def samples(text: str, parse=parse_openmetrics) -> dict[str, list]:
    return {f.name: f.samples for f in parse(text)}


def test_the_figures_of_a_run_with_a_failure() -> None:
    log = EventLog(worker_failure_run())
    led = build_ledger(log)
    fams = {f.name: f for f in families(log, led, IDENT, live={"step": 150.0, "step_rate": 2.5})}
    (ratio,) = fams["hpcelastic_effective_training_time_ratio"].samples
    assert ratio.value == led.ettr and ratio.labels == {
        "run": IDENT.run,
        "slurm_job": "11",
        "sluid": "sluid-1",
    }
    lost = {s.labels["cause"]: s.value for s in fams["hpcelastic_lost_time_seconds"].samples}
    assert lost == led.badput_by_cause
    assert [s.value for s in fams["hpcelastic_restarts"].samples] == [1.0]
    assert [(s.labels["kind"], s.value) for s in fams["hpcelastic_incidents"].samples] == [
        ("worker_failure", 1)
    ]
    assert fams["hpcelastic_world_size"].samples[0].value == 8.0  # the round's rendezvous
    assert fams["hpcelastic_step"].samples[0].value == 150.0  # the coordinator's live figure wins
    assert fams["hpcelastic_step_rate"].samples[0].value == 2.5


def test_served_and_written_as_real_parsers_read_them(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    for r in worker_failure_run():
        with (rd.path / "events.n1.jsonl").open("a") as f:
            f.write(json.dumps(r) + "\n")
    assert len(rd.run_id) == 16 and rd.run_id == RunDir(rd.path).run_id  # stable: read back, not made anew
    textfiles = tmp_path / "textfiles"
    textfiles.mkdir()
    exporter = Exporter(rd, Identity(rd.run_id, "11"), "127.0.0.1", 0, textfiles)
    try:
        (target,) = json.loads((rd.path / "metrics.json").read_text())
        assert target == {
            "targets": [f"127.0.0.1:{exporter.port}"],
            "labels": {"run": rd.run_id, "slurm_job": "11"},
        }
        url = f"http://127.0.0.1:{exporter.port}/metrics"
        req = urllib.request.Request(url, headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        om = samples(urllib.request.urlopen(req, timeout=5).read().decode())
        assert "hpcelastic_effective_training_time_ratio" in om and "hpcelastic_run" in om
        plain = samples(urllib.request.urlopen(url, timeout=5).read().decode(), parse_text)
        assert plain["hpcelastic_restarts"][0].name == "hpcelastic_restarts_total"
        assert "secret" not in urllib.request.urlopen(url, timeout=5).read().decode()
    finally:
        exporter.close()
    assert json.loads((rd.path / "metrics.json").read_text()) == []  # withdrawn
    (prom,) = textfiles.glob("*")  # no temporary file left next to it
    assert prom.name == f"hpcelastic_{rd.run_id}.prom"
    assert "hpcelastic_effective_training_time_ratio" in samples(prom.read_text(), parse_text)


def test_slurm_25_11_sluid_is_read_from_its_variable() -> None:
    assert slurm.sluid({"SLURM_JOB_SLUID": "a1b2"}) == "a1b2"
    assert slurm.sluid({}) is None and slurm.read({"SLURM_JOB_SLUID": "x"}).sluid == "x"
