"""Containers (hpcelastic/jobs/container.py): the site section, the step each runtime renders, the run's OCI
bundle, what a Slurm release refuses, and the decision an agent in an image without Slurm's commands
leaves to ``finalize``.

The rendered scripts run under bash with a test-only ``srun`` shim (tests/unit/test_render.py's) that dumps
the argv it got: the words of pyxis's and Slurm's OCI options, and of the ``apptainer exec`` and ``podman
run`` commands srun would start, are asserted exactly. pyxis and Apptainer cannot be installed on this
machine: their command lines are what is tested; podman and Slurm's OCI run for real in
tests/slurm/test_containers_slurm.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcelastic import sites
from hpcelastic.errors import UserError
from hpcelastic.jobs import container
from hpcelastic.jobs.render import render
from hpcelastic.jobs.spec import build_spec
from hpcelastic.lifecycle import attempt_end, finalize
from hpcelastic.reasons import Reason
from hpcelastic.rundir import RunDir
from tests.unit.test_render import SHIM

AGENT_HEAD = ["/opt/py/bin/python3", "-m", "hpcelastic", "agent"]


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("HPCELASTIC_SITE", raising=False)


def site_with(tmp_path: Path, section: dict, **top: object) -> Path:
    site = tmp_path / "site.yaml"
    lines = [f"{k}: {json.dumps(v)}" for k, v in top.items()] + [f"container: {json.dumps(section)}"]
    site.write_text("\n".join(lines) + "\n")
    return site


def srun_argv(tmp_path: Path, section: dict, gpus: int | None = None) -> tuple[list[str], Path]:
    """Render a job with ``section``, run its script under bash with the srun shim; srun's argv."""
    case = tmp_path / "case"
    shims = case / "bin"
    shims.mkdir(parents=True)
    for name in ("srun", "python"):
        (shims / name).write_text(SHIM.format(python=sys.executable))
        (shims / name).chmod(0o755)
    (case / "train.py").write_text("print('hi')\n")
    site = site_with(case, {"python": AGENT_HEAD[0], **section}, python=str(shims / "python"))
    overrides = {"gpus_per_node": gpus} if gpus else {}
    spec = build_spec(
        sites.resolve(str(site), overrides),
        script=str(case / "train.py"),
        cwd=str(case),
        run_dir=str(case / "run"),
    )
    script = case / "job.sbatch"
    script.write_text(render(spec).script_text)
    env = {"PATH": f"{shims}:{os.environ['PATH']}", "SHIM_OUT": str(case / "out")}
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return json.loads((case / "out.srun").read_text())["argv"], case


def mounts_of(case: Path, extra: list[str]) -> list[str]:
    return [f"{case}:{case}", *extra]  # run, checkpoint and script directories are under the working one


def test_pyxis_options_go_on_srun(tmp_path: Path) -> None:
    argv, case = srun_argv(
        tmp_path,
        {"runtime": "pyxis", "image": "nvcr.io#nvidia/pytorch:24.05-py3", "mounts": ["/data:/data:ro"]},
    )
    head = argv[: argv.index(AGENT_HEAD[0])]
    assert head[-3:] == [
        "--container-image=nvcr.io#nvidia/pytorch:24.05-py3",
        f"--container-mounts={','.join(mounts_of(case, ['/data:/data:ro']))}",
        f"--container-workdir={case}",
    ]
    assert argv[argv.index(AGENT_HEAD[0]) :][:4] == AGENT_HEAD


def test_apptainer_wraps_the_agent(tmp_path: Path) -> None:
    argv, case = srun_argv(tmp_path, {"runtime": "apptainer", "image": "/images/train.sif"}, gpus=4)
    start = argv.index("apptainer")
    binds = ",".join(mounts_of(case, []))
    assert argv[start : argv.index(AGENT_HEAD[0])] == [
        "apptainer", "exec", "--nv", "--bind", binds, "--pwd", str(case), "/images/train.sif",
    ]  # fmt: skip
    assert argv[argv.index(AGENT_HEAD[0]) :][:4] == AGENT_HEAD


def test_podman_wraps_the_agent_with_the_host_network_and_the_job_environment(tmp_path: Path) -> None:
    argv, case = srun_argv(
        tmp_path,
        {"runtime": "podman", "image": "localhost/train:1", "args": ["--device", "nvidia.com/gpu=all"]},
    )
    words = argv[argv.index("podman") : argv.index(AGENT_HEAD[0])]
    assert words[:7] == ["podman", "run", "--rm", "--network", "host", "--ipc", "host"]
    assert words[7:9] == ["-v", f"{case}:{case}"] and words[9:11] == ["-w", str(case)]
    passed = [words[i + 1] for i, w in enumerate(words) if w == "-e"]
    assert passed == [*container.PODMAN_ENV]  # HPCELASTIC_RUN_DIR and HPCELASTIC_CONTAINER: in HPCELASTIC_*
    assert words[-3:] == ["--device", "nvidia.com/gpu=all", "localhost/train:1"]


def test_oci_uses_the_runs_own_bundle(tmp_path: Path) -> None:
    argv, case = srun_argv(tmp_path, {"runtime": "oci", "image": "/bundles/train"})
    assert f"--container={case}/run/{container.OCI_BUNDLE_DIR}" in argv
    assert argv[argv.index(AGENT_HEAD[0]) :][:4] == AGENT_HEAD


def test_the_run_s_oci_bundle_adds_the_mounts_and_shares_the_network(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    (bundle / "rootfs").mkdir(parents=True)
    config = {
        "root": {"path": "rootfs", "readonly": True},
        "hostname": "runc",
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
        "linux": {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")]},
    }
    (bundle / "config.json").write_text(json.dumps(config))
    out = json.loads(container.oci_bundle(str(bundle), ["/run:/run", "/data:/in:ro"], "/work"))
    assert out["root"]["path"] == str(bundle / "rootfs")
    assert [m["destination"] for m in out["mounts"]] == ["/proc", "/run", "/in"]
    assert out["mounts"][2] == {
        "destination": "/in",
        "type": "bind",
        "source": "/data",
        "options": ["rbind", "ro"],
    }
    assert [n["type"] for n in out["linux"]["namespaces"]] == ["pid", "ipc", "mount"]
    assert "hostname" not in out and out["process"]["cwd"] == "/work"
    with pytest.raises(UserError, match="no OCI bundle"):
        container.oci_bundle(str(tmp_path / "missing"), [], "/")


def test_mount_points_are_made_in_the_rootfs_before_the_nodes_runc_race_for_them(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    (bundle / "rootfs" / "srv").mkdir(parents=True)
    (bundle / "config.json").write_text(json.dumps({"root": {"path": "rootfs"}, "mounts": []}))
    data, conf = tmp_path / "data", tmp_path / "site.conf"
    data.mkdir()
    conf.write_text("x")
    mounts = [f"{data}:/srv/data", f"{conf}:/etc/site.conf:ro", f"{tmp_path}/missing:/opt/m"]
    container.make_mount_points(container.oci_bundle(str(bundle), mounts, "/"))
    rootfs = bundle / "rootfs"
    assert (rootfs / "srv" / "data").is_dir() and (rootfs / "etc" / "site.conf").is_file()
    assert (rootfs / "opt" / "m").is_file()  # a missing source: runc would fail on it all the same
    (rootfs / "srv").chmod(0o500)  # a rootfs the submitter cannot write is left to runc
    try:
        container.make_mount_points(container.oci_bundle(str(bundle), [f"{data}:/srv/other"], "/"))
    finally:
        (rootfs / "srv").chmod(0o700)
    assert os.geteuid() == 0 or not (rootfs / "srv" / "other").exists()


def test_slurm_22_05_oci_mode_is_refused(tmp_path: Path) -> None:
    oci = container.Container("oci", "/b")
    with pytest.raises(UserError, match="22.05's OCI mode"):
        container.check_release(oci, (22, 5))
    container.check_release(oci, (24, 11))
    container.check_release(oci, None)  # unknown: the agents say it at start if the variables are missing
    container.check_release(container.Container("podman", "i"), (22, 5))


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"runtime": "podman"}, "needs container.image"),
        ({"image": "x.sif"}, "no container.runtime"),
        ({"runtime": "apptainer", "image": "x.sif", "mounts": ["data:/data"]}, "absolute paths"),
        ({"runtime": "apptainer", "image": "x.sif", "mounts": ["/a,b:/c"]}, "comma"),
        ({"runtime": "docker", "image": "x"}, "must be one of pyxis, apptainer, podman, oci"),
    ],
)
def test_sites_validate_refuses_an_incomplete_container_section(
    tmp_path: Path, section: dict, message: str
) -> None:
    site = site_with(tmp_path, section)
    proc = subprocess.run(
        [sys.executable, "-m", "hpcelastic", "sites", "validate", str(site)], capture_output=True, text=True
    )
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_python_command_is_refused_with_a_pointer_to_the_container_section(tmp_path: Path) -> None:
    """The old workaround, ``python: apptainer exec --nv image.sif python3``, validated and then ran as one
    quoted word that does not exist; now it is refused where it is written."""
    site = tmp_path / "site.yaml"
    site.write_text("python: apptainer exec --nv image.sif python3\n")
    proc = subprocess.run(
        [sys.executable, "-m", "hpcelastic", "sites", "validate", str(site)], capture_output=True, text=True
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "is a command, not an interpreter path" in proc.stderr and "container:" in proc.stderr


def test_a_container_needs_the_sbatch_backend(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    site = site_with(tmp_path, {"runtime": "podman", "image": "i"}, backend="submitit")
    with pytest.raises(UserError, match="needs the sbatch backend"):
        build_spec(sites.resolve(str(site)), script=str(tmp_path / "train.py"), cwd=str(tmp_path))


def test_the_command_line_may_give_only_the_image(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    site = site_with(tmp_path, {"runtime": "apptainer", "image": "/old.sif"})
    spec = build_spec(
        sites.resolve(str(site), {"container.image": "/new.sif"}),
        script=str(tmp_path / "train.py"),
        cwd=str(tmp_path),
    )
    assert spec.container == container.Container("apptainer", "/new.sif")


def test_an_agent_without_scontrol_leaves_the_decision_to_finalize(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In an image without Slurm's commands the coordinator's agent records what it knows of the end;
    ``finalize`` (on the host, after the step) ends the attempt with that and not with srun's exit code."""
    rd = RunDir.create(tmp_path / "run")
    left = attempt_end.Deferred(Reason.PREEMPTED, ("n2",), ("n2",), True)
    attempt_end.defer(rd, 0, left)
    assert attempt_end.deferred(rd, 0) == left and attempt_end.deferred(rd, 1) is None
    seen: dict[str, object] = {}

    def decided(run_dir: RunDir, attempt: int, reason: Reason, **kw: object) -> attempt_end.EndOutcome:
        seen.update(kw, attempt=attempt, reason=reason)
        return attempt_end.EndOutcome(5, "")

    monkeypatch.setattr(finalize, "end_attempt", decided)
    environ = {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "0"}
    assert finalize.finalize(rd, 5, stopped=True, environ=environ, say=lambda m: None) == 5
    assert seen["reason"] is Reason.PREEMPTED and seen["bad_nodes"] == ("n2",) and seen["progressed"] is True


def test_mounts_refuse_paths_that_cannot_be_mounted(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="cannot be mounted"):
        container.job_mounts("/runs/a,b", "/runs/a,b/ckpt", None, "/work", ())
    assert container.job_mounts("/w/run", "/w/run/ckpt", "/w/train.py", "/w", ("/d:/d",)) == (
        "/w:/w",
        "/d:/d",
    )
    with pytest.raises(UserError, match="would hide the image"):
        container.job_mounts("/w/run", "/w/run/ckpt", "/train.py", "/w", ())
