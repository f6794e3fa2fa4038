"""hpcelastic.worker with and without the agent's environment."""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from hpcelastic import handoff
from hpcelastic.errors import UserError
from hpcelastic.rundir import RunDir

_ENV = [
    "HPCELASTIC_RUN_DIR",
    "HPCELASTIC_ATTEMPT",
    "HPCELASTIC_CHECKPOINT_DIR",
    "HPCELASTIC_RESUME_FROM",
    "HPCELASTIC_HEARTBEAT_SOCKET",
    "HPCELASTIC_STOP_FILE",
    "HPCELASTIC_STOP_SIGNAL",
    "RANK",
]


@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[ModuleType]:
    """A freshly imported worker module with no agent environment, run from an empty directory."""
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    import hpcelastic.worker as mod

    yield importlib.reload(mod)


def _run(code: str, env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in _ENV}
    argv = [sys.executable, "-c", code]
    return subprocess.run(argv, env={**clean, **env}, cwd=cwd, capture_output=True, text=True, timeout=60)


def test_plain_python_without_agent(worker: ModuleType, tmp_path: Path) -> None:
    assert worker.resume_path() is None
    assert worker.should_stop() is False
    worker.heartbeat(3)  # no socket configured: silently nothing
    assert worker.checkpoint_dir() == str(tmp_path / "checkpoints")
    p = tmp_path / "checkpoints" / "c.pt"
    p.write_bytes(b"w")
    worker.publish_checkpoint(p, 7)
    latest = json.loads((tmp_path / "checkpoints" / handoff.LATEST_FILE).read_text())
    assert latest["path"] == str(p) and latest["step"] == 7
    with pytest.raises(UserError, match="does not exist"):
        worker.publish_checkpoint(tmp_path / "nope.pt", 8)


def test_without_agent_a_torchrun_restart_resumes_what_was_published(tmp_path: Path) -> None:
    """A named checkpoint dir, or a torchrun restart, resumes the published checkpoint; a fresh plain run
    in a directory with old checkpoints does not."""
    resume = "from hpcelastic import worker; print(worker.resume_path())"
    named = tmp_path / "named"
    here = tmp_path / "fresh"
    for d in (named, here / "checkpoints"):
        d.mkdir(parents=True)
        (d / "c.pt").write_bytes(b"w")
        handoff.write_latest_file(d, {"path": str(d / "c.pt"), "step": 4})
    assert _run(resume, {"HPCELASTIC_CHECKPOINT_DIR": str(named)}).stdout.strip() == str(named / "c.pt")
    for restarts, expected in (("0", "None"), ("1", str(here / "checkpoints" / "c.pt"))):
        got = _run(resume, {"TORCHELASTIC_RESTART_COUNT": restarts}, cwd=here)
        assert got.stdout.strip() == expected, got.stderr


def test_under_agent_publish_and_resume(
    worker: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    rd = RunDir.create(tmp_path / "run")
    ckdir = tmp_path / "ck"
    monkeypatch.setenv("HPCELASTIC_RUN_DIR", str(rd.path))
    monkeypatch.setenv("HPCELASTIC_CHECKPOINT_DIR", str(ckdir))
    monkeypatch.setenv("HPCELASTIC_ATTEMPT", "2")
    monkeypatch.setenv("RANK", "0")
    assert worker.checkpoint_dir() == str(ckdir) and ckdir.is_dir()
    p = ckdir / "step-40.pt"
    p.write_bytes(b"w")
    worker.publish_checkpoint(p, 40)
    ev = rd.events()[-1]
    assert (ev["event"], ev["step"], ev["attempt"], ev["rank"]) == ("checkpoint_published", 40, 2, 0)
    monkeypatch.setenv("HPCELASTIC_RESUME_FROM", str(p))
    assert importlib.reload(worker).resume_path() == str(p)


def test_resume_from_deleted_path_falls_back_to_record(
    worker: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    rd = RunDir.create(tmp_path / "run")
    ckdir = tmp_path / "ck"
    ckdir.mkdir()
    older = ckdir / "a.pt"
    older.write_bytes(b"w")
    handoff.publish(rd, ckdir, older, 1, 0, 0)
    monkeypatch.setenv("HPCELASTIC_RUN_DIR", str(rd.path))
    monkeypatch.setenv("HPCELASTIC_RESUME_FROM", str(ckdir / "deleted.pt"))
    assert worker.resume_path() == str(older)


def test_stop_file(worker: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    stop = tmp_path / "stop"
    monkeypatch.setenv("HPCELASTIC_STOP_FILE", str(stop))
    assert worker.should_stop() is False
    stop.touch()
    assert worker.should_stop() is True


def test_heartbeat_reaches_agent_socket(
    worker: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = str(tmp_path / "hb.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)
    server.settimeout(5)
    monkeypatch.setenv("HPCELASTIC_HEARTBEAT_SOCKET", path)
    monkeypatch.setenv("RANK", "3")
    try:
        worker.heartbeat(12)
        msg = json.loads(server.recv(4096))
    finally:
        server.close()
    assert msg["rank"] == 3 and msg["step"] == 12 and isinstance(msg["ts"], float)
    worker.heartbeat(13)  # the agent is gone: no exception, no block


def test_unusable_checkpoint_dir_is_a_user_error(
    worker: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("HPCELASTIC_CHECKPOINT_DIR", str(blocker / "ck"))
    with pytest.raises(UserError, match="checkpoint dir"):
        worker.checkpoint_dir()


_SIGNAL_SCRIPT = """
import os, signal, sys
from hpcelastic import worker
before = worker.should_stop()
os.kill(os.getpid(), signal.SIGUSR1)
print(before, worker.should_stop(), "torch" in sys.modules)
"""


def test_stop_signal_sets_flag_installed_at_import() -> None:
    out = _run(_SIGNAL_SCRIPT, {"HPCELASTIC_STOP_SIGNAL": "USR1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True", "False"]


def test_user_signal_handler_is_left_alone() -> None:
    code = (
        "import os, signal\n"
        "seen = []\n"
        "signal.signal(signal.SIGUSR2, lambda *a: seen.append(1))\n"
        "from hpcelastic import worker\n"
        "os.kill(os.getpid(), signal.SIGUSR2)\n"
        "print(seen, worker.should_stop())\n"
    )
    out = _run(code, {"HPCELASTIC_STOP_SIGNAL": "SIGUSR2"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[1]", "False"]
