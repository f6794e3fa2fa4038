"""The agent's command line: built by :meth:`AgentCommand.to_argv`, parsed by ``hpcelastic agent``.

:class:`AgentCommand` holds the command line's values, one field per option, in the order of the
documented form (docs/ARCHITECTURE.md, "Agent command line"). The batch script (``render``), the
submitit task (which runs the rendered argv) and ``hpcelastic run`` all build it with
:meth:`AgentCommand.to_argv`; the ``agent`` click command, whose parameters are these fields, is
its only parser, and :meth:`AgentCommand.to_spec` validates it into the agent's :class:`AgentSpec`.
Defaults come from the site schema (:data:`hpcelastic.sites.SCHEMA`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hpcelastic import sites
from hpcelastic.errors import UserError
from hpcelastic.parse import AUTO, check_module_name, parse_nodes, parse_nproc, parse_signal, script_not_found
from hpcelastic.slow.policy import SlowSettings
from hpcelastic.tier.settings import TierSettings

DEFAULT_SIGNAL = parse_signal(sites.default("signal.name"))
DEFAULT_MAX_RESTARTS: int = sites.default("max_restarts")
DEFAULT_GRACE_PERIOD = float(sites.default("requeue.grace_period"))
DEFAULT_REQUEUE_MODE: str = sites.default("requeue.mode")
DEFAULT_MAX_REQUEUES: int = sites.default("requeue.max_requeues")
REQUEUE_MODES: tuple[str, ...] = sites.SCHEMA["requeue.mode"].choices or ()
DEFAULT_CONSOLE: str = sites.default("console")

if TYPE_CHECKING:
    from hpcelastic.env.base import BootstrapOptions


def _bootstrap_options(**given: object) -> BootstrapOptions:
    # env/ loads the environments (hostlist, ...): only the agent needs them, not submit's render.
    from hpcelastic.env.base import BootstrapOptions

    return BootstrapOptions(**given)  # type: ignore[arg-type]


@dataclass(frozen=True)
class AgentSpec:
    """The agent's command line, validated."""

    argv: tuple[str, ...]
    min_nodes: int | None = None
    max_nodes: int | None = None
    spare_nodes: int = 0
    nproc: int | None = None
    max_restarts: int = DEFAULT_MAX_RESTARTS
    checkpoint_dir: Path | None = None
    stall_timeout: float | None = None
    stop_signal: signal.Signals = DEFAULT_SIGNAL
    grace_period: float = DEFAULT_GRACE_PERIOD
    rdzv: BootstrapOptions = field(default_factory=_bootstrap_options)
    requeue_mode: str = DEFAULT_REQUEUE_MODE
    max_requeues: int = DEFAULT_MAX_REQUEUES
    #: torchft replica groups (agent/replicas.py); 1: off.
    replica_groups: int = 1
    min_replica_groups: int = 1
    #: Fork workers from a fork server that has imported torch (agent/forkserver.py).
    warm_start: bool = True
    #: Which workers' output reaches the console (agent/console.py); all of it reaches the rank logs.
    console: str = DEFAULT_CONSOLE
    #: The coordinator's OpenMetrics port (0: a free one; None: no endpoint) and textfile directory.
    metrics_port: int | None = 0
    metrics_textfile_dir: Path | None = None
    #: The node-local checkpoint tier (hpcelastic/tier/); None: workers save to the checkpoint dir.
    local_tier: TierSettings | None = None
    #: Slow-node detection and what it does (hpcelastic/slow/); None: off.
    slow: SlowSettings | None = None


@dataclass(frozen=True)
class AgentCommand:
    """``hpcelastic agent``'s options as typed; None means "not given" (the option is left out)."""

    run_dir: Path | None = None
    nodes: str | None = None
    spare_nodes: int | None = None
    nproc_per_node: str = AUTO
    max_restarts: int = DEFAULT_MAX_RESTARTS
    checkpoint_dir: Path | None = None
    rdzv_endpoint: str | None = None
    rdzv_port: int | None = None
    rdzv_interface: str | None = None
    rdzv_timeout: float | None = None
    stall_timeout: float | None = None
    signal: str | None = None
    grace_period: float | None = None
    requeue_mode: str | None = None
    max_requeues: int | None = None
    replica_groups: int | None = None
    min_replica_groups: int | None = None
    no_warm_start: bool = False
    console: str | None = None
    metrics_port: int | None = None
    no_metrics: bool = False
    metrics_textfile_dir: Path | None = None
    #: The checkpoint tier's settings as one JSON object (``TierSettings.to_text``).
    local_tier: str | None = None
    #: Slow-node detection's settings, ``ACTION,MIN_SLOWDOWN,WINDOWS`` (``SlowSettings.to_text``).
    slow: str | None = None
    module: bool = False
    program: tuple[str, ...] = field(default=())

    def option_words(self) -> list[str]:
        """The options, in the documented order, each given one as ``--name VALUE`` (flags alone)."""
        words: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "program" or value is None:
                continue
            if isinstance(value, bool):
                words += [option_flag(f.name)] if value else []
            else:
                words += [option_flag(f.name), _text(value)]
        return words

    def to_argv(self, python: str, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
        """``PYTHON -m hpcelastic agent OPTIONS [EXTRA] -- PROGRAM...``: the one builder of this line."""
        return (python, "-m", "hpcelastic", "agent", *self.option_words(), *extra, "--", *self.program)

    def to_spec(self) -> AgentSpec:
        """Validate into the :class:`AgentSpec` the agent runs (unset options take their defaults)."""
        from hpcelastic.env.base import parse_endpoint

        lo, hi = parse_nodes(self.nodes) if self.nodes is not None else (None, None)
        if self.rdzv_endpoint:
            parse_endpoint(self.rdzv_endpoint)
        rdzv = _bootstrap_options(
            run_dir=self.run_dir,
            endpoint=self.rdzv_endpoint,
            port=self.rdzv_port,
            interface=self.rdzv_interface,
            **({} if self.rdzv_timeout is None else {"timeout": self.rdzv_timeout}),
        )
        return AgentSpec(
            argv=worker_argv(self.program, self.module),
            min_nodes=lo,
            max_nodes=hi,
            spare_nodes=self.spare_nodes or 0,
            nproc=parse_nproc(self.nproc_per_node),
            max_restarts=self.max_restarts,
            checkpoint_dir=self.checkpoint_dir.absolute() if self.checkpoint_dir else None,
            stall_timeout=self.stall_timeout,
            stop_signal=DEFAULT_SIGNAL if self.signal is None else parse_signal(self.signal),
            grace_period=DEFAULT_GRACE_PERIOD if self.grace_period is None else self.grace_period,
            rdzv=rdzv,
            requeue_mode=self.requeue_mode or DEFAULT_REQUEUE_MODE,
            max_requeues=DEFAULT_MAX_REQUEUES if self.max_requeues is None else self.max_requeues,
            replica_groups=self.replica_groups or 1,
            min_replica_groups=self.min_replica_groups or 1,
            warm_start=not self.no_warm_start,
            console=self.console or DEFAULT_CONSOLE,
            metrics_port=None if self.no_metrics else (self.metrics_port or 0),
            metrics_textfile_dir=self.metrics_textfile_dir.absolute() if self.metrics_textfile_dir else None,
            local_tier=TierSettings.parse(self.local_tier) if self.local_tier else None,
            slow=slow_settings(self.slow),
        )


def slow_settings(text: str | None) -> SlowSettings | None:
    """``--slow``'s settings; None when not given or ``off``."""
    settings = SlowSettings.from_text(text) if text else None
    return settings if settings is not None and settings.on else None


def option_flag(name: str) -> str:
    """The flag of :class:`AgentCommand` field ``name``: ``max_restarts`` -> ``--max-restarts``."""
    return "-m" if name == "module" else "--" + name.replace("_", "-")


def _text(value: object) -> str:
    """An option value as the command line carries it (``60.0`` -> ``60``)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def worker_argv(program: tuple[str, ...], module: bool) -> tuple[str, ...]:
    """The command each worker runs: python for scripts and modules, the program itself otherwise."""
    if not program:
        raise UserError("no training script given; add `-- train.py ARGS`")
    head, rest = program[0], program[1:]
    if module:
        return (sys.executable, "-u", "-m", check_module_name(head), *rest)
    path = Path(head)
    if path.is_file():
        if path.suffix == ".py" or not os.access(path, os.X_OK):
            return (sys.executable, "-u", str(path), *rest)
        return (str(path.absolute()), *rest)
    found = shutil.which(head) if "/" not in head else None
    if found:
        return (found, *rest)
    raise script_not_found(head, path.absolute())
