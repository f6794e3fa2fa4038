"""``JobSpec``: one submission, validated from the merged configuration and the command line.

Everything a user typed is checked here, before anything is created or submitted, and every
problem is a one-line :class:`~hpcelastic.errors.UserError`.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hpcelastic.errors import UserError
from hpcelastic.jobs.container import Container, from_config
from hpcelastic.jobs.options import DEFAULT_NODES
from hpcelastic.parse import (
    AUTO,
    check_module_name,
    check_no_task_array,
    is_env_name,
    no_nul,
    parse_nodes,
    parse_nproc,
    parse_time,
    script_not_found,
    signal_name,
)
from hpcelastic.sites import Resolved, default
from hpcelastic.slow.policy import SlowSettings
from hpcelastic.tier.settings import TierSettings

# bash refuses to assign these; the run directory variable is hpcelastic's own.
_RESERVED_ENV = frozenset(
    {"BASHOPTS", "BASH_VERSINFO", "EUID", "PPID", "SHELLOPTS", "UID", "HPCELASTIC_RUN_DIR"}
)


@dataclass(frozen=True)
class JobSpec:
    """A validated submission; :func:`hpcelastic.jobs.render.render` turns it into a JobRequest."""

    script: str  # absolute path of the training script, or a module name with ``module``
    script_args: tuple[str, ...]
    module: bool
    nodes_min: int
    nodes_max: int
    spare_nodes: int  # allocated on top of nodes_min..nodes_max; the agents hold them as hot spares
    gpus_per_node: int | None
    nproc_per_node: str  # a positive integer as text, or "auto"
    time_limit_s: int | None
    job_name: str
    run_dir: str
    checkpoint_dir: str
    cwd: str
    python: str
    partition: str | None
    account: str | None
    qos: str | None
    constraint: str | None
    exclude: str | None
    gpu_request: str
    signal: str
    signal_lead_s: int
    max_restarts: int
    requeue_mode: str
    max_requeues: int
    grace_period_s: int | None
    rdzv_interface: str | None
    rdzv_port: int | None
    stall_timeout_s: float | None
    modules: tuple[str, ...]
    setup: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    sbatch_directives_site: tuple[str, ...]  # the site's extra #SBATCH options, verbatim (admin-written)
    sbatch_args: tuple[str, ...]  # the user's --sbatch-arg values, passed to sbatch untouched
    template: str
    backend: str
    site: str
    config: Mapping[str, Any]  # the resolved configuration, nested, for <run>/config.yaml
    replica_groups: int = 1  # torchft replica groups (hpcelastic.agent.replicas); 1: off
    min_replica_groups: int = 1
    warm_start: bool = True  # fork workers from the node's fork server (hpcelastic.agent.forkserver)
    console: str = "all"  # worker output on the console (hpcelastic.agent.console)
    metrics_port: int | None = None  # the coordinator's OpenMetrics port (None: a free one)
    metrics_enabled: bool = True
    metrics_textfile_dir: str | None = None
    container: Container | None = None  # the agent runs in this container (hpcelastic.jobs.container)
    #: Submit with ``--requeue=expedite`` (Slurm 25.11+ that offers it: :func:`with_slurm_facts`).
    expedite: bool = False
    local_tier: str | None = None  # the node-local checkpoint tier's settings (hpcelastic.tier), JSON
    slow: str | None = None  # slow-node detection's settings (hpcelastic.slow.policy.SlowSettings.to_text)

    @property
    def nodes_text(self) -> str:
        """``MIN:MAX`` as the agent takes it."""
        return f"{self.nodes_min}:{self.nodes_max}"


def with_slurm_facts(spec: JobSpec) -> JobSpec:
    """``spec`` with what the cluster's Slurm offers (asked here, at the edge; ``build_spec`` asks nothing):
    the expedited requeue where the site wants it, in requeue mode, on the sbatch backend."""
    if not spec.config.get("requeue", {}).get("expedite") or spec.requeue_mode != "requeue":
        return spec
    if spec.backend != "sbatch":
        return spec
    from hpcelastic.jobs import slurm

    return replace(spec, expedite=slurm.expedited_requeue())


def check_hostlist(text: str, what: str) -> None:
    """A Slurm hostlist such as ``node[1-3,7],gpu01``; UserError naming the flag otherwise."""
    import hostlist

    try:
        hostlist.expand_hostlist(text)
    except hostlist.BadHostlist as e:
        raise UserError(f"{what} {text!r} is not a Slurm hostlist such as node[1-3],gpu07 ({e})") from None


def check_job_name(name: str) -> str:
    """A job name must fit on one ``#SBATCH`` line: no control characters."""
    if not name or not name.strip():
        raise UserError("--job-name is empty")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise UserError(f"--job-name {name!r} contains a control character (newline, tab, ...); remove it")
    return name


def default_job_name(script: str, module: bool) -> str:
    """``train.py`` -> ``train``; ``pkg.train`` (with -m) -> ``train``."""
    base = script.rsplit(".", 1)[-1] if module else Path(script).stem
    return base or "hpcelastic"


def _safe_path_part(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "job"


def default_run_dir(run_root: str, job_name: str, cwd: str, now: float | None = None) -> str:
    """``<run_root>/<job-name>-<YYYYmmdd-HHMMSS>``, absolute (relative roots are under ``cwd``)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    root = Path(os.path.expanduser(run_root))
    return str((Path(cwd) / root / f"{_safe_path_part(job_name)}-{stamp}").absolute())


def _resolve_script(script: str, module: bool, cwd: str) -> str:
    if not script:
        raise UserError("no training script given (usage: hpcelastic submit [OPTIONS] SCRIPT [ARGS]...)")
    if module:
        return check_module_name(script)
    path = Path(cwd) / os.path.expanduser(script)
    if not path.is_file():
        raise script_not_found(script, path)
    return str(path.resolve())


def _nproc(value: str | int | None, gpus: int | None) -> str:
    if value is None or str(value).strip() == "":
        return str(gpus) if gpus else AUTO
    count = parse_nproc(value)
    return AUTO if count is None else str(count)


def build_spec(
    config: Resolved,
    *,
    script: str,
    script_args: Sequence[str] = (),
    module: bool = False,
    nodes: str | int = DEFAULT_NODES,
    nproc_per_node: str | int | None = None,
    job_name: str | None = None,
    run_dir: str | None = None,
    checkpoint_dir: str | None = None,
    env: Mapping[str, str] | None = None,
    sbatch_args: Sequence[str] = (),
    cwd: str | None = None,
    now: float | None = None,
) -> JobSpec:
    """Validate one submission. ``config`` already holds the command-line overrides of config keys."""
    cwd = os.path.abspath(cwd or os.getcwd())
    nodes_min, nodes_max = parse_nodes(nodes)
    v = config.get
    gpus = v("gpus_per_node")
    max_gpus = v("max_gpus_per_node")
    if gpus is not None and max_gpus is not None and gpus > max_gpus:
        raise UserError(
            f"--gpus-per-node {gpus} is more than site {config.site!r} has per node ({max_gpus}); "
            f"use --gpus-per-node {max_gpus} and more nodes"
        )
    time_limit = parse_time(v("time")) if v("time") else None
    lead = v("signal.lead_time")
    if time_limit is not None and lead >= time_limit:
        raise UserError(
            f"the signal lead time ({lead} s) is not shorter than --time ({time_limit} s); "
            "raise --time or lower the lead with --signal"
        )
    groups, min_groups = v("replica_groups"), v("min_replica_groups")
    if groups > 1 or min_groups > 1:
        from hpcelastic.agent.replicas import check_groups

        if nodes_min != nodes_max:
            raise UserError("--replica-groups needs a fixed node count (--nodes N), not a range")
        problem = check_groups(nodes_max, groups, min_groups)
        if problem:
            raise UserError(problem)
    grace = v("requeue.grace_period")
    if grace is not None and lead is not None and lead <= grace:
        raise UserError(
            f"the signal lead time ({lead} s) is not longer than requeue.grace_period ({grace} s): the time "
            "limit would end the workers' checkpoint; raise the lead with --signal SIG@SECONDS"
        )
    script_path = _resolve_script(script, module, cwd)
    for i, arg in enumerate(script_args):
        no_nul(arg, f"script argument {i + 1}")
    name = check_job_name(job_name if job_name is not None else default_job_name(script, module))
    run = os.path.abspath(os.path.join(cwd, os.path.expanduser(run_dir))) if run_dir else None
    run = run or default_run_dir(v("run_root"), name, cwd, now)
    ckpt = os.path.abspath(os.path.join(cwd, os.path.expanduser(checkpoint_dir))) if checkpoint_dir else None
    merged_env = {**{k: str(x) for k, x in (v("env") or {}).items()}, **dict(env or {})}
    for key, value in merged_env.items():
        if not is_env_name(key):
            raise UserError(
                f"environment variable name {key!r} is not a valid name (letters, digits and _, "
                "not starting with a digit; not _ alone, which the shell sets itself)"
            )
        no_nul(value, f"environment value {key}")
        if key in _RESERVED_ENV:
            raise UserError(
                f"--env {key}=...: {key} cannot be set for the job (reserved by bash or hpcelastic)"
            )
    if v("exclude"):
        check_hostlist(v("exclude"), "--exclude")
    directives = tuple(v("sbatch_directives") or ())
    for d in directives:
        if not d.startswith("-") or any(ord(c) < 32 for c in d):
            raise UserError(
                f"site {config.site!r}: sbatch_directives entry {d!r} must be one option on one line"
            )
    for a in sbatch_args:
        no_nul(a, "--sbatch-arg")
        if not a.startswith("-"):
            raise UserError(f"--sbatch-arg {a!r} is not an sbatch option (write it as --sbatch-arg=--mem=0)")
    tier = TierSettings.from_config(v)
    check_no_task_array(directives, f"site {config.site!r}: sbatch_directives entry")
    check_no_task_array(sbatch_args, "--sbatch-arg")
    container = from_config(config.values, config.site)
    if container is not None and v("backend") != "sbatch":
        raise UserError(f"a container (container.runtime {container.runtime}) needs the sbatch backend")
    return JobSpec(
        script=script_path,
        script_args=tuple(script_args),
        module=module,
        nodes_min=nodes_min,
        nodes_max=nodes_max,
        spare_nodes=v("spare_nodes"),
        gpus_per_node=gpus,
        nproc_per_node=_nproc(nproc_per_node, gpus),
        time_limit_s=time_limit,
        job_name=name,
        run_dir=run,
        checkpoint_dir=ckpt or os.path.join(run, "checkpoints"),
        cwd=cwd,
        python=v("python") or sys.executable,
        partition=v("partition"),
        account=v("account"),
        qos=v("qos"),
        constraint=v("constraint"),
        exclude=v("exclude"),
        gpu_request=v("gpu_request"),
        signal=signal_name(v("signal.name")) or signal_name(default("signal.name")),
        signal_lead_s=lead,
        max_restarts=v("max_restarts"),
        requeue_mode=v("requeue.mode"),
        max_requeues=v("requeue.max_requeues"),
        grace_period_s=v("requeue.grace_period"),
        rdzv_interface=v("rdzv_interface"),
        rdzv_port=v("rdzv_port"),
        stall_timeout_s=v("stall_timeout"),
        modules=tuple(v("modules") or ()),
        setup=tuple(v("setup") or ()),
        env=tuple(merged_env.items()),
        sbatch_directives_site=directives,
        sbatch_args=tuple(sbatch_args),
        template=v("template"),
        backend=v("backend"),
        site=config.site,
        config=config.as_tree(),
        replica_groups=groups,
        min_replica_groups=min_groups,
        warm_start=v("warm_start"),
        console=v("console"),
        metrics_port=v("metrics.port"),
        metrics_enabled=v("metrics.enabled"),
        metrics_textfile_dir=v("metrics.textfile_dir"),
        container=container,
        local_tier=tier.to_text() if tier else None,
        slow=SlowSettings.from_config(v).to_text(),
    )
