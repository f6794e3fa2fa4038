"""The sbatch backend: hand the rendered script file to ``sbatch --parsable``."""

from __future__ import annotations

from hpcelastic.jobs import slurm
from hpcelastic.jobs.render import JobRequest
from hpcelastic.rundir import RunDir


class SbatchBackend:
    """Submits ``<run>/job.sbatch`` (the request's script text) with sbatch."""

    name = "sbatch"

    def preview(self, request: JobRequest) -> str:
        """The rendered script, exactly as submitted."""
        return request.script_text

    def submit(self, request: JobRequest, run_dir: RunDir) -> str:
        """Run ``sbatch --parsable [--sbatch-arg ...] <run>/job.sbatch`` from the submit directory."""
        return slurm.sbatch(run_dir.script_path, request.sbatch_args, cwd=request.spec.cwd)
