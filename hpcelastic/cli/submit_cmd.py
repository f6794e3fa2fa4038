"""``hpcelastic submit``: parse flags, then hand over to :mod:`hpcelastic.api` (no logic here)."""

from __future__ import annotations

import shlex

import click


def _env(name: str) -> str:
    return f"HPCELASTIC_{name}"


@click.command(
    context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]},
    short_help="Render a batch script and submit it to Slurm.",
)
@click.option(
    "--nodes", envvar=_env("NODES"), default="1", show_default=True, help="N, or N_MIN:N_MAX (elastic)."
)
@click.option("--gpus-per-node", envvar=_env("GPUS_PER_NODE"), type=int, help="GPUs to request on each node.")
@click.option("--nproc-per-node", envvar=_env("NPROC_PER_NODE"), help="Workers per node: N or auto.")
@click.option("--time", "time_limit", envvar=_env("TIME"), help="Time limit: MM, HH:MM:SS, D-HH:MM, ...")
@click.option("--partition", envvar=_env("PARTITION"), help="Slurm partition.")
@click.option("--account", envvar=_env("ACCOUNT"), help="Slurm account.")
@click.option("--qos", envvar=_env("QOS"), help="Slurm QOS.")
@click.option("--constraint", envvar=_env("CONSTRAINT"), help="Node feature constraint.")
@click.option("--exclude", envvar=_env("EXCLUDE"), help="Nodes never to use (a hostlist).")
@click.option("--job-name", envvar=_env("JOB_NAME"), help="Job name [default: the script's name].")
@click.option("--site", envvar=_env("SITE"), help="Site config name or YAML file [default: detected].")
@click.option("--max-restarts", envvar=_env("MAX_RESTARTS"), type=int, help="Job-wide worker restarts.")
@click.option("--max-requeues", envvar=_env("MAX_REQUEUES"), type=int, help="Requeues after failures.")
@click.option("--checkpoint-dir", envvar=_env("CHECKPOINT_DIR"), help="[default: RUN_DIR/checkpoints]")
@click.option("--run-dir", envvar=_env("RUN_DIR"), help="[default: ./hpcelastic-runs/NAME-DATE-TIME]")
@click.option(
    "--signal", "signal_spec", envvar=_env("SIGNAL"), help="SIG@SECONDS before the limit [USR2@180]."
)
@click.option(
    "--env", "env_items", envvar=_env("ENV"), multiple=True, help="KEY=VALUE for the job (repeatable)."
)
@click.option(
    "--sbatch-arg", "sbatch_args", envvar=_env("SBATCH_ARG"), multiple=True, help="Passed to sbatch."
)
@click.option("--template", envvar=_env("TEMPLATE"), help="Batch script template name or file.")
@click.option("--backend", envvar=_env("BACKEND"), type=click.Choice(["sbatch", "submitit"]), help="[sbatch]")
@click.option("--dry-run", envvar=_env("DRY_RUN"), is_flag=True, help="Print the script; submit nothing.")
@click.option("--json", "as_json", envvar=_env("JSON"), is_flag=True, help="Print one JSON object.")
@click.option("-m", "--module", envvar=_env("MODULE"), is_flag=True, help="SCRIPT is a module (python -m).")
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def submit(
    nodes: str,
    gpus_per_node: int | None,
    nproc_per_node: str | None,
    time_limit: str | None,
    partition: str | None,
    account: str | None,
    qos: str | None,
    constraint: str | None,
    exclude: str | None,
    job_name: str | None,
    site: str | None,
    max_restarts: int | None,
    max_requeues: int | None,
    checkpoint_dir: str | None,
    run_dir: str | None,
    signal_spec: str | None,
    env_items: tuple[str, ...],
    sbatch_args: tuple[str, ...],
    template: str | None,
    backend: str | None,
    dry_run: bool,
    as_json: bool,
    module: bool,
    script: str,
    script_args: tuple[str, ...],
) -> None:
    """Submit SCRIPT [ARGS]... to Slurm, one hpcelastic agent per node.

    \b
    Every option can also be set as HPCELASTIC_<OPTION>, e.g. HPCELASTIC_NODES=2:4.
    Everything after SCRIPT reaches the script unchanged:
      hpcelastic submit --nodes 2 --gpus-per-node 4 --time 04:00:00 train.py --lr 3e-4
    """
    from hpcelastic import api

    spec = api.prepare(
        script,
        script_args,
        module=module,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        nproc_per_node=nproc_per_node,
        time=time_limit,
        partition=partition,
        account=account,
        qos=qos,
        constraint=constraint,
        exclude=exclude,
        job_name=job_name,
        site=site,
        max_restarts=max_restarts,
        max_requeues=max_requeues,
        checkpoint_dir=checkpoint_dir,
        run_dir=run_dir,
        signal=signal_spec,
        env=list(env_items),
        sbatch_args=sbatch_args,
        template=template,
        backend=backend,
    )
    if dry_run:
        _dry_run(spec, as_json)
        return
    job = api.submit_spec(spec)
    if as_json:
        import json

        click.echo(json.dumps({"job_id": job.job_id, "run_dir": str(job.run_dir), "backend": spec.backend}))
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
