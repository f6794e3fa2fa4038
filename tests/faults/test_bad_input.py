"""Bad input, table-driven, through the real command line (``python -m hpcelastic`` in a subprocess).

Every case must end with exit code 2 and exactly one stderr line ``hpcelastic: error: ...`` naming the
problem; no traceback; nothing on stdout; no Slurm job (asked with the real ``squeue``: none named
after the case, none whose working directory is the case's directory); and no new or changed file in
the case's directory, which is also HOME and the XDG directories (so not even the run index).

Shell-looking text (quotes, ``$()``, newlines, unicode) is bad input only in a flag value that must be
a number, a name or a path; as an argument of the training script it is passed through untouched
(``test_shell_looking_script_arguments_are_not_bad_input``). NUL cannot be passed in an argument or an
environment variable at all, so the NUL cases come through YAML.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.faults.localjob import REPO

TRAIN = "print('trained')\n"
FAKE_RUN_EVENT = '{"ts": 1.0, "event": "attempt_started", "host": "h", "attempt": 0}\n'
# Files every case finds in its directory (cwd = HOME = tmp_path).
COMMON_FILES: dict[str, str | bytes] = {
    "train.py": TRAIN,
    "adir/keep": "",
    "bad.yaml": "partition: [debug\n",
    "typo.yaml": "partitoin: debug\n",
    "type.yaml": 'max_restarts: "3"\n',
    "impossible.yaml": "max_gpus_per_node: 0\n",
    "toplist.yaml": "- partition\n- debug\n",
    "section.yaml": "signal: 3\n",
    "nul.yaml": 'env:\n  NCCL_DEBUG: "IN\\0FO"\n',
    "latin1.yaml": b"description: caf\xe9\n",
    "port.yaml": "rdzv_port: 70000\n",
    "lead.yaml": "signal:\n  lead_time: 100000\n",
    "sigkill.yaml": "signal:\n  name: KILL\n",
    "grace-long.yaml": "requeue:\n  grace_period: 2200000\n",
    "grace-over-lead.yaml": "signal:\n  lead_time: 120\nrequeue:\n  grace_period: 120\n",
    "submitit-resubmit.yaml": "backend: submitit\nrequeue:\n  mode: resubmit\n",
    "undefined.j2": "#!/bin/bash\n{{ no_such_variable }}\n",
    "fakerun/events.jsonl": FAKE_RUN_EVENT,
    "fakelogs/events.jsonl": FAKE_RUN_EVENT,
    "fakelogs/logs/attempt-0/rank-0.log": "hello\n",
}


@dataclass(frozen=True)
class Case:
    """One bad input: the command line after ``hpcelastic``, extra environment, what the line names."""

    id: str
    argv: tuple[str, ...]
    expect: str
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str | bytes] = field(default_factory=dict)


def sub(*argv: str, expect: str, env: dict[str, str] | None = None, id: str, **kw) -> Case:  # noqa: A002
    """A ``submit`` case (a unique --job-name is added unless the case sets the name itself)."""
    return Case(id=id, argv=("submit", *argv), expect=expect, env=env or {}, **kw)


CASES: list[Case] = [
    # ---- submit: node, GPU and worker counts ----
    sub("--nodes", "0", "train.py", expect="--nodes '0': at least one node", id="submit-nodes-0"),
    sub("--nodes", "4:2", "train.py", expect="N_MIN is larger than N_MAX", id="submit-nodes-4:2"),
    sub("--nodes", "abc", "train.py", expect="--nodes 'abc' is not N", id="submit-nodes-abc"),
    sub("--nodes", "٣", "train.py", expect="--nodes '٣' is not N", id="submit-nodes-arabic-digit"),
    sub("--nodes", "1\n2", "train.py", expect="--nodes '1\\n2' is not N", id="submit-nodes-newline"),
    sub("--nodes", "$(touch pwned)", "train.py", expect="'$(touch pwned)' is not N", id="submit-nodes-$()"),
    sub("--nodes", '2"; rm -rf ~', "train.py", expect="is not N or N_MIN:N_MAX", id="submit-nodes-quote"),
    sub(
        "--site",
        "testbed",
        "--gpus-per-node",
        "99",
        "train.py",
        expect="more than site 'testbed' has per node (4)",
        id="submit-gpus-above-site-max",
    ),
    sub("--gpus-per-node", "-1", "train.py", expect="must be at least 0, got -1", id="submit-gpus-negative"),
    sub("--gpus-per-node", "1.5", "train.py", expect="'1.5' is not a valid integer", id="submit-gpus-float"),
    sub(
        "--max-restarts",
        "-1",
        "train.py",
        expect="--max-restarts: must be at least 0",
        id="submit-restarts-neg",
    ),
    sub(
        "--max-requeues",
        "-3",
        "train.py",
        expect="--max-requeues: must be at least 0",
        id="submit-requeues-neg",
    ),
    sub("--nproc-per-node", "0", "train.py", expect="--nproc-per-node '0'", id="submit-nproc-0"),
    sub("--nproc-per-node", "²", "train.py", expect="--nproc-per-node '²'", id="submit-nproc-superscript"),
    # ---- submit: time and signal ----
    sub("--time", "0", "train.py", expect="time limit '0' is zero", id="submit-time-0"),
    sub("--time", "1:2:3:4", "train.py", expect="'1:2:3:4' is not a Slurm time", id="submit-time-4-fields"),
    sub("--time", "two hours", "train.py", expect="'two hours' is not a Slurm time", id="submit-time-words"),
    sub("--time", "١٠", "train.py", expect="'١٠' is not a Slurm time", id="submit-time-arabic-digits"),
    sub("--time", "4:00'00", "train.py", expect="is not a Slurm time", id="submit-time-quote"),
    sub("--time", "25:99:99", "train.py", expect="minutes must be below 60, not 99", id="submit-time-99-min"),
    sub("--time", "10:61", "train.py", expect="seconds must be below 60, not 61", id="submit-time-61-s"),
    sub("--time", "1-24:00", "train.py", expect="hours must be below 24, not 24", id="submit-time-24-h"),
    sub(
        "--nodes",
        "4",
        "--replica-groups",
        "2",
        "--min-replica-groups",
        "3",
        "train.py",
        expect="--min-replica-groups 3 exceeds --replica-groups 2; lower --min-replica-groups to 2",
        id="submit-min-groups-above-groups",
    ),
    sub(
        "--signal",
        "USR2",
        "train.py",
        expect="--signal 'USR2' is not SIG@SECONDS",
        id="submit-signal-no-lead",
    ),
    sub("--signal", "FOO@10", "train.py", expect="'FOO@10' is not SIG@SECONDS", id="submit-signal-unknown"),
    sub("--signal", "USR2@99999", "train.py", expect="at most 65535 s", id="submit-signal-lead-too-long"),
    sub(
        "--signal", "USR2@-5", "train.py", expect="'USR2@-5' is not SIG@SECONDS", id="submit-signal-negative"
    ),
    sub(
        "--signal", "USR2@²", "train.py", expect="'USR2@²' is not SIG@SECONDS", id="submit-signal-superscript"
    ),
    sub(
        "--time",
        "2",
        "--signal",
        "USR2@180",
        "train.py",
        expect="not shorter than --time",
        id="submit-signal-after-time-limit",
    ),
    # ---- submit: environment, names, Slurm values ----
    sub("--env", "NOEQ", "train.py", expect="--env 'NOEQ' is not KEY=VALUE", id="submit-env-no-equals"),
    sub("--env", "1BAD=x", "train.py", expect="--env '1BAD=x' is not KEY=VALUE", id="submit-env-bad-name"),
    sub("--env", "_=x", "train.py", expect="--env '_=x' is not KEY=VALUE", id="submit-env-underscore"),
    sub("--env", "A\nB=1", "train.py", expect="--env 'A\\nB=1' is not KEY=VALUE", id="submit-env-newline"),
    sub("--env", "ÄÖ=1", "train.py", expect="--env 'ÄÖ=1' is not KEY=VALUE", id="submit-env-unicode-name"),
    sub("--env", "HPCELASTIC_RUN_DIR=/x", "train.py", expect="reserved", id="submit-env-reserved"),
    sub(
        "--job-name", "a\nb", "train.py", expect="--job-name 'a\\nb' contains a control", id="submit-name-nl"
    ),
    sub(
        "--job-name", "x\x1b[31m", "train.py", expect="'x\\x1b[31m' contains a control", id="submit-name-esc"
    ),
    sub(
        "--partition",
        "debug\n#SBATCH --wrap=id",
        "train.py",
        expect="'debug\\n#SBATCH --wrap=id' cannot go on an #SBATCH line",
        id="submit-partition-sbatch-injection",
    ),
    sub(
        "--exclude",
        "node[1-",
        "train.py",
        expect="'node[1-' is not a Slurm hostlist",
        id="submit-exclude-bad",
    ),
    sub("--sbatch-arg", "foo", "train.py", expect="'foo' is not an sbatch option", id="submit-sbatch-arg"),
    sub(
        "--sbatch-arg=--array=0-1",
        "train.py",
        expect="job arrays of several tasks are not supported",
        id="submit-sbatch-arg-array",
    ),
    sub("--sbatch-arg=-a1,3", "train.py", expect="'-a1,3': job arrays", id="submit-sbatch-arg-array-short"),
    # ---- submit: site and user configuration ----
    sub("--site", "nope", "train.py", expect="unknown site 'nope'", id="submit-site-unknown"),
    sub("--site", "日本", "train.py", expect="unknown site '日本'", id="submit-site-unicode"),
    sub(
        "--site",
        "x/y\nz.yaml",
        "train.py",
        expect="site file x/y\\nz.yaml does not",
        id="submit-site-newline",
    ),
    sub(
        "--site", "./missing.yaml", "train.py", expect="missing.yaml does not exist", id="submit-site-missing"
    ),
    sub("--site", "./bad.yaml", "train.py", expect="bad.yaml: invalid YAML: line 2", id="yaml-malformed"),
    sub("--site", "./typo.yaml", "train.py", expect="did you mean 'partition'?", id="yaml-unknown-key"),
    sub("--site", "./type.yaml", "train.py", expect="max_restarts: must be an integer", id="yaml-wrong-type"),
    sub("--site", "./impossible.yaml", "train.py", expect="must be at least 1, got 0", id="yaml-impossible"),
    sub(
        "--site", "./toplist.yaml", "train.py", expect="top level must be a mapping", id="yaml-top-level-list"
    ),
    sub("--site", "./section.yaml", "train.py", expect="signal: must be a mapping", id="yaml-section-scalar"),
    sub("--site", "./nul.yaml", "train.py", expect="NUL byte", id="yaml-env-nul"),
    sub("--site", "./latin1.yaml", "train.py", expect="not UTF-8 text", id="yaml-not-utf8"),
    sub("--site", "./port.yaml", "train.py", expect="rdzv_port: must be between 1 and 65535", id="yaml-port"),
    sub("--site", "./lead.yaml", "train.py", expect="lead_time: must be between 0 and 65535", id="yaml-lead"),
    # ---- the stop signal and the grace period (issue 10, item 9) ----
    sub("--signal", "KILL@100", "train.py", expect="SIGKILL cannot be caught", id="submit-signal-kill"),
    sub("--signal", "SIGSTOP@100", "train.py", expect="SIGSTOP cannot be caught", id="submit-signal-stop"),
    sub("--site", "./sigkill.yaml", "train.py", expect="SIGKILL cannot be caught", id="yaml-signal-kill"),
    sub(
        "--site",
        "./grace-long.yaml",
        "train.py",
        expect="grace_period: must be between 0 and 65535",
        id="yaml-grace-period-overflows-select",
    ),
    sub(
        "--site",
        "./grace-over-lead.yaml",
        "train.py",
        expect="lead time (120 s) is not longer than requeue.grace_period (120 s)",
        id="yaml-grace-period-not-below-lead",
    ),
    sub(
        "train.py",
        expect="config.yaml: qos: must be a string, not a list",
        files={"xdg-config/hpcelastic/config.yaml": "qos: [1]\n"},
        id="user-config-wrong-type",
    ),
    # ---- submit: script, run directory, backend, template ----
    sub(expect="Missing argument 'SCRIPT'", id="submit-no-script"),
    sub("missing.py", expect="training script 'missing.py' does not exist", id="submit-script-missing"),
    sub("adir", expect="training script 'adir' is a directory", id="submit-script-is-directory"),
    sub("ünï代码.py", expect="'ünï代码.py' does not exist", id="submit-script-unicode"),
    sub("mi\nssing.py", expect="'mi\\nssing.py' does not exist", id="submit-script-newline"),
    sub(os.fsdecode(b"\xff.py"), expect="'\\udcff.py' does not exist", id="submit-script-not-utf8"),
    sub("-m", "not a module", expect="-m 'not a module' is not a Python module", id="submit-module-bad"),
    sub("--run-dir", "adir", "train.py", expect="adir already exists", id="submit-run-dir-exists"),
    sub(
        "--run-dir",
        "train.py/run",
        "train.py",
        expect="cannot create run directory",
        id="submit-run-dir-unwritable",
    ),
    sub(
        "--run-dir",
        "r\nx",
        "train.py",
        expect="r\\nx/slurm-%j.out' cannot go on",
        id="submit-run-dir-newline",
    ),
    sub(
        "--backend",
        "nope",
        "train.py",
        expect="'nope' is not one of 'sbatch', 'submitit'",
        id="submit-backend",
    ),
    sub(
        "--template",
        "nope.j2",
        "train.py",
        expect="template 'nope.j2' not found",
        id="submit-template-unknown",
    ),
    sub(
        "--template",
        "./undefined.j2",
        "train.py",
        expect="'no_such_variable' is undefined",
        id="submit-template-bad",
    ),
    # ---- submit: refused only once the run directory exists (it must be removed again) ----
    sub(
        "--site",
        "./submitit-resubmit.yaml",
        "--run-dir",
        "deep/er/run",
        "train.py",
        expect="supports requeue mode 'requeue' only",
        id="submitit-resubmit-mode",
    ),
    sub(
        "--backend",
        "submitit",
        "--run-dir",
        "deep/er/run",
        "--sbatch-arg=-N1",
        "train.py",
        expect="'-N1': the submitit backend needs the long form",
        id="submitit-short-sbatch-arg",
    ),
    # ---- submit: HPCELASTIC_* environment variables ----
    sub(
        "train.py", env={"HPCELASTIC_NODES": "0"}, expect="HPCELASTIC_NODES=0: --nodes '0'", id="env-NODES=0"
    ),
    sub(
        "train.py",
        env={"HPCELASTIC_NODES": "abc"},
        expect="HPCELASTIC_NODES=abc: --nodes 'abc' is not N",
        id="env-NODES=abc",
    ),
    sub(
        "train.py",
        env={"HPCELASTIC_STALL_TIMEOUT": "0"},
        expect="HPCELASTIC_STALL_TIMEOUT=0: command line: --stall-timeout: must be at least 0.1",
        id="env-STALL_TIMEOUT=0",
    ),
    sub("train.py", env={"HPCELASTIC_SITE": "nope"}, expect="unknown site 'nope'", id="env-SITE=nope"),
    sub("train.py", env={"HPCELASTIC_SITE": "x\ny"}, expect="unknown site 'x\\ny'", id="env-SITE-newline"),
    sub(
        "train.py",
        env={"HPCELASTIC_GPUS_PER_NODE": "abc"},
        expect="'abc' is not a valid int",
        id="env-GPUS=abc",
    ),
    sub(
        "train.py",
        env={"HPCELASTIC_DRY_RUN": "maybe"},
        expect="'maybe' is not a valid boolean",
        id="env-DRY_RUN",
    ),
    sub("train.py", env={"HPCELASTIC_BACKEND": "slurmx"}, expect="'slurmx' is not one of", id="env-BACKEND"),
    sub(
        "train.py",
        env={"HPCELASTIC_TIME": "$(reboot)"},
        expect="'$(reboot)' is not a Slurm time",
        id="env-TIME",
    ),
    sub("train.py", env={"HPCELASTIC_SIGNAL": "USR2@"}, expect="'USR2@' is not SIG@SECONDS", id="env-SIGNAL"),
    sub("train.py", env={"HPCELASTIC_ENV": "NOEQ"}, expect="--env 'NOEQ' is not KEY=VALUE", id="env-ENV"),
    sub(
        "train.py", env={"HPCELASTIC_RUN_DIR": "adir"}, expect="adir already exists", id="env-RUN_DIR-exists"
    ),
    # ---- sites ----
    Case("sites-show-unknown", ("sites", "show", "nope"), "unknown site 'nope'"),
    Case("sites-show-newline", ("sites", "show", "a\nb"), "unknown site 'a\\nb'"),
    Case("sites-validate-missing", ("sites", "validate", "missing.yaml"), "missing.yaml does not exist"),
    Case("sites-check-unknown", ("sites", "check", "nope"), "unknown site 'nope'"),
    Case("sites-check-missing", ("sites", "check", "missing.yaml"), "site file missing.yaml does not exist"),
    Case(
        "sites-check-bad-key",
        ("sites", "check", "typo.yaml", "--probe"),
        "partiton: unknown key; did you mean 'partition'?",
        files={"typo.yaml": "partiton: gpu\n"},
    ),
    Case(
        "sites-validate-container-without-image",
        ("sites", "validate", "container-runtime.yaml"),
        "container.runtime podman needs container.image",
        files={"container-runtime.yaml": "container:\n  runtime: podman\n"},
    ),
    Case(
        "sites-validate-python-command",
        ("sites", "validate", "python-command.yaml"),
        "is a command, not an interpreter path",
        files={"python-command.yaml": "python: apptainer exec --nv image.sif python3\n"},
    ),
    sub(
        "--container-image",
        "img.sif",
        "train.py",
        expect="container.image is set but no container.runtime",
        id="submit-container-image-without-runtime",
    ),  # fmt: skip
    sub(
        "--container-runtime",
        "apptainer",
        "train.py",
        expect="container.runtime apptainer needs container.image",
        id="submit-container-runtime-without-image",
    ),  # fmt: skip
    sub(
        "--container-runtime",
        "docker",
        "train.py",
        expect="'docker' is not one of",
        id="submit-container-docker",
    ),
    Case("sites-validate-directory", ("sites", "validate", "adir"), "'adir' is a directory"),
    Case("sites-validate-malformed", ("sites", "validate", "bad.yaml"), "invalid YAML"),
    Case("sites-validate-nul", ("sites", "validate", "nul.yaml"), "NCCL_DEBUG: the value contains a NUL"),
    Case("sites-validate-not-utf8", ("sites", "validate", "latin1.yaml"), "not UTF-8 text"),
    # ---- agent ----
    Case("agent-script-missing", ("agent", "--", "missing.py"), "'missing.py' does not exist"),
    Case("agent-no-script", ("agent",), "no training script given"),
    Case("agent-nproc-0", ("agent", "--nproc-per-node", "0", "--", "train.py"), "--nproc-per-node '0'"),
    Case("agent-nproc-superscript", ("agent", "--nproc-per-node", "²", "--", "train.py"), "'²' must be"),
    Case(
        "agent-endpoint-no-port", ("agent", "--rdzv-endpoint", "host:", "--", "train.py"), "endpoint 'host:'"
    ),
    Case("agent-endpoint-newline", ("agent", "--rdzv-endpoint", "h\nx:1", "--", "train.py"), "'h\\nx:1'"),
    Case("agent-endpoint-port-range", ("agent", "--rdzv-endpoint", "h:99999", "--", "train.py"), "'h:99999'"),
    Case("agent-no-run-dir", ("agent", "--", "train.py"), "--run-dir is required"),
    Case("agent-missing-secret", ("agent", "--run-dir", "adir", "--", "train.py"), "adir/secret is missing"),
    Case("agent-run-dir-missing", ("agent", "--run-dir", "nope", "--", "train.py"), "nope does not exist"),
    Case("agent-nodes-0", ("agent", "--nodes", "0", "--", "train.py"), "--nodes '0'"),
    Case("agent-nodes-reversed", ("agent", "--nodes", "3:1", "--", "train.py"), "--nodes '3:1'"),
    Case("agent-nodes-underscore", ("agent", "--nodes", "1_0", "--", "train.py"), "--nodes '1_0' is not N"),
    Case("agent-signal-unknown", ("agent", "--signal", "FOO", "--", "train.py"), "--signal 'FOO' is not"),
    Case("agent-signal-number", ("agent", "--signal", "999", "--", "train.py"), "--signal '999' is not"),
    Case("agent-signal-kill", ("agent", "--signal", "KILL", "--", "train.py"), "SIGKILL cannot be caught"),
    Case(
        "agent-signal-stop-number", ("agent", "--signal", "19", "--", "train.py"), "SIGSTOP cannot be caught"
    ),
    Case(
        "agent-grace-period-25-days",
        ("agent", "--grace-period", "2200000", "--", "train.py"),
        "'--grace-period': 2200000.0 is not in the range 0<=x<=65535",
    ),
    Case("agent-restarts-negative", ("agent", "--max-restarts", "-1", "--", "train.py"), "'--max-restarts'"),
    Case("agent-module-bad", ("agent", "-m", "a b", "--", "x"), "-m 'a b' is not a Python module"),
    Case(
        "agent-env-ENVIRONMENT",
        ("agent", "--", "train.py"),
        "HPCELASTIC_ENVIRONMENT='bogus' is not one of",
        env={"HPCELASTIC_ENVIRONMENT": "bogus"},
    ),
    Case(
        "agent-env-LOCAL_NODE_RANK",
        ("agent", "--", "train.py"),
        "HPCELASTIC_LOCAL_NODE_RANK='abc' is not an integer",
        env={"HPCELASTIC_LOCAL_NODE_RANK": "abc"},
    ),
    Case(
        "agent-env-HEARTBEAT_TIMEOUT",
        ("agent", "--", "train.py"),
        "HPCELASTIC_HEARTBEAT_TIMEOUT='x' is not a number",
        env={"HPCELASTIC_HEARTBEAT_TIMEOUT": "x"},
    ),
    # ---- run ----
    Case("run-nodes-0", ("run", "--nodes", "0", "train.py"), "--nodes '0'"),
    Case("run-nproc-x", ("run", "--nproc-per-node", "x", "train.py"), "--nproc-per-node 'x'"),
    Case("run-script-missing", ("run", "missing.py"), "'missing.py' does not exist"),
    Case("run-script-is-directory", ("run", "adir"), "training script 'adir' is a directory"),
    Case(
        "run-tier-mb-alone",
        ("run", "--local-checkpoint-mb", "64", "train.py"),
        "needs --local-checkpoint-dir",
    ),
    Case(
        "run-tier-twice",
        (
            "run",
            "--local-tier",
            '{"local_checkpoint_dir": "/dev/shm/x"}',
            "--local-checkpoint-dir",
            "/tmp/y",
            "train.py",
        ),
        "give one or the other",
    ),
    Case("run-module-bad", ("run", "-m", "bad module"), "-m 'bad module' is not a Python module"),
    Case("run-run-dir-exists", ("run", "--run-dir", "adir", "train.py"), "adir already exists"),
    Case("run-rdzv-timeout-0", ("run", "--rdzv-timeout", "0", "train.py"), "'--rdzv-timeout'"),
    Case(
        "run-grace-period-25-days",
        ("run", "--grace-period", "2200000", "train.py"),
        "'--grace-period': 2200000.0 is not in the range",
    ),
    # ---- status, logs, cancel, finalize ----
    Case("status-unknown-dir", ("status", "nope"), "nope: no such run directory"),
    Case("status-unknown-job", ("status", "999999"), "job 999999 is not in the run index"),
    Case("status-newline", ("status", "a\nb"), "a\\nb: no such run directory"),
    Case("status-nothing-recorded", ("status",), "no run given and none recorded yet"),
    Case("status-not-a-run-dir", ("status", "adir"), "adir is not an hpcelastic run directory"),
    Case("logs-unknown-job", ("logs", "12345"), "job 12345 is not in the run index"),
    Case("logs-rank-negative", ("logs", "--rank", "-1", "fakelogs"), "'--rank'"),
    Case("logs-rank-not-int", ("logs", "--rank", "x", "fakelogs"), "'--rank'"),
    Case("logs-no-logs-yet", ("logs", "fakerun"), "no worker logs yet"),
    Case("logs-rank-without-log", ("logs", "--rank", "7", "fakelogs"), "no log for rank 7 in attempt 0"),
    Case("cancel-unknown-job", ("cancel", "4242"), "job 4242 is not in the run index"),
    Case("cancel-never-submitted", ("cancel", "fakerun"), "has no Slurm job id"),
    Case("unknown-command", ("bo\ngus",), "No such command 'bo\\ngus'"),
    Case("finalize-exit-code", ("finalize", "--run-dir", "fakerun", "--exit-code", "x"), "'--exit-code'"),
]


def _write(root: Path, files: dict[str, str | bytes]) -> None:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if rel.endswith("/keep"):
            continue
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)


def _snapshot(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under ``root``: mode, and for files size and modification time."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out[str((Path(dirpath) / name).relative_to(root))] = (
                (Path(dirpath) / name).lstat().st_mode,
                0,
                0,
            )
        for name in filenames:
            st = (Path(dirpath) / name).lstat()
            out[str((Path(dirpath) / name).relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


def _clean_env(tmp_path: Path, extra: dict[str, str]) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HPCELASTIC_", "SLURM_", "OMPI_", "PMIX_", "PMI_"))
    }
    env.update(
        HOME=str(tmp_path),
        XDG_CONFIG_HOME=str(tmp_path / "xdg-config"),
        XDG_STATE_HOME=str(tmp_path / "xdg-state"),
        XDG_CACHE_HOME=str(tmp_path / "xdg-cache"),
        PYTHONPATH=str(REPO),
    )
    env.update(extra)
    return env


def slurm_jobs_of(tmp_path: Path, job_name: str) -> list[str]:
    """Jobs (any state Slurm still shows) named ``job_name`` or working in ``tmp_path``."""
    proc = subprocess.run(
        ["squeue", "-h", "-t", "all", "-o", "%i|%j|%Z"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    found = []
    for line in proc.stdout.splitlines():
        job_id, name, workdir = line.split("|", 2)
        if name == job_name or workdir.startswith(str(tmp_path)):
            found.append(job_id)
    return found


def _with_job_name(case: Case, name: str) -> tuple[str, ...]:
    if case.argv[0] != "submit" or "--job-name" in case.argv:
        return case.argv
    return ("submit", "--job-name", name, *case.argv[1:])


def test_the_table_has_enough_distinct_cases() -> None:
    assert len(CASES) >= 40
    assert len({c.id for c in CASES}) == len(CASES)
    assert len({(c.argv, tuple(sorted(c.env.items()))) for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(tmp_path: Path, case: Case) -> None:
    _write(tmp_path, {**COMMON_FILES, **case.files})
    job_name = f"hpce-bad-{uuid.uuid4().hex[:10]}"
    before = _snapshot(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "hpcelastic", *_with_job_name(case, job_name)],
        cwd=tmp_path,
        env=_clean_env(tmp_path, case.env),
        capture_output=True,
        encoding="utf-8",
        timeout=60,
    )
    submitted = slurm_jobs_of(tmp_path, job_name)
    if submitted:  # a wrong acceptance must not leave a job on the shared testbed
        subprocess.run(["scancel", *submitted], capture_output=True, check=False)
    report = f"exit {proc.returncode}\nstdout: {proc.stdout!r}\nstderr: {proc.stderr!r}"
    assert "Traceback" not in proc.stdout + proc.stderr, report
    assert proc.returncode == 2, report
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "\n" not in proc.stderr.rstrip("\n"), report
    assert lines[0].startswith("hpcelastic: error: ") and lines[0][len("hpcelastic: error: ") :].strip()
    assert case.expect in lines[0], report
    assert proc.stdout == "", report
    assert not submitted, f"submitted {submitted} for bad input; {report}"
    assert _snapshot(tmp_path) == before, "files were created or changed"


SHELL_LOOKING = ["it's", '"; rm -rf ~', "$(touch pwned)", "`id`", "two\nlines", "ünï 代码 ✓", "--nodes", "0"]


def test_shell_looking_script_arguments_are_not_bad_input(tmp_path: Path) -> None:
    """After SCRIPT every argument is the script's, whatever it looks like: accepted and kept as is."""
    _write(tmp_path, COMMON_FILES)
    before = _snapshot(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "hpcelastic", "submit", "--dry-run", "--json", "train.py", *SHELL_LOOKING],
        cwd=tmp_path,
        env=_clean_env(tmp_path, {}),
        capture_output=True,
        encoding="utf-8",
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    argv = json.loads(proc.stdout)["agent_argv"]
    assert argv[argv.index("--") + 1 :] == [str(tmp_path / "train.py"), *SHELL_LOOKING]
    assert _snapshot(tmp_path) == before
