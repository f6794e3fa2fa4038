"""The submitit backend: submitit writes and submits the batch script; each task runs the agent.

submitit starts one task per node (``tasks_per_node=1``); in each task :class:`AgentTask` runs the
very same ``hpcelastic agent`` command line that the sbatch template renders, forwards the
preemption/time-limit signal to it, and on task 0 runs ``hpcelastic finalize`` afterwards.
Resubmission (requeue mode ``resubmit``) is not offered here: a submitit job cannot be re-run
from its batch script alone, so this backend accepts requeue mode ``requeue`` only.
"""

from __future__ import annotations

import os
import shlex
import signal
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcelastic.errors import UserError
from hpcelastic.jobs.render import JobRequest, trapped_signals
from hpcelastic.rundir import RunDir

SUBMITIT_FOLDER = "submitit"


class AgentFailed(RuntimeError):
    """The agent (or finalize) ended with a non-zero exit code; submitit records the job as failed."""

    def __init__(self, exit_code: int) -> None:
        super().__init__(f"hpcelastic agent exited with code {exit_code}")
        self.exit_code = exit_code


@dataclass(frozen=True)
class AgentTask:
    """The callable submitit runs in every task: the node's agent, then (task 0) finalize."""

    agent_argv: tuple[str, ...]
    finalize_argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    signals: tuple[str, ...]

    def __call__(self) -> int:
        env = {**os.environ, **dict(self.env)}
        # Own session: the signal reaches the agent once, from us, not also via the process group.
        proc = subprocess.Popen(list(self.agent_argv), env=env, start_new_session=True)
        for name in self.signals:
            signal.signal(getattr(signal, f"SIG{name}"), lambda signum, _frame: proc.send_signal(signum))
        rc = proc.wait()
        from hpcelastic.env.slurm import task_rank

        if task_rank(os.environ) == 0:
            rc = subprocess.call([*self.finalize_argv, "--exit-code", str(rc)], env=env)
        if rc != 0:
            raise AgentFailed(rc)
        return rc


def _option_pairs(options: tuple[str, ...]) -> dict[str, Any]:
    """``("--mem=0", "--exclusive")`` -> ``{"mem": "0", "exclusive": True}`` for submitit."""
    out: dict[str, Any] = {}
    for opt in options:
        if not opt.startswith("--"):
            raise UserError(f"sbatch option {opt!r}: the submitit backend needs the long form --name=value")
        key, sep, value = opt[2:].partition("=")
        out[key] = value if sep else True
    return out


class SubmititBackend:
    """Submits through :class:`submitit.SlurmExecutor`; job files go to ``<run>/submitit``."""

    name = "submitit"

    def _executor(self, request: JobRequest, folder: Path) -> Any:
        try:
            import submitit
        except ImportError:
            raise UserError(
                "the submitit backend needs submitit: pip install 'hpcelastic[submitit]'"
            ) from None
        spec = request.spec
        if spec.requeue_mode != "requeue":
            raise UserError("the submitit backend supports requeue mode 'requeue' only; use --backend sbatch")
        try:
            executor = submitit.SlurmExecutor(folder=folder, python=shlex.quote(spec.python))
        except RuntimeError as e:
            raise UserError(f"the submitit backend cannot run here: {e}") from None
        extra: dict[str, Any] = {
            "requeue": True,
            "signal": f"{spec.signal}@{spec.signal_lead_s}",  # no B:: submitit's tasks get it
            "chdir": spec.cwd,
            **_option_pairs(spec.sbatch_directives_site),
            **_option_pairs(request.sbatch_args),
        }
        lo, hi = spec.nodes_min + spec.spare_nodes, spec.nodes_max + spec.spare_nodes  # spares on top
        if lo != hi:
            extra["nodes"] = f"{lo}-{hi}"
        params: dict[str, Any] = {
            "job_name": spec.job_name,
            "nodes": hi,
            "ntasks_per_node": 1,
            "signal_delay_s": spec.signal_lead_s,
            "setup": [f"module load {shlex.quote(m)}" for m in spec.modules] + list(spec.setup),
            "additional_parameters": extra,
        }
        if spec.time_limit_s is not None:
            params["time"] = max(1, -(-spec.time_limit_s // 60))
        if spec.gpus_per_node:
            key = "gres" if spec.gpu_request == "gres" else "gpus_per_node"
            params[key] = f"gpu:{spec.gpus_per_node}" if key == "gres" else spec.gpus_per_node
        for key in ("partition", "account", "qos", "constraint", "exclude"):
            if getattr(spec, key):
                params[key] = getattr(spec, key)
        executor.update_parameters(**params)
        return executor

    def _task(self, request: JobRequest) -> AgentTask:
        return AgentTask(
            request.agent_argv, request.finalize_argv, request.env, trapped_signals(request.spec)
        )

    def preview(self, request: JobRequest) -> str:
        """The batch script submitit would write (its job folder inside the run directory)."""
        executor = self._executor(request, Path(request.spec.run_dir) / SUBMITIT_FOLDER)
        return executor._make_submission_file_text(executor._submitit_command_str, "preview")

    def submit(self, request: JobRequest, run_dir: RunDir) -> str:
        """Submit :class:`AgentTask` with submitit and return the Slurm job id."""
        folder = run_dir.path / SUBMITIT_FOLDER
        folder.mkdir(mode=0o700, exist_ok=True)  # submitit would create it with the umask's mode
        executor = self._executor(request, folder)
        try:
            job = executor.submit(self._task(request))
        except Exception as e:  # submitit wraps sbatch's failure in its own exception types
            from hpcelastic.errors import SlurmError

            raise SlurmError(f"submitit could not submit: {str(e).strip().splitlines()[-1]}") from None
        _user_only(folder)
        return str(job.job_id)


def _user_only(folder: Path) -> None:
    """Drop group and other permissions from the files submitit wrote (its pickled task, its script)."""
    for path in folder.iterdir():
        st = path.lstat()
        if stat.S_ISREG(st.st_mode):
            os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)
