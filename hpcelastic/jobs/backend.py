"""The backend interface and the one submission routine both backends share.

A backend turns a :class:`~hpcelastic.jobs.render.JobRequest` into a Slurm job. Everything around
that (the run directory, its files, the ``submitted`` event, clean-up on failure) lives here so
that the CLI and the Python API submit in exactly the same way.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

from hpcelastic import __version__, events
from hpcelastic.errors import SlurmError, UserError
from hpcelastic.jobs import slurm
from hpcelastic.jobs.render import JobRequest
from hpcelastic.record import runindex
from hpcelastic.rundir import RunDir, write_atomic

BACKENDS = ("sbatch", "submitit")


class Backend(Protocol):
    """Submit a rendered request; return the Slurm job id."""

    name: str

    def preview(self, request: JobRequest) -> str:
        """The exact batch script this backend would hand to sbatch."""
        ...

    def submit(self, request: JobRequest, run_dir: RunDir) -> str:
        """Submit ``request`` whose run directory exists; return the job id or raise."""
        ...


def get_backend(name: str) -> Backend:
    """The backend called ``name`` (``sbatch`` or ``submitit``)."""
    if name == "sbatch":
        from hpcelastic.jobs.sbatch import SbatchBackend

        return SbatchBackend()
    if name == "submitit":
        from hpcelastic.jobs.submitit_backend import SubmititBackend

        return SubmititBackend()
    raise UserError(f"unknown backend {name!r}; use one of {', '.join(BACKENDS)}")


def _first_missing(path: Path) -> Path | None:
    """The outermost ancestor of ``path`` (or ``path``) that does not exist yet."""
    missing = None
    for p in (path, *path.parents):
        if p.exists():
            break
        missing = p
    return missing


def _meta(request: JobRequest, backend: str) -> dict:
    spec = request.spec
    return {
        "version": __version__,
        "submitted_at": time.time(),
        "backend": backend,
        "site": spec.site,
        "job_name": spec.job_name,
        "script": spec.script,
        "script_args": list(spec.script_args),
        "module": spec.module,
        "nodes": spec.nodes_text,
        "nproc_per_node": spec.nproc_per_node,
        "gpus_per_node": spec.gpus_per_node,
        "checkpoint_dir": spec.checkpoint_dir,
        "cwd": spec.cwd,
        "python": spec.python,
        "requeue_mode": spec.requeue_mode,
        "max_requeues": spec.max_requeues,
        "signal_lead_s": spec.signal_lead_s,
        "requeue_expedite": spec.expedite,
        "sbatch_args": list(request.sbatch_args),
        "sbatch_command": list(request.sbatch_command) if backend == "sbatch" else None,
        "agent_argv": list(request.agent_argv),
    }


def submit_request(
    request: JobRequest, backend: Backend, extra_files: Mapping[str, bytes] | None = None
) -> tuple[str, RunDir]:
    """Create the run directory, write its files, submit, and record ``submitted``.

    On any failure the run directory (and any parent this call created) is removed again, so a
    failed submission leaves nothing behind, unless Slurm queued the job all the same (a time-out,
    a lost reply, Ctrl-C): then it is kept and recorded. Returns ``(job_id, run_dir)``.
    """
    import yaml

    spec = request.spec
    if spec.container is not None:
        from hpcelastic.jobs import container
        from hpcelastic.jobs.render import container_mounts

        container.check_release(spec.container, slurm.release())
        workdir = spec.container.workdir or spec.cwd
        bundle = container.bundle_files(spec.container, container_mounts(spec), workdir)
        extra_files = {**bundle, **(extra_files or {})}
    target = Path(spec.run_dir)
    created_root = _first_missing(target)
    run = RunDir.create(target)
    try:
        preview = backend.preview(request)
        write_atomic(run.script_path, preview.encode("utf-8", "surrogateescape"), mode=0o700)
        write_atomic(run.config_path, yaml.safe_dump(dict(spec.config), sort_keys=True).encode())
        run.create_secret()
        for name, data in (extra_files or {}).items():
            (run.path / name).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_atomic(run.path / name, data)
        if Path(spec.checkpoint_dir).is_relative_to(run.path):
            Path(spec.checkpoint_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
        run.write_meta(_meta(request, backend.name))
        if spec.container is not None and spec.container.runtime == "oci":
            from hpcelastic.jobs import container

            container.make_mount_points(extra_files[f"{container.OCI_BUNDLE_DIR}/config.json"])
    except BaseException:
        shutil.rmtree(created_root or run.path, ignore_errors=True)
        raise
    try:
        job_id = backend.submit(request, run)
    except BaseException as e:
        job_id = _queued_anyway(run, e, lambda: shutil.rmtree(created_root or run.path, ignore_errors=True))
        _record(run, job_id, request, backend)
        if not isinstance(e, Exception):  # Ctrl-C: the queued job stays, and the user is told so
            _say(
                f"interrupted, but job {job_id} was already queued; its run directory {run.path} is kept "
                f"(stop it with `hpcelastic cancel {job_id}`)"
            )
            raise
        _say(f"warning: sbatch failed ({e}), but job {job_id} is queued from {run.script_path}")
        return job_id, run
    _record(run, job_id, request, backend)
    return job_id, run


def _say(message: str) -> None:
    print(f"hpcelastic: {message}", file=sys.stderr, flush=True)


def _record(run: RunDir, job_id: str, request: JobRequest, backend: Backend) -> None:
    nodes, script = request.spec.nodes_text, request.spec.script
    run.record(events.submitted(job_id=job_id, backend=backend.name, nodes=nodes, script=script))
    runindex.record_job(job_id, run.path)


def _queued_anyway(run: RunDir, error: BaseException, remove: Callable[[], None]) -> str:
    """The job a failed or interrupted submission queued all the same; else ``remove()`` and re-raise.

    A refusal sbatch printed (a bad partition...) queued nothing. After a time-out, a lost reply or
    Ctrl-C the job may be queued: Slurm is asked for a job whose batch script is this run's. When
    Slurm cannot say, the run directory is kept (a queued job needs it) and the user is told.
    """
    if not (isinstance(error, SlurmError) and not error.transient):
        try:
            found = slurm.jobs_running_script(run.script_path)
        except SlurmError as e:
            raise UserError(
                f"sbatch did not answer ({error or type(error).__name__}) and Slurm cannot be asked ({e}); "
                f"the job may be queued, so {run.path} is kept: check with `squeue --me` and delete the "
                "directory if no job uses it"
            ) from None
        if found:
            return found[0]
    remove()
    raise error


def describe(request: JobRequest, backend: Backend) -> str:
    """One JSON line summarising a dry run (for ``--json``)."""
    return json.dumps(
        {
            "backend": backend.name,
            "run_dir": request.spec.run_dir,
            "sbatch_command": list(request.sbatch_command),
            "agent_argv": list(request.agent_argv),
            "script": backend.preview(request),
        }
    )
