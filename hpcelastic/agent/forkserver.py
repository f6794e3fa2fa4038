"""Warm worker starts: a per-node process that has imported torch forks each worker's interpreter.

The agent starts this file as a script with the worker's own interpreter (standard library only, so
it runs under any Python) and talks to it over a ``SOCK_SEQPACKET`` socket pair: JSON messages, with
file descriptors passed alongside (``SCM_RIGHTS``).

* ``{"ready": true}`` once the preloads are imported (or ``{"error": ...}`` and exit): the server
  never initialises CUDA and refuses to serve if importing started a thread (fork copies one thread).
* ``spawn`` (argv, env, cwd; the output pipe's write end attached) -> ``{"id", "pid"}`` with the
  worker's pidfd attached, so the agent watches and signals a process that is not its child.
* ``{"exit": pid, "code": N}`` when a worker ends: only the server can wait for its children.
  ``code`` follows ``Popen.returncode`` (``-SIGNUM`` for a signal).

The worker (a fork of the server) becomes what ``python -u SCRIPT ARGS`` would have been: its own
session, ``PR_SET_PDEATHSIG`` (the server dies with the agent), its share of the CPUs, fresh signal
dispositions, the environment replaced wholesale, cwd, argv, ``sys.path[0]``, stdio on the log pipe,
reseeded random generators, torch's thread count from the worker's ``OMP_NUM_THREADS``, and ``SCRIPT``
run as ``__main__`` by ``runpy.run_path``. It ends with the codes, tracebacks and shutdown a cold start
shows (threads joined, atexit handlers run, open files flushed), then ``os._exit`` instead of tearing
torch's modules down object by object (seconds). Differences: the hash seed is the server's; variables
read while importing the preloads come from the server's environment (the job's, without the per-rank
variables); ``__del__`` of objects still alive at exit does not run (as in multiprocessing's workers).
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import importlib
import io
import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, NoReturn

MAX_MESSAGE = 1 << 20
MAX_FDS = 4
PR_SET_PDEATHSIG = 1
PR_SET_PTRACER = 0x59616D61
#: The server's ``LC_CTYPE`` as the agent gave it (the interpreter may have coerced it since).
_GIVEN_CTYPE: list[str | None] = [None]
#: Signal dispositions as the interpreter set them up, before anything was imported.
_FRESH_SIGNALS = {
    s: signal.getsignal(s) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)
}


def send(sock: socket.socket, msg: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> None:
    """One message, with ``fds`` attached."""
    data = json.dumps(msg).encode()
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendmsg([data])


def recv(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the descriptors attached to it; (None, []) at end of file."""
    data, anc, _flags, _addr = sock.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(MAX_FDS * 4))
    fds: list[int] = []
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
            fds += list(arr)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), fds


def thread_count() -> int:
    """Kernel threads of this process (native ones included, which ``threading`` does not see)."""
    return len(os.listdir("/proc/self/task"))


class _Server:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sel = selectors.DefaultSelector()
        self.children: dict[int, int] = {}  # pidfd -> pid
        self.sel.register(sock, selectors.EVENT_READ, None)

    def serve(self) -> dict[str, Any] | None:
        """Serve until the agent hangs up (None), or return a spawn request in the forked worker."""
        while True:
            for key, _ in self.sel.select():
                if key.data is None:
                    msg, fds = recv(self.sock)
                    if msg is None:
                        return None
                    if self._spawn(msg, fds):
                        return msg | {"_fds": fds}
                else:
                    self._reap(key.fd)

    def _spawn(self, msg: dict[str, Any], fds: list[int]) -> bool:
        """Fork a worker; True in the worker. The parent answers with the pid and a pidfd."""
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError as e:
            send(self.sock, {"id": msg.get("id"), "error": f"fork failed: {e}"})
            for fd in fds:
                os.close(fd)
            return False
        if pid == 0:
            return True
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = pid
        self.sel.register(pidfd, selectors.EVENT_READ, pid)
        send(self.sock, {"id": msg.get("id"), "pid": pid}, [pidfd])
        return False

    def _reap(self, pidfd: int) -> None:
        pid = self.children.pop(pidfd)
        self.sel.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(OSError):
            send(self.sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})

    def close_in_child(self) -> None:
        """In a forked worker: drop the server's descriptors."""
        for pidfd in self.children:
            os.close(pidfd)
        self.sel.close()
        self.sock.close()


def _become_worker(req: dict[str, Any], server_pid: int) -> None:
    """Turn this fork into the worker process ``python -u SCRIPT ARGS`` would have started."""
    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != server_pid:  # the server died before the death signal was armed
        os._exit(1)
    if req.get("ptracer"):  # Yama ptrace_scope 1: let the agent's py-spy read this worker
        libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(req["ptracer"]), 0, 0, 0)
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)
    for sig, handler in _FRESH_SIGNALS.items():
        with contextlib.suppress(OSError, ValueError, TypeError):
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    for sig in req.get("ignore_signals", []):  # as a cold worker's preexec_fn leaves them
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    if req.get("cpus"):  # its share (hpcelastic/agent/cpus.py), as a cold worker's preexec_fn sets it
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, req["cpus"])
    out = req["_fds"][0]
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    for fd in {devnull, out}:
        os.close(fd)
    os.chdir(req["cwd"])
    coerced = _coerced_locale(req["env"])
    os.environ.clear()
    os.environ.update(req["env"] | coerced)
    argv: list[str] = req["argv"]
    sys.argv = list(argv)
    sys.orig_argv = list(req["orig_argv"])
    sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
    _fresh_stdio(bool(req.get("unbuffered")) or bool(os.environ.get("PYTHONUNBUFFERED")))
    _reseed()
    _torch_threads()


def _coerced_locale(env: dict[str, str]) -> dict[str, str]:
    """``LC_CTYPE`` as a fresh interpreter would set it (PEP 538 C locale coercion), like the server's."""
    ctype = os.environ.get("LC_CTYPE")
    same_inputs = env.get("LANG") == os.environ.get("LANG") and "LC_ALL" not in env
    if ctype is None or "LC_CTYPE" in env or not same_inputs or _GIVEN_CTYPE[0] is not None:
        return {}
    return {"LC_CTYPE": ctype}


def _fresh_stdio(unbuffered: bool) -> None:
    """New ``sys.stdin/stdout/stderr`` over fds 0-2, configured as a fresh interpreter would."""

    def stream(fd: int, mode: str, errors: str, line_buffering: bool) -> io.TextIOWrapper:
        raw: Any = io.FileIO(fd, mode, closefd=False)
        buffered = (
            raw
            if (unbuffered and mode == "w")
            else (io.BufferedWriter(raw) if mode == "w" else io.BufferedReader(raw))
        )
        return io.TextIOWrapper(
            buffered,
            encoding=sys.stdout.encoding,
            errors=errors,
            line_buffering=line_buffering,
            write_through=unbuffered and mode == "w",
        )

    sys.stdin = sys.__stdin__ = stream(0, "r", "strict", False)
    sys.stdout = sys.__stdout__ = stream(1, "w", "strict", False)
    sys.stderr = sys.__stderr__ = stream(2, "w", "backslashreplace", True)


def _torch_threads() -> None:
    """torch sized its thread pool from the server's ``OMP_NUM_THREADS`` when imported: the worker's own
    value (its share of the CPUs, hpcelastic/agent/cpus.py) is applied, as a cold start's import would."""
    torch, value = sys.modules.get("torch"), os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and value.isdigit() and int(value) > 0:
        with contextlib.suppress(Exception):
            torch.set_num_threads(int(value))


def _reseed() -> None:
    """Generators seeded from the OS at import would otherwise repeat in every fork."""
    if "random" in sys.modules:
        sys.modules["random"].seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        with contextlib.suppress(Exception):
            numpy_random.seed()


def _run_script(script: str) -> NoReturn:
    """Run ``script`` as ``__main__`` and exit as the interpreter would have, with the same code.

    Exit is CPython's shutdown without its last step: the script's non-daemon threads are joined,
    atexit handlers run and every open Python file is flushed, then ``os._exit`` (as
    multiprocessing's workers do) instead of tearing down torch's modules object by object, which
    takes seconds and would delay the agent seeing a crashed worker.
    """
    sigint = False
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = _system_exit_code(e)
    except BaseException as exc:  # noqa: BLE001 - reported exactly like an uncaught exception
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != script:
            tb = tb.tb_next
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        code, sigint = 1, isinstance(exc, KeyboardInterrupt)
    _shutdown()
    if sigint:  # CPython dies by SIGINT after an uncaught KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


def _system_exit_code(e: SystemExit) -> int:
    """The exit status CPython gives an uncaught ``SystemExit`` (printing a non-integer code)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    with contextlib.suppress(Exception):
        print(e.code, file=sys.stderr)
    return 1


def _shutdown() -> None:
    """The observable part of CPython's shutdown: join threads, run atexit, flush files."""
    import atexit
    import gc

    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for obj in gc.get_objects():  # the script's objects: the server froze its own (main)
        if issubclass(type(obj), io.IOBase):
            with contextlib.suppress(BaseException):
                if not obj.closed and obj.writable():
                    obj.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()


def _preload(modules: list[str]) -> str | None:
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as e:  # noqa: BLE001 - any failure means: no warm starts
            return f"importing {name} failed: {type(e).__name__}: {e}"
    if thread_count() != 1:
        return (
            f"importing {', '.join(modules)} started {thread_count() - 1} thread(s), which a fork would "
            "not copy (numpy's OpenBLAS does so unless OMP_NUM_THREADS is set)"
        )
    return None


def main() -> None:
    """``forkserver.py FD SCRIPT_DIR MODULES_JSON CTYPE_JSON``: preload, then serve the agent on FD."""
    fd, script_dir, modules = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    _GIVEN_CTYPE[0] = json.loads(sys.argv[4])
    sys.path[0] = script_dir
    sock = socket.socket(fileno=fd)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)  # the agent stops the server by hanging up
    problem = _preload(modules)
    try:
        if problem is not None:
            send(sock, {"error": problem})
            return
        import gc

        gc.freeze()  # the preloads' objects: never collected, so forks share their pages
        send(sock, {"ready": True, "pid": os.getpid()})
    except OSError:
        return  # the agent hung up while the preloads ran (it gave up, or ended): nothing to serve
    server_pid = os.getpid()
    server = _Server(sock)
    req = server.serve()
    if req is None:
        return
    server.close_in_child()
    _become_worker(req, server_pid)
    from hpcelastic.tier import step_clock  # the tier's evidence that a save ended (a no-op without it)

    step_clock.install_from_env()
    from hpcelastic.slow import arrivals  # who the others wait for (a no-op unless slow-node detection is on)

    arrivals.install_from_env()
    from hpcelastic.agent import pg_teardown  # a DDP script's exit never hangs in gloo's destructor

    pg_teardown.install()
    _run_script(req["argv"][0])


# ---- the agent's side ---------------------------------------------------------------------------
#: Imported by the server before it forks anything.
DEFAULT_PRELOAD = ("torch", "torch.distributed")
READY_TIMEOUT = 120.0
REPLY_TIMEOUT = 10.0


class ForkServerError(Exception):
    """The fork server cannot start workers (it failed to start, died, or did not answer)."""


def warm_script(argv: tuple[str, ...] | list[str]) -> tuple[str | None, str]:
    """(script, "") when ``argv`` is ``PYTHON -u SCRIPT ARGS`` with this interpreter, else (None, why)."""
    if len(argv) >= 2 and argv[1] == "-m" or len(argv) >= 3 and argv[2] == "-m":
        return None, "module mode (-m)"
    if len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-u":
        return None, "not a Python script"
    if argv[2].startswith("-"):
        return None, f"interpreter option {argv[2]}"
    return argv[2], ""


class WarmProc:
    """A worker forked by the fork server, with the part of ``Popen``'s interface the agent uses.

    Signalled through its own pidfd (a duplicate, closed once its exit is known): the server reaps the
    worker, so its pid can be another process's by the time the agent signals it.
    """

    def __init__(self, server: ForkServer, pid: int, stdout: io.BufferedReader, pidfd: int) -> None:
        self.server = server
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._pidfd = os.dup(pidfd)

    def poll(self) -> int | None:
        return self._ended(self.server.exit_code(self.pid, 0.0) if self.returncode is None else None)

    def wait(self, timeout: float | None = None) -> int:
        code = self._ended(self.server.exit_code(self.pid, timeout) if self.returncode is None else None)
        if code is None:
            raise subprocess.TimeoutExpired(self.server.argv, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None and self._pidfd >= 0:
            signal.pidfd_send_signal(self._pidfd, sig)

    def _ended(self, code: int | None) -> int | None:
        if self.returncode is None and code is not None:
            self.returncode = code
            os.close(self._pidfd)
            self._pidfd = -1
        return self.returncode


class ForkServer:
    """The agent's handle on its node's fork server; started at once, ready after the preloads."""

    def __init__(
        self,
        python: str,
        script: str,
        environ: dict[str, str],
        preload: tuple[str, ...] = DEFAULT_PRELOAD,
        preexec_fn: Any = None,
    ) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        script_dir = os.path.dirname(os.path.realpath(script))
        self.argv = [
            python,
            "-u",  # as the workers' command line has it (sys.flags.unbuffered)
            os.path.abspath(__file__),
            str(theirs.fileno()),
            script_dir,
            json.dumps(preload),
            json.dumps(environ.get("LC_CTYPE")),
        ]
        self._proc = subprocess.Popen(
            self.argv,
            env=environ,
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=preexec_fn,
        )
        theirs.close()
        self._sock = ours
        self._lock = threading.Lock()
        self._exits: dict[int, int] = {}
        self._next_id = 0
        self._ready = False
        #: Why warm starts are off, once they are.
        self.problem: str | None = None

    @property
    def pid(self) -> int:
        return self._proc.pid

    def ready(self, timeout: float = READY_TIMEOUT) -> bool:
        """Wait until the preloads are imported; False (and ``problem`` says why) if it failed."""
        with self._lock:
            if self._ready or self.problem:
                return self._ready
            try:
                msg = self._recv(timeout)
            except TimeoutError:
                self.problem = f"it was not ready within {timeout:.0f} s"
                return False
            except ForkServerError as e:
                self.problem = str(e)
                return False
            if msg.get("ready"):
                self._ready = True
            else:
                self.problem = str(msg.get("error") or "it did not start")
            return self._ready

    def spawn(
        self,
        argv: list[str],
        env: dict[str, str],
        out_fd: int,
        orig_argv: list[str],
        ptracer: int = 0,
        ignore_signals: tuple[int, ...] = (),
        cpus: tuple[int, ...] = (),
    ) -> tuple[int, int]:
        """Fork a worker running ``argv`` (script first) with output on ``out_fd``, ``ignore_signals``
        ignored, bound to ``cpus`` (all the server's when empty): (pid, pidfd)."""
        with self._lock:
            if self.problem:
                raise ForkServerError(self.problem)
            self._next_id += 1
            req = {
                "op": "spawn",
                "id": self._next_id,
                "argv": argv,
                "orig_argv": orig_argv,
                "env": env,
                "cwd": os.getcwd(),
                "unbuffered": True,
                "ptracer": ptracer,
                "ignore_signals": [int(sig) for sig in ignore_signals],
                "cpus": list(cpus),
            }
            try:
                send(self._sock, req, [out_fd])
                while True:
                    msg, fds = self._recv_fds(REPLY_TIMEOUT)
                    if msg.get("id") == self._next_id:
                        break
                    for fd in fds:
                        os.close(fd)
            except (OSError, TimeoutError, ForkServerError) as e:
                self.problem = f"the fork server stopped answering ({e or 'time-out'})"
                raise ForkServerError(self.problem) from None
            if "pid" not in msg or len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                raise ForkServerError(str(msg.get("error") or "no pid in the answer"))
            return int(msg["pid"]), fds[0]

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        """Worker ``pid``'s return code once the server reported it; None if not within ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while pid not in self._exits:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    self._recv(left)
                except TimeoutError:
                    return None
                except ForkServerError:
                    # The server is gone, and its workers died with it (their parent-death signal).
                    return self._exits.setdefault(pid, -signal.SIGKILL)
            return self._exits.pop(pid)

    def close(self) -> None:
        """Hang up: the server exits (its running workers, if any, die with it)."""
        with contextlib.suppress(OSError):
            self._sock.close()
        try:
            self._proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def _recv(self, timeout: float | None) -> dict[str, Any]:
        msg, fds = self._recv_fds(timeout)
        for fd in fds:
            os.close(fd)
        return msg

    def _recv_fds(self, timeout: float | None) -> tuple[dict[str, Any], list[int]]:
        """The next message (exit reports are also kept in ``_exits``); TimeoutError on time-out."""
        self._sock.settimeout(timeout)
        try:
            msg, fds = recv(self._sock)
        except (TimeoutError, BlockingIOError):
            raise TimeoutError from None
        except OSError as e:
            raise ForkServerError(f"the fork server is gone ({e})") from None
        if msg is None:
            self.problem = self.problem or f"the fork server exited (code {self._proc.poll()})"
            raise ForkServerError(self.problem)
        if "exit" in msg:
            self._exits[int(msg["exit"])] = int(msg["code"])
        return msg, fds


if __name__ == "__main__":
    main()
