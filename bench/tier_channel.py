"""The local tier's data path against the machine's own limits (issue 29, item 2), in one run.

A part of ``--mb`` MB (``--files`` files, in tmpfs like the tier's local directory) moved every way the tier
moves it, each beside what the machine can do at best:

* ``memory copy``: the part's bytes copied from one buffer into another (numpy, warm pages);
* ``raw TCP, memory to memory``: bytes from memory through a plain loopback socket into a buffer, dropped
  (the loopback's limit for one connection of Python's socket calls);
* ``raw TCP``: a plain socket copy over loopback between two processes, no authentication: the same files
  read into a 4 MB buffer and sent, received into one and written (the floor of any copy through files);
* ``restore``: :func:`hpcelastic.tier.channel.get` from a :class:`~hpcelastic.tier.channel.DataServer` in
  another process (a spare fetching its part from its peer's replica), every file MACed both ways;
* ``replicate``: :func:`~hpcelastic.tier.channel.put` of the same part, unthrottled (its speed limit);
* ``persist``: the tier's copy into the shared directory (the agent's own ``copy_file``, unthrottled; like
  the agent, no sync), onto this machine's disk under ``--shared`` standing in for the shared filesystem;
* ``read shared``: the part read back from that directory, written back and dropped from the page cache
  first (``sync``, ``posix_fadvise(DONTNEED)``, not timed): what a spare without a replica reads instead.

Medians of ``--runs``; writes the ``tier_channel`` section of bench/RESULTS.md.

    python bench/tier_channel.py [--mb 1024] [--files 4] [--runs 5] [--shared DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._results import machine_line, update_section  # noqa: E402
from hpcelastic.tier import channel  # noqa: E402
from hpcelastic.tier.node import copy_file  # noqa: E402

SECRET = "bench-tier-channel-secret"
NAME, POSITION = "ckpt-000100", "0"
#: A 405B model's part per node at 16,384 GPUs (bench/checkpoint_tiers.py), and a 400 Gb/s NIC.
PART_405B_MB, NIC_GB_S = 3164, 50.0


def _part(root: Path, mb: int, files: int) -> list[channel.FileRef]:
    """``files`` files of random bytes, ``mb`` MB in all, under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    each = (mb << 20) // files
    refs = []
    rng = np.random.default_rng(0)
    for i in range(files):
        path = root / f"__{i}_0.distcp"
        rng.integers(0, 255, each, dtype=np.uint8).tofile(path)
        refs.append(channel.FileRef(path.name, path, each))
    return refs


# ---- the peer, in a process of its own ----------------------------------------------------------------
def serve(held: Path, inbox: Path) -> None:
    """A DataServer holding the files under ``held`` as part ``POSITION`` of ``NAME``; a ``put`` lands in
    ``inbox``. Prints its port, then serves until stdin closes."""
    files = [channel.FileRef(p.name, p, p.stat().st_size) for p in sorted(held.iterdir())]
    count = iter(range(1 << 30))

    def staging() -> Path:
        path = inbox / f"staging-{next(count)}"
        path.mkdir(parents=True)
        return path

    def received(name: str, position: str, path: Path, got: list[tuple[str, int]]) -> None:
        shutil.rmtree(path)

    handlers = channel.Handlers(
        part_files=lambda name, position: files if (name, position) == (NAME, POSITION) else None,
        reserve=lambda name, position, size: None,
        release=lambda size: None,
        staging=staging,
        received=received,
    )
    server = channel.DataServer(SECRET, handlers, channel.Throttle(float(1 << 40)))
    print(server.port, flush=True)
    sys.stdin.read()
    server.close()


def raw_sink(dest: Path) -> None:
    """A plain TCP receiver: a connection's first byte says whether to write what follows into a file under
    ``dest`` (each 4 MB buffer filled whole, then written, as the channel does) or only to receive it; then
    one byte back."""
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    buf = memoryview(bytearray(channel.CHUNK))
    while True:
        conn, _ = listener.accept()
        with conn:
            to_file = conn.recv(1) == b"f"
            with open(dest / "raw", "wb", buffering=0) if to_file else contextlib.nullcontext() as out:
                while got := _fill(conn, buf):
                    if out is not None:
                        out.write(buf[:got])
            conn.sendall(b"k")


def _fill(conn: socket.socket, buf: memoryview) -> int:
    """``buf`` filled from ``conn`` (less at its end); the bytes received."""
    got = 0
    while got < len(buf) and (n := conn.recv_into(buf[got:])):
        got += n
    return got


# ---- the measured copies ------------------------------------------------------------------------------
def _timed(run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def memory_copy(mb: int) -> Callable[[], None]:
    src = np.ones(mb << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    return lambda: np.copyto(dst, src)


def raw_tcp_memory(mb: int, port: int) -> Callable[[], None]:
    """The loopback's own limit: bytes from memory sent, received into one buffer and dropped."""
    data = memoryview(np.ones(mb << 20, dtype=np.uint8))

    def run() -> None:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"m")
            for off in range(0, len(data), channel.CHUNK):
                sock.sendall(data[off : off + channel.CHUNK])
            sock.shutdown(socket.SHUT_WR)
            sock.recv(1)

    return run


def raw_tcp(files: list[channel.FileRef], port: int) -> Callable[[], None]:
    def run() -> None:
        buf = memoryview(bytearray(channel.CHUNK))
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"f")
            for f in files:
                with open(f.path, "rb", buffering=0) as fin:
                    while n := fin.readinto(buf):
                        sock.sendall(buf[:n])
            sock.shutdown(socket.SHUT_WR)
            sock.recv(1)

    return run


def restore(port: int, dest: Path) -> Callable[[], None]:
    def run() -> None:
        shutil.rmtree(dest, ignore_errors=True)
        channel.get("127.0.0.1", port, SECRET, NAME, POSITION, dest, lambda size: None)

    return run


def replicate(files: list[channel.FileRef], port: int) -> Callable[[], None]:
    return lambda: channel.put(
        "127.0.0.1", port, SECRET, NAME, POSITION, files, channel.Throttle(float(1 << 40))
    )


def persist(files: list[channel.FileRef], dest: Path) -> Callable[[], None]:
    unthrottled = channel.Throttle(float(1 << 40))

    def run() -> None:
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        for f in files:  # the agent's own persist copy, unthrottled
            copy_file(f.path, dest / f.rel, unthrottled)

    return run


def drop_cache(dest: Path) -> None:
    """The files under ``dest`` written back and out of the page cache (not timed): read cold."""
    os.sync()
    for path in dest.iterdir():
        with open(path, "rb") as fin:
            os.posix_fadvise(fin.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def read_shared(dest: Path) -> Callable[[], None]:
    def run() -> None:
        buf = memoryview(bytearray(channel.CHUNK))
        for path in sorted(dest.iterdir()):
            with open(path, "rb", buffering=0) as fin:
                while fin.readinto(buf):
                    pass

    return run


def _peer(*argv: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, __file__, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def measure(mb: int, nfiles: int, runs: int, shared: Path) -> dict[str, list[float]]:
    tmp = Path(tempfile.mkdtemp(prefix="hpcelastic-bench-channel-", dir="/dev/shm"))
    shared_dir = Path(tempfile.mkdtemp(prefix="hpcelastic-bench-channel-", dir=shared))
    server = sink = None
    try:
        files = _part(tmp / "held", mb, nfiles)
        (tmp / "inbox").mkdir()
        (tmp / "raw").mkdir()
        server, port = _peer("--serve", str(tmp / "held"), str(tmp / "inbox"))
        sink, raw_port = _peer("--raw-sink", str(tmp / "raw"))
        ways: dict[str, Callable[[], None]] = {
            "memory copy": memory_copy(mb),
            "raw TCP, memory to memory": raw_tcp_memory(mb, raw_port),
            "raw TCP": raw_tcp(files, raw_port),
            "restore": restore(port, tmp / "restored"),
            "replicate": replicate(files, port),
            "persist": persist(files, shared_dir / "part"),
            "read shared": read_shared(shared_dir / "part"),
        }
        times: dict[str, list[float]] = {k: [] for k in ways}
        for r in range(runs):  # alternating, so that a slow moment of the machine falls on every way alike
            for way, run in ways.items():
                if way == "read shared":
                    drop_cache(shared_dir / "part")
                times[way].append(_timed(run))
            print(
                f"run {r + 1}/{runs}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()),
                flush=True,
            )
        return times
    finally:
        for proc in (server, sink):
            if proc is not None:
                proc.kill()
                proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shared_dir, ignore_errors=True)


def section(times: dict[str, list[float]], mb: int, nfiles: int, runs: int, shared: Path) -> str:
    med = {k: statistics.median(v) for k, v in times.items()}
    rate = {k: mb / 1024 / v for k, v in med.items()}
    rows = [
        f"| {k} | {med[k]:.2f} s | {rate[k]:.2f} GB/s | {min(v):.2f}-{max(v):.2f} s "
        f"| {med[k] / med['memory copy']:.1f}x |"
        for k, v in times.items()
    ]
    restore_vs_raw = rate["restore"] / rate["raw TCP"]
    restore_vs_wire = rate["restore"] / rate["raw TCP, memory to memory"]
    restore_vs_shared = med["read shared"] / med["restore"]
    gb_405 = PART_405B_MB / 1024
    channel_405 = gb_405 / rate["restore"]
    return "\n".join(
        [
            "## Tier data path against the machine's limits (`bench/tier_channel.py`)",
            "",
            machine_line(),
            f"A part of {mb} MB in {nfiles} files (tmpfs, as the tier's local directory), peers in "
            f"processes of their own over loopback; the shared directory is this machine's disk ({shared}). "
            f"Medians of {runs} alternating runs.",
            "",
            "| way | median | speed | range | / memory copy |",
            "|---|---|---|---|---|",
            *rows,
            "",
            f"Restore from a peer's replica: {restore_vs_raw:.0%} of a raw TCP copy's speed between the same "
            f"files (target at least 50 %), {restore_vs_wire:.0%} of the loopback's memory-to-memory "
            "speed (the rest is tmpfs: reading the held files and writing the received ones, which the "
            f"raw copy pays alike); {restore_vs_shared:.1f}x as fast as reading the shared directory cold "
            "(target faster; this machine's disk is a virtual one, cached by its host).",
            "",
            "Replicate (the same part pushed to a peer) runs slower than restore here: py-spy on the "
            "receiving peer puts its time in the socket, the tmpfs writes and the tag alike; not resolved. "
            "It runs in the background, throttled to `replication_mb_s`.",
            "",
            f"A spare restoring a 405B model's part at 16,384 GPUs ({gb_405:.1f} GB per node, "
            f"bench/checkpoint_tiers.py) at this channel's speed per connection: {channel_405:.1f} s; "
            f"a 400 Gb/s link ({NIC_GB_S:.0f} GB/s) "
            f"would carry it in {gb_405 / NIC_GB_S:.2f} s, so one connection's CPU (MAC and copies, "
            f"{rate['restore']:.2f} GB/s here) is the limit, not the link.",
        ]
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        return serve(Path(sys.argv[2]), Path(sys.argv[3]))
    if len(sys.argv) > 1 and sys.argv[1] == "--raw-sink":
        return raw_sink(Path(sys.argv[2]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=1024)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--shared", type=Path, default=Path("/var/tmp"), help="a directory on a disk")
    args = parser.parse_args()
    times = measure(args.mb, args.files, args.runs, args.shared)
    text = section(times, args.mb, args.files, args.runs, args.shared)
    update_section("tier_channel", text)
    print(text)


if __name__ == "__main__":
    main()
