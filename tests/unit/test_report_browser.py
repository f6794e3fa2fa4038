"""The HTML report as a person sees it: rendered by a real headless Chromium (Debian's ``chromium``)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from hpcelastic import events as ev
from hpcelastic.events import EventLog, ProgressMark
from hpcelastic.reasons import Reason
from hpcelastic.record.ledger import build_ledger
from hpcelastic.record.report import render_report
from tests.unit.test_ledger import (
    ckpt,
    ended,
    failure,
    rdzv,
    rec,
    spawned,
    start,
    step,
    succeed,
    worker_failure_run,
)
from tests.unit.test_ledger_replicas import killed_group_1_run

T0 = 1_700_000_000.0


def synthetic_run() -> list[dict[str, Any]]:
    """Attempt 0: a worker failure, restart, preemption; pending; attempt 1: a crash, then success."""
    crash = failure(0, 2, "n2", "Traceback\nRuntimeError: CUDA error: an illegal memory access")
    records = [r for r in worker_failure_run() if r["event"] not in ("attempt_ended", "job_succeeded")]
    records += [
        step(150.0, 0, 1, 200),
        ckpt(160.0, 0, 210),
        rec(190.0, ev.signal_received(signal="USR2", node_rank=0)),
        ckpt(195.0, 0, 240),
        ended(200.0, 0, Reason.PREEMPTED),
        rec(
            200.5,
            ev.requeued(
                job_id="11", attempt=1, reason=Reason.PREEMPTED, exclude=[], duration_s=0.4, note=None
            ),
        ),  # fmt: skip
        start(320.0, 1),
        rdzv(325.0, 0),
        spawned(327.0, 0),
        step(340.0, 1, 0, 241, ProgressMark.FIRST),
        ckpt(400.0, 1, 300),
        rec(431.0, ev.worker_failed(crash, exit_ts=430.0)),
        rec(436.0, ev.root_cause(crash, traceback="", exit_ts=430.0)),
        rdzv(437.0, 1),
        spawned(438.0, 1),
        step(450.0, 1, 1, 301, ProgressMark.FIRST),
        *succeed(600.0, 1),
    ]
    for r in records:  # a realistic epoch, so that the clock times are of today's kind
        r["ts"] += T0
        for key in ("exit_ts", "spawned_ts", "step_ts"):
            if isinstance(r.get(key), float):
                r[key] += T0
    return records


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, "headless Chromium is needed for this test: apt-get install -y chromium"
    return found


def run_chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [chromium(), "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'profile'}", *args]  # fmt: skip
    env = {**os.environ, "HOME": str(tmp_path)}
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, check=True)


class _Dom(HTMLParser):
    """Elements by class and id, and the text inside each element with an id."""

    def __init__(self) -> None:
        super().__init__()
        self.classes: dict[str, int] = {}
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.text: dict[str, str] = {}
        self._open: list[str | None] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        self.tags.append((tag, a))
        for c in a.get("class", "").split():
            self.classes[c] = self.classes.get(c, 0) + 1
        if tag not in ("line", "rect", "path", "meta", "br", "img", "input", "link"):
            self._open.append(a.get("id"))
            if a.get("id"):
                self.text.setdefault(a["id"], "")

    def handle_endtag(self, tag: str) -> None:
        if self._open and tag not in ("line", "rect", "path", "meta"):
            self._open.pop()

    def handle_data(self, data: str) -> None:
        for i in self._open:
            if i:
                self.text[i] += data


def png_pixels(path: Path) -> tuple[int, int, list[bytes]]:
    """Width, height and the unfiltered rows of an 8-bit RGB(A) PNG (what Chromium writes)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width, height, bpp = 8, b"", 0, 0, 4
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and colour in (2, 6), (depth, colour)
            bpp = 4 if colour == 6 else 3
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        ftype, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if ftype == 1:
                line[i] = (line[i] + a) & 0xFF
            elif ftype == 2:
                line[i] = (line[i] + b) & 0xFF
            elif ftype == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        rows.append(bytes(line))
        prev = line
    return (
        width,
        height,
        [r if bpp == 3 else b"".join(r[i : i + 3] for i in range(0, len(r), 4)) for r in rows],
    )


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    log = EventLog(synthetic_run())
    # one checkpoint the script wrote and did not publish (found in its checkpoint directory): a dashed tick
    ledger = build_ledger(log, written=[("step-225.pt", 1_700_000_175.0)])
    page = render_report(ledger, log, run="/runs/demo-run")
    path = tmp_path_factory.mktemp("report") / "report.html"
    path.write_text(page)
    return path


def test_report_is_self_contained(report: Path) -> None:
    page = report.read_text()
    assert "<script" not in page
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in page and "@import" not in page


def test_rendered_dom_has_the_timeline_and_the_summary(report: Path, tmp_path: Path) -> None:
    dom = _Dom()
    dom.feed(run_chromium(tmp_path, "--dump-dom", report.as_uri()).stdout)
    assert any(tag == "svg" and a.get("id") == "timeline" for tag, a in dom.tags)
    assert dom.classes.get("attempt-bar") == 2
    assert dom.classes.get("failure-marker") == 3
    assert dom.classes.get("round-seg") == 4
    assert dom.classes.get("checkpoint-tick") == 5
    dashed = [a for tag, a in dom.tags if a.get("class") == "checkpoint-tick" and a.get("stroke-dasharray")]
    assert len(dashed) == 1, dashed
    assert dom.classes.get("seg-pending") == 1
    ratio = build_ledger(EventLog(synthetic_run())).ettr
    assert ratio is not None
    assert "Effective training time ratio" in dom.text["kpi-ettr"]
    assert f"{100 * ratio:.1f} %" in dom.text["kpi-ettr"]
    incidents = dom.text["incidents"]
    assert "worker_failure" in incidents and "preemption" in incidents
    assert "RuntimeError: boom" in incidents
    assert "worker_failure" in dom.text["by-cause"]


#: Run in the page (a copy: the report itself has no script): every word of the incident table whose letters
#: lie on two lines, written into the page for ``--dump-dom`` to show.
BROKEN_WORDS = """<script>
const broken = [];
for (const cell of document.querySelectorAll('#incidents td, #incidents th')) {
  const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    for (const m of node.data.matchAll(/[A-Za-z_]{3,}/g)) {
      const range = document.createRange();
      range.setStart(node, m.index); range.setEnd(node, m.index + m[0].length);
      const tops = new Set([...range.getClientRects()].map(r => Math.round(r.top)));
      if (tops.size > 1) broken.push(m[0]);
    }
  }
}
const out = document.createElement('pre'); out.id = 'broken'; out.textContent = JSON.stringify(broken);
document.body.appendChild(out);
</script>"""


@pytest.mark.parametrize("width", [1400, 1000])
def test_no_word_of_the_incident_table_is_broken_across_lines(
    report: Path, tmp_path: Path, width: int
) -> None:
    """Issue 30: at 1400 px the table broke words in the middle ("whe n", "detect ion")."""
    page = tmp_path / "measured.html"
    page.write_text(report.read_text().replace("</body>", BROKEN_WORDS + "</body>"))
    dom = _Dom()
    dom.feed(run_chromium(tmp_path, f"--window-size={width},900", "--dump-dom", page.as_uri()).stdout)
    assert json.loads(dom.text["broken"]) == []


def test_screenshot_is_a_readable_picture(report: Path, tmp_path: Path) -> None:
    shot = tmp_path / "report.png"
    run_chromium(tmp_path, f"--screenshot={shot}", "--window-size=1200,700", report.as_uri())
    width, height, rows = png_pixels(shot)
    assert (width, height) == (1200, 700)
    pixels = {row[i : i + 3] for row in rows[::3] for i in range(0, len(row), 9)}
    assert len(pixels) > 50, "the screenshot is (nearly) blank"
    productive = bytes.fromhex("2e9d57")
    assert productive in pixels, "no productive (green) time drawn"
    assert bytes.fromhex("d64545") in pixels, "no worker-failure (red) time drawn"


@pytest.fixture(scope="module")
def replica_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    records = killed_group_1_run()
    for r in records:
        for key in ("ts", "exit_ts", "spawned_ts", "step_ts"):
            if isinstance(r.get(key), float):
                r[key] += T0
    log = EventLog(records)
    path = tmp_path_factory.mktemp("replica-report") / "report.html"
    path.write_text(render_report(build_ledger(log), log, run="/runs/replica-run"))
    return path


def test_replica_groups_have_their_own_lanes(replica_report: Path, tmp_path: Path) -> None:
    dom = _Dom()
    dom.feed(run_chromium(tmp_path, "--dump-dom", replica_report.as_uri()).stdout)
    lanes = [a for tag, a in dom.tags if "group-lane" in a.get("class", "").split()]
    assert [a["data-group"] for a in lanes] == ["0", "1"]
    assert dom.classes.get("lane-productive") == 3  # group 0 once, group 1 before and after its restart
    assert dom.classes.get("lane-restart") == 1 and dom.classes.get("lane-shutdown") == 2
    assert dom.classes.get("group-failure-marker") == 1
    assert dom.classes.get("failure-marker") is None  # the job itself was never interrupted
    assert "90.6 %" in dom.text["kpi-replica-steps"]
    assert "0 + 1 in groups" in dom.text["kpi-incident-count"]
    assert "145 of 160" in dom.text["replica-summary"]
    assert "healed from group(s) 0" in dom.text["group-incidents"]


def test_screenshot_shows_the_restarted_group_lane(replica_report: Path, tmp_path: Path) -> None:
    shot = tmp_path / "replica.png"
    run_chromium(tmp_path, f"--screenshot={shot}", "--window-size=1200,700", replica_report.as_uri())
    _w, _h, rows = png_pixels(shot)
    green, restart = bytes.fromhex("2e9d57"), bytes.fromhex("8ecae6")

    def colours(row: bytes) -> set[bytes]:  # right of the label column: the bars, not the legend's swatches
        return {row[i : i + 3] for i in range(3 * 200, len(row), 3)}

    # Only group 1's lane holds productive time and its restart on one line of pixels.
    lane_rows = [y for y, row in enumerate(rows) if {green, restart} <= colours(row)]
    assert 5 <= len(lane_rows) <= 15, lane_rows
