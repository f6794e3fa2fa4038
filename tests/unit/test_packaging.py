"""The built wheel carries the templates and site configs, and works outside the checkout."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_wheel_ships_data_and_renders_from_an_install(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(REPO)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = dist.glob("hpcelastic-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "hpcelastic/_data/sbatch_templates/default.sbatch.j2" in names
    assert {
        "hpcelastic/_data/site_configs/default.yaml",
        "hpcelastic/_data/site_configs/testbed.yaml",
    } <= names

    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    work = tmp_path / "elsewhere"
    work.mkdir()
    (work / "train.py").write_text("print('hi')\n")
    env = dict(os.environ, PYTHONPATH=str(target), HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path / "cfg"))
    where = subprocess.run(
        [sys.executable, "-c", "import hpcelastic.resources as r; print(r.data_dir('site_configs'))"],
        capture_output=True,
        text=True,
        cwd=work,
        env=env,
        check=True,
    )
    assert where.stdout.strip() == str(target / "hpcelastic" / "_data" / "site_configs")
    out = subprocess.run(
        [sys.executable, "-m", "hpcelastic", "submit", "--dry-run", "--site", "testbed", "--nodes", "2"]
        + ["--gpus-per-node", "2", "train.py"],
        capture_output=True,
        text=True,
        cwd=work,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --gres=gpu:2" in out.stdout and "hpcelastic agent" in out.stdout
    assert not (work / "hpcelastic-runs").exists()
