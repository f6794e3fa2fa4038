"""The local tier's node-side parts on real files and sockets: what a scan takes for complete
(hpcelastic/tier/scan.py), the data channel between agents (tier/channel.py), and the settings each node
checks at start (tier/settings.py)."""

from __future__ import annotations

import io
import os
import socket
import time
import zipfile
from pathlib import Path

import pytest

from hpcelastic.errors import UserError
from hpcelastic.tier import channel, scan
from hpcelastic.tier.settings import MB, TierSettings, check_node

SECRET = "s3cret"


def zip_bytes(payload: bytes = b"x" * 1000) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("data.pkl", payload)
    return buf.getvalue()


# ---- scans ----------------------------------------------------------------------------------------
def test_a_dcp_directory_is_complete_only_with_its_metadata(tmp_path: Path) -> None:
    d = tmp_path / "step-10"
    d.mkdir()
    (d / "__0_0.distcp").write_bytes(b"a" * 100)
    (entry,) = scan.scan(tmp_path).values()
    assert entry.dcp and not entry.marker and entry.size == 100
    (d / ".metadata").write_bytes(b"m")
    (entry,) = scan.scan(tmp_path).values()
    assert entry.marker


def test_a_torn_torch_save_never_settles_and_a_complete_one_does(tmp_path: Path) -> None:
    (tmp_path / "step-10.pt").write_bytes(zip_bytes()[:-30])
    (tmp_path / "step-5.pt").write_bytes(zip_bytes())
    (tmp_path / "step-15.pt.tmp").write_bytes(b"partial")  # a partial write's name: not a checkpoint
    (tmp_path / "hpcelastic-latest.json").write_text("{}")
    entries = scan.scan(tmp_path)
    assert set(entries) == {"step-10.pt", "step-5.pt"}
    assert entries["step-10.pt"].torn and not entries["step-10.pt"].marker
    late = 10**19
    assert not scan.settled(None, entries["step-10.pt"], [], tmp_path, now_ns=late)
    assert scan.settled(None, entries["step-5.pt"], [], tmp_path, now_ns=late)


def test_a_file_open_for_writing_or_just_changed_is_not_settled(tmp_path: Path) -> None:
    (tmp_path / "step-5.pt").write_bytes(zip_bytes())
    entry = scan.scan(tmp_path)["step-5.pt"]
    now = entry.files[0].mtime_ns
    assert not scan.settled(None, entry, [], tmp_path, now_ns=now)  # seen once, just written
    assert scan.settled(entry, entry, [], tmp_path, now_ns=now)  # unchanged since the last scan
    writing = [str(tmp_path / "step-5.pt")]
    assert not scan.settled(entry, entry, writing, tmp_path, now_ns=now + 10**10)


def test_publish_marks_a_checkpoint_complete_with_its_step(tmp_path: Path) -> None:
    (tmp_path / "ckpt-a").mkdir()
    (tmp_path / "ckpt-a" / "state.bin").write_bytes(b"x")
    scan.write_publish_marker(str(tmp_path), str(tmp_path / "ckpt-a" / "state.bin"), 42)
    assert scan.read_published(tmp_path) == {"ckpt-a": 42}
    with pytest.raises(UserError, match="inside"):
        scan.write_publish_marker(str(tmp_path), "/elsewhere/x.pt", 1)
    assert scan.by_step(["step-10", "last", "step-9"]) == ["step-9", "step-10", "last"]


# ---- the data channel -----------------------------------------------------------------------------
class Peer:
    """A data server whose agent holds one part and accepts puts into ``root``."""

    def __init__(self, root: Path, budget: int = 10 * MB, secret: str = SECRET) -> None:
        self.root = root
        self.budget = budget
        self.received: list[tuple[str, str, list[tuple[str, int]]]] = []
        self.held: dict[tuple[str, str], list[channel.FileRef]] = {}
        self.count = 0
        handlers = channel.Handlers(self.part_files, self.reserve, lambda n: None, self.staging, self.take)
        self.server = channel.DataServer(secret, handlers, channel.Throttle(100 * MB))

    def part_files(self, name: str, position: str) -> list[channel.FileRef] | None:
        return self.held.get((name, position))

    def reserve(self, name: str, position: str, size: int) -> str | None:
        return None if size <= self.budget else f"{size} bytes do not fit"

    def staging(self) -> Path:
        self.count += 1
        path = self.root / f"staging-{self.count}"
        path.mkdir()
        return path

    def take(self, name: str, position: str, staging: Path, files: list[tuple[str, int]]) -> None:
        for rel, _ in files:
            target = self.root / "replicas" / position / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / rel, target)
        self.received.append((name, position, files))


def part(tmp_path: Path) -> list[channel.FileRef]:
    d = tmp_path / "live" / "step-5"
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(os.urandom(5 * MB + 3))
    (d / ".metadata").write_bytes(b"meta")
    return [channel.FileRef(f"step-5/{p.name}", p, p.stat().st_size) for p in sorted(d.iterdir())]


def test_put_and_get_copy_a_part_whole(tmp_path: Path) -> None:
    peer = Peer(tmp_path / "peer")
    (tmp_path / "peer").mkdir()
    files = part(tmp_path)
    channel.put("127.0.0.1", peer.server.port, SECRET, "step-5", "0", files, channel.Throttle(100 * MB))
    assert peer.received == [("step-5", "0", [(f.rel, f.size) for f in files])]
    for f in files:
        assert (tmp_path / "peer" / "replicas" / "0" / f.rel).read_bytes() == f.path.read_bytes()
    peer.held[("step-5", "0")] = files
    dest = tmp_path / "fetched"
    got = channel.get("127.0.0.1", peer.server.port, SECRET, "step-5", "0", dest, lambda n: None)
    assert [rel for rel, _ in got] == [f.rel for f in files]
    assert all((dest / f.rel).read_bytes() == f.path.read_bytes() for f in files)
    peer.server.close()


def test_a_stranger_without_the_secret_neither_puts_nor_gets(tmp_path: Path) -> None:
    (tmp_path / "peer").mkdir()
    peer = Peer(tmp_path / "peer")
    files = part(tmp_path)
    peer.held[("step-5", "0")] = files
    with pytest.raises(channel.ChannelError):
        channel.put("127.0.0.1", peer.server.port, "wrong", "step-5", "0", files, channel.Throttle(MB))
    with pytest.raises(channel.ChannelError):
        channel.get("127.0.0.1", peer.server.port, "wrong", "step-5", "0", tmp_path / "x", lambda n: None)
    assert peer.received == [] and not (tmp_path / "x").exists()
    with socket.create_connection(("127.0.0.1", peer.server.port)) as s:  # garbage is dropped
        s.sendall(b"\xff" * 64)
    peer.server.close()


def test_an_altered_byte_fails_its_mac_and_nothing_is_taken_into_place(tmp_path: Path) -> None:
    (tmp_path / "peer").mkdir()
    peer = Peer(tmp_path / "peer")
    files = part(tmp_path)
    real_send = channel.send_files

    def tampering(sock: socket.socket, refs: list[channel.FileRef], session, throttle) -> list[str]:  # type: ignore[no-untyped-def]
        macs = real_send(sock, refs, session, throttle)
        return ["0" * 64] + macs[1:]

    channel.send_files = tampering  # type: ignore[assignment]
    try:
        with pytest.raises(channel.ChannelError, match="MAC"):
            channel.put(
                "127.0.0.1", peer.server.port, SECRET, "step-5", "0", files, channel.Throttle(100 * MB)
            )
    finally:
        channel.send_files = real_send  # type: ignore[assignment]
    assert peer.received == [] and not (tmp_path / "peer" / "replicas").exists()
    peer.server.close()


def test_a_part_that_does_not_fit_is_refused_before_a_byte_is_sent(tmp_path: Path) -> None:
    (tmp_path / "peer").mkdir()
    peer = Peer(tmp_path / "peer", budget=MB)
    with pytest.raises(channel.ChannelError, match="do not fit"):
        channel.put(
            "127.0.0.1", peer.server.port, SECRET, "step-5", "0", part(tmp_path), channel.Throttle(MB)
        )
    staging = tmp_path / "peer" / "staging-1"
    deadline = time.monotonic() + 5  # the server removes it after its answer
    while staging.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert peer.received == [] and peer.count == 1 and not staging.exists()
    peer.server.close()


@pytest.mark.parametrize("rel", ["../etc/passwd", "/abs", "a/../../b", "", "a//b"])
def test_file_names_outside_the_directory_are_refused(rel: str) -> None:
    with pytest.raises(channel.ChannelError):
        channel.safe_rel(rel)


def test_the_throttle_holds_sends_to_the_rate() -> None:
    throttle = channel.Throttle(10 * MB)
    t0 = time.monotonic()
    for _ in range(4):
        throttle.take(5 * MB)  # 20 MB at 10 MB/s with a 1 s burst: about 1 s
    assert 0.8 < time.monotonic() - t0 < 3


# ---- settings -------------------------------------------------------------------------------------
DIR = "checkpoint_tier.local_checkpoint_dir"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"local_checkpoint_dir": "rel/path"}, f"{DIR}: 'rel/path' is not an absolute"),
        ({"local_checkpoint_dir": "/dev/shm/{host}"}, f"{DIR}: '/dev/shm/{{host}}' names {{host}}"),
        ({"local_checkpoint_dir": "/d", "replicas": -1}, "checkpoint_tier.replicas: must be an integer"),
        (
            {"local_checkpoint_dir": "/d", "local_checkpoint_mb": 0},
            "checkpoint_tier.local_checkpoint_mb: must",
        ),
        (
            {"local_checkpoint_dir": "/d", "restore": "some"},
            "checkpoint_tier.restore: must be one of all, own",
        ),
    ],
)
def test_bad_settings_are_one_line_naming_the_setting(values: dict, message: str) -> None:
    with pytest.raises(UserError) as e:
        TierSettings(**values)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_node_refuses_a_missing_directory_the_shared_filesystem_and_a_budget_too_big_or_small(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    settings = TierSettings("/dev/shm/t22-unit-{node}", local_checkpoint_mb=8)
    with pytest.raises(UserError, match=r"local_checkpoint_dir: /nonexistent-parent does not exist"):
        check_node(settings, Path("/nonexistent-parent/x"), run)
    with pytest.raises(UserError, match="same filesystem as the run directory"):
        check_node(settings, tmp_path / "local", run)
    shm = Path("/dev/shm/t22-unit-node0")
    node = check_node(settings, shm, run)
    assert node.budget == 8 * MB and node.fstype == "tmpfs" and not shm.exists()
    with pytest.raises(
        UserError, match=r"checkpoint_tier.local_checkpoint_mb=8 is smaller than one checkpoint"
    ):
        check_node(settings, shm, run, checkpoint_bytes=9 * MB)
    huge = TierSettings("/dev/shm/x", local_checkpoint_mb=1 << 40)
    with pytest.raises(UserError, match=r"checkpoint_tier.local_checkpoint_mb=\d+ is more than tmpfs"):
        check_node(huge, shm, run)


def test_memory_filesystems_are_checked_against_the_nodes_memory(tmp_path: Path) -> None:
    from hpcelastic.tier.settings import DEFAULT_MEMORY_SHARE, meminfo, memory_left_after

    info = meminfo()
    assert memory_left_after(1) is None
    why = memory_left_after(info["MemAvailable"])  # everything available: below the reserve afterwards
    assert why is not None and "less than its reserve" in why
    run = tmp_path / "run"
    run.mkdir()
    node = check_node(TierSettings("/dev/shm/t22-mem-{node}"), Path("/dev/shm/t22-mem-n0"), run)
    assert node.in_memory and node.budget <= info["MemTotal"] * DEFAULT_MEMORY_SHARE
