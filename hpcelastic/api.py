"""``hpcelastic.submit(...)``: submit a training script or a Python callable from Python.

The CLI's ``submit`` command goes through :func:`prepare` and :func:`submit_spec` too, so both
paths validate, render and record a submission identically.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcelastic.callable_runner import RESULT_FILE
from hpcelastic.errors import UserError
from hpcelastic.jobs.spec import JobSpec
from hpcelastic.rundir import RunDir

CALLABLE_FILE = "callable.pkl"

CALLABLE_RUNNER = "hpcelastic.callable_runner"


def prepare(
    script: str, script_args: Sequence[str] = (), *, cwd: str | None = None, **options: Any
) -> JobSpec:
    """Layer the configuration, apply ``options`` on top and validate: the :class:`JobSpec`.

    ``options`` are ``hpcelastic submit``'s options as keywords (:data:`~hpcelastic.jobs.options.API_NAMES`:
    ``nodes``, ``gpus_per_node``, ``time``, ``site``, ``signal="USR2@180"``, ``env`` (a mapping or
    ``KEY=VALUE`` strings), ``module``, ...); None leaves an option to the site configuration.
    """
    from hpcelastic import sites
    from hpcelastic.jobs.options import split
    from hpcelastic.jobs.spec import build_spec, with_slurm_facts

    overrides, rest = split(options)
    given = {k: v for k, v in rest.items() if v is not None}
    config = sites.resolve(given.pop("site", None), overrides)
    return with_slurm_facts(build_spec(config, script=script, script_args=script_args, cwd=cwd, **given))


@dataclass(frozen=True)
class Job:
    """A submitted run: its first Slurm job id and its run directory."""

    job_id: str
    run_dir: Path

    @property
    def latest_job_id(self) -> str:
        """The job id the run is on now (differs from ``job_id`` after a resubmission)."""
        return RunDir(self.run_dir).latest_job_id() or self.job_id

    def state(self) -> str:
        """Slurm's state of the current job (``PENDING``, ``RUNNING``, ``COMPLETED``...), or ``UNKNOWN``."""
        return _state_of(self.latest_job_id)

    def cancel(self) -> None:
        """Cancel the current job (``scancel``)."""
        from hpcelastic.jobs import slurm

        slurm.cancel(self.latest_job_id)

    def wait(self, poll_s: float = 10.0, timeout_s: float | None = None) -> str:
        """Block until the current job reaches a final state (:data:`jobs.slurm.ENDED_STATES`) and return it.

        Raises TimeoutError after ``timeout_s``. A job Slurm has forgotten counts as ``UNKNOWN``
        (final): ``hpcelastic status`` tells from the run directory how it ended.
        """
        from hpcelastic.jobs.slurm import ENDED_STATES

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            jid = self.latest_job_id
            state = _state_of(jid)
            # a resubmission may have replaced the job meanwhile: stop only on the newest id
            if (state in ENDED_STATES or state == "UNKNOWN") and self.latest_job_id == jid:
                return state
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.latest_job_id} still {state} after {timeout_s} s")
            time.sleep(poll_s)

    def result(self) -> Any:
        """What rank 0 of a submitted callable returned (after the job completed)."""
        import pickle

        path = self.run_dir / RESULT_FILE
        if not path.is_file():
            raise UserError(f"{path} does not exist: the callable has not returned (yet)")
        with path.open("rb") as f:
            return pickle.load(f)


def _state_of(job_id: str) -> str:
    from hpcelastic.jobs import slurm

    row = slurm.query_states([job_id]).get(job_id)
    return row.state.split()[0] if row else "UNKNOWN"


def submit_spec(spec: JobSpec, extra_files: Mapping[str, bytes] | None = None) -> Job:
    """Render ``spec``, create its run directory and submit it with its backend."""
    from hpcelastic.jobs.backend import get_backend, submit_request
    from hpcelastic.jobs.render import render

    backend = get_backend(spec.backend)
    job_id, run = submit_request(render(spec), backend, extra_files)
    return Job(job_id=job_id, run_dir=run.path)


def submit(
    target: str | Callable[..., Any],
    *args: Any,
    kwargs: Mapping[str, Any] | None = None,
    **options: Any,
) -> Job:
    """Submit ``target`` (a script path, or a callable) to Slurm under the hpcelastic agent.

    For a script, ``args`` are its command-line arguments. For a callable, every worker calls
    ``target(*args, **kwargs)`` with the torchrun environment set; rank 0's return value is
    available from :meth:`Job.result`. Callables default to the submitit backend. ``options`` are
    those of :func:`prepare` (``nodes``, ``gpus_per_node``, ``time``, ``site``, ...).
    """
    if isinstance(target, str | Path):
        return submit_spec(prepare(str(target), [str(a) for a in args], **options))
    if not callable(target):
        raise UserError(f"hpcelastic.submit needs a script path or a callable, not {type(target).__name__}")
    import cloudpickle

    options.setdefault("backend", "submitit")
    options.setdefault("job_name", getattr(target, "__name__", "callable"))
    payload = cloudpickle.dumps((target, tuple(args), dict(kwargs or {})))
    spec = prepare(CALLABLE_RUNNER, module=True, **options)
    spec = dataclasses.replace(spec, script_args=(str(Path(spec.run_dir) / CALLABLE_FILE),))
    return submit_spec(spec, {CALLABLE_FILE: payload})
