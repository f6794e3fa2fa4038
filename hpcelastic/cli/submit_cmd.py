"""``hpcelastic submit``: parse flags, then hand over to :mod:`hpcelastic.api` (no logic here).

The flags are generated from :data:`hpcelastic.jobs.options.SUBMIT_OPTIONS`, the one declaration
of a submission's options (the Python API takes the same names as keywords).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from typing import Any

import click
from click.core import ParameterSource

from hpcelastic.errors import UserError
from hpcelastic.jobs.options import SUBMIT_OPTIONS, SubmitOption


def _click_option(option: SubmitOption) -> Callable[[Any], Any]:
    flags = (option.short, option.flag) if option.short else (option.flag,)
    kind: Any = click.Choice(option.choices) if option.choices else option.type
    extra: dict[str, Any] = {"is_flag": True} if option.is_flag else {"type": kind}
    text = option.help
    if option.negatable:  # None unless given: the site's setting stays in force
        flags, extra = (f"{option.flag}/--no-{option.flag[2:]}",), {"default": None}
    if option.default is not None:
        extra.update(default=option.default, show_default=True)
    elif option.shown_default is not None:
        shown = option.shown_default
        text += f"  [default: {str(shown).lower() if isinstance(shown, bool) else shown}]"
    return click.option(
        *flags, option.name, envvar=option.envvar, multiple=option.multiple, help=text, **extra
    )


def _from_environment(ctx: click.Context, error: UserError) -> UserError:
    """``error`` naming the ``HPCELASTIC_<OPTION>`` variables it is about, when their values came from
    the environment (``HPCELASTIC_NODES=abc``: the user never typed ``--nodes``)."""
    named = [
        f"{o.envvar}={os.environ.get(o.envvar, '')}"
        for o in SUBMIT_OPTIONS
        if ctx.get_parameter_source(o.name) is ParameterSource.ENVIRONMENT and o.flag in str(error)
    ]
    return UserError(f"{', '.join(named)}: {error}") if named else error


def _with_submit_options(command: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(SUBMIT_OPTIONS):
        command = _click_option(option)(command)
    return command


@click.command(
    context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]},
    short_help="Render a batch script and submit it to Slurm.",
)
@_with_submit_options
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def submit(script: str, script_args: tuple[str, ...], dry_run: bool, json: bool, **options: Any) -> None:
    """Submit SCRIPT [ARGS]... to Slurm, one hpcelastic agent per node.

    \b
    Every option can also be set as HPCELASTIC_<OPTION>, e.g. HPCELASTIC_NODES=2:4.
    Everything after SCRIPT reaches the script unchanged:
      hpcelastic submit --nodes 2 --gpus-per-node 4 --time 04:00:00 train.py --lr 3e-4
    """
    from hpcelastic import api

    try:
        spec = api.prepare(script, script_args, **options)
    except UserError as e:
        raise _from_environment(click.get_current_context(), e) from None
    if dry_run:
        _dry_run(spec, json)
        return
    job = api.submit_spec(spec)
    if json:
        import json as json_lib

        click.echo(
            json_lib.dumps({"job_id": job.job_id, "run_dir": str(job.run_dir), "backend": spec.backend})
        )
        return
    click.echo(f"Submitted job {job.job_id} ({spec.backend}, nodes {spec.nodes_text}, site {spec.site})")
    click.echo(f"Run directory: {job.run_dir}")
    click.echo(f"Next: hpcelastic status {shlex.quote(str(job.run_dir))}")


def _dry_run(spec, as_json: bool) -> None:  # spec: JobSpec (imported lazily)
    from hpcelastic.jobs.backend import describe, get_backend
    from hpcelastic.jobs.render import render

    request = render(spec)
    backend = get_backend(spec.backend)
    if as_json:
        click.echo(describe(request, backend))
        return
    click.echo(backend.preview(request), nl=False)
    if spec.backend == "sbatch":
        cmd = " ".join(shlex.quote(a) for a in request.sbatch_command)
        click.echo(f"# dry run: would write the script above and run: {cmd}", err=True)
    click.echo(f"# dry run: nothing submitted; {spec.run_dir} was not created", err=True)
