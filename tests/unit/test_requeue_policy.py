"""The requeue executor's decisions and fault handling, without a Slurm cluster.

The decisions that never reach Slurm (limits, start-up failures, success, cancel, races) run as
is. The fault paths (slurmctld unreachable, scontrol missing, exclusion refused while running)
use small stand-in commands on PATH that fail the way Slurm's do; what real scontrol and sbatch
do is tested in tests/slurm/test_requeue_slurm.py.
"""

from __future__ import annotations

import json
import multiprocessing
import stat
import sys
import time
from pathlib import Path

import pytest

from hpcelastic import events, handoff
from hpcelastic.env.slurm import job_id
from hpcelastic.events import Event, EventLog, EventName
from hpcelastic.lifecycle.attempt_end import end_attempt
from hpcelastic.lifecycle.cancel import mark_cancelled
from hpcelastic.lifecycle.classify import classify_stop_signal
from hpcelastic.lifecycle.executor import Executor, Outcome
from hpcelastic.lifecycle.history import (
    History,
    excluded_nodes,
    requeue_counts,
    root_cause_signature,
)
from hpcelastic.lifecycle.policy import (
    MAX_STOPS_WITHOUT_PROGRESS,
    AttemptEnd,
    Settings,
    stops_without_progress,
)
from hpcelastic.reasons import Reason, RequeueCounter
from hpcelastic.rundir import RunDir

FAST = (0.01, 0.01, 0.01)

_FAKE_SCONTROL = """#!{python}
import json, os, sys
log = os.environ["FAKE_LOG"]
with open(log, "a") as f:
    f.write(json.dumps(["scontrol", *sys.argv[1:]]) + "\\n")
mode = os.environ.get("FAKE_SCONTROL", "unreachable")
state_file = log + ".state"
state = open(state_file).read() if os.path.exists(state_file) else "RUNNING"
if mode == "unreachable":
    sys.stderr.write("scontrol: error: Unable to contact slurm controller (connect failure)\\n")
    sys.exit(1)
if sys.argv[1] == "--json":  # as 22.05's scontrol says it
    sys.stderr.write("scontrol: unrecognized option '--json'\\n")
    sys.stderr.write("Try \\"scontrol --help\\" for more information\\n")
    sys.exit(1)
if sys.argv[1:3] == ["show", "job"]:
    end = os.environ.get("FAKE_END", "Unknown")
    preempt = os.environ.get("FAKE_PREEMPT", "None")
    print(f"JobId=123 JobName=t JobState={{state}} Restarts=0 EndTime={{end}} "
          f"PreemptTime={{preempt}} ExcNodeList=(null) WorkDir=/tmp")
elif sys.argv[1] == "update":
    if state == "RUNNING":
        sys.stderr.write("scontrol: error: Job is no longer pending execution for job 123\\n")
        sys.exit(1)
elif sys.argv[1] == "requeue":
    open(state_file, "w").write("PENDING")
"""

_FAKE_SBATCH = """#!{python}
import json, os, sys
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps(["sbatch", *sys.argv[1:]]) + "\\n")
print("4242")
"""

_FAKE_SQUEUE = """#!{python}
import sys
"""


def _fake_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, commands: dict[str, str]) -> Path:
    """Put stand-in Slurm commands (and nothing else Slurm) first on PATH; returns the call log."""
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    for name, text in commands.items():
        p = bindir / name
        p.write_text(text.format(python=sys.executable))
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setenv("PATH", str(bindir))
    return log


def _calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture(autouse=True)
def no_real_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No Slurm command is found unless a test puts its stand-ins on PATH: the job ids here ("123")
    may be real jobs of a testbed running beside these tests, which must neither be asked nor requeued."""
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))


@pytest.fixture
def rd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RunDir:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    r = RunDir.create(tmp_path / "run")
    (r.path / "job.sbatch").write_text("#!/bin/bash\n#SBATCH --requeue\nsleep 60\n")
    r.record(events.submitted(job_id="123", backend="sbatch", nodes="2", script=str(r.script_path)))
    handoff.begin_attempt(r, "123", 0, ["node1", "node2"])
    return r


def _kinds(rd: RunDir) -> list[str]:
    return [e["event"] for e in rd.events()]


def _quiet() -> Executor:
    return Executor(retry_delays_s=FAST, say=lambda m: None)


def _conclude(
    rd: RunDir,
    attempt: int,
    reason: str,
    exit_code: int,
    bad_nodes: list[str],
    job: str | None,
    root: dict[str, object] | None = None,
    *,
    max_requeues: int = 2,
    executor: Executor | None = None,
) -> Outcome:
    """End ``attempt`` through the executor, as the agent does (the root cause given directly)."""
    end = AttemptEnd(
        attempt, Reason(reason), exit_code, job, tuple(bad_nodes), signature=root_cause_signature(root)
    )
    return (executor or _quiet()).conclude(rd, end, Settings.parse("requeue", max_requeues))


def test_success_needs_no_requeue(rd: RunDir) -> None:
    out = _conclude(rd, 0, "succeeded", 0, [], "123")
    assert (out.action, out.exit_code) == ("not_needed", 0)
    assert _kinds(rd)[-2:] == ["attempt_ended", "job_succeeded"]


def test_requeue_limit_zero_skips_with_a_clear_event(rd: RunDir) -> None:
    msgs: list[str] = []
    out = _conclude(
        rd, 0, "restarts_exhausted", 3, [], "123", max_requeues=0, executor=Executor(say=msgs.append)
    )
    assert (out.action, out.exit_code) == ("skipped", 3)
    skipped = [e for e in rd.events() if e["event"] == "requeue_skipped"]
    assert skipped[0]["reason"] == "limit_reached" and "--max-requeues" in skipped[0]["detail"]
    assert rd.events()[-1]["event"] == "job_failed" and rd.events()[-1]["reason"] == "restarts_exhausted"
    assert msgs and "--max-requeues" in msgs[0]


def _root(port: int) -> dict[str, object]:
    return {"exitcode": 1, "error": f"ConnectionError: node{port % 7} refused port {port}", "signal": None}


def test_identical_startup_failure_is_not_requeued_twice(rd: RunDir) -> None:
    first = _conclude(rd, 0, "restarts_exhausted", 3, [], None, _root(29500))
    assert first.action == "skipped"  # no Slurm job id here; the failure's signature is still recorded
    handoff.begin_attempt(rd, "123", 1)
    second = _conclude(rd, 1, "restarts_exhausted", 3, [], "123", _root(31044))
    assert (second.action, second.exit_code, second.reason) == ("skipped", 8, "startup_failure")
    skipped = [e for e in rd.events() if e["event"] == "requeue_skipped"]
    assert skipped[-1]["reason"] == "startup_failure"
    last = rd.events()[-1]
    assert last["event"] == "job_failed" and last["exit_code"] == 8


def test_same_failure_after_progress_is_requeued(
    rd: RunDir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _conclude(rd, 0, "restarts_exhausted", 3, [], None, _root(1))
    handoff.begin_attempt(rd, "123", 1)
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "s.pt").write_bytes(b"w")
    handoff.publish(rd, ck, ck / "s.pt", 50, 1, 0)
    monkeypatch.setenv(
        "PATH", str(tmp_path / "empty")
    )  # no Slurm: the decision must get past the start-up check
    out = _conclude(rd, 1, "restarts_exhausted", 3, [], "123", _root(1))
    assert out.reason == "restarts_exhausted" and out.action == "failed"
    assert [e["event"] for e in rd.events()].count("requeue_failed") == 2


def _decide_in_child(run: str, q: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    end = AttemptEnd(0, Reason.SUCCEEDED, 0, "123")
    out = Executor(say=lambda m: None).conclude(RunDir(run), end, Settings())
    q.put(out.action)


def test_racing_deciders_decide_once(rd: RunDir) -> None:
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_decide_in_child, args=(str(rd.path), q)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    actions = sorted(q.get(timeout=5) for _ in procs)
    assert actions == ["already_decided"] * 3 + ["not_needed"]
    assert _kinds(rd).count("attempt_ended") == 1 and _kinds(rd).count("job_succeeded") == 1


def test_cancelled_run_is_never_requeued(rd: RunDir) -> None:
    mark_cancelled(rd)
    out = _conclude(rd, 0, "preempted", 5, [], "123")
    assert out.action == "skipped" and rd.events()[-2]["reason"] == "cancelled"


def test_unreachable_slurmctld_retries_then_resubmits(
    rd: RunDir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = _fake_bin(
        tmp_path, monkeypatch, {"scontrol": _FAKE_SCONTROL, "sbatch": _FAKE_SBATCH, "squeue": _FAKE_SQUEUE}
    )
    out = _conclude(rd, 0, "preempted", 5, ["node2"], "123", max_requeues=0)
    assert (out.action, out.job_id, out.next_attempt, out.exit_code) == ("resubmitted", "4242", 1, 5)
    calls = _calls(log)
    requeues = [c for c in calls if c[:2] == ["scontrol", "requeue"]]
    assert len(requeues) == 1 + len(FAST)  # first try plus one per back-off step
    sbatch = [c for c in calls if c[0] == "sbatch"]
    assert len(sbatch) == 1
    assert "--dependency=afterany:123" in sbatch[0] and "--exclude=node2" in sbatch[0]
    assert sbatch[0][-1] == str(rd.script_path)
    failed = [e for e in rd.events() if e["event"] == "requeue_failed"]
    assert failed[0]["fallback"] == "resubmit" and "Unable to contact" in failed[0]["error"]
    res = rd.events()[-1]
    assert res["event"] == "resubmitted" and res["job_id"] == "4242" and res["previous_job_id"] == "123"
    assert res["exclude"] == ["node2"] and res["duration_s"] >= 0
    assert rd.latest_job_id() == "4242"
    counts = requeue_counts(rd.events())
    assert counts[RequeueCounter.PREEMPTED] == 1 and counts[RequeueCounter.FAILURE] == 0
    assert excluded_nodes(rd.events()) == ("node2",)
    from hpcelastic.record.runindex import lookup

    assert lookup("4242") == rd.path


def test_no_slurm_commands_at_all(rd: RunDir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    msgs: list[str] = []
    out = _conclude(
        rd,
        0,
        "node_unhealthy",
        7,
        ["node1"],
        "123",
        max_requeues=3,
        executor=Executor(retry_delays_s=FAST, say=msgs.append),
    )
    assert (out.action, out.exit_code) == ("failed", 7)
    failed = [e for e in rd.events() if e["event"] == "requeue_failed"]
    assert [e["fallback"] for e in failed] == ["resubmit", "none"]
    assert "not found on PATH" in failed[0]["error"]
    assert rd.events()[-1]["event"] == "job_failed" and rd.events()[-1]["reason"] == "requeue_failed"
    assert "sbatch --dependency=afterany:123" in msgs[-1]
    assert rd.latest_job_id() == "123"  # nothing was submitted


def test_bad_nodes_are_excluded_once_the_job_is_pending(
    rd: RunDir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = _fake_bin(tmp_path, monkeypatch, {"scontrol": _FAKE_SCONTROL})
    monkeypatch.setenv("FAKE_SCONTROL", "ok")
    out = _conclude(rd, 0, "node_unhealthy", 7, ["node2"], "123")
    assert (out.action, out.job_id, out.next_attempt) == ("requeued", "123", 1)
    verbs = [c[1] for c in _calls(log) if c[1] != "--json"]  # the first show asks for JSON (23.02+)
    # First: is Slurm cancelling it? Then: does the job hold GRES (the fake one holds none: no wait for
    # dead nodes), requeue, and exclude node2 once the job is pending; then how long Slurm holds it.
    assert verbs == ["show", "show", "requeue", "show", "update", "show"]
    assert _calls(log)[-2][-1] == "ExcNodeList=node2" and _calls(log)[-1][1:] == ["show", "config"]
    ev = rd.events()[-1]
    assert (
        ev["event"] == "requeued" and ev["attempt"] == 1 and ev["exclude"] == ["node2"] and ev["note"] is None
    )
    assert requeue_counts(rd.events())[RequeueCounter.NODE_UNHEALTHY] == 1


def test_classify_stop_signal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_bin(tmp_path, monkeypatch, {"scontrol": _FAKE_SCONTROL})
    monkeypatch.setenv("FAKE_SCONTROL", "ok")
    fmt = "%Y-%m-%dT%H:%M:%S"
    monkeypatch.setenv("FAKE_END", time.strftime(fmt, time.localtime(time.time() + 90)))
    assert classify_stop_signal("123") == "time_limit"
    monkeypatch.setenv("FAKE_END", time.strftime(fmt, time.localtime(time.time() + 7200)))
    assert classify_stop_signal("123") == "preempted"
    monkeypatch.setenv("FAKE_END", time.strftime(fmt, time.localtime(time.time() + 30)))
    monkeypatch.setenv("FAKE_PREEMPT", time.strftime(fmt, time.localtime()))
    assert classify_stop_signal("123") == "preempted"
    monkeypatch.setenv("FAKE_SCONTROL", "unreachable")
    assert classify_stop_signal("123") == "preempted"


def test_array_job_id_and_signature() -> None:
    env = {"SLURM_JOB_ID": "501", "SLURM_ARRAY_JOB_ID": "500", "SLURM_ARRAY_TASK_ID": "3"}
    assert job_id(env) == "500_3"
    assert job_id({"SLURM_JOB_ID": "77"}) == "77"
    assert job_id({}) is None
    assert root_cause_signature(_root(1)) == root_cause_signature(_root(2))
    other = {"exitcode": 1, "error": "SyntaxError: invalid syntax"}
    assert root_cause_signature(other) != root_cause_signature(_root(1))
    assert root_cause_signature(None) is None


def test_bad_policy_settings_are_user_errors() -> None:
    from hpcelastic.errors import UserError

    with pytest.raises(UserError, match="requeue mode"):
        Settings.parse("sometimes", 3)
    with pytest.raises(UserError, match="max-requeues"):
        Settings.parse("requeue", -1)


def test_unknown_reason_is_a_programming_error(rd: RunDir) -> None:
    assert Reason.parse("bored") is None
    with pytest.raises(ValueError):
        Reason("bored")
    assert "attempt_ended" not in _kinds(rd)
    assert not (rd.path / "claims" / "decide-attempt-0").exists()  # a later valid decision still can happen


def test_stops_without_progress_counts_the_streak() -> None:
    evs = EventLog(
        [
            {"event": "attempt_ended", "attempt": 0, "reason": "time_limit"},
            {"event": "checkpoint_published", "attempt": 0, "step": 5},
            {"event": "attempt_ended", "attempt": 1, "reason": "time_limit"},
            {"event": "attempt_ended", "attempt": 2, "reason": "preempted"},
        ]
    )

    def streak(log: EventLog, attempt: int, reason: Reason) -> int:
        history = History.from_log(log, attempt, cancelled=False)
        return stops_without_progress(history, AttemptEnd(attempt, reason, reason.exit_code, "1"))

    assert streak(evs, 3, Reason.TIME_LIMIT) == 3  # attempts 1, 2, 3; 0 published
    assert streak(evs, 3, Reason.RESTARTS_EXHAUSTED) == 0
    assert streak(EventLog(evs[:2]), 1, Reason.PREEMPTED) == 1


def test_a_job_stopped_again_and_again_without_a_checkpoint_is_not_requeued(tmp_path: Path) -> None:
    rd = RunDir(tmp_path)
    for k in range(MAX_STOPS_WITHOUT_PROGRESS - 1):
        rd.record(Event(EventName.ATTEMPT_ENDED, {"attempt": k, "reason": "time_limit", "exit_code": 5}))
    out = _conclude(rd, MAX_STOPS_WITHOUT_PROGRESS - 1, "time_limit", 5, [], "4242", max_requeues=3)
    assert out.action == "skipped"
    skipped = [e for e in rd.events() if e["event"] == "requeue_skipped"]
    assert skipped[-1]["reason"] == "no_progress" and "--time" in skipped[-1]["detail"]


def test_end_attempt_reads_the_root_cause_from_the_event_log(rd: RunDir) -> None:
    """Two attempts failing alike at start-up: end_attempt finds each root cause in the log itself."""
    failure = {"round": 0, "rank": 0, "local_rank": 0, "node_rank": 0, "node": "node1", "exitcode": 1}
    for attempt, port in ((0, 29500), (1, 31044)):
        if attempt:
            handoff.begin_attempt(rd, "123", attempt)
        err = {**failure, "error": f"ConnectionError: refused port {port}"}
        rd.record(events.root_cause(err, traceback="", exit_ts=None))
        out = end_attempt(
            rd,
            attempt,
            Reason.RESTARTS_EXHAUSTED,
            job_id=None if attempt == 0 else "123",
            requeue_mode="requeue",
            max_requeues=2,
            executor=_quiet(),
        )
    assert out.exit_code == Reason.STARTUP_FAILURE.exit_code
    ended = rd.events().of(events.ATTEMPT_ENDED)
    assert ended[0]["signature"] is not None and ended[0]["signature"] == ended[1]["signature"]


def test_a_job_given_up_on_is_not_held_by_the_expedited_requeue(
    rd: RunDir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slurm 25.11 holds (REQUEUE_HOLD) an ``--requeue=expedite`` job that exits non-zero with healthy
    epilogs: a job hpcelastic does not bring back gets ``Requeue=0`` first (from Slurm's documentation;
    no 25.11 here)."""
    log = _fake_bin(tmp_path, monkeypatch, {"scontrol": _FAKE_SCONTROL})
    monkeypatch.setenv("FAKE_SCONTROL", "ok")
    rd.write_meta({**rd.read_meta(), "requeue_expedite": True})
    out = _conclude(rd, 0, "restarts_exhausted", 3, [], "123", max_requeues=0)
    assert out.action == "skipped"
    assert ["scontrol", "update", "JobId=123", "Requeue=0"] in _calls(log)
    assert not [c for c in _calls(log) if c[1] == "requeue"]
