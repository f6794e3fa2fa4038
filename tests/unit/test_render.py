"""Rendering: the batch script's directives, the agent line, and quoting of every user value."""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hpcelastic import sites
from hpcelastic.errors import UserError
from hpcelastic.jobs.render import agent_argv, render, sbatch_quote
from hpcelastic.jobs.spec import JobSpec, build_spec

DOCS = Path(__file__).resolve().parents[2] / "docs" / "ARCHITECTURE.md"


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("HPCELASTIC_SITE", raising=False)


def make_spec(tmp: Path, site: str = "default", overrides: dict | None = None, **kw) -> JobSpec:
    script = tmp / "train.py"
    script.write_text("print('hi')\n")
    kw.setdefault("run_dir", str(tmp / "run"))
    return build_spec(sites.resolve(site, overrides), script=str(script), cwd=str(tmp), **kw)


def directives(text: str) -> list[str]:
    return [line[len("#SBATCH ") :] for line in text.splitlines() if line.startswith("#SBATCH ")]


def test_batch_script_directives(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, "testbed", {"gpus_per_node": 2, "time": "1-2:00"}, nodes="2:4")
    d = directives(render(spec).script_text)
    run = tmp_path / "run"
    for wanted in [
        "--nodes=2-4",
        "--ntasks-per-node=1",
        "--gres=gpu:2",
        "--partition=debug",
        "--time=1-02:00:00",
        "--requeue",
        "--signal=B:USR2@60",
        f"--output={run}/slurm-%j.out",
        "--open-mode=append",
        f"--chdir={tmp_path}",
    ]:
        assert wanted in d, (wanted, d)


def test_default_signal_and_gpu_style(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, "default", {"gpus_per_node": 8})
    d = directives(render(spec).script_text)
    assert "--signal=B:USR2@180" in d and "--gpus-per-node=8" in d
    assert not any(x.startswith("--gres") for x in d)


def test_agent_line_has_the_documented_form(tmp_path: Path) -> None:
    """The rendered srun line follows docs/ARCHITECTURE.md "Agent command line", option by option."""
    spec = make_spec(tmp_path, "testbed", {"gpus_per_node": 2}, nodes="2:4", script_args=["--lr", "3e-4"])
    text = render(spec).script_text
    joined = text[text.index("\nsrun ") + 1 :].split(" &\n", 1)[0].replace("\\\n", "")
    argv = shlex.split(joined)
    doc = DOCS.read_text().split("## Agent command line", 1)[1].split("```")[1].replace("\\\n", "")
    doc_words = doc.split()
    # srun prefix, then PYTHON, then the fixed words of the documented form
    srun = ["srun", "--ntasks-per-node=1", "--cpus-per-task=$agent_cpus", "--kill-on-bad-exit=0", "--no-kill"]
    assert argv[:6] == shlex.split(" ".join(doc_words[:6])) == [*srun, "--unbuffered"]
    assert argv[6] == spec.python
    assert argv[7:10] == doc_words[7:10] == ["-m", "hpcelastic", "agent"]
    documented = re.findall(r"--[a-z-]+", doc)
    used = [w for w in argv[10 : argv.index("--")] if w.startswith("--")]
    assert used == [o for o in documented[5:] if o in used], "options out of the documented order"
    assert {"--run-dir", "--nodes", "--nproc-per-node", "--max-restarts"} <= set(used)
    assert argv[argv.index("--nodes") + 1] == "2:4"
    assert argv[argv.index("--nproc-per-node") + 1] == "2"
    assert argv[argv.index("--rdzv-interface") + 1] == "lo"
    assert argv[argv.index("--") :] == ["--", str(tmp_path / "train.py"), "--lr", "3e-4"]


def test_script_never_contains_the_secret_and_exports_run_dir(tmp_path: Path) -> None:
    text = render(make_spec(tmp_path)).script_text
    assert "SECRET" not in text.upper().replace("RUN/SECRET", "")
    assert f"export HPCELASTIC_RUN_DIR={tmp_path / 'run'}" in text
    assert '--exit-code "$rc"' in text and "\nexit $?\n" in text


def test_module_mode_and_nproc_auto(tmp_path: Path) -> None:
    spec = build_spec(sites.resolve("default"), script="pkg.train", module=True, cwd=str(tmp_path))
    argv = agent_argv(spec)
    assert argv[argv.index("--nproc-per-node") + 1] == "auto"
    assert argv[-3:] == ("-m", "--", "pkg.train")


def sbatch_parse_argument(line: str) -> str:
    """The argument rules of sbatch's ``_get_argument`` (Slurm src/sbatch/opt.c), as documented there:
    quotes (' or ") group, a backslash makes the next character literal, unquoted whitespace or # ends it."""
    out, quote, escape = [], "", False
    for ch in line.lstrip():
        if escape:
            out.append(ch)
            escape = False
        elif ch == "\\":
            escape = True
        elif quote:
            if ch == quote:
                quote = ""
            else:
                out.append(ch)
        elif ch in "\"'":
            quote = ch
        elif ch.isspace() or ch == "#":
            break
        else:
            out.append(ch)
    return "".join(out)


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\n\r\0")))
@example('a "quoted" #name \\ with $(rm -rf /) and `id`')
def test_sbatch_quote_round_trips_through_sbatch_rules(value: str) -> None:
    assert sbatch_parse_argument("--job-name=" + sbatch_quote(value)) == "--job-name=" + value


def test_sbatch_quote_refuses_line_breaks() -> None:
    with pytest.raises(UserError):
        sbatch_quote("a\nb")


SHIM = """#!{python} -S
import json, os, sys
with open(os.environ["SHIM_OUT"] + "." + os.path.basename(sys.argv[0]), "w") as f:
    json.dump({{"argv": sys.argv[1:], "env": dict(os.environ)}}, f)
"""

text_values = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=30
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    args=st.lists(text_values, max_size=4),
    env_values=st.lists(text_values, max_size=3),
    job_name=st.text(
        alphabet=st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=20
    ).filter(str.strip),
)
@example(
    args=["it's", '"dq"', "$(touch /tmp/pwned)", "`id`", "a\nb", "ünï ✓", "--lr", "", " ", "\\", "*"],
    env_values=["$(id)", "x'y\"z", "line1\nline2"],
    job_name='x"; touch /tmp/pwned #',
)
def test_user_values_reach_the_job_byte_for_byte(
    tmp_path: Path, args: list[str], env_values: list[str], job_name: str
) -> None:
    """A test of quoting, not of srun: the rendered script runs under bash with test-only ``srun`` and
    ``python`` shims on PATH that dump their argv and environment as JSON. The arguments after ``--``
    must equal the user's arguments exactly, each --env value must arrive unchanged, and the job name
    must not change what bash runs."""
    case = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
    shims = case / "bin"
    shims.mkdir(parents=True)
    for name in ("srun", "python"):
        shim = shims / name
        shim.write_text(SHIM.format(python=sys.executable))
        shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    env = {f"HPCE_T_{i}": v for i, v in enumerate(env_values)}
    site = case / "site.yaml"
    site.write_text(f"python: {json.dumps(str(shims / 'python'))}\n")
    spec = make_spec(case, str(site), env=env, script_args=args, job_name=job_name)
    script = case / "job.sbatch"
    script.write_text(render(spec).script_text)
    out = case / "out"
    run_env = {"PATH": f"{shims}:{os.environ['PATH']}", "SHIM_OUT": str(out)}
    proc = subprocess.run(["bash", str(script)], env=run_env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    srun = json.loads((case / "out.srun").read_text())
    argv = srun["argv"]
    assert argv[argv.index("--") + 1 :] == [str(case / "train.py"), *args]
    for key, value in env.items():
        assert srun["env"][key] == value
    assert srun["env"]["HPCELASTIC_RUN_DIR"] == str(case / "run")
    finalize = json.loads((case / "out.python").read_text())["argv"]
    assert finalize == ["-m", "hpcelastic", "finalize", "--run-dir", str(case / "run"), "--exit-code", "0"]
    assert sorted(p.name for p in case.iterdir()) == [
        "bin",
        "job.sbatch",
        "out.python",
        "out.srun",
        "site.yaml",
        "train.py",
    ]
    name_line = next(d for d in directives(script.read_text()) if d.startswith("--job-name="))
    assert sbatch_parse_argument(name_line) == "--job-name=" + job_name


def _agent_cpus(text: str, environ: dict[str, str]) -> str:
    """``$agent_cpus`` as the rendered script's own lines compute it in bash from ``environ``."""
    lines = text[text.index("\nagent_cpus=") : text.index("\n# --- one agent per node")]
    env = {"PATH": os.environ["PATH"], **environ}
    proc = subprocess.run(
        ["bash", "-c", f'set -u{lines}\necho "$agent_cpus"'], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    return proc.stdout.strip()


@pytest.mark.parametrize(
    ("on_node", "per_node", "cpus"),
    [
        ("16", "16(x4)", "16"),  # every CPU the job holds on the node
        ("8", "8(x2),4", "4"),  # nodes that differ: the smallest count, which every node can give
        ("12", "12,6(x3),24", "6"),
        ("2", "2", "2"),
        (None, None, "1"),  # never under sbatch; still a valid srun -c
    ],
)
def test_srun_gets_every_cpu_the_job_holds_on_a_node(
    tmp_path: Path, on_node: str | None, per_node: str | None, cpus: str
) -> None:
    """srun (Slurm >= 22.05) does not inherit sbatch's --cpus-per-task: the agent step asks for the
    job's CPUs on each node itself, computed before srun from Slurm's batch variables."""
    text = render(make_spec(tmp_path, "testbed", {"gpus_per_node": 2})).script_text
    srun = '\nsrun --ntasks-per-node=1 --cpus-per-task="$agent_cpus" '
    assert text.index("\nagent_cpus=") < text.index(srun)
    environ = {"SLURM_CPUS_ON_NODE": on_node, "SLURM_JOB_CPUS_PER_NODE": per_node}
    assert _agent_cpus(text, {k: v for k, v in environ.items() if v is not None}) == cpus


def test_expedited_requeue_where_slurm_offers_it(tmp_path: Path) -> None:
    """Slurm 25.11's ``--requeue=expedite`` replaces ``--requeue`` when the cluster offers it
    (``with_slurm_facts`` asks); resubmit mode stays ``--no-requeue``. Designed from Slurm's documentation:
    there is no 25.11 here to run it."""
    from dataclasses import replace

    spec = make_spec(tmp_path)
    assert "--requeue" in directives(render(spec).script_text)
    assert "--requeue=expedite" in directives(render(replace(spec, expedite=True)).script_text)
    resubmit = make_spec(tmp_path, overrides={"requeue.mode": "resubmit"})
    assert "--no-requeue" in directives(render(resubmit).script_text)


def test_expedite_is_asked_of_slurm_only_where_it_can_apply(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpcelastic.jobs import slurm
    from hpcelastic.jobs.spec import with_slurm_facts

    config = "SlurmctldParameters     = enable_expedited_requeue,idle_on_node_suspend\nAuthInfo = x\n"
    monkeypatch.setattr(slurm, "run_slurm", lambda argv, **kw: config)
    for release, offered in (((25, 11), True), ((26, 5), True), ((24, 11), False), (None, False)):
        monkeypatch.setattr(slurm, "release", lambda r=release: r)
        assert slurm.expedited_requeue() is offered
        assert with_slurm_facts(make_spec(tmp_path)).expedite is offered
    monkeypatch.setattr(slurm, "release", lambda: (25, 11))
    assert not with_slurm_facts(make_spec(tmp_path, overrides={"requeue.mode": "resubmit"})).expedite
    site = tmp_path / "no-expedite.yaml"
    site.write_text("requeue:\n  expedite: false\n")
    assert not with_slurm_facts(make_spec(tmp_path, str(site))).expedite
    monkeypatch.setattr(slurm, "run_slurm", lambda argv, **kw: "SlurmctldParameters = (null)\n")
    assert not slurm.expedited_requeue()
