"""The run's figures where clusters watch them: OpenMetrics (Prometheus text format), served by the
coordinator and written as a node-exporter textfile.

:func:`families` is pure over the event log and its ledger: the effective training time ratio, productive,
lost (by cause), unknown and pending time, incidents, restarts, requeues, the current attempt, round,
world size, step and step rate, each labelled with the run's stable id (:meth:`RunDir.run_id`, the same
across requeues and resubmissions), its current job and, on Slurm 25.11, ``SLURM_JOB_SLUID``.
:class:`Exporter` (the coordinator's agent) serves them with prometheus_client's HTTP server on a thread
of its own (read-only, plain HTTP, never the control plane's thread; no secret is in the figures), on the
coordinator's address and a free port (or ``metrics.port``), and publishes the target in
``<run>/metrics.json`` in Prometheus' ``file_sd_configs`` format; with ``metrics.textfile_dir`` it also
writes ``hpcelastic_<run id>.prom`` there (atomically, as node-exporter's textfile collector wants).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import start_http_server, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from hpcelastic import events as ev
from hpcelastic.events import EventLog
from hpcelastic.record.ledger import Ledger, build_ledger
from hpcelastic.rundir import RunDir, write_json_atomic

PREFIX = "hpcelastic"
#: How often the textfile is rewritten (node-exporter reads it on each of its own scrapes).
TEXTFILE_INTERVAL_S = 15.0
#: A scrape reuses the figures of one this recent (several Prometheus servers, a burst of scrapes).
CACHE_S = 1.0


@dataclass(frozen=True)
class Identity:
    """The labels every figure carries: the run's stable id, its current job, Slurm 25.11's SLUID."""

    run: str
    job: str
    sluid: str | None = None

    @property
    def labels(self) -> dict[str, str]:
        # ``slurm_job``, not ``job``: Prometheus gives each target a ``job`` label of its own (the scrape job)
        return {"run": self.run, "slurm_job": self.job, **({"sluid": self.sluid} if self.sluid else {})}


def _gauge(
    name: str, doc: str, ident: Identity, value: float, unit: str = "", **extra: str
) -> GaugeMetricFamily:
    labels = {**ident.labels, **extra}
    g = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=list(labels), unit=unit)
    g.add_metric(list(labels.values()), value)
    return g


def _counter(name: str, doc: str, ident: Identity, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=list(ident.labels))
    c.add_metric(list(ident.labels.values()), value)
    return c


def _step_rate(log: EventLog, attempt: Any, rnd: Any) -> float | None:
    """Steps per second of the round, from its first and newest progress marks (None: fewer than two)."""
    marks = [
        (p["step"], p["step_ts"])
        for p in log.of(ev.PROGRESS, attempt=attempt, round=rnd)
        if isinstance(p.get("step"), int) and isinstance(p.get("step_ts"), (int, float))
    ]
    if len(marks) < 2 or marks[-1][1] <= marks[0][1]:
        return None
    return (marks[-1][0] - marks[0][0]) / (marks[-1][1] - marks[0][1])


def families(
    log: EventLog, ledger: Ledger, ident: Identity, live: Mapping[str, float] | None = None
) -> list[Metric]:
    """The run's figures as metric families (pure). ``live``: the coordinator's current ``round``,
    ``world_size``, ``step`` and ``step_rate`` (``JobState.live``), newer than the log's marks."""
    out: list[Metric] = []
    info = InfoMetricFamily(f"{PREFIX}_run", "The run this exporter reports on", labels=list(ident.labels))
    info.add_metric(list(ident.labels.values()), {"job_ids": ",".join(log.job_ids())})
    out.append(info)
    if ledger.ettr is not None:
        lower = "Productive / allocated time (a lower bound while some training is of unknown fate)"
        out.append(_gauge("effective_training_time_ratio", lower, ident, ledger.ettr, unit="ratio"))
        upper = ledger.ettr_upper if ledger.ettr_upper is not None else ledger.ettr
        kept = "The ratio if all training of unknown fate was kept"
        out.append(_gauge("effective_training_time_ratio_upper", kept, ident, upper))
    for name, doc, value in (
        ("allocated", "Time the run held an allocation", ledger.allocated_s),
        ("productive", "Training time whose work was kept", ledger.productive_s),
        ("unknown", "Training before a failure whose redone share nothing tells", ledger.unknown_s),
        ("pending", "Time waiting for the next allocation after a requeue", ledger.pending_s),
    ):
        out.append(_gauge(f"{name}_time", doc, ident, value, unit="seconds"))
    lost = GaugeMetricFamily(f"{PREFIX}_lost_time", "Allocated time lost, by cause", unit="seconds",
                             labels=[*ident.labels, "cause"])  # fmt: skip
    for cause, seconds in sorted(ledger.badput_by_cause.items()):
        lost.add_metric([*ident.labels.values(), cause], seconds)
    out.append(lost)
    incidents = CounterMetricFamily(f"{PREFIX}_incidents", "Interruptions of training, by kind",
                                    labels=[*ident.labels, "kind"])  # fmt: skip
    kinds: dict[str, int] = {}
    for inc in ledger.incidents:
        kinds[str(inc.kind)] = kinds.get(str(inc.kind), 0) + 1
    for kind, n in sorted(kinds.items()):
        incidents.add_metric([*ident.labels.values(), kind], n)
    out.append(incidents)
    restarts = len(log.of(ev.RESTARTING)) + len(log.of(ev.REPLICA_GROUP_RESTARTING))
    out.append(_counter("restarts", "Worker restarts inside allocations (job-wide and replica group)", ident,
                        restarts))  # fmt: skip
    out.append(_counter("requeues", "Requeues and resubmissions", ident,
                        len(log.of(ev.REQUEUED)) + len(log.of(ev.RESUBMITTED))))  # fmt: skip
    slow = CounterMetricFamily(f"{PREFIX}_slow_nodes", "Slow nodes found, by what was done (report, exclude, "
                               "swap)", labels=[*ident.labels, "action"])  # fmt: skip
    actions: dict[str, int] = {}
    for r in log.of(ev.NODE_SLOW):
        actions[str(r.get("action"))] = actions.get(str(r.get("action")), 0) + 1
    for action, n in sorted(actions.items()):
        slow.add_metric([*ident.labels.values(), action], n)
    out.append(slow)
    started = log.last(ev.ATTEMPT_STARTED)
    if started is not None:
        attempt = float(started["attempt"])
        out.append(_gauge("attempt", "The current attempt (allocation), from 0", ident, attempt))
    for name, value in {**_logged(log), **(live or {})}.items():
        out.append(_gauge(name, _LIVE_DOCS[name], ident, value))
    return out


_LIVE_DOCS = {
    "round": "The current round of the attempt (a restart starts a new one)",
    "world_size": "Workers in the current round",
    "step": "The highest step reported by any rank (heartbeats)",
    "step_rate": "Steps per second in the current round",
}


def _logged(log: EventLog) -> dict[str, float]:
    """The current round's figures as the log has them (its rendezvous, its progress marks)."""
    current = log.since_last(ev.ATTEMPT_STARTED)
    out: dict[str, float] = {}
    rdzv = current.last(ev.RENDEZVOUS)
    if rdzv is not None:
        out.update(round=float(rdzv["round"]), world_size=float(rdzv["world_size"]))
    step = current.last(ev.PROGRESS)
    if step is not None:
        out["step"] = float(step["step"])
        rate = _step_rate(current, step.get("attempt"), step.get("round"))
        if rate is not None:
            out["step_rate"] = rate
    return out


class _RunCollector(Collector):
    """Reads the run's event log at each scrape (cached for :data:`CACHE_S`)."""

    def __init__(
        self, run_dir: RunDir, ident: Identity, live: Callable[[], Mapping[str, float]] | None
    ) -> None:
        self.run_dir, self.ident, self.live = run_dir, ident, live
        self._lock = threading.Lock()
        self._cached: tuple[float, list[Metric]] = (-1.0, [])

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            at, found = self._cached
            now = time.monotonic()
            if now - at > CACHE_S:
                log = self.run_dir.events()
                live = self.live() if self.live is not None else None
                found = families(log, build_ledger(log, now=time.time()), self.ident, live)
                self._cached = (now, found)
        yield from found


class Exporter:
    """The coordinator's endpoint and textfile; :meth:`close` withdraws the published target."""

    def __init__(
        self,
        run_dir: RunDir,
        ident: Identity,
        host: str,
        port: int,
        textfile_dir: Path | None = None,
        live: Callable[[], Mapping[str, float]] | None = None,
    ) -> None:
        self.run_dir, self.ident = run_dir, ident
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_RunCollector(run_dir, ident, live))
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.host, self.port = host, self._server.server_port
        self.textfile = textfile_dir / f"{PREFIX}_{ident.run}.prom" if textfile_dir else None
        self._stop = threading.Event()
        target = [{"targets": [f"{host}:{self.port}"], "labels": ident.labels}]
        try:
            write_json_atomic(self.target_path(run_dir), target)
        except OSError:
            self._server.shutdown()
            self._server.server_close()
            raise
        self._writer: threading.Thread | None = None
        if self.textfile is not None:
            self._writer = threading.Thread(target=self._write_textfile, name="metrics-textfile", daemon=True)
            self._writer.start()

    @staticmethod
    def target_path(run_dir: RunDir) -> Path:
        """``<run>/metrics.json``: the scrape target, as Prometheus' ``file_sd_configs`` reads it."""
        return run_dir.path / "metrics.json"

    def _write_textfile(self) -> None:
        assert self.textfile is not None
        while True:
            with contextlib.suppress(OSError):
                write_to_textfile(str(self.textfile), self.registry)
            if self._stop.wait(TEXTFILE_INTERVAL_S):
                return

    def close(self) -> None:
        """Stop serving; the target list becomes empty (Prometheus drops it) and the textfile gets the
        figures of the end."""
        self._stop.set()
        if self._writer is not None:
            self._writer.join(timeout=5.0)
            with contextlib.suppress(OSError):
                write_to_textfile(str(self.textfile), self.registry)
        with contextlib.suppress(OSError):
            write_json_atomic(self.target_path(self.run_dir), [])
        self._server.shutdown()
        self._server.server_close()
