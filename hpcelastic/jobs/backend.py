"""The backend interface and the one submission routine both backends share.

A backend turns a :class:`~hpcelastic.jobs.render.JobRequest` into a Slurm job. Everything around
that (the run directory, its files, the ``submitted`` event, clean-up on failure) lives here so
that the CLI and the Python API submit in exactly the same way.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from hpcelastic import __version__, events, runindex
from hpcelastic.errors import UserError
from hpcelastic.jobs.render import JobRequest
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
        "sbatch_args": list(request.sbatch_args),
        "sbatch_command": list(request.sbatch_command) if backend == "sbatch" else None,
        "agent_argv": list(request.agent_argv),
    }


def submit_request(
    request: JobRequest, backend: Backend, extra_files: Mapping[str, bytes] | None = None
) -> tuple[str, RunDir]:
    """Create the run directory, write its files, submit, and record ``submitted``.

    On any failure the run directory (and any parent this call created) is removed again, so a
    failed submission leaves nothing behind. Returns ``(job_id, run_dir)``.
    """
    import yaml

    spec = request.spec
    target = Path(spec.run_dir)
    created_root = _first_missing(target)
    run = RunDir.create(target)
    try:
        preview = backend.preview(request)
        write_atomic(run.script_path, preview.encode("utf-8", "surrogateescape"), mode=0o700)
        write_atomic(run.config_path, yaml.safe_dump(dict(spec.config), sort_keys=True).encode())
        run.create_secret()
        for name, data in (extra_files or {}).items():
            write_atomic(run.path / name, data)
        if Path(spec.checkpoint_dir).is_relative_to(run.path):
            Path(spec.checkpoint_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
        run.write_meta(_meta(request, backend.name))
        job_id = backend.submit(request, run)
        run.record(
            events.submitted(job_id=job_id, backend=backend.name, nodes=spec.nodes_text, script=spec.script)
        )
        runindex.record_job(job_id, run.path)
    except BaseException:
        shutil.rmtree(created_root or run.path, ignore_errors=True)
        raise
    return job_id, run


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
