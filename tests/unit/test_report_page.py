"""The report page tells the truth at a glance (issue 21, point 4), seen in a real headless Chromium at
1,400 and 800 px: the ratio card's colour follows the ratio, labels stay out of the bars, a local run says
so, the legend lists only what is drawn, training of unknown fate is drawn as unknown, and the page never
scrolls sideways."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hpcelastic import events as ev
from hpcelastic.events import EventLog
from hpcelastic.reasons import Reason
from hpcelastic.record.ledger import build_ledger
from hpcelastic.record.report import LABEL_CHARS, PHASE_COLOURS, Phase, render_report
from tests.unit.test_ledger import failure, rdzv, rec, spawned, start, succeed
from tests.unit.test_report_browser import T0, _Dom, png_pixels, run_chromium, synthetic_run


def unknown_local_run() -> list[dict[str, Any]]:
    """``hpcelastic run`` of an unchanged script (no heartbeats, nothing read seen): a crash at 60 s."""
    crash = failure(0, 1, "local1", "boom")
    records = [
        start(0.0, 0, job="local-a-very-long-run-name-that-would-run-into-the-bar"),
        rdzv(1.0, 0),
        spawned(2.0, 0),
        rec(60.5, ev.worker_failed(crash, exit_ts=60.0)),
        rec(61.0, ev.root_cause(crash, traceback="", exit_ts=60.0)),
        rdzv(62.0, 1),
        spawned(63.0, 1),
        *succeed(70.0, 0),
    ]
    for r in records:
        for key in ("ts", "exit_ts", "spawned_ts"):
            if isinstance(r.get(key), float):
                r[key] += T0
    return records


def page(tmp_path: Path, records: list[dict[str, Any]], name: str) -> Path:
    log = EventLog(records)
    path = tmp_path / f"{name}.html"
    path.write_text(render_report(build_ledger(log), log, run=f"/runs/{name}"))
    return path


def dom_of(tmp_path: Path, path: Path) -> _Dom:
    dom = _Dom()
    dom.feed(run_chromium(tmp_path, "--dump-dom", path.as_uri()).stdout)
    return dom


def overflow(tmp_path: Path, report: Path, width: int) -> dict[str, int]:
    """The report's scroll and client widths in a ``width`` px window (a probe page reads them: the
    report itself has no script)."""
    probe = tmp_path / f"probe-{width}.html"
    probe.write_text(
        f'<!DOCTYPE html><html><body style="margin:0"><iframe id="f" src="{report.as_uri()}" '
        f'style="border:0;width:{width}px;height:600px"></iframe><pre id="out"></pre><script>'
        "document.getElementById('f').onload = () => { const d = document.getElementById('f')"
        ".contentDocument.documentElement; document.getElementById('out').textContent = "
        "JSON.stringify({scroll: d.scrollWidth, client: d.clientWidth}); };</script></body></html>"
    )
    out = run_chromium(
        tmp_path, "--allow-file-access-from-files", "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()
    ).stdout
    dom = _Dom()
    dom.feed(out)
    return json.loads(dom.text["out"])


@pytest.mark.parametrize("width", [1400, 800])
def test_the_page_fits_the_window_and_draws_the_run(tmp_path: Path, width: int) -> None:
    report = page(tmp_path, synthetic_run(), "synthetic")
    sizes = overflow(tmp_path, report, width)
    assert sizes["scroll"] <= sizes["client"] == width, sizes  # no horizontal scrollbar
    shot = tmp_path / f"report-{width}.png"
    run_chromium(tmp_path, f"--screenshot={shot}", f"--window-size={width},900", report.as_uri())
    w, _h, rows = png_pixels(shot)
    pixels = {row[i : i + 3] for row in rows[::2] for i in range(0, len(row), 3)}
    assert w == width
    assert {bytes.fromhex("2e9d57"), bytes.fromhex("d64545")} <= pixels, "bars not drawn"
    assert bytes.fromhex("fdf0f0") in pixels, "a 67 % ratio's card is red"
    assert bytes.fromhex("f0faf3") not in pixels


def test_a_poor_ratio_is_not_green_and_unknown_training_is_drawn_as_unknown(tmp_path: Path) -> None:
    report = page(tmp_path, unknown_local_run(), "unknown")
    led = build_ledger(EventLog(unknown_local_run()))
    assert led.ettr is not None and led.ettr < 0.7 and led.unknown_s == pytest.approx(58.0)
    dom = dom_of(tmp_path, report)
    card = next(a for tag, a in dom.tags if a.get("id") == "kpi-ettr")
    assert "poor" in card["class"].split() and "good" not in card["class"]
    assert f"{100 * led.ettr:.1f} % to {100 * led.ettr_upper:.1f} %" in dom.text["kpi-ettr"]
    assert dom.classes.get("seg-unknown") == 1 and dom.classes.get("seg-redone") is None
    assert "training, redone share unknown" in dom.text["legend-cause"]
    assert "unknown" in dom.text["incidents"]
    # The header of a run without Slurm.
    text = report.read_text()
    assert "local run (hpcelastic run, no Slurm job)" in text and "job(s) -" not in text
    shot = tmp_path / "unknown.png"
    run_chromium(tmp_path, f"--screenshot={shot}", "--window-size=800,700", report.as_uri())
    _w, _h, rows = png_pixels(shot)
    pixels = {row[i : i + 3] for row in rows for i in range(0, len(row), 3)}
    assert bytes.fromhex(PHASE_COLOURS[Phase.UNKNOWN][1:]) in pixels
    assert bytes.fromhex("fdf0f0") in pixels and bytes.fromhex("f0faf3") not in pixels


def test_the_legend_lists_only_what_the_picture_draws(tmp_path: Path) -> None:
    led = build_ledger(EventLog(unknown_local_run()))
    html = render_report(led, EventLog(unknown_local_run()), run="/runs/x")
    legend = html[html.index('id="legend-phase"') :]
    legend = legend[: legend.index("</ul>")]
    drawn = {s.phase for s in led.segments}
    assert Phase.PENDING not in drawn and "pending after a requeue" not in legend
    cause = html[html.index('id="legend-cause"') :]
    assert "checkpoint</li>" not in cause[: cause.index("</ul>")]  # no checkpoint in this run
    for phase in drawn:
        assert phase.value in {p.value for p in Phase}


def test_job_labels_are_cut_to_their_column() -> None:
    html = render_report(build_ledger(EventLog(unknown_local_run())), EventLog(unknown_local_run()), run="/r")
    start_ = html.index('class="small attempt-label"')
    label = html[html.index(">", start_) + 1 : html.index("<title>", start_)]
    assert len(label) == LABEL_CHARS and label.endswith("…")
    assert "job local-a-very-long-run-name-that-would-run-into-the-bar" in html  # in the tooltip


def test_reason_for_preemption_shows_on_its_own_line() -> None:
    records = [*synthetic_run()]
    html = render_report(build_ledger(EventLog(records)), EventLog(records), run="/r")
    assert f">{Reason.PREEMPTED.value}<title>" in html
