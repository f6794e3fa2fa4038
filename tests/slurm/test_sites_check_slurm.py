"""``hpcelastic sites check`` against the real testbed (22.05; 24.11 in tests/slurm/test_slurm_2411.py): the
project's testbed site passes, with ``--probe`` too (a job step on two nodes); deliberately wrong sites are
found, one line a key, by what Slurm says (a partition, GPUs, a constraint, the signal's lead) and by what
only the nodes can tell (an interface that does not exist, a port another program holds, a tier directory
and a container runtime the nodes lack, an interpreter they do not have). Nothing is left behind."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.slurm_utils import wait_nodes_idle

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def sites_check(cwd: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """``hpcelastic sites check ARGS --json`` through the real CLI: (exit code, its JSON)."""
    argv = [sys.executable, "-m", "hpcelastic", "sites", "check", *args, "--json"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=400, cwd=cwd, env=env)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def site(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return str(path)


def found(out: dict[str, Any]) -> dict[str, str]:
    return {f["key"]: f["text"] for f in out["findings"]}


def test_the_testbed_site_passes_and_each_wrong_setting_is_found(tmp_path: Path, slurm_cluster) -> None:  # type: ignore[no-untyped-def]
    wait_nodes_idle(2)
    code, out = sites_check(tmp_path, "testbed", "--probe")
    assert (code, out["findings"], out["slurm"]) == (0, [], "22.05"), out
    assert any(n.startswith("probe on node") and "rendezvous address 127.0.0.1" in n for n in out["notes"]), (
        out
    )

    wrong = site(
        tmp_path,
        "cluster",
        "partition: debug\nmax_gpus_per_node: 8\nconstraint: h100\nsignal:\n  lead_time: 30\n",
    )
    code, out = sites_check(tmp_path, wrong)
    assert code == 1 and set(found(out)) == {"max_gpus_per_node", "constraint", "signal.lead_time"}, out
    assert "at most 4" in found(out)["max_gpus_per_node"] and "h100" in found(out)["constraint"]
    code, out = sites_check(tmp_path, site(tmp_path, "nopart", "partition: gpu\n"))
    assert (code, list(found(out))) == (1, ["partition"]) and "it has debug" in out["findings"][0]["text"], (
        out
    )

    held = socket.create_server(("127.0.0.1", 0))  # another program holds the rendezvous port
    try:
        nodes = site(
            tmp_path,
            "nodes",
            "partition: debug\nrdzv_interface: nosuch0\n"
            "checkpoint_tier:\n  local_checkpoint_dir: /nonexistent-hpcelastic/{node}\n"
            "container:\n  runtime: apptainer\n  image: /nonexistent-hpcelastic/image.sif\n",
        )
        code, out = sites_check(tmp_path, nodes, "--probe")
        assert code == 1, out
        assert set(found(out)) == {
            "rdzv_interface",
            "checkpoint_tier.local_checkpoint_dir",
            "container.runtime",
        }
        assert "'nosuch0' does not exist" in found(out)["rdzv_interface"], out
        port = site(
            tmp_path, "port", f"partition: debug\nrdzv_interface: lo\nrdzv_port: {held.getsockname()[1]}\n"
        )
        code, out = sites_check(tmp_path, port, "--probe")
        assert (code, list(found(out))) == (1, ["rdzv_port"]) and "in use" in found(out)["rdzv_port"], out
    finally:
        held.close()
    python = site(tmp_path, "python", "partition: debug\npython: /nonexistent-hpcelastic/bin/python\n")
    code, out = sites_check(tmp_path, python, "--probe")
    assert (code, list(found(out))) == (1, ["python"]), out
    assert "ran on 0 of 2 node(s) with /nonexistent-hpcelastic/bin/python" in found(out)["python"], out
    assert not (tmp_path / "hpcelastic-runs").exists()  # the probe's directory and the run root it made: gone
