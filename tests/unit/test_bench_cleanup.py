"""Benches leave no process behind, even one in a session of its own whose parent died (issue 10, 18)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

from bench._cleanup import TOKEN_VARIABLE, tracked

# Like torchrun's workers: a child in a new session (setsid) that outlives its parent, and a
# grandchild of that one; the parent exits at once.
SPAWNER = """
import subprocess, sys
a = subprocess.Popen(["setsid", sys.executable, "-c",
    "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"],
    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(a.pid, flush=True)
"""


def test_tracked_kills_every_descendant_whatever_its_session(tmp_path: Path) -> None:
    with tracked() as token:
        out = subprocess.run([sys.executable, "-c", SPAWNER], capture_output=True, text=True, check=True)
        orphan = psutil.Process(int(out.stdout))
        deadline = time.monotonic() + 10
        while len(orphan.children()) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        grandchild = orphan.children()[0]
        assert orphan.environ()[TOKEN_VARIABLE] == token
        assert orphan.ppid() == os.getpid()  # its parent died: adopted by the subreaper
    for p in (orphan, grandchild):
        assert not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
