"""The worker environment contract, traceback capture and the NVML health decisions."""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from hpcelastic.agent.console import WorkerConsole
from hpcelastic.agent.health import GpuHealth
from hpcelastic.agent.messages import Round
from hpcelastic.agent.watchdog import Watchdog
from hpcelastic.agent.workers import (
    WorkerConfig,
    WorkerGroup,
    _copy_lines,
    catches,
    node_stalled,
    read_error_file,
    traceback_from_tail,
    worker_env,
)
from hpcelastic.env.base import worker_environ
from hpcelastic.rundir import RunDir

TORCHRUN_VARS = [
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
]
HPC_VARS = [
    "HPCELASTIC_RUN_DIR",
    "HPCELASTIC_ATTEMPT",
    "HPCELASTIC_CHECKPOINT_DIR",
    "HPCELASTIC_HEARTBEAT_SOCKET",
    "HPCELASTIC_STOP_FILE",
    "HPCELASTIC_STOP_SIGNAL",
]


def config(tmp_path: Path, gpus: tuple[str, ...] = ()) -> WorkerConfig:
    return WorkerConfig(
        argv=("python", "train.py"),
        nproc=2,
        gpus=gpus,
        run_dir=RunDir(tmp_path),
        attempt=1,
        run_id="4242",
        checkpoint_dir=tmp_path / "ckpt",
        heartbeat_socket="/tmp/hb.sock",
        stop_file=tmp_path / "stop",
        stop_signal="USR2",
        environ=worker_environ(
            {
                "PATH": "/bin",
                "OMPI_COMM_WORLD_RANK": "3",
                "MPI_LOCALRANKID": "0",
                "HPCELASTIC_SECRET": "x",
                "KEEP": "1",
            }
        ),
        node_rank=2,
    )


ROUND = Round(
    round=2,
    restart_count=1,
    max_restarts=3,
    group_rank=1,
    group_world_size=3,
    rank_offset=2,
    world_size=6,
    master_addr="n0",
    master_port=41000,
)


def test_worker_env_has_the_full_torchrun_contract(tmp_path: Path) -> None:
    env = worker_env(config(tmp_path), ROUND, 1, tmp_path / "err.json")
    assert all(v in env for v in TORCHRUN_VARS + HPC_VARS)
    assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"], env["ROLE_RANK"]) == ("3", "1", "1", "3")
    assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_WORLD_SIZE"]) == ("6", "2", "3")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("n0", "41000")
    assert (env["TORCHELASTIC_RESTART_COUNT"], env["TORCHELASTIC_MAX_RESTARTS"]) == ("1", "3")
    assert env["OMP_NUM_THREADS"] == "1" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["HPCELASTIC_ATTEMPT"] == "1" and env["KEEP"] == "1"
    assert (
        "OMPI_COMM_WORLD_RANK" not in env and "MPI_LOCALRANKID" not in env and "HPCELASTIC_SECRET" not in env
    )
    assert "CUDA_VISIBLE_DEVICES" not in env and "HPCELASTIC_RESUME_FROM" not in env


def test_one_gpu_per_worker_and_resume_path(tmp_path: Path) -> None:
    cfg = config(tmp_path, gpus=("4", "5"))
    env = worker_env(cfg, ROUND, 1, tmp_path / "err.json", "/ck/step-9.pt")
    assert env["CUDA_VISIBLE_DEVICES"] == "5"
    assert env["HPCELASTIC_RESUME_FROM"] == "/ck/step-9.pt"


def test_traceback_from_worker_output_with_torch_rank_prefix() -> None:
    lines = [
        "step 3",
        "[rank3]: Traceback (most recent call last):",
        '[rank3]:   File "train.py", line 9, in <module>',
        "[rank3]:     main()",
        "[rank3]: RuntimeError: injected crash at step 8 on rank 3",
    ]
    error, tb = traceback_from_tail(lines)  # type: ignore[misc]
    assert error == "RuntimeError: injected crash at step 8 on rank 3"
    assert tb.startswith("Traceback") and "train.py" in tb
    assert traceback_from_tail(["no traceback here"]) is None


def test_torch_record_error_file(tmp_path: Path) -> None:
    path = tmp_path / "err.json"
    record = {
        "message": {
            "message": "ValueError: bad",
            "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1"},
        }
    }
    path.write_text(json.dumps(record))
    assert read_error_file(path) == ("ValueError: bad", "Traceback ...")
    assert read_error_file(tmp_path / "missing.json") is None


class FakeNVML(SimpleNamespace):
    """The few pynvml members the checker uses, with one GPU lost and one with ECC errors."""

    class NVMLError(Exception):
        def __init__(self, value: int = 999) -> None:
            super().__init__(f"nvml error {value}")
            self.value = value

    class NVMLError_NotSupported(NVMLError):  # noqa: N801
        pass

    NVML_ERROR_GPU_IS_LOST = 15
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    nvmlEventTypeXidCriticalError = 8

    def __init__(self, lost: set[int], ecc: dict[int, int], xids: list[int]) -> None:
        super().__init__()
        self.lost, self.ecc, self.xids = lost, ecc, xids

    def nvmlEventSetCreate(self) -> str:
        return "set"

    def nvmlDeviceRegisterEvents(self, handle: int, types: int, s: str) -> None:
        return None

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if i in self.lost:
            raise self.NVMLError(self.NVML_ERROR_GPU_IS_LOST)
        return i

    def nvmlDeviceGetTotalEccErrors(self, handle: int, kind: int, counter: int) -> int:
        return self.ecc.get(handle, 0)

    def nvmlEventSetWait_v2(self, s: str, timeout_ms: int) -> SimpleNamespace:
        if not self.xids:
            raise self.NVMLError(10)  # NVML_ERROR_TIMEOUT
        return SimpleNamespace(eventData=self.xids.pop(0), device=0)

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return f"GPU-{handle}"

    def nvmlDeviceGetIndex(self, handle: int) -> int:
        return handle


def test_health_reports_lost_gpu_ecc_and_critical_xid_only() -> None:
    nv = FakeNVML(lost={1}, ecc={2: 3}, xids=[13, 79])  # Xid 13 (graphics exception) is not fatal
    problems = GpuHealth(nv, ["0", "1", "2"]).check()
    assert [(p.gpu, p.reason) for p in problems] == [
        ("1", "GPU is lost (fallen off the bus)"),
        ("2", "3 uncorrectable ECC error(s)"),
        ("0", "critical Xid 79"),
    ]
    assert GpuHealth(FakeNVML(set(), {}, []), ["0"]).check() == []


def test_health_is_skipped_without_gpus_or_nvml() -> None:
    assert GpuHealth.open(()) is None
    assert GpuHealth.open(("0",)) is None  # this machine has no NVIDIA driver


def test_step_progress_outlives_stopping_the_workers(tmp_path: Path) -> None:
    """The end of an attempt is decided after the workers are stopped: their progress must be kept.

    (The agent used to read the steps of ``group.workers`` after ``stop`` had emptied it, so every
    attempt looked as if it had made no progress.)
    """
    cfg = dataclasses.replace(config(tmp_path), argv=(sys.executable, "-c", "import time; time.sleep(30)"))
    watchdog, devnull = Watchdog(), os.open(os.devnull, os.O_WRONLY)
    try:
        with selectors.DefaultSelector() as sel:
            group = WorkerGroup(cfg, sel, watchdog, out_fd=devnull)
            group.start(ROUND)
            group.beat(ROUND.rank_offset, None)
            assert not group.progressed
            group.beat(ROUND.rank_offset + 1, 7)
            group.stop(1.0)
    finally:
        watchdog.close()
        os.close(devnull)
    assert group.workers == [] and group.progressed


def test_torchft_info_lines_stay_in_the_rank_log(tmp_path: Path) -> None:
    """A torchft quorum line goes to the rank log only, also when its timestamp was torn off (seen in CI)."""
    lines = [
        b"2026-11-23T20:31:07.101 [INFO] [torchft::manager] - [Replica r0] Start quorum\n",
        b" [INFO] [torchft::manager] - [Replica r0] Start quorum for group_rank 0\n",
        b"step 3 loss 0.5\n",
        b"2026-11-23T20:31:07.101 [WARN] [torchft::manager] - quorum timed out\n",
    ]
    log = io.BytesIO()
    shown = tmp_path / "agent-output"
    with open(shown, "wb") as out:
        console = WorkerConsole("all", 0, fd=out.fileno())
        _copy_lines(io.BytesIO(b"".join(lines)), log, collections.deque(), console)
    assert log.getvalue() == b"".join(lines)
    assert shown.read_bytes() == b"[rank0] step 3 loss 0.5\n[rank0] " + lines[3]


# ---- what the agent reads in /proc before it stops a worker (issue 18, items 4 and 5) -------------
# Rank 0 has no handler for USR2; rank 1 has one (it writes a file) and keeps a checkpoint file open.
HANDLERS = """
import os, signal, sys, time
rank, out = int(os.environ["RANK"]), sys.argv[1]
if rank % 2:
    signal.signal(signal.SIGUSR2, lambda *a: open(os.path.join(out, "usr2"), "w").close())
    ckpt = open(os.path.join(os.environ["HPCELASTIC_CHECKPOINT_DIR"], "step-5.pt"), "ab")
    open(os.path.join(os.environ["HPCELASTIC_CHECKPOINT_DIR"], "old.pt"), "ab").close()
    reading = open(os.path.join(os.environ["HPCELASTIC_CHECKPOINT_DIR"], "old.pt"), "rb")
open(os.path.join(out, f"ready-{rank}"), "w").close()
time.sleep(30)
"""


def test_only_workers_with_a_handler_get_the_stop_signal_and_saves_are_seen(tmp_path: Path) -> None:
    """Workers start with the stop signal ignored; a worker without a handler (SigCgt) is not sent it and
    survives it; a file in the checkpoint dir open for writing (not one open for reading) is a save."""
    out = tmp_path / "out"
    out.mkdir()
    cfg = dataclasses.replace(config(tmp_path), argv=(sys.executable, "-c", HANDLERS, str(out)))
    cfg.checkpoint_dir.mkdir()
    watchdog, devnull = Watchdog(), os.open(os.devnull, os.O_WRONLY)
    try:
        with selectors.DefaultSelector() as sel:
            group = WorkerGroup(cfg, sel, watchdog, out_fd=devnull)
            group.start(ROUND)
            deadline = time.monotonic() + 30
            while len(list(out.glob("ready-*"))) < 2:
                assert time.monotonic() < deadline, "the workers did not start"
                time.sleep(0.05)
            plain, handler = group.workers
            assert [w.rank for w in group.signal_catching(signal.SIGUSR2)] == [plain.rank]
            while not (out / "usr2").exists():
                assert time.monotonic() < deadline, "the worker with a handler was not sent the signal"
                time.sleep(0.05)
            os.kill(plain.proc.pid, signal.SIGUSR2)  # Slurm's signal: ignored, not fatal
            time.sleep(0.2)
            assert plain.proc.poll() is None
            assert group.saving(plain) == []
            assert group.saving(handler) == [str(cfg.checkpoint_dir / "step-5.pt")]
            group.note_saves()
            assert plain.last_save is None and handler.last_save is not None
            group.stop(1.0)
    finally:
        watchdog.close()
        os.close(devnull)


def test_a_node_stalls_only_when_every_rank_does() -> None:
    assert node_stalled([1.0, 2.0], timeout=5.0, now=10.0)
    assert not node_stalled([1.0, 9.0], timeout=5.0, now=10.0)  # one rank works (or saves)
    assert not node_stalled([1.0, None], timeout=5.0, now=10.0)  # one rank never showed activity
    assert not node_stalled([], timeout=5.0, now=10.0)


def test_sigcgt_is_read_bit_by_signal() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import sys, time; print(flush=True); time.sleep(30)"],
                            stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"\n"
        assert catches(proc.pid, signal.SIGINT)  # Python's KeyboardInterrupt handler
        assert not catches(proc.pid, signal.SIGUSR2)
    finally:
        proc.kill()
        proc.wait()
    assert not catches(proc.pid, signal.SIGINT)  # no such process


WRAPPED = """
import os, subprocess, sys
child = "import os, signal, sys, time; touch = lambda n: open(os.path.join(sys.argv[1], n), 'w').close(); "
child += "signal.signal(signal.SIGUSR2, lambda *a: touch('usr2-' + os.environ['RANK'])); "
child += "touch('ready-' + os.environ['RANK']); time.sleep(30)"
subprocess.run([sys.executable, "-c", child, sys.argv[1]])
"""


def test_the_stop_signal_reaches_the_script_a_wrapper_started(tmp_path: Path) -> None:
    """The worker is a wrapper without a handler; the script it started has one: that script is sent the
    signal and the worker is not one to stop as a script without a handler."""
    out = tmp_path / "out"
    out.mkdir()
    cfg = dataclasses.replace(config(tmp_path), argv=(sys.executable, "-c", WRAPPED, str(out)))
    watchdog, devnull = Watchdog(), os.open(os.devnull, os.O_WRONLY)
    try:
        with selectors.DefaultSelector() as sel:
            group = WorkerGroup(cfg, sel, watchdog, out_fd=devnull)
            group.start(ROUND)
            deadline = time.monotonic() + 30
            while len(list(out.glob("ready-*"))) < 2:
                assert time.monotonic() < deadline, "the scripts did not start"
                time.sleep(0.05)
            assert group.signal_catching(signal.SIGUSR2) == []
            while len(list(out.glob("usr2-*"))) < 2:
                assert time.monotonic() < deadline, "the wrapped scripts were not sent the signal"
                time.sleep(0.05)
            group.stop(1.0)
    finally:
        watchdog.close()
        os.close(devnull)
