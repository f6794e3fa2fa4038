"""Warm starts: a worker forked by the fork server sees and does what a fresh interpreter would.

Each script runs twice, as the agent starts workers: cold (``python -u SCRIPT`` in a new session)
and warm (forked by a real fork server that has imported torch); argv, environment, ``__main__``,
signal dispositions, output, exit codes and signals must match.
"""

from __future__ import annotations

import dataclasses
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from hpcelastic.agent import workers as workers_module
from hpcelastic.agent.forkserver import ForkServer, ForkServerError, WarmProc, warm_script
from hpcelastic.agent.watchdog import Watchdog
from hpcelastic.agent.workers import TREE_VARIABLE, WorkerGroup, _child_setup, base_env, tree_marker
from tests.faults.localjob import LocalJob
from tests.unit.test_workers_env import ROUND, config

PROBE = """
import json, os, signal, sys, threading, time, atexit
mode = sys.argv[1]
def disp(s):
    h = signal.getsignal(s)
    return h if isinstance(h, int) else getattr(h, "__name__", str(h))
facts = {
    "argv": sys.argv, "orig_argv": sys.orig_argv[1:], "name": __name__, "file": __file__,
    "path0": sys.path[0], "cwd": os.getcwd(), "env": dict(os.environ),
    "main_is_module": sys.modules["__main__"].__dict__ is globals(),
    "signals": {s.name: disp(s) for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP)},
    "mask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "own_session": os.getsid(0) == os.getpid(), "stdin": sys.stdin.read(),
    "stdout_fd1": sys.stdout.fileno(), "threads": len(os.listdir("/proc/self/task")),
    "flags_unbuffered": sys.stdout.write_through,
}
if mode == "facts":
    print(json.dumps(facts))
elif mode == "exit3":
    sys.exit(3)
elif mode == "exitmsg":
    sys.exit("bad config")
elif mode == "raise":
    def inner():
        raise ValueError("boom")
    inner()
elif mode == "interrupt":
    raise KeyboardInterrupt
elif mode == "shutdown":
    atexit.register(lambda: print("atexit ran", flush=True))
    leftover = open(sys.argv[2], "w")
    leftover.write("unflushed data")
    def late():
        time.sleep(0.3)
        print("thread joined", flush=True)
    threading.Thread(target=late).start()
    print("main done")
elif mode == "sigterm":
    signal.signal(signal.SIGUSR1, lambda *a: print("usr1 handled", flush=True))
    print("ready", flush=True)
    while True:
        time.sleep(0.05)
"""


def worker_environ(tmp: Path) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "RANK": "3",
        "WORLD_SIZE": "4",
        "MY_VAR": "x y",
        "HOME": str(tmp),
    }


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("probe") / "probe.py"
    path.write_text(PROBE)
    return path


@pytest.fixture(scope="module")
def server(probe: Path) -> Iterator[ForkServer]:
    env = worker_environ(probe.parent) | {"RANK": "server-only", "SERVER_ONLY": "1"}
    fs = ForkServer(sys.executable, str(probe), env, preexec_fn=_child_setup)
    assert fs.ready(), fs.problem
    yield fs
    fs.close()


def run_cold(argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        argv,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def run_warm(fs: ForkServer, argv: list[str], env: dict[str, str]) -> WarmProc:
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        pid, pidfd = fs.spawn(argv[2:], env, w, argv)
    finally:
        os.close(w)
    proc = WarmProc(fs, pid, open(r, "rb"), pidfd)  # noqa: SIM115 - closed by the caller's read
    os.close(pidfd)
    return proc


def both(fs: ForkServer, probe: Path, *args: str) -> tuple[tuple[int, str], tuple[int, str]]:
    """(return code, output) of the probe started cold and warm."""
    argv = [sys.executable, "-u", str(probe), *args]
    env = worker_environ(probe.parent)
    out = []
    for proc in (run_cold(argv, env), run_warm(fs, argv, env)):
        assert proc.stdout is not None
        text = proc.stdout.read().decode()
        out.append((proc.wait(timeout=60), text))
    return out[0], out[1]


def test_a_warm_worker_sees_what_a_cold_one_sees(server: ForkServer, probe: Path) -> None:
    (cold_code, cold_out), (warm_code, warm_out) = both(server, probe, "facts")
    cold, warm = json.loads(cold_out), json.loads(warm_out)
    assert cold_code == warm_code == 0
    assert warm == cold
    # Replaced wholesale: nothing of the server's (LC_CTYPE is the interpreter's own PEP 538 coercion).
    assert {k: v for k, v in warm["env"].items() if k != "LC_CTYPE"} == worker_environ(probe.parent)
    assert warm["name"] == "__main__" and warm["main_is_module"] and warm["own_session"]
    assert warm["threads"] == 1 and warm["stdin"] == ""


@pytest.mark.parametrize(
    ("mode", "code"), [("exit3", 3), ("exitmsg", 1), ("raise", 1), ("interrupt", -signal.SIGINT)]
)
def test_exit_codes_and_tracebacks_match(server: ForkServer, probe: Path, mode: str, code: int) -> None:
    cold, warm = both(server, probe, mode)
    assert cold == warm
    assert warm[0] == code


def test_shutdown_joins_threads_runs_atexit_and_flushes_files(
    server: ForkServer, probe: Path, tmp_path: Path
) -> None:
    cold_file, warm_file = tmp_path / "cold.txt", tmp_path / "warm.txt"
    argv = [sys.executable, "-u", str(probe), "shutdown"]
    env = worker_environ(probe.parent)
    cold = run_cold([*argv, str(cold_file)], env)
    warm = run_warm(server, [*argv, str(warm_file)], env)
    for proc in (cold, warm):
        assert proc.wait(timeout=60) == 0
    assert warm.stdout.read() == cold.stdout.read() == b"main done\nthread joined\natexit ran\n"  # type: ignore[union-attr]
    assert warm_file.read_text() == cold_file.read_text() == "unflushed data"


def test_signals_reach_a_warm_worker_and_its_pidfd_reports_the_exit(server: ForkServer, probe: Path) -> None:
    argv = [sys.executable, "-u", str(probe), "sigterm"]
    r, w = os.pipe2(os.O_CLOEXEC)
    pid, pidfd = server.spawn(argv[2:], worker_environ(probe.parent), w, argv)
    os.close(w)
    proc = WarmProc(server, pid, open(r, "rb"), pidfd)  # noqa: SIM115
    assert proc.stdout.readline() == b"ready\n"
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.1)
    proc.send_signal(signal.SIGUSR1)
    assert proc.stdout.readline() == b"usr1 handled\n"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    # The pidfd (the agent's view of a process that is not its child) is readable once it exited.
    import select

    assert select.select([pidfd], [], [], 5)[0] == [pidfd]
    os.close(pidfd)


def test_warm_path_only_for_plain_scripts_of_this_interpreter() -> None:
    assert warm_script((sys.executable, "-u", "t.py", "--x")) == ("t.py", "")
    assert warm_script((sys.executable, "-u", "-m", "pkg.train")) == (None, "module mode (-m)")
    assert warm_script(("/usr/bin/train-bin", "--x")) == (None, "not a Python script")
    assert warm_script(("/other/python", "-u", "t.py")) == (None, "not a Python script")


def _alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie (an orphan reparented to a subreaper in this process)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_dead_server_takes_its_workers_and_refuses_new_ones(probe: Path) -> None:
    fs = ForkServer(sys.executable, str(probe), worker_environ(probe.parent), preload=("json",))
    try:
        assert fs.ready(), fs.problem
        argv = [sys.executable, "-u", str(probe), "sigterm"]
        proc = run_warm(fs, argv, worker_environ(probe.parent))
        assert proc.stdout.readline() == b"ready\n"
        os.kill(fs.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if not _alive(proc.pid):
                break
            time.sleep(0.05)
        else:
            pytest.fail("the worker outlived its fork server")
        with pytest.raises(ForkServerError):
            run_warm(fs, argv, worker_environ(probe.parent))
    finally:
        fs.close()


def test_a_preload_that_fails_is_reported(probe: Path) -> None:
    fs = ForkServer(sys.executable, str(probe), worker_environ(probe.parent), preload=("no_such_module_x",))
    try:
        assert not fs.ready()
        assert "importing no_such_module_x failed" in (fs.problem or "")
    finally:
        fs.close()


# ---- through the agents (`hpcelastic run`'s code path) -------------------------------------------
def started_events(job: LocalJob) -> list[dict[str, object]]:
    return [e for e in job.rd.events() if e["event"] == "workers_started"]


def test_agents_restart_warm_workers_and_say_so(tmp_path: Path) -> None:
    job = LocalJob(tmp_path, nodes="2", nproc=2, train_args=("--crash-at-step", "5", "--crash-rank", "1"))
    assert job.wait(timeout=240) == [0, 0]
    started = started_events(job)
    assert [(e["round"], e["spawn"], e["cold_reasons"]) for e in started] == [
        (0, "warm", {}),
        (1, "warm", {}),
    ]
    assert json.loads(job.out.read_text())["world_size"] == 4


def test_no_warm_start_spawns_cold_and_says_why(tmp_path: Path) -> None:
    job = LocalJob(tmp_path, nodes="2", nproc=2, agent_args=("--no-warm-start",))
    assert job.wait(timeout=240) == [0, 0]
    why = "warm starts are off (--no-warm-start)"
    assert [(e["spawn"], e["cold_reasons"]) for e in started_events(job)] == [("cold", {"0": why, "1": why})]


# ---- the opt-out: site key `warm_start`, agent flag `--no-warm-start` -----------------------------
def test_site_key_warm_start_false_renders_no_warm_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpcelastic import sites
    from hpcelastic.errors import UserError
    from hpcelastic.jobs.render import agent_argv
    from hpcelastic.jobs.spec import build_spec

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("HPCELASTIC_SITE", raising=False)
    script = tmp_path / "train.py"
    script.write_text("")

    def argv() -> tuple[str, ...]:
        spec = build_spec(sites.resolve("default", None), script=str(script), cwd=str(tmp_path),
                          run_dir=str(tmp_path / "run"))  # fmt: skip
        return agent_argv(spec)

    assert "--no-warm-start" not in argv()
    user = tmp_path / "xdg" / "hpcelastic" / "config.yaml"
    user.parent.mkdir(parents=True)
    user.write_text("warm_start: false\n")
    assert "--no-warm-start" in argv()
    user.write_text("warm_start: 3\n")
    with pytest.raises(UserError, match="warm_start"):
        argv()


# ---- a warm worker's tree is the agent's to end (issue 18, item 10) ------------------------------
# Forks (no exec) a child that leaves the session, writes its pid, then both sleep.
FORKING = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    with open(os.path.join(sys.argv[1], f"child-{os.environ['RANK']}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(300)
    os._exit(0)
time.sleep(300)
"""


@pytest.fixture
def warm_group(tmp_path: Path) -> Iterator[tuple[WorkerGroup, ForkServer]]:
    """A node's worker group (2 workers of FORKING) forked warm by a real fork server."""
    script = tmp_path / "forking.py"
    script.write_text(FORKING)
    argv = (sys.executable, "-u", str(script), str(tmp_path))
    cfg = dataclasses.replace(config(tmp_path), argv=argv)
    fs = ForkServer(
        sys.executable, str(script), base_env(cfg.environ, 2), preload=("json",), preexec_fn=_child_setup
    )
    watchdog, devnull = Watchdog(), os.open(os.devnull, os.O_WRONLY)
    try:
        with selectors.DefaultSelector() as sel:
            group = WorkerGroup(cfg, sel, watchdog, out_fd=devnull, forkserver=fs)
            group.start(ROUND)
            assert group.spawn == "warm", group.spawn_reason
            yield group, fs
            group.stop(0.5)
    finally:
        os.kill(fs.pid, signal.SIGCONT)
        fs.close()
        watchdog.close()
        os.close(devnull)


def _children(d: Path) -> list[int]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        files = sorted(d.glob("child-*"))
        if len(files) == 2 and all(f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.05)
    pytest.fail("the warm workers did not fork")


def test_a_setsid_fork_of_a_warm_worker_carries_the_marker_and_dies_with_it(
    warm_group: tuple[WorkerGroup, ForkServer], tmp_path: Path
) -> None:
    """What teardown reads is /proc/PID/environ, which os.environ never changes: the fork server's own
    environment carries the marker, so a warm worker's fork that called setsid is found and killed."""
    group, _fs = warm_group
    children = _children(tmp_path)
    marker = f"{TREE_VARIABLE}={tree_marker()}".encode()
    for pid in [w.proc.pid for w in group.workers] + children:
        assert marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"), pid
    group.stop(0.5)
    deadline = time.monotonic() + 5  # a SIGKILLed process ends when next scheduled
    while [c for c in children if _alive(c)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [c for c in children if _alive(c)], "a setsid fork of a warm worker survived the stop"


def test_a_warm_worker_is_signalled_through_its_pidfd(
    warm_group: tuple[WorkerGroup, ForkServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fork server reaps warm workers, so their pids may be reused: never signalled by pid."""
    group, _fs = warm_group
    _children(Path(group.cfg.checkpoint_dir).parent)
    worker = group.workers[0]

    def no_kill(pid: int, sig: int) -> None:
        assert pid != worker.proc.pid, "a warm worker signalled by pid"

    monkeypatch.setattr(os, "kill", no_kill)
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.proc.wait(timeout=30) == -signal.SIGTERM


def test_a_worker_that_does_not_go_after_sigkill_does_not_wedge_the_agent(
    warm_group: tuple[WorkerGroup, ForkServer], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Its exit never reported (here: the fork server is stopped, as a worker in uninterruptible I/O never
    exits): stop() waits a bounded time, says so, and returns."""
    group, fs = warm_group
    _children(tmp_path)
    monkeypatch.setattr(workers_module, "KILL_WAIT_S", 1.0)
    os.kill(fs.pid, signal.SIGSTOP)
    stopper = threading.Thread(target=group.stop, args=(0.3,), daemon=True)
    t0 = time.monotonic()
    stopper.start()
    stopper.join(timeout=20)
    assert not stopper.is_alive(), "stop() waits forever for a worker whose exit never comes"
    assert time.monotonic() - t0 < 10 and group.workers == []
