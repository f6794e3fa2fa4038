"""No user value can run a command in the batch script (issue 10, 11).

Every field a user (CLI, Python API, site path) controls is filled with arbitrary text, the script is
rendered and run by bash with nothing on PATH but test-only ``srun`` and ``python`` shims and a
``command_not_found_handle`` that logs any other command. Either rendering refuses the value with
a :class:`UserError`, or the script must run exactly the expected commands with the expected words
and create no file of its own.
"""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hpcelastic import sites
from hpcelastic.errors import UserError
from hpcelastic.jobs.render import render
from hpcelastic.jobs.spec import build_spec
from hpcelastic.parse import is_env_name
from tests.unit.test_render import SHIM

anything = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=24
)
# One path component: no "/" (and short enough for any filesystem).
component = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\0/"), min_size=1, max_size=24
)
NOT_FOUND = '() { printf \'%s\\n\' "$1" >> "$NOT_FOUND_LOG"; return 127; }'


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("HPCELASTIC_SITE", raising=False)


TEMPLATE_COMMANDS = ("sleep", "mv", "rm")


def _case(tmp_path: Path) -> Path:
    case = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
    shims = case / "bin"
    shims.mkdir(parents=True)
    for name in ("srun", "python"):
        shim = shims / name
        shim.write_text(SHIM.format(python=sys.executable))
        shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    for name in TEMPLATE_COMMANDS:  # what the template itself runs (the batch shell's heartbeat)
        (shims / name).symlink_to(shutil.which(name) or f"/bin/{name}")
    (case / "train.py").write_text("print('hi')\n")
    return case


def run_shimmed(case: Path, script: Path) -> None:
    """Run the rendered ``script`` under bash with nothing on PATH but the case's shims; every other
    command it tries is logged (and must not be), and it must succeed."""
    run_env = {
        "PATH": str(case / "bin"),
        "SHIM_OUT": str(case / "out"),
        "NOT_FOUND_LOG": str(case / "not-found"),
        "BASH_FUNC_command_not_found_handle%%": NOT_FOUND,
    }
    proc = subprocess.run(["/bin/bash", str(script)], env=run_env, capture_output=True, text=True, timeout=30)
    assert not (case / "not-found").exists(), (case / "not-found").read_text()
    assert proc.returncode == 0, proc.stderr


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    env=st.dictionaries(anything, anything, max_size=3),
    site_dir=component,
    run_dir=component,
    checkpoint_dir=component,
    options=st.fixed_dictionaries({k: anything for k in ("partition", "account", "qos", "constraint")}),
)
@example(
    env={"X=1; touch /tmp/p; Y": "v", "OK": "$(id)"},
    site_dir="s", run_dir="r", checkpoint_dir="c", options={},
)  # fmt: skip
@example(env={}, site_dir="x\ntouch pwned\n", run_dir="r", checkpoint_dir="c", options={})
@example(env={}, site_dir="s", run_dir="r%j %x", checkpoint_dir="c\n$(id)", options={})
@example(env={}, site_dir="s", run_dir="r", checkpoint_dir="c", options={"partition": "p\ntouch pwned"})
def test_no_user_value_runs_a_command(
    tmp_path: Path, env: dict[str, str], site_dir: str, run_dir: str, checkpoint_dir: str, options: dict
) -> None:
    case = _case(tmp_path)
    try:
        site = case / site_dir / "site.yaml"
        site.parent.mkdir()
    except OSError:  # a name this filesystem refuses (".", "..", too long): not a value a user can give
        return
    site.write_text(f"python: {json.dumps(str(case / 'bin' / 'python'))}\n")
    overrides = {k: v for k, v in options.items() if v}
    try:
        spec = build_spec(
            sites.resolve(str(site), overrides),
            script=str(case / "train.py"),
            cwd=str(case),
            env=env,
            run_dir=str(case / run_dir),
            checkpoint_dir=str(case / checkpoint_dir),
        )
        text = render(spec).script_text
    except UserError:
        return
    assert all(is_env_name(k) for k in env), "an invalid variable name was accepted"
    script = case / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    before = sorted(p.name for p in case.iterdir())
    run_shimmed(case, script)
    assert sorted(p.name for p in case.iterdir()) == sorted([*before, "out.python", "out.srun"])
    srun = json.loads((case / "out.srun").read_text())
    assert srun["argv"][srun["argv"].index("--") + 1 :] == [str(case / "train.py")]
    assert srun["argv"][srun["argv"].index("--checkpoint-dir") + 1] == str(case / checkpoint_dir)
    assert {k: srun["env"].get(k) for k in env} == env
    assert srun["env"]["HPCELASTIC_RUN_DIR"] == str(case / run_dir)
    finalize = json.loads((case / "out.python").read_text())["argv"]
    assert finalize == ["-m", "hpcelastic", "finalize", "--run-dir", str(case / run_dir), "--exit-code", "0"]


def test_env_keys_are_refused_by_the_python_api_with_one_line(tmp_path: Path) -> None:
    case = _case(tmp_path)
    with pytest.raises(UserError, match="not a valid name"):
        build_spec(sites.resolve("default"), script=str(case / "train.py"), env={"X=1; touch p; Y": "v"})


def test_percent_in_the_run_dir_is_not_a_pattern(tmp_path: Path) -> None:
    case = _case(tmp_path)
    spec = build_spec(
        sites.resolve("default"), script=str(case / "train.py"), cwd=str(case), run_dir=str(case / "r%j%%x")
    )
    out = next(x for x in render(spec).directives if x.startswith("--output="))
    assert out == f"--output={case}/r%%j%%%%x/slurm-%j.out"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    runtime=st.sampled_from(sites.SCHEMA["container.runtime"].choices or ()),
    image=anything.filter(bool),
    workdir=anything,
    python=anything,
    args=st.lists(anything, max_size=3),
    mounts=st.lists(anything, max_size=2),
)
@example(
    runtime="podman", image="img; touch pwned", workdir="/w\n$(id)", python="/p`id`",
    args=["--x=$(touch pwned)", "'"], mounts=["/a:/b"],
)  # fmt: skip
@example(runtime="pyxis", image="a,b --container-mounts=/:/", workdir="/w", python="/p", args=[], mounts=[])
@example(runtime="apptainer", image="x.sif", workdir="", python="", args=["\n"], mounts=["/a:/b:ro"])
def test_no_container_value_runs_a_command(
    tmp_path: Path, runtime: str, image: str, workdir: str, python: str, args: list[str], mounts: list[str]
) -> None:
    """The container section's every field (issue 20) through the same bash run: the runtime's words reach
    srun byte for byte (``--container-image=IMAGE`` on srun for pyxis, the image as one word for apptainer
    and podman), or rendering refuses the value with one line."""
    case = _case(tmp_path)
    section = {"runtime": runtime, "image": image, "workdir": workdir, "python": python, "args": args}
    section["mounts"] = mounts
    site = case / "site.yaml"
    host_python = json.dumps(str(case / "bin" / "python"))
    site.write_text(f"python: {host_python}\ncontainer: {json.dumps(section, ensure_ascii=False)}\n")
    try:
        spec = build_spec(sites.resolve(str(site)), script=str(case / "train.py"), cwd=str(case))
        text = render(spec).script_text
    except UserError:
        return
    script = case / "job.sbatch"
    script.write_text(text)
    run_shimmed(case, script)
    argv = json.loads((case / "out.srun").read_text())["argv"]
    agent = argv.index("-m") - 1
    assert argv[agent] == (python or "python3")
    head = argv[:agent]
    if runtime == "pyxis":
        assert f"--container-image={image}" in head and f"--container-workdir={workdir or case}" in head
    elif runtime == "oci":
        assert any(w.startswith("--container=") for w in head)
    else:
        assert head[-1] == image and head[-1 - len(args) : -1] == args
    assert argv[argv.index("--") + 1 :] == [str(case / "train.py")]
