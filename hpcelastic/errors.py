"""Error types and the process exit codes that hpcelastic documents.

A :class:`UserError` is a mistake in the user's input (flags, YAML, paths). The
CLI prints it as one line and exits with :data:`EXIT_USAGE`; it never shows a
traceback for it.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_RESTARTS_EXHAUSTED = 3
EXIT_TOO_FEW_NODES = 4
EXIT_STOPPED_FOR_REQUEUE = 5
EXIT_COORDINATOR_LOST = 6
EXIT_NODE_UNHEALTHY = 7
EXIT_STARTUP_FAILURE = 8
EXIT_STEP_FAILED = 9
#: The run was cancelled (``scancel``, ``hpcelastic cancel``): 128 + SIGTERM, as a process TERM ended.
EXIT_CANCELLED = 143

EXIT_CODE_MEANINGS: dict[int, str] = {
    EXIT_OK: "all workers finished successfully",
    EXIT_INTERNAL: "internal error in hpcelastic (a bug: please report it)",
    EXIT_USAGE: "bad input: a flag, file or environment value is wrong",
    EXIT_RESTARTS_EXHAUSTED: "workers kept failing and the job-wide restart budget is spent",
    EXIT_TOO_FEW_NODES: "fewer nodes than the minimum of --nodes MIN:MAX remain",
    EXIT_STOPPED_FOR_REQUEUE: "stopped on a preemption or time-limit signal (under Slurm: requeued)",
    EXIT_COORDINATOR_LOST: "the coordinator (group rank 0 agent) was lost",
    EXIT_NODE_UNHEALTHY: "a GPU health check failed; the node was marked bad",
    EXIT_STARTUP_FAILURE: "workers failed identically before training started; not requeued",
    EXIT_STEP_FAILED: "the job step failed before any agent began the attempt (srun's own error); requeued",
    EXIT_CANCELLED: "the run was cancelled (scancel or hpcelastic cancel); not requeued",
}


class HpcElasticError(Exception):
    """Base class of all errors hpcelastic raises on purpose."""

    exit_code: int = EXIT_INTERNAL


class UserError(HpcElasticError):
    """A problem with the user's input; shown as one line, exit code 2."""

    exit_code = EXIT_USAGE


class SlurmError(HpcElasticError):
    """A Slurm command failed; the message carries Slurm's own words."""

    exit_code = EXIT_INTERNAL

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient
