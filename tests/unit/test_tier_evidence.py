"""Issue 27: the local tier judges a checkpoint complete only on evidence, holds only what it really holds,
and deletes nothing the script may need. Real files (the layouts the libraries write), a real LocalTier on
/dev/shm and a real peer's data server; the coordinator's messages are what the tier is told."""

from __future__ import annotations

import io
import json
import os
import struct
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcelastic import events as ev
from hpcelastic.agent import messages
from hpcelastic.rundir import RunDir
from hpcelastic.tier import scan, step_clock
from hpcelastic.tier.book import HERE, PEER, PERSISTED
from hpcelastic.tier.node import SHARED_STAGING, UNJUDGED_DIR, LocalTier
from hpcelastic.tier.settings import TierSettings, check_node

SECRET = "s3cret"
LATE = 10**19  # a scan "much later": every file quiet


def zip_bytes(payload: bytes = b"x" * 1000) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("data.pkl", payload)
    return buf.getvalue()


def safetensors_bytes(n: int = 64) -> bytes:
    header = json.dumps({"w": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
    return struct.pack("<Q", len(header)) + header + b"\1" * n


def write(path: Path, data: bytes, mtime_ns: int | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))


# ---- what the format proves ---------------------------------------------------------------------------
def test_nested_dcp_directories_complete_only_with_every_metadata_and_a_step_after(tmp_path: Path) -> None:
    """DCP's ``.metadata`` below the top of the entry counts (the bug: only the top was looked at), every DCP
    directory of the entry needs its own, and the workers' going on says no further one was to come."""
    top = tmp_path / "step-10"
    write(top / "model" / "__0_0.distcp", b"a" * 100)
    write(top / "model" / ".metadata", b"m")
    write(top / "optim" / "__0_0.distcp", b"b" * 100)
    entry = scan.scan(tmp_path)["step-10"]
    assert entry.dcp and not entry.marker and "step-10/optim has no .metadata" in entry.why_unjudged
    write(top / "optim" / ".metadata", b"m", time.time_ns())
    entries = scan.scan(tmp_path)
    # model/ and optim/ each complete: but a third DCP save of the entry may not have begun yet (the crash
    # between two of them leaves a torn entry whose every DCP directory has its .metadata)
    assert not entries["step-10"].marker and "below its top" in entries["step-10"].why_unjudged
    assert scan.judge("step-10", entries, round_start_ns=0, stepped_ns=time.time_ns() + 10**9)
    write(tmp_path / "flat" / "__0_0.distcp", b"a")
    write(tmp_path / "flat" / ".metadata", b"m")
    assert scan.scan(tmp_path)["flat"].marker


def test_accelerate_fsdp_save_state_is_not_complete_by_format_alone(tmp_path: Path) -> None:
    """``checkpoint_N/pytorch_model_fsdp_0/`` and ``optimizer_0/`` (DCP) with ``random_states_R.pkl`` beside
    them: the per-rank files come after the DCP writes, so only behaviour can say the save ended."""
    top = tmp_path / "checkpoint_5"
    for d in ("pytorch_model_fsdp_0", "optimizer_0"):
        write(top / d / "__0_0.distcp", b"a" * 10)
        write(top / d / ".metadata", b"m")
    write(top / "random_states_0.pkl", zip_bytes())
    entry = scan.scan(tmp_path)["checkpoint_5"]
    assert not entry.marker and not entry.torn and "beside DCP directories" in entry.why_unjudged


def test_safetensors_files_and_an_index_with_its_shards(tmp_path: Path) -> None:
    write(tmp_path / "model.safetensors", safetensors_bytes())
    write(tmp_path / "short.safetensors", safetensors_bytes()[:-5])
    entries = scan.scan(tmp_path)
    assert entries["model.safetensors"].marker and entries["short.safetensors"].torn
    top = tmp_path / "hf"
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    write(top / "config.json", b"{}")
    write(top / "model-00001-of-00002.safetensors", safetensors_bytes())
    write(top / "model.safetensors.index.json", json.dumps(index).encode())
    entry = scan.scan(tmp_path)["hf"]
    assert not entry.marker and "model-00002-of-00002.safetensors" in entry.why_unjudged
    write(top / "model-00002-of-00002.safetensors", safetensors_bytes())
    assert scan.scan(tmp_path)["hf"].marker


# ---- what the script's behaviour proves ----------------------------------------------------------------
def test_a_save_written_file_by_file_is_final_only_once_a_newer_save_began_after_it(tmp_path: Path) -> None:
    """The bug: a directory was complete 0.3 s after its first file closed. Now the model file alone, however
    long quiet, proves nothing; the next save, begun after its last write, does."""
    t0 = time.time_ns()
    write(tmp_path / "step-20" / "model.pt", zip_bytes(), t0 + 1_000)
    entries = scan.scan(tmp_path)
    assert not entries["step-20"].marker
    assert scan.settled(None, entries["step-20"], [], tmp_path, now_ns=LATE)  # quiet, yet not judged
    assert not scan.judge("step-20", entries, round_start_ns=t0)
    write(tmp_path / "step-25" / "model.pt", zip_bytes(), t0 + 2_000)
    entries = scan.scan(tmp_path)
    assert scan.judge("step-20", entries, round_start_ns=t0)
    assert not scan.judge("step-25", entries, round_start_ns=t0)
    # A leftover of an earlier round (written before this round began) is judged by its format only.
    assert not scan.judge("step-20", entries, round_start_ns=t0 + 1_500)
    # The workers all ended with status 0: nothing they wrote can change.
    assert scan.judge("step-25", entries, round_start_ns=t0, finished=True)


# ---- the node's tier ------------------------------------------------------------------------------------
class Node:
    """A LocalTier on /dev/shm whose messages to the coordinator are kept."""

    def __init__(self, tmp_path: Path, name: str, node_rank: int = 0) -> None:
        self.run = (
            RunDir(tmp_path / "run") if (tmp_path / "run").exists() else RunDir.create(tmp_path / "run")
        )
        settings = TierSettings(f"/dev/shm/hpce27-{tmp_path.name}-{{node}}")
        node = check_node(settings, settings.local_dir(name, "j"), self.run.path)
        self.sent: list[messages.TierHave] = []
        self.tier = LocalTier(
            settings, node, run_dir=self.run, checkpoint_dir=tmp_path / "ckpt", secret=SECRET, host=name,
            node_rank=node_rank, attempt=0, say=lambda text: None,
        )  # fmt: skip
        self.tier.send = lambda m: self.sent.append(m) or True  # type: ignore[func-returns-value]

    def kinds(self) -> list[tuple[str, str, str]]:
        return [(m.kind, m.name, m.position) for m in self.sent]

    def scan_twice(self, finished: bool = False) -> None:
        self.tier.scan((), "0", finished)
        self.tier.scan((), "0", finished)

    def events(self, name: str) -> list[dict]:
        return [e for e in self.run.events() if e["event"] == name]


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[list[Node]]:
    made: list[Node] = []
    (tmp_path / "ckpt").mkdir()
    yield made
    for n in made:
        n.tier.close()


def test_a_restore_deletes_nothing_it_cannot_judge_and_sets_a_torn_save_aside(
    tmp_path: Path, nodes: list[Node]
) -> None:
    """The bug: the restore before a round cleared the whole local directory. Now a save the tier could not
    judge stays where the script put it (said once); a newer one the coordinator could not restore whole
    and a torn archive go aside, out of the script's sight but not deleted; and at the tier's end what it
    could not judge is copied, as it is, to the shared checkpoint directory."""
    nodes.append(node := Node(tmp_path, "n0"))
    live = node.tier.live
    now = time.time_ns()
    write(live / "step-15.pt", zip_bytes(), now)
    node.scan_twice()
    assert node.kinds() == [("own", "step-15.pt", "0")]
    write(live / "checkpoint_10" / "model.pt", zip_bytes())  # its optimizer file never came
    write(live / "checkpoint_20" / "model.pt", zip_bytes())  # nor this one's
    write(live / "step-25.pt", zip_bytes()[:-30])  # killed mid-write
    here = (("0", HERE, 0, "", 0),)
    node.tier.on_message(messages.TierRestore(1, "step-15.pt", 15, "", here, aside=("checkpoint_20",)))
    assert node.tier.restore(1).path == live / "step-15.pt"
    assert (live / "checkpoint_10" / "model.pt").read_bytes() == zip_bytes()
    assert not (live / "checkpoint_20").exists() and not (live / "step-25.pt").exists()
    aside = {e["checkpoint"]: e for e in node.events(ev.TIER_SET_ASIDE)}
    assert set(aside) == {"checkpoint_20", "step-25.pt"} and all(
        Path(e["path"]).exists() for e in aside.values()
    )
    assert (
        aside["step-25.pt"]["why"].startswith("torn")
        and "newer than the restored" in aside["checkpoint_20"]["why"]
    )
    (unjudged,) = node.events(ev.TIER_UNJUDGED)
    assert unjudged["checkpoint"] == "checkpoint_10" and "marks the save's end" in unjudged["why"]
    node.tier.on_message(messages.TierRestore(2, "step-15.pt", 15, "", (("0", HERE, 0, "", 0),)))
    node.tier.restore(2)
    assert len(node.events(ev.TIER_UNJUDGED)) == 1  # said once
    node.tier.close()
    saved = tmp_path / "ckpt" / UNJUDGED_DIR / "attempt-0" / "n0"
    assert {p.name for p in saved.iterdir()} == {"checkpoint_10", "checkpoint_20"}
    assert (saved / "checkpoint_20" / "model.pt").read_bytes() == zip_bytes()
    assert {e["checkpoint"] for e in node.events(ev.TIER_UNJUDGED) if e["saved_to"]} == {
        "checkpoint_10",
        "checkpoint_20",
    }


def test_a_save_rewritten_in_place_is_dropped_first_then_judged_again(
    tmp_path: Path, nodes: list[Node]
) -> None:
    """``last.ckpt`` rewritten by ``torch.save`` (same inode, truncated first): the copy the coordinator
    counted is gone, and it hears so before the new save is reported."""
    nodes.append(node := Node(tmp_path, "n0"))
    write(node.tier.live / "last.ckpt", zip_bytes(b"a" * 1000), time.time_ns())
    node.scan_twice()
    assert node.kinds() == [("own", "last.ckpt", "0")]
    write(node.tier.live / "last.ckpt", zip_bytes(b"b" * 2000), time.time_ns())
    node.scan_twice()
    assert node.kinds() == [
        ("own", "last.ckpt", "0"),
        ("dropped", "last.ckpt", "0"),
        ("own", "last.ckpt", "0"),
    ]


def test_a_node_with_only_a_copy_answers_for_a_checkpoint_saved_again_by_another(
    tmp_path: Path, nodes: list[Node]
) -> None:
    """The bug (Lightning's ``last.ckpt`` under the tier): a restore placed node 0's ``last.ckpt`` on node 1,
    then node 0 rewrote it in place. Asked about the new save, node 1 never answered (it took the name for
    one it had answered for already), so the coordinator waited for it for good. Now it says, once, that it
    wrote nothing of it."""
    nodes.append(writer := Node(tmp_path, "n0"))
    nodes.append(other := Node(tmp_path, "n1", node_rank=1))
    write(writer.tier.live / "last.ckpt", zip_bytes(b"a" * 1000), time.time_ns())
    writer.scan_twice()
    sources = (("0", PEER, 0, "127.0.0.1", writer.tier.port),)
    other.tier.on_message(messages.TierRestore(1, "last.ckpt", 5, "", sources))
    assert other.tier.restore(1).path == other.tier.live / "last.ckpt"
    write(writer.tier.live / "last.ckpt", zip_bytes(b"b" * 2000), time.time_ns())
    writer.scan_twice()
    assert writer.kinds()[-2:] == [("dropped", "last.ckpt", "0"), ("own", "last.ckpt", "0")]
    other.tier.on_message(messages.TierQuery("last.ckpt"))
    other.tier.on_message(messages.TierQuery("epoch=0-step=10.ckpt"))  # one it has nothing of
    for _ in range(2):
        other.tier.scan((), "1")
    answers = [(m.name, m.position, m.size) for m in other.sent if m.kind == "own"]
    assert sorted(answers) == [("epoch=0-step=10.ckpt", "1", 0), ("last.ckpt", "1", 0)]  # each once


def test_a_part_counted_here_but_not_whole_is_fetched_from_the_next_holder(
    tmp_path: Path, nodes: list[Node]
) -> None:
    """The bug: a part the book planned was "here", nothing was linked, and the restore said it succeeded.
    Now the node checks every file, tells the coordinator its copy is gone, and takes the part from the next
    holder in the plan."""
    nodes.append(peer := Node(tmp_path, "n1", node_rank=1))
    nodes.append(node := Node(tmp_path, "n0"))
    files = {"step-5/__0_0.distcp": os.urandom(3000), "step-5/.metadata": b"meta"}
    for rel, data in files.items():
        write(peer.tier.live / rel, data, time.time_ns())
    peer.scan_twice()
    assert ("own", "step-5", "0") in peer.kinds()
    for rel, data in files.items():
        write(node.tier.live / rel, data, time.time_ns())
    node.scan_twice()
    (node.tier.live / "step-5" / "__0_0.distcp").unlink()  # the script removed it (or it never came)
    sources = (("0", HERE, 0, "", 0), ("0", PEER, 1, "127.0.0.1", peer.tier.port))
    node.tier.on_message(messages.TierRestore(1, "step-5", 5, "", sources))
    restored = node.tier.restore(1)
    assert restored.path == node.tier.live / "step-5" and not restored.error
    for rel, data in files.items():
        assert (node.tier.live / rel).read_bytes() == data
    assert node.kinds()[-2:] == [("dropped", "step-5", "0"), ("replica", "step-5", "0")]
    (event,) = node.events(ev.TIER_RESTORED)
    assert event["tier"] == "peer" and event["peers"] == ["1"]


def test_a_restore_with_no_whole_source_fails_rather_than_claim_success(
    tmp_path: Path, nodes: list[Node]
) -> None:
    nodes.append(node := Node(tmp_path, "n0"))
    node.tier.on_message(messages.TierRestore(1, "step-5", 5, "", (("0", HERE, 0, "", 0),)))
    restored = node.tier.restore(1)
    assert restored.path is None and "no copy of step-5 part 0 on this node" in restored.error


def test_a_failed_persist_leaves_nothing_staged_and_a_short_commit_publishes_nothing(
    tmp_path: Path, nodes: list[Node]
) -> None:
    nodes.append(node := Node(tmp_path, "n0"))
    write(node.tier.live / "step-5.pt", zip_bytes(), time.time_ns())
    node.scan_twice()
    node.tier.on_message(messages.TierComplete("step-5.pt", 5, "0", persist=True))
    staged = tmp_path / "ckpt" / SHARED_STAGING / "step-5.pt" / "step-5.pt"
    deadline = time.monotonic() + 10
    while ("persisted", "step-5.pt", "0") not in node.kinds() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert staged.is_file()
    node.tier.on_message(messages.TierCommit("step-5.pt", 5, size=10**6))  # not what was staged
    node.tier.on_message(messages.TierCommit("step-5.pt", 5, abort=True))
    while not any(m.kind == "persist_failed" for m in node.sent) and time.monotonic() < deadline:
        time.sleep(0.02)
    while (tmp_path / "ckpt" / SHARED_STAGING).exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not (tmp_path / "ckpt" / SHARED_STAGING).exists()
    assert (
        not (tmp_path / "ckpt" / "step-5.pt").exists()
        and not (node.run.path / "hpcelastic-latest.json").exists()
    )
    (failed,) = [m for m in node.sent if m.kind == "persist_failed"]
    assert "bytes staged of 1000000" in failed.why


def test_a_save_is_final_once_every_worker_took_a_step_after_its_last_write(tmp_path: Path) -> None:
    """The step clock a warm-started worker keeps (a global optimizer step hook) is the behaviour that judges
    a save no format marks; a DCP directory without its ``.metadata`` is never judged that way."""
    import subprocess
    import sys

    clocks = tmp_path / "clocks"
    clocks.mkdir()
    t0 = time.time_ns()
    write(tmp_path / "ckpt" / "checkpoint_5" / "model.pt", zip_bytes(), t0)
    write(tmp_path / "ckpt" / "step-9" / "__1_0.distcp", b"x", t0)
    entries = scan.scan(tmp_path / "ckpt")
    assert step_clock.last_step_ns(clocks) is None  # no worker keeps a clock: the newer-save rule applies
    code = (
        "import torch, os; from hpcelastic.tier import step_clock; assert step_clock.install_from_env();"
        "p = torch.nn.Parameter(torch.ones(1)); o = torch.optim.SGD([p], lr=0.1);"
        "[(p.sum().backward(), o.step()) for _ in range(3)]"
    )
    env = {**os.environ, step_clock.VARIABLE: str(clocks / "0")}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    stepped = step_clock.last_step_ns(clocks)
    assert stepped is not None and stepped > t0
    assert scan.judge("checkpoint_5", entries, round_start_ns=t0, stepped_ns=stepped)
    assert not scan.judge("checkpoint_5", entries, round_start_ns=t0, stepped_ns=t0 - 1)
    assert not scan.judge("step-9", entries, round_start_ns=t0, stepped_ns=stepped)
    (clocks / "1").write_bytes(step_clock.LAYOUT.pack(0, 0))  # a second worker that took no step yet
    assert step_clock.last_step_ns(clocks) == 0
    step_clock.reset(clocks)
    assert step_clock.last_step_ns(clocks) is None


def test_a_peer_cannot_place_files_outside_the_checkpoint_it_names(tmp_path: Path, nodes: list[Node]) -> None:
    """A peer with the job secret sends a part of ``step-5`` whose file is ``step-6/x``: refused, nothing
    placed (the channel keeps every path inside the tier; the node keeps it inside the checkpoint)."""
    from hpcelastic.tier import channel

    nodes.append(node := Node(tmp_path, "n0"))
    src = tmp_path / "x"
    src.write_bytes(b"payload")
    files = [channel.FileRef("step-6/x", src, 7)]
    with pytest.raises(channel.ChannelError):
        channel.put("127.0.0.1", node.tier.port, SECRET, "step-5", "1", files, channel.Throttle(10**8))
    assert not any(node.tier.replicas.rglob("x")) and ("replica", "step-5", "1") not in node.kinds()


def test_a_checkpoint_an_earlier_attempt_persisted_is_linked_beside_the_restored_one(
    tmp_path: Path, nodes: list[Node]
) -> None:
    """A new attempt's node gets, besides the published checkpoint, the others earlier attempts persisted
    (``last.ckpt`` of step 10 beside ``epoch=0-step=15.ckpt``): each linked from the checkpoint directory, as
    a script without the tier would see them there."""
    nodes.append(node := Node(tmp_path, "n0"))
    ckpt = tmp_path / "ckpt"
    for name in ("epoch=0-step=15.ckpt", "last.ckpt"):
        write(ckpt / name, zip_bytes())
    persisted = (("*", PERSISTED, -1, "", 0),)
    node.tier.on_message(
        messages.TierRestore(0, "epoch=0-step=15.ckpt", 15, str(ckpt / "epoch=0-step=15.ckpt"), persisted)
    )
    node.tier.on_message(
        messages.TierRestore(0, "last.ckpt", 10, str(ckpt / "last.ckpt"), persisted, extra=True)
    )
    live = node.tier.live
    assert node.tier.restore(0).path == live / "epoch=0-step=15.ckpt"
    assert (live / "last.ckpt").resolve() == ckpt / "last.ckpt"
    assert (live / "last.ckpt").read_bytes() == zip_bytes()
