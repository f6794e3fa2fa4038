"""What a restarted round read from its checkpoint directory, as its agent sees it (inotify)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from hpcelastic.agent.resume_watch import ResumeWatch, describe
from hpcelastic.lifecycle import evidence


def test_the_first_checkpoint_file_read_is_the_evidence(tmp_path: Path) -> None:
    (tmp_path / "step-4").mkdir()
    (tmp_path / "step-4" / "__0_0.distcp").write_bytes(b"x" * 10)
    (tmp_path / "step-4" / ".metadata").write_bytes(b"meta")
    torch.save({"w": 1}, tmp_path / "model.pt")
    (tmp_path / "hpcelastic-latest.json").write_text("{}")
    (tmp_path / ".model.pt.tmp").write_text("x")
    done = (tmp_path / "step-4" / ".metadata").stat().st_mtime
    watch = ResumeWatch(str(tmp_path), 3)
    try:
        assert watch.take() is None
        os.listdir(tmp_path)  # a script looking for its newest checkpoint: not a read of one
        (tmp_path / "hpcelastic-latest.json").read_text()
        (tmp_path / ".model.pt.tmp").read_text()
        with open(tmp_path / "new.pt", "wb") as f:  # a save is no read
            f.write(b"y")
        assert watch.take() is None
        (tmp_path / "step-4" / ".metadata").read_bytes()
        time.sleep(0.01)
        file = watch.take()
        assert file == str(tmp_path / "step-4" / ".metadata")
        found = describe(str(tmp_path), file)
        assert (found.file, found.path, found.completed_ts) == ("step-4/.metadata", "step-4", done)
        assert found.newest == "new.pt"
    finally:
        watch.close()


def test_a_checkpoint_is_its_dcp_directory_its_folder_or_its_file(tmp_path: Path) -> None:
    acc = tmp_path / "checkpoint_9"
    acc.mkdir()
    for name in ("model.safetensors", "optimizer.bin", "random_states_0.pkl"):
        (acc / name).write_bytes(b"z")
    os.utime(acc / "optimizer.bin", (100.0, 100.0))
    os.utime(acc / "model.safetensors", (50.0, 50.0))
    os.utime(acc / "random_states_0.pkl", (70.0, 70.0))
    assert evidence.checkpoint_of(tmp_path, acc / "model.safetensors") == ("checkpoint_9", 100.0)
    torch.save({"w": 1}, tmp_path / "a.pt")
    assert evidence.checkpoint_of(tmp_path, tmp_path / "a.pt")[0] == "a.pt"
    torn = tmp_path / "torn.pt"
    torn.write_bytes((tmp_path / "a.pt").read_bytes()[:40])
    assert evidence.checkpoint_of(tmp_path, torn) == ("torn.pt", None)
