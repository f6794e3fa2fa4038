"""What clusters watch, and how a cancel reads, on a real Slurm job (issue 21, points 1, 2 and metrics).

One job on a 2-node testbed instance of this module's own (``watch``, index 40): the shipped DDP example
(heartbeats, its own checkpoint every step), a worker SIGKILLed at step 40, then a plain ``scancel`` while
it trains again. Along the way:

- a real Prometheus server (Debian's ``prometheus``, on loopback, a config of this test's own) finds the
  coordinator's endpoint through ``<run>/metrics.json`` (``file_sd_configs``) and scrapes it; the ratio,
  the restart and the incident are queried through its HTTP API, labelled with the run's id, the job and
  the SLUID (``SLURM_JOB_SLUID``, Slurm 25.11, set here for the job as 25.11 would);
- the endpoint's text parses with prometheus_client's OpenMetrics parser; the node-exporter textfile too;
- the ledger of the crash rests on the heartbeats: the restarted round resumed after the step before the
  crash, so no whole step was redone;
- the plain scancel is a cancel, not a failure: Slurm says CANCELLED with Restarts=0, the attempt ended
  ``cancelled``, no node is recorded lost, ``status`` says cancelled, and the scrape target is withdrawn.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from tests.slurm_utils import events, named
from tests.slurm_utils import job_record as job
from tests.slurm_utils import wait_job_state as wait_state
from tests.testbed import Testbed, own_instance

NAME = "watch"
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.xdist_group(name=NAME)]
SETTINGS = {"index": "40", "nodes": "2"}
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "ddp_train.py"
SLUID = "s1uid-test-0040"


@pytest.fixture(scope="module")
def tb(slurm_cluster: dict[str, object]) -> Iterator[Testbed]:
    with own_instance(NAME, SETTINGS) as inst:
        yield inst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def prometheus(tmp_path: Path, targets: Path) -> Iterator[str]:
    """A Prometheus server of this test's own on loopback, scraping every second what ``targets`` lists."""
    binary = shutil.which("prometheus")
    assert binary, "Debian's prometheus is needed: bash scripts/setup.sh installs it"
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: hpcelastic\n"
        f"    file_sd_configs: [{{files: ['{targets}'], refresh_interval: 1s}}]\n"
    )
    port = free_port()
    argv = [binary, f"--config.file={config}", f"--web.listen-address=127.0.0.1:{port}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}", "--log.level=warn"]  # fmt: skip
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"{url}/-/ready", timeout=1).status == 200:
                    break
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()


def query(url: str, promql: str, timeout: float = 60.0) -> list[dict[str, Any]]:
    """The first non-empty answer of Prometheus' instant query API within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        q = urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=5) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        if body["data"]["result"] or time.monotonic() > deadline:
            return body["data"]["result"]
        time.sleep(0.5)


def wait_for(what: str, predicate: Any, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def published(run: Path) -> list[dict[str, Any]] | None:
    """The scrape targets in ``<run>/metrics.json``, once the coordinator wrote them."""
    with contextlib.suppress(OSError, ValueError):
        return json.loads((run / "metrics.json").read_text())
    return None


def test_prometheus_scrapes_a_job_that_crashes_and_is_cancelled(
    tb: Testbed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_CONF", tb.slurm_conf)  # scontrol of this test's helpers: this instance
    env = {
        **tb.slurm_env(),
        "XDG_STATE_HOME": str(tmp_path / "state"),
        "XDG_CONFIG_HOME": str(tmp_path / "cfg"),
    }
    textfiles = tmp_path / "textfile"
    textfiles.mkdir()
    (tmp_path / "cfg" / "hpcelastic").mkdir(parents=True)
    (tmp_path / "cfg" / "hpcelastic" / "config.yaml").write_text(f"metrics:\n  textfile_dir: '{textfiles}'\n")
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "hpcelastic", "submit", "--json", "--site", "testbed", "--nodes", "2",
            "--nproc-per-node", "1", "--time", "10", "--run-dir", str(run), "--env",
            f"SLURM_JOB_SLUID={SLUID}", str(EXAMPLE), "--steps", "100000", "--step-time", "0.1",
            "--crash-at-step", "40", "--crash-rank", "1", "--crash-mode", "sigkill"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    job_id = str(json.loads(proc.stdout)["job_id"])
    run_id = (run / "run_id").read_text().strip()
    with prometheus(tmp_path, run / "metrics.json") as url:
        target = wait_for("the published target", lambda: published(run))
        assert target[0]["labels"] == {"run": run_id, "slurm_job": job_id, "sluid": SLUID}
        endpoint = f"http://{target[0]['targets'][0]}/metrics"
        # the endpoint itself: OpenMetrics as a real parser reads it, no secret in it
        req = urllib.request.Request(endpoint, headers={"Accept": "application/openmetrics-text"})
        text = urllib.request.urlopen(req, timeout=5).read().decode()
        names = {f.name for f in parse_openmetrics(text)}
        assert {"hpcelastic_effective_training_time_ratio", "hpcelastic_restarts", "hpcelastic_run"} <= names
        assert (run / "secret").read_text().strip() not in text
        # the ratio through Prometheus' HTTP API, labelled by run, job and SLUID
        sel = f'{{run="{run_id}",slurm_job="{job_id}",sluid="{SLUID}"}}'
        (ratio,) = query(url, f"hpcelastic_effective_training_time_ratio{sel}")
        assert 0.0 <= float(ratio["value"][1]) <= 1.0 and ratio["metric"]["job"] == "hpcelastic"
        (world,) = query(url, f"hpcelastic_world_size{sel}")
        assert float(world["value"][1]) == 2.0
        # the crash and its restart, then training again: counted where Prometheus sees them
        wait_for("the restart", lambda: named(events(run), "restarting"))
        (restarts,) = query(url, f"hpcelastic_restarts_total{sel} >= 1", timeout=30)
        (incidents,) = query(url, f'hpcelastic_incidents_total{{run="{run_id}",kind="worker_failure"}}', 30)
        assert float(restarts["value"][1]) == 1.0 and float(incidents["value"][1]) == 1.0
        wait_for(
            "training after the restart",
            lambda: [e for e in named(events(run), "progress") if e["round"] == 1],
        )
        (rate,) = query(url, f"hpcelastic_step_rate{sel}", timeout=30)  # live from the coordinator
        assert float(rate["value"][1]) > 0
        prom = textfiles / f"hpcelastic_{run_id}.prom"
        assert wait_for("the textfile", lambda: prom.exists())
        assert "hpcelastic_effective_training_time_ratio" in {f.name for f in parse_text(prom.read_text())}
        # a plain scancel: a cancel, not a failure, not a lost node
        subprocess.run(["scancel", job_id], check=True, env=env)
        wait_state(job_id, {"CANCELLED"}, 60)
        time.sleep(12)  # past cred_expire: a requeue would show by now
        rec = job(job_id)
        assert rec["JobState"] == "CANCELLED" and rec["Restarts"] == "0", rec
    log = events(run)
    ended = named(log, "attempt_ended")
    assert [e["reason"] for e in ended] == ["cancelled"], ended
    assert not named(log, "node_lost") and not named(log, "requeued")
    assert named(log, "agent_stopped") or named(log, "cancelled")
    status = json.loads(
        subprocess.run(
            [sys.executable, "-m", "hpcelastic", "status", "--json", str(run)],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        ).stdout  # fmt: skip
    )
    assert status["outcome"] == "cancelled"
    (inc,) = status["ledger"]["incidents"]
    assert inc["kind"] == "worker_failure" and inc["redone_source"] == "heartbeats"
    assert inc["redone_steps"] == 0 and inc["redone_work_s"] < 1.0
    assert json.loads((run / "metrics.json").read_text()) == []  # the target is withdrawn
