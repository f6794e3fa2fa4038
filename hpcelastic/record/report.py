"""``hpcelastic report``: one self-contained HTML page about a run (inline CSS and SVG, no script,
no network).

The page shows the summary (effective training time ratio, badput by cause and by phase), a timeline
picture (one bar per attempt: rounds above it, time coloured by cause, a strip of phases below it,
failure markers and checkpoint ticks) and the table of incidents. Hovering over any shape shows its
figures (SVG ``<title>``).
"""

from __future__ import annotations

import html
import time
from collections.abc import Iterable

from hpcelastic import events as ev
from hpcelastic.events import EventLog
from hpcelastic.record.ledger import (
    Incident,
    IncidentKind,
    Ledger,
    Phase,
    Segment,
    duration,
    ratio_text,
    redone_text,
)
from hpcelastic.record.replica_lanes import GroupLane, ReplicaFigures

#: Bar colour per cause (the incident kind, ``productive``, ``startup``).
CAUSE_COLOURS = {
    "productive": "#2e9d57",
    "startup": "#9aa5b1",
    IncidentKind.WORKER_FAILURE.value: "#d64545",
    IncidentKind.NODE_LOSS.value: "#8e44ad",
    IncidentKind.STALL.value: "#e67e22",
    IncidentKind.NODE_UNHEALTHY.value: "#8b1e1e",
    IncidentKind.PREEMPTION.value: "#2f80ed",
    IncidentKind.TIME_LIMIT.value: "#17a2b8",
    IncidentKind.COORDINATOR_LOST.value: "#6d4c41",
    IncidentKind.TOO_FEW_NODES.value: "#c2185b",
    IncidentKind.STARTUP_FAILURE.value: "#7f6a00",
    IncidentKind.UNKNOWN.value: "#555555",
    "shutdown": "#b8a9c9",
    "dropped": "#7a7a7a",
}
#: Strip colour per phase.
PHASE_COLOURS = {
    Phase.PRODUCTIVE: "#2e9d57",
    Phase.STARTUP: "#c5ccd3",
    Phase.REDONE: "#f4a261",
    Phase.DETECTION: "#e63946",
    Phase.TEARDOWN: "#7b2cbf",
    Phase.RENDEZVOUS: "#457b9d",
    Phase.RESTART: "#8ecae6",
    Phase.PENDING: "#d9d9d9",
    Phase.QUEUED: "#d9d9d9",
    Phase.SHUTDOWN: "#b8a9c9",
    Phase.DROPPED: "#7a7a7a",
    Phase.UNKNOWN: "#bdbdbd",
}
_PHASE_TEXT = {
    Phase.PRODUCTIVE: "productive training",
    Phase.STARTUP: "start-up to the first step",
    Phase.REDONE: "work redone (since the last checkpoint)",
    Phase.DETECTION: "detection",
    Phase.TEARDOWN: "teardown",
    Phase.RENDEZVOUS: "rendezvous",
    Phase.RESTART: "restart to the first step",
    Phase.PENDING: "pending after a requeue",
    Phase.QUEUED: "queued before the first start",
    Phase.SHUTDOWN: "shutdown after the last step",
    Phase.DROPPED: "replica group left out",
    Phase.UNKNOWN: "training before a failure, redone share unknown",
}
#: The effective training time ratio's card: green from 90 % (Meta's and ByteDance's published runs), amber
#: from 70 %, else red.
ETTR_GOOD, ETTR_FAIR = 0.9, 0.7
#: The most characters of a label left of the timeline (its column is LEFT px wide at 10-12 px type).
LABEL_CHARS = 22

LEFT, WIDTH, RIGHT, ROW, TOP = 150, 840, 50, 78, 34
#: The height of one replica group's lane under its attempt's bar.
LANE = 15

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1f2933;
       margin: 24px 32px; max-width: 1120px; overflow-wrap: break-word; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 8px; }
.meta { color: #52606d; margin: 0 0 16px; }
.kpis { display: flex; flex-wrap: wrap; gap: 12px; }
.kpi { border: 1px solid #d9e2ec; border-radius: 6px; padding: 10px 14px; min-width: 150px; }
.kpi .label { color: #52606d; font-size: 12px; text-transform: uppercase; letter-spacing: .04em; }
.kpi .value { font-size: 22px; font-weight: 600; }
.kpi.good { border-color: #2e9d57; background: #f0faf3; }
.kpi.fair { border-color: #d69e2e; background: #fffaeb; }
.kpi.poor { border-color: #d64545; background: #fdf0f0; }
#timeline { width: 100%; height: auto; max-width: 1040px; display: block; }
.wide { overflow-x: auto; max-width: 100%; }
table { border-collapse: collapse; margin: 4px 0; }
th, td { border-bottom: 1px solid #e4e7eb; padding: 4px 10px; text-align: left; vertical-align: top; }
th { background: #f5f7fa; font-weight: 600; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; } td.num { white-space: nowrap; }
#incidents { font-size: 12px; width: 100%; } #incidents th, #incidents td { padding: 4px 5px; }
#incidents td:nth-child(5) { min-width: 170px; }
#incidents td:nth-child(4) { white-space: nowrap; }
.est { color: #8a6d00; } .swatch { display: inline-block; width: 12px; height: 12px; border-radius: 2px;
  vertical-align: -1px; margin-right: 6px; border: 1px solid rgba(0,0,0,.15); }
.legend { display: flex; flex-wrap: wrap; gap: 4px 16px; margin: 6px 0; padding: 0; list-style: none; }
.legend-title { font-weight: 600; margin-top: 8px; }
svg text { font: 12px system-ui, sans-serif; fill: #323f4b; } svg .small { font-size: 10px; fill: #52606d; }
.notes li { color: #52606d; }
"""


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _tick(offset: float) -> str:
    """An axis label: ``+2 h``, ``+5 min``, ``+30 s``."""
    if offset >= 3600 and offset % 3600 == 0:
        return f"{int(offset // 3600)} h"
    if offset >= 60 and offset % 60 == 0:
        return f"{int(offset // 60)} min"
    return f"{offset:g} s"


def _clock(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _short(text: str) -> str:
    """``text`` cut to fit the label column left of the timeline (the whole of it is its tooltip)."""
    return text if len(text) <= LABEL_CHARS else text[: LABEL_CHARS - 1] + "…"


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f} %" if whole > 0 else "n/a"


class _Timeline:
    """The SVG picture: x is wall-clock time, one row per attempt."""

    def __init__(self, ledger: Ledger) -> None:
        self.led = ledger
        spans = [(s.t0, s.t1) for s in ledger.segments] + [(a.start, a.end) for a in ledger.attempts]
        self.t0 = min((a for a, _ in spans), default=0.0)
        self.t1 = max((b for _, b in spans), default=1.0)
        if self.t1 <= self.t0:
            self.t1 = self.t0 + 1.0
        self.lanes: dict[int, list[GroupLane]] = {}
        for lane in ledger.replica_groups.lanes if ledger.replica_groups is not None else []:
            self.lanes.setdefault(lane.attempt, []).append(lane)
        self.tops: dict[int, float] = {}
        top = float(TOP)
        for a in ledger.attempts:
            self.tops[a.attempt] = top
            top += ROW + LANE * self._lane_rows(a.attempt)
        self.height = top + 10 if ledger.attempts else TOP + ROW + 10

    def _lane_rows(self, attempt: int) -> int:
        """One row per replica group (its lanes of several epochs share the row)."""
        return len({lane.group for lane in self.lanes.get(attempt, [])})

    def x(self, t: float) -> float:
        return LEFT + (t - self.t0) / (self.t1 - self.t0) * WIDTH

    def y(self, attempt: int) -> float:
        return self.tops.get(attempt, float(TOP))

    def _row_of(self, seg: Segment) -> int:
        """Pending time is drawn in the row of the attempt it waits for (the next one) when there is one."""
        if seg.phase is Phase.QUEUED:
            return self.led.attempts[0].attempt if self.led.attempts else 0
        if seg.phase is Phase.PENDING:
            later = [a.attempt for a in self.led.attempts if a.start >= seg.t1 - 1e-9]
            return later[0] if later else seg.attempt
        return seg.attempt

    def _ticks(self) -> list[float]:
        span = self.t1 - self.t0
        steps = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400]
        step = next((s for s in steps if span / s <= 8), 86400 * max(1, int(span / 86400 / 8) + 1))
        return [i * step for i in range(int(span // step) + 1)]

    def svg(self) -> str:
        height = round(self.height)
        out = [
            f'<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{LEFT + WIDTH + RIGHT}" '
            f'height="{height}" viewBox="0 0 {LEFT + WIDTH + RIGHT} {height}" role="img" '
            f'preserveAspectRatio="xMinYMin meet" aria-label="timeline of the run">',
            '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
            'patternTransform="rotate(45)"><rect width="6" height="6" fill="#eeeeee"/>'
            '<line x1="0" y1="0" x2="0" y2="6" stroke="#b0b0b0" stroke-width="2"/></pattern></defs>',
        ]
        for off in self._ticks():
            x = self.x(self.t0 + off)
            out.append(
                f'<line x1="{x:.1f}" y1="{TOP - 8}" x2="{x:.1f}" y2="{height - 10}" stroke="#e4e7eb"/>'
            )
            out.append(
                f'<text class="small" x="{x:.1f}" y="{TOP - 12}" text-anchor="middle">+{_tick(off)}</text>'
            )
        out.append(f'<text class="small" x="4" y="{TOP - 12}">{_e(_clock(self.t0))}</text>')
        for a in self.led.attempts:
            out.append(self._attempt(a.attempt))
        for s in self.led.segments:
            if s.phase in (Phase.PENDING, Phase.QUEUED):
                out.append(self._pending(s))
        for i, inc in enumerate(self.led.incidents):
            out.append(self._marker(i, inc))
        out.append("</svg>")
        return "\n".join(out)

    def _attempt(self, attempt: int) -> str:
        a = next(a for a in self.led.attempts if a.attempt == attempt)
        y = self.y(attempt)
        bar = y + 20
        out = [f'<g class="attempt-bar" data-attempt="{attempt}">']
        out.append(f'<text x="4" y="{bar + 11}" font-weight="600">attempt {attempt}</text>')
        for i, line in enumerate([f"job {a.job_id}" if a.job_id else "", a.end_reason or "running"]):
            if line:
                out.append(
                    f'<text class="small attempt-label" x="4" y="{bar + 24 + 11 * i}">{_e(_short(line))}'
                    f"<title>{_e(line)}</title></text>"
                )
        x0, x1 = self.x(a.start), self.x(a.end)
        out.append(
            f'<rect class="attempt-bg" x="{x0:.1f}" y="{bar}" width="{max(1.0, x1 - x0):.1f}" height="24" '
            f'fill="#f5f7fa" stroke="#9aa5b1"><title>attempt {attempt}: {_e(_clock(a.start))} to '
            f"{_e(_clock(a.end))} ({duration(a.seconds)})</title></rect>"
        )
        for s in self.led.segments:
            if s.attempt != attempt or s.phase in (Phase.PENDING, Phase.QUEUED):
                continue
            out.append(self._segment(s, bar))
        for i, r in enumerate(a.rounds):
            end = a.rounds[i + 1].start if i + 1 < len(a.rounds) else a.end
            rx0, rx1 = self.x(r.start), self.x(end)
            shade = "#dbe4ee" if i % 2 == 0 else "#c3d0de"
            first = f"first step {_clock(r.first_step)}" if r.first_step is not None else "no step reached"
            est = " (estimated)" if r.first_step_estimated and r.first_step is not None else ""
            out.append(
                f'<g class="round-seg" data-round="{r.round}"><rect x="{rx0:.1f}" y="{y + 4}" '
                f'width="{max(1.0, rx1 - rx0):.1f}" height="13" fill="{shade}"/>'
                f"<title>round {r.round}: world size {r.world_size}; {_e(first)}{est}</title>"
                + (
                    f'<text class="small" x="{rx0 + 3:.1f}" y="{y + 14}">r{r.round}</text>'
                    if rx1 - rx0 > 18
                    else ""
                )
                + f'<line class="round-boundary" x1="{rx0:.1f}" y1="{y + 4}" x2="{rx0:.1f}" y2="{bar + 24}" '
                'stroke="#52606d" stroke-width="1"/></g>'
            )
        out += self._group_lanes(attempt, bar + 46)
        for c in self.led.checkpoints:
            if a.start <= c.ts <= a.end:
                cx = self.x(c.ts)
                what = f"checkpoint step {c.step}" if c.step is not None else f"checkpoint {c.name}"
                if not c.published:
                    what += f" ({c.name}, written by the script, not published)"
                out.append(
                    f'<line class="checkpoint-tick" x1="{cx:.1f}" y1="{bar + 33}" x2="{cx:.1f}" '
                    f'y2="{bar + 41}" stroke="#1f2933" stroke-width="1.5"'
                    + ("" if c.published else ' stroke-dasharray="2 1"')
                    + f"><title>{_e(what)} at {_e(_clock(c.ts))}</title></line>"
                )
        out.append("</g>")
        return "\n".join(out)

    def _group_lanes(self, attempt: int, top: float) -> list[str]:
        """One thin lane per replica group: its own timeline, coloured by phase."""
        lanes = self.lanes.get(attempt, [])
        rows = {g: i for i, g in enumerate(sorted({lane.group for lane in lanes}))}
        out = []
        for lane in lanes:
            y = top + LANE * rows[lane.group]
            lost = sum(i.lost_s for i in lane.incidents)
            out.append(
                f'<g class="group-lane" data-group="{lane.group}"><text class="small" x="14" y="{y + 10}">'
                f"group {lane.group}</text><title>replica group {lane.group}: productive "
                f"{duration(lane.seconds('productive'))}, lost {duration(lost)}</title>"
            )
            for sp in lane.spans:
                x0, x1 = self.x(sp.t0), self.x(sp.t1)
                phase = Phase(sp.phase)
                tip = f"group {lane.group}: {_PHASE_TEXT[phase]}: {duration(sp.t1 - sp.t0)}" + (
                    f" — {sp.cause}" if sp.incident is not None else ""
                )
                out.append(
                    f'<rect class="lane-seg lane-{sp.phase}" data-group="{lane.group}" x="{x0:.2f}" '
                    f'y="{y + 1}" width="{max(x1 - x0, 0.5):.2f}" height="{LANE - 4}" '
                    f'fill="{PHASE_COLOURS[phase]}">'
                    f"<title>{_e(tip)}</title></rect>"
                )
            for inc in lane.incidents:
                x = self.x(inc.t_fail)
                tip = f"group {inc.group}: {inc.kind} at {_clock(inc.t_fail)}: {inc.cause}"
                colour = CAUSE_COLOURS.get(inc.kind, "#555555")
                out.append(
                    f'<path class="group-failure-marker" d="M{x - 4:.1f},{y} L{x + 4:.1f},{y + LANE - 2} '
                    f'M{x + 4:.1f},{y} L{x - 4:.1f},{y + LANE - 2}" stroke="{colour}" '
                    f'stroke-width="2"><title>{_e(tip)}</title></path>'
                )
            out.append("</g>")
        return out

    def _segment(self, s: Segment, bar: float) -> str:
        x0, x1 = self.x(s.t0), self.x(s.t1)
        w = max(x1 - x0, 0.0 if s.phase is Phase.PRODUCTIVE else 1.0)
        colour = PHASE_COLOURS[s.phase] if s.phase is Phase.UNKNOWN else CAUSE_COLOURS.get(s.cause, "#555555")
        tip = (
            f"{_PHASE_TEXT[s.phase]}{' (estimated)' if s.estimated else ''}: {duration(s.seconds)}"
            + (f" — {s.cause}" if s.phase is not Phase.PRODUCTIVE else "")
            + (f", round {s.round}" if s.round is not None else "")
        )
        opacity = ' fill-opacity="0.6"' if s.estimated else ""
        return (
            f'<rect class="seg seg-{s.phase.value}" data-cause="{_e(s.cause)}" x="{x0:.2f}" y="{bar + 1}" '
            f'width="{w:.2f}" height="22" fill="{colour}"{opacity}><title>{_e(tip)}</title></rect>'
            f'<rect class="phase" x="{x0:.2f}" y="{bar + 26}" width="{w:.2f}" height="6" '
            f'fill="{PHASE_COLOURS[s.phase]}"><title>{_e(tip)}</title></rect>'
        )

    def _pending(self, s: Segment) -> str:
        bar = self.y(self._row_of(s)) + 20
        x0, x1 = self.x(s.t0), self.x(s.t1)
        what = (
            "queued before the first start"
            if s.phase is Phase.QUEUED
            else f"pending after a requeue ({s.cause})"
        )
        label = "pending" if s.phase is Phase.PENDING else "queued"
        text = (
            f'<text class="small" x="{(x0 + x1) / 2:.1f}" y="{bar + 15}" text-anchor="middle">{label}</text>'
        )
        return (
            f'<g class="seg seg-{s.phase.value}"><rect x="{x0:.2f}" y="{bar + 1}" '
            f'width="{max(1.0, x1 - x0):.2f}" height="22" fill="url(#hatch)" stroke="#b0b0b0">'
            f"<title>{_e(what)}: {duration(s.seconds)}</title></rect>"
            + (text if x1 - x0 > 50 else "")
            + "</g>"
        )

    def _marker(self, index: int, inc: Incident) -> str:
        bar = self.y(inc.attempt) + 20
        x = self.x(inc.t_fail)
        colour = CAUSE_COLOURS.get(inc.kind.value, "#555555")
        tip = f"#{index + 1} {inc.kind.value} at {_clock(inc.t_fail)}: {inc.cause}"
        top, low = bar - 12, bar - 2
        cross = f"M{x - 5:.1f},{top} L{x + 5:.1f},{low} M{x + 5:.1f},{top} L{x - 5:.1f},{low}"
        return (
            f'<g class="failure-marker" data-kind="{inc.kind.value}"><title>{_e(tip)}</title>'
            f'<line x1="{x:.1f}" y1="{bar - 2}" x2="{x:.1f}" y2="{bar + 26}" stroke="#1f2933" '
            'stroke-dasharray="2 2"/>'
            f'<path d="{cross}" stroke="#ffffff" stroke-width="5" stroke-linecap="round"/>'
            f'<path d="{cross}" stroke="{colour}" stroke-width="2.5" stroke-linecap="round"/></g>'
        )


def _legend(ledger: Ledger) -> str:
    """What the picture draws: the causes and phases that occur in this run, and the marks it has."""
    drawn = {s.phase for s in ledger.segments} | {
        Phase(sp.phase)
        for lane in (ledger.replica_groups.lanes if ledger.replica_groups else [])
        for sp in lane.spans
    }
    causes = [
        c for c in CAUSE_COLOURS if c in ledger.badput_by_cause or (c == "productive" and ledger.productive_s)
    ]
    items = "".join(
        f'<li><span class="swatch" style="background:{CAUSE_COLOURS[c]}"></span>{_e(c)}</li>' for c in causes
    )
    if Phase.UNKNOWN in drawn:
        items += (
            f'<li><span class="swatch" style="background:{PHASE_COLOURS[Phase.UNKNOWN]}"></span>'
            "training, redone share unknown</li>"
        )
    phases = [p for p in Phase if p in drawn and p is not Phase.QUEUED]
    strip = "".join(
        f'<li><span class="swatch" style="background:{PHASE_COLOURS[p]}"></span>{_e(_PHASE_TEXT[p])}</li>'
        for p in phases
    )
    marks = [
        '<li><span class="swatch" style="background:#fff;border:0;color:#d64545">✕</span>'
        "failure, preemption or time limit</li>"
        if ledger.incidents
        else "",
        '<li><span class="swatch" style="background:#1f2933;width:2px"></span>checkpoint</li>'
        if ledger.checkpoints
        else "",
        '<li><span class="swatch" style="background:repeating-linear-gradient(45deg,#eee 0 3px,'
        '#b0b0b0 3px 5px)"></span>pending / queued (not allocated)</li>'
        if drawn & {Phase.PENDING, Phase.QUEUED}
        else "",
        '<li><span class="swatch" style="background:#2e9d57;opacity:.6"></span>paler: estimated</li>'
        if any(s.estimated for s in ledger.segments)
        else "",
    ]
    return (
        '<div class="legend-title">Bar colour: cause of the time</div>'
        f'<ul class="legend" id="legend-cause">{items}{"".join(marks)}</ul>'
        '<div class="legend-title">Strip below the bar: phase</div>'
        f'<ul class="legend" id="legend-phase">{strip}</ul>'
    )


def _table(
    headers: Iterable[str], rows: Iterable[Iterable[str]], *, table_id: str, numeric: range = range(0)
) -> str:
    head = "".join(f"<th{' class=num' if i in numeric else ''}>{_e(h)}</th>" for i, h in enumerate(headers))
    body = "".join(
        "<tr>"
        + "".join(f"<td{' class=num' if i in numeric else ''}>{c}</td>" for i, c in enumerate(r))
        + "</tr>"
        for r in rows
    )
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _fig(inc: Incident, name: str) -> str:
    if name == "redone_work_s" and inc.redone_source is None:
        return (
            f'<span class="unknown" title="nothing tells what the next round resumed from: '
            f'{_e(duration(inc.unknown_s))} of training before the failure">unknown</span>'
        )
    value = duration(getattr(inc, name))
    if name in inc.estimated:
        return f'<span class="est" title="estimated">≈ {value}</span>'
    if name == "redone_work_s":  # what it rests on, as status says it
        return f'<span title="{_e(redone_text(inc))}">{value}</span>'
    return value


def _incidents(ledger: Ledger) -> str:
    if not ledger.incidents:
        return '<p id="incidents">No incidents: training was never interrupted.</p>'
    names = [
        "redone_work_s",
        "detection_s",
        "teardown_s",
        "rendezvous_s",
        "restart_to_first_step_s",
        "pending_s",
    ]
    rows = [
        [
            str(i + 1),
            f'<span title="{_e(_clock(inc.t_fail))}">{_e(_clock(inc.t_fail)[11:])}'
            + ("</span>" if "t_fail" not in inc.estimated else ' <span class="est">(≈)</span></span>'),
            f"{inc.attempt}" + (f" / {inc.round}" if inc.round is not None else ""),
            f'<span class="swatch" style="background:{CAUSE_COLOURS.get(inc.kind.value, "#555")}"></span>'
            + _e(inc.kind.value),
            _e(inc.cause),
            *[_fig(inc, n) for n in names],
            duration(inc.lost_s),
            _e(inc.recovery) + (f" ({inc.redone_steps} steps redone)" if inc.redone_steps else ""),
        ]
        for i, inc in enumerate(ledger.incidents)
    ]
    headers = ["#", "when", "attempt/ round", "kind", "what", "redone work", "detection", "teardown",
               "rendezvous", "restart to 1st step", "pending", "lost", "recovery"]  # fmt: skip
    return '<div class="wide">' + _table(headers, rows, table_id="incidents", numeric=range(5, 12)) + "</div>"


def _by(ledger: Ledger, totals: dict[str, float], table_id: str, colours: dict[str, str]) -> str:
    rows = [
        [
            f'<span class="swatch" style="background:{colours.get(k, "#555")}"></span>{_e(k)}',
            duration(v),
            _pct(v, ledger.allocated_s),
        ]
        for k, v in sorted(totals.items(), key=lambda kv: -kv[1])
    ]
    return _table(["cause" if table_id == "by-cause" else "phase", "time", "of allocated"], rows,
                  table_id=table_id, numeric=range(1, 3))  # fmt: skip


def _incident_count(ledger: Ledger) -> str:
    rep = ledger.replica_groups
    groups = sum(len(lane.incidents) for lane in rep.lanes) if rep is not None else 0
    return f"{len(ledger.incidents)}" + (f" + {groups} in groups" if groups else "")


def _replica_table(rep: ReplicaFigures) -> list[str]:
    """The replica groups: each group's time and failures, then the group incidents."""
    rows = [
        [
            str(t.group),
            duration(t.productive_s),
            duration(t.lost_s),
            str(t.restarts),
            ("≈ " if t.steps_missed_estimated else "") + str(t.steps_missed),
            duration(t.startup_s),
            duration(t.shutdown_s),
            duration(t.dropped_s) if t.dropped else "-",
        ]
        for t in rep.per_group
    ]
    headers = ["group", "productive", "lost", "restarts", "steps missed", "startup", "shutdown", "left out"]
    incidents = [
        [
            str(i.group),
            f"{i.attempt} / {i.round}",
            _e(i.kind),
            _e(i.cause),
            duration(i.detection_s),
            duration(i.teardown_s),
            duration(i.rendezvous_s),
            duration(i.restart_to_heal_s),
            duration(i.lost_s),
            _e(f"healed from group(s) {', '.join(map(str, i.healed_from))}" if i.healed_from else i.recovery),
        ]
        for lane in rep.lanes
        for i in lane.incidents
    ]
    inc_headers = ["group", "attempt/ round", "kind", "what", "detection", "teardown", "rendezvous",
                   "restart and heal", "lost", "recovery"]  # fmt: skip
    eff = rep.replica_step_efficiency
    summary = (
        f"{rep.groups} replica groups; replica-step efficiency "
        + (
            f"{100 * eff:.1f} % ({rep.replica_steps_committed} of {rep.replica_steps_possible})"
            if eff
            else "n/a"
        )
        + f"; the job counts as productive while at least {rep.min_groups_stepping} group steps."
    )
    return [
        "<h2>Replica groups</h2>",
        f'<p id="replica-summary">{_e(summary)}</p>',
        _table(headers, [[_e(c) for c in r] for r in rows], table_id="replica-groups", numeric=range(1, 8)),
        _table(inc_headers, incidents, table_id="group-incidents", numeric=range(4, 9)) if incidents else "",
    ]


def _grade(ettr: float | None) -> str:
    """The ratio card's colour class."""
    if ettr is None:
        return ""
    return "good" if ettr >= ETTR_GOOD else "fair" if ettr >= ETTR_FAIR else "poor"


def _jobs(log: EventLog) -> str:
    """``job(s) 11, 12`` of a Slurm run; a run of ``hpcelastic run`` has none."""
    ids = log.job_ids()
    if ids:
        return f"job(s) {', '.join(ids)}"
    return "local run (hpcelastic run, no Slurm job)"


def render_report(ledger: Ledger, log: EventLog, *, run: str, generated: float | None = None) -> str:
    """The whole page as one HTML string."""
    ratio = ratio_text(ledger)
    wall = f"{100.0 * ledger.ettr_wall:.1f} %" if ledger.ettr_wall is not None else "n/a"
    outcome = log.last(ev.JOB_SUCCEEDED, ev.JOB_FAILED, ev.CANCELLED)
    status = (
        "succeeded"
        if outcome and outcome["event"] == ev.JOB_SUCCEEDED
        else f"{outcome['event'].replace('job_', '')} ({outcome.get('reason', '')})"
        if outcome
        else "not finished"
    )
    submitted = log.first(ev.SUBMITTED)
    script = submitted.get("script") if submitted else None
    kpis = [
        ("Effective training time ratio", ratio, f"main {_grade(ledger.ettr)}", "ettr"),
        ("Productive time", duration(ledger.productive_s), "", "productive"),
        ("Allocated time", duration(ledger.allocated_s), "", "allocated"),
        ("Badput", duration(ledger.badput_s), "", "badput"),
        ("Pending after requeues", duration(ledger.pending_s), "", "pending"),
        ("Incidents", _incident_count(ledger), "", "incident-count"),
        ("Incl. pending time", wall, "", "ettr-wall"),
    ]
    if ledger.replica_groups is not None:
        eff = ledger.replica_groups.replica_step_efficiency
        kpis.insert(
            1,
            (
                "Replica-step efficiency",
                f"{100 * eff:.1f} %" if eff is not None else "n/a",
                "",
                "replica-steps",
            ),
        )
    kpi_html = "".join(
        f'<div class="kpi {cls}" id="kpi-{kid}"><div class="label">{_e(label)}</div>'
        f'<div class="value">{_e(value)}</div></div>'
        for label, value, cls, kid in kpis
    )
    meta = (
        f"{_e(run)}" + (f" · script {_e(script)}" if script else "") + f" · {_e(_jobs(log))}"
        f" · {len(ledger.attempts)} attempt(s) · outcome: {_e(status)}"
    )
    notes = [*ledger.notes]
    if ledger.queued_s:
        notes.append(
            f"queued {duration(ledger.queued_s)} before the first start (not counted in either ratio)"
        )
    notes.append(
        "effective training time ratio = productive time / allocated time; badput = allocated - productive; "
        "'incl. pending time' also counts the time spent waiting for the next allocation after a requeue"
    )
    by_phase_colours = {p.value: c for p, c in PHASE_COLOURS.items()}
    stamp = time.time() if generated is None else generated
    body = [
        f"<h1>Run report: {_e(run.rstrip('/').rsplit('/', 1)[-1])}</h1>",
        f'<p class="meta">{meta}</p>',
        f'<div class="kpis">{kpi_html}</div>',
        "<h2>Timeline</h2>",
        _Timeline(ledger).svg(),
        _legend(ledger),
        "<h2>Badput by cause</h2>",
        _by(ledger, ledger.badput_by_cause, "by-cause", CAUSE_COLOURS),
        "<h2>Badput by phase</h2>",
        _by(ledger, ledger.badput_by_phase, "by-phase", by_phase_colours),
        "<h2>Incidents</h2>",
        _incidents(ledger),
        *(_replica_table(ledger.replica_groups) if ledger.replica_groups is not None else []),
        "<h2>Notes</h2>",
        '<ul class="notes">' + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>",
        f'<p class="meta">generated {_e(_clock(stamp))} by hpcelastic</p>',
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>hpcelastic report: {_e(run)}</title>"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<style>{CSS}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
