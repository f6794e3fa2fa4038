"""Render a :class:`JobSpec` into a :class:`JobRequest`: the batch script text and the sbatch command.

Dry-run prints the request and submit sends the same object, so the two never drift apart.
Quoting rules, in one place:

* shell words (arguments, paths, environment values) go through :func:`shlex.quote`;
* ``#SBATCH`` values are read by sbatch's own parser (Slurm ``src/sbatch/opt.c``): quotes group,
  a backslash escapes the next character and a line ends the option. :func:`sbatch_quote` wraps
  every value in double quotes and escapes ``\\`` and ``"``; values with a line break are refused.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hpcelastic import __version__
from hpcelastic.agent.spec import DEFAULT_CONSOLE, AgentCommand
from hpcelastic.errors import UserError
from hpcelastic.jobs import container as containers
from hpcelastic.jobs.spec import JobSpec
from hpcelastic.parse import is_env_name
from hpcelastic.resources import data_dir

#: The shipped partial with the site's modules, setup lines and environment (default.sbatch.j2 includes it).
SITE_SETUP_TEMPLATE = "site_setup.sh.j2"
_PLAIN = re.compile(r"[A-Za-z0-9_.,:@%/+=-]+")
#: ``--cpus-per-task``: srun (Slurm 22.05 and later) does not inherit sbatch's, and a site with
#: task/affinity or task/cgroup may then bind each agent, and all its workers, to one CPU. The batch
#: script sets ``$agent_cpus`` (sbatch_templates/default.sbatch.j2) to every CPU the job holds on a node.
#: ``--no-kill``: a node's death takes only its own task; the agents, not srun, handle the lost node.
#: Shell text, not quoted: each word is a constant.
SRUN_PREFIX = (
    "srun",
    "--ntasks-per-node=1",
    '--cpus-per-task="$agent_cpus"',
    "--kill-on-bad-exit=0",
    "--no-kill",
    "--unbuffered",
)


@dataclass(frozen=True)
class JobRequest:
    """What a backend submits: the script text, the sbatch command line and the agent's argv."""

    spec: JobSpec
    script_text: str
    sbatch_args: tuple[str, ...]  # the user's --sbatch-arg values, passed to sbatch untouched
    directives: tuple[str, ...]  # the #SBATCH options in the script, already quoted for sbatch
    agent_argv: tuple[str, ...]  # PYTHON -m hpcelastic agent ... -- SCRIPT ARGS
    finalize_argv: tuple[str, ...]  # PYTHON -m hpcelastic finalize --run-dir RUN (+ --exit-code RC)
    env: tuple[tuple[str, str], ...]  # exported before the step, HPCELASTIC_RUN_DIR first

    @property
    def script_path(self) -> Path:
        """Where submit writes :attr:`script_text`."""
        return Path(self.spec.run_dir) / "job.sbatch"

    @property
    def sbatch_command(self) -> tuple[str, ...]:
        """The exact command the sbatch backend runs."""
        return ("sbatch", "--parsable", *self.sbatch_args, str(self.script_path))


def sbatch_quote(value: str) -> str:
    """Quote ``value`` for one ``#SBATCH --opt=VALUE`` line as sbatch parses it."""
    if "\n" in value or "\r" in value or "\0" in value:
        raise UserError(f"{value!r} cannot go on an #SBATCH line: it contains a line break")
    if _PLAIN.fullmatch(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def comment_text(value: str) -> str:
    """``value`` for a ``#`` comment line: control characters (a line break first) are escaped."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in str(value))


def output_pattern(path: str) -> str:
    """``path`` for sbatch's ``--output``, whose ``%`` starts a pattern (``%j``): ``%`` is written ``%%``."""
    return path.replace("%", "%%")


def _option(name: str, value: str | int | None = None) -> str:
    return f"--{name}" if value is None else f"--{name}={sbatch_quote(str(value))}"


def directives_for(spec: JobSpec) -> tuple[str, ...]:
    """The ``#SBATCH`` options (without the ``#SBATCH`` prefix) for ``spec``."""
    lo, hi = spec.nodes_min + spec.spare_nodes, spec.nodes_max + spec.spare_nodes
    nodes = str(lo) if lo == hi else f"{lo}-{hi}"
    out = [_option("job-name", spec.job_name), _option("nodes", nodes), _option("ntasks-per-node", 1)]
    if spec.gpus_per_node:
        gpus = spec.gpus_per_node
        out.append(
            _option("gres", f"gpu:{gpus}") if spec.gpu_request == "gres" else _option("gpus-per-node", gpus)
        )
    if spec.time_limit_s is not None:
        from hpcelastic.parse import format_time

        out.append(_option("time", format_time(spec.time_limit_s)))
    for name in ("partition", "account", "qos", "constraint", "exclude"):
        value = getattr(spec, name)
        if value:
            out.append(_option(name, value))
    out += [
        # In resubmit mode hpcelastic chains a new job itself; Slurm must not requeue this one too.
        _requeue_option(spec),
        # Slurm keeps the allocation when a node dies (the batch host's node excepted) instead of
        # killing and requeueing the whole job: the survivors go on in the same allocation.
        _option("no-kill"),
        _option("signal", f"B:{spec.signal}@{spec.signal_lead_s}"),
        _option("output", output_pattern(str(Path(spec.run_dir))) + "/slurm-%j.out"),
        _option("open-mode", "append"),
        _option("chdir", spec.cwd),
    ]
    # Site directives are written by the admin as options; each is one shell-free line.
    out += list(spec.sbatch_directives_site)
    return tuple(out)


def _requeue_option(spec: JobSpec) -> str:
    """``--requeue`` (``=expedite`` where Slurm offers it: top priority, no credential wait, the job's
    healthy nodes held for it after a node failure), or ``--no-requeue`` in resubmit mode."""
    if spec.requeue_mode != "requeue":
        return _option("no-requeue")
    return _option("requeue", "expedite") if spec.expedite else _option("requeue")


def agent_command(spec: JobSpec) -> AgentCommand:
    """The agent's options for ``spec``: every value the site or the user settled is passed on."""
    return AgentCommand(
        run_dir=Path(spec.run_dir),
        nodes=spec.nodes_text,
        spare_nodes=spec.spare_nodes or None,
        nproc_per_node=spec.nproc_per_node,
        max_restarts=spec.max_restarts,
        checkpoint_dir=Path(spec.checkpoint_dir),
        rdzv_port=spec.rdzv_port,
        rdzv_interface=spec.rdzv_interface or None,
        stall_timeout=spec.stall_timeout_s,
        signal=spec.signal,
        grace_period=spec.grace_period_s,
        requeue_mode=spec.requeue_mode,
        max_requeues=spec.max_requeues,
        replica_groups=spec.replica_groups if spec.replica_groups > 1 else None,
        min_replica_groups=spec.min_replica_groups if spec.min_replica_groups > 1 else None,
        no_warm_start=not spec.warm_start,
        console=spec.console if spec.console != DEFAULT_CONSOLE else None,
        metrics_port=spec.metrics_port,
        no_metrics=not spec.metrics_enabled,
        metrics_textfile_dir=Path(spec.metrics_textfile_dir) if spec.metrics_textfile_dir else None,
        local_tier=spec.local_tier,
        slow=spec.slow,
        module=spec.module,
        program=(spec.script, *spec.script_args),
    )


def agent_argv(spec: JobSpec) -> tuple[str, ...]:
    """``PYTHON -m hpcelastic agent ...`` exactly as docs/ARCHITECTURE.md ("Agent command line") states;
    in a container, PYTHON is the image's (``container.python``)."""
    return agent_command(spec).to_argv(spec.container.python if spec.container else spec.python)


def container_mounts(spec: JobSpec) -> tuple[str, ...]:
    """Every mount of the job's container (:func:`hpcelastic.jobs.container.job_mounts`); none without one."""
    c = spec.container
    if c is None:
        return ()
    script = None if spec.module else spec.script
    return containers.job_mounts(spec.run_dir, spec.checkpoint_dir, script, spec.cwd, c.mounts)


def step_words(
    spec: JobSpec, argv: Sequence[str], env_names: Sequence[str]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The job step: ``(srun's options after SRUN_PREFIX, the command srun runs)``; the agent itself, or
    the agent inside the site's container (:func:`hpcelastic.jobs.container.wrap`)."""
    c = spec.container
    if c is None:
        return (), tuple(argv)
    return containers.wrap(
        c,
        argv,
        mounts=container_mounts(spec),
        workdir=spec.cwd,
        env_names=env_names,
        gpus=bool(spec.gpus_per_node),
        bundle=str(Path(spec.run_dir) / containers.OCI_BUNDLE_DIR),
    )


def trapped_signals(spec: JobSpec) -> tuple[str, ...]:
    """The signals the batch step forwards to the agents: the site's stop signal, and TERM (scancel)."""
    return tuple(dict.fromkeys((spec.signal, "TERM")))


def _join(words: Sequence[str]) -> str:
    return " ".join(shlex.quote(w) for w in words)


def agent_line(argv: Sequence[str], srun_options: Sequence[str] = (), wrapper: Sequence[str] = ()) -> str:
    """The srun + agent command as shell text, broken into lines like the documented form; a container's
    srun options follow srun's, its runtime's command goes on a line of its own before the agent."""
    agent = list(argv)
    cut1 = agent.index("--max-restarts")
    cut2 = agent.index("--signal")
    groups = [agent[:cut1], agent[cut1:cut2], agent[cut2:]]
    first = " ".join(SRUN_PREFIX) + (" " + _join(srun_options) if srun_options else "")
    return " \\\n  ".join([first, *([_join(wrapper)] if wrapper else []), *(_join(g) for g in groups)])


def _environment(template: str):  # -> (jinja2.Environment, the template's name)
    path = Path(template).expanduser()
    if path.is_file():
        folder, name = path.parent, path.name
    else:
        folder, name = data_dir("sbatch_templates"), template
        if not (folder / name).is_file():
            known = ", ".join(sorted(p.name for p in folder.glob("*.sbatch.j2")))
            raise UserError(
                f"template {template!r} not found (shipped templates: {known}; or give a file path)"
            )
    return _jinja(folder), name


def _jinja(folder: Path):  # -> jinja2.Environment, imported lazily
    """Templates from ``folder``, then the shipped ones (a site's own template may include the shipped
    ``site_setup.sh.j2``)."""
    import jinja2

    shipped = data_dir("sbatch_templates")
    env = jinja2.Environment(
        loader=jinja2.ChoiceLoader(
            [jinja2.FileSystemLoader(str(folder)), jinja2.FileSystemLoader(str(shipped))]
        ),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["q"] = shlex.quote
    env.filters["sbatch_quote"] = sbatch_quote
    env.filters["comment"] = comment_text
    return env


def site_setup(
    site: str, modules: Sequence[str], setup: Sequence[str], env: Sequence[tuple[str, str]]
) -> str:
    """The shell lines that load the site's modules, run its setup lines and export its environment: the
    batch script's (``default.sbatch.j2`` includes them) and ``sites check --probe``'s."""
    template = _jinja(data_dir("sbatch_templates")).get_template(SITE_SETUP_TEMPLATE)
    return template.render(site=site, modules=modules, setup=setup, env=env)


def render(spec: JobSpec) -> JobRequest:
    """Render ``spec`` with its template into a :class:`JobRequest` (pure: creates no files)."""
    argv = agent_argv(spec)
    finalize = (spec.python, "-m", "hpcelastic", "finalize", "--run-dir", spec.run_dir)
    env = (("HPCELASTIC_RUN_DIR", spec.run_dir), *spec.env)
    if spec.container is not None:
        env = (*env, (containers.CONTAINER_ENV, spec.container.runtime))
    for key, _ in env:
        if not is_env_name(key):
            raise UserError(f"environment variable name {key!r} is not a valid name (letters, digits, _)")
    directives = directives_for(spec)
    srun_options, command = step_words(spec, argv, [k for k, _ in env])
    wrapper = command[: len(command) - len(argv)]
    jinja_env, name = _environment(spec.template)
    import jinja2

    try:
        text = jinja_env.get_template(name).render(
            version=__version__,
            site=spec.site,
            run_dir=spec.run_dir,
            directives=directives,
            modules=spec.modules,
            setup=spec.setup,
            env=env,
            trapped_signals=list(trapped_signals(spec)),
            agent_line=agent_line(argv, srun_options, wrapper),
            finalize_line=_join(finalize) + ' --exit-code "$rc"',
            spec=spec,
        )
    except jinja2.TemplateError as e:
        raise UserError(f"template {spec.template!r}: {e.message or e}") from None
    return JobRequest(
        spec=spec,
        script_text=text,
        sbatch_args=spec.sbatch_args,
        directives=directives,
        agent_argv=argv,
        finalize_argv=finalize,
        env=env,
    )
