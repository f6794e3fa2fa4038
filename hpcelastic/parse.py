"""One parser per concept the user types: node counts, worker counts, signals, time limits, env names.

Every command line (``submit``, ``agent``, ``run``), the Python API and the site files parse these
values here, so a value is accepted or refused alike everywhere, with one wording. Only ASCII digits
count: ``\\d``, ``str.isdigit()`` and ``int()`` also take ``'٣'``, ``'²'`` or ``'1_0'``, which no
Slurm tool would. Light on imports: the CLI's start-up time depends on it.
"""

from __future__ import annotations

import re
import signal as _signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpcelastic.errors import UserError

ASCII_INT = re.compile(r"[0-9]+")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_SIGNAL_LEAD_S = 65535  # Slurm's limit for --signal=...@T
#: The longest grace period: no longer than Slurm's longest lead time (and far below select's ~24.8 days).
MAX_GRACE_PERIOD_S = MAX_SIGNAL_LEAD_S
#: ``--console``: every rank's output, rank 0's of each replica group, or hpcelastic's lines only.
CONSOLE_MODES = ("all", "rank0", "failures")
#: The shortest --stall-timeout (seconds): `submit` and `run` take the same fractional values.
MIN_STALL_TIMEOUT_S = 0.1
#: Signals no process can catch: as the stop signal they would kill every agent and worker at once.
UNCATCHABLE_SIGNALS = ("KILL", "STOP")
AUTO = "auto"

_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_NODES = re.compile(r"\s*([0-9]+)\s*(?::\s*([0-9]+)\s*)?")


def parse_nodes(value: str | int) -> tuple[int, int]:
    """``"4"`` -> (4, 4), ``"2:4"`` -> (2, 4); :class:`UserError` for 0, a reversed range or junk."""
    m = _NODES.fullmatch(str(value))
    if not m:
        raise UserError(f"--nodes {value!r} is not N or N_MIN:N_MAX (e.g. --nodes 4 or --nodes 2:4)")
    low = int(m.group(1))
    high = int(m.group(2)) if m.group(2) is not None else low
    if low < 1:
        raise UserError(f"--nodes {value!r}: at least one node is needed")
    if high < low:
        raise UserError(f"--nodes {value!r}: N_MIN is larger than N_MAX; write it as {high}:{low}")
    return low, high


def parse_nproc(value: str | int) -> int | None:
    """Workers per node: ``"auto"`` -> None (the node's GPUs, else 1), else a positive integer."""
    text = str(value).strip().lower()
    if text == AUTO:
        return None
    if ASCII_INT.fullmatch(text) and int(text) > 0:
        return int(text)
    raise UserError(f"--nproc-per-node {value!r} must be a positive integer or 'auto'")


def signal_name(value: Any) -> str | None:
    """``"SIGUSR2"``, ``"usr2"`` or ``12`` -> ``"USR2"``; None when it is not a signal."""
    text = str(value).strip().upper()
    if text.isascii() and text.isdigit():
        try:
            return _signal.Signals(int(text)).name.removeprefix("SIG")
        except ValueError:
            return None
    name = text if text.startswith("SIG") else "SIG" + text
    return name.removeprefix("SIG") if name in _signal.Signals.__members__ else None


def uncatchable(name: str) -> str | None:
    """Why the signal ``name`` (as :func:`signal_name` gives it) cannot be the stop signal, or None."""
    if name in UNCATCHABLE_SIGNALS:
        return f"SIG{name} cannot be caught, so no agent could checkpoint; use USR2 or USR1"
    return None


def parse_signal(value: str | int) -> _signal.Signals:
    """``USR2``, ``SIGUSR2`` or ``12`` -> the signal; :class:`UserError` otherwise."""
    name = signal_name(value)
    if name is None:
        raise UserError(f"--signal {value!r} is not a signal name such as USR2")
    problem = uncatchable(name)
    if problem:
        raise UserError(f"--signal {value!r}: {problem}")
    return _signal.Signals["SIG" + name]


def parse_signal_lead(value: str) -> tuple[str, int]:
    """``"USR2@180"`` -> ("USR2", 180): the signal and its lead time before the limit."""
    name, sep, lead = str(value).partition("@")
    sig = signal_name(name)
    if not sep or sig is None or not ASCII_INT.fullmatch(lead.strip()):
        raise UserError(f"--signal {value!r} is not SIG@SECONDS (e.g. --signal USR2@180)")
    problem = uncatchable(sig)
    if problem:
        raise UserError(f"--signal {value!r}: {problem}")
    seconds = int(lead)
    if seconds > MAX_SIGNAL_LEAD_S:
        raise UserError(f"--signal {value!r}: Slurm allows at most {MAX_SIGNAL_LEAD_S} s of lead time")
    return sig, seconds


_TIME_FORMS = (
    (re.compile(r"([0-9]+)"), ("m",)),
    (re.compile(r"([0-9]+):([0-9]+)"), ("m", "s")),
    (re.compile(r"([0-9]+):([0-9]+):([0-9]+)"), ("h", "m", "s")),
    (re.compile(r"([0-9]+)-([0-9]+)"), ("d", "h")),
    (re.compile(r"([0-9]+)-([0-9]+):([0-9]+)"), ("d", "h", "m")),
    (re.compile(r"([0-9]+)-([0-9]+):([0-9]+):([0-9]+)"), ("d", "h", "m", "s")),
)
_UNIT_S = {"d": 86400, "h": 3600, "m": 60, "s": 1}
#: The bound of each field that follows a larger one (``1-23:59:59``); the first field is unbounded.
_UNIT_LIMIT = {"h": 24, "m": 60, "s": 60}
_UNIT_NAME = {"h": "hours", "m": "minutes", "s": "seconds"}


def parse_time(value: Any) -> int:
    """Seconds in a Slurm time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS.

    Raises ValueError (with the accepted forms) for anything else or for zero.
    """
    text = str(value).strip()
    for pattern, units in _TIME_FORMS:
        m = pattern.fullmatch(text)
        if m:
            fields = list(zip(m.groups(), units, strict=True))
            for n, (g, u) in enumerate(fields):
                # Slurm would carry 99 minutes over into hours silently: a typo must not change the limit.
                if n and int(g) >= _UNIT_LIMIT[u]:
                    raise ValueError(
                        f"time limit {text!r}: {_UNIT_NAME[u]} must be below {_UNIT_LIMIT[u]}, not {int(g)}"
                    )
            seconds = sum(int(g) * _UNIT_S[u] for g, u in fields)
            if seconds <= 0:
                raise ValueError(f"time limit {text!r} is zero")
            return seconds
    raise ValueError(f"{text!r} is not a Slurm time (use MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS)")


def format_time(seconds: int) -> str:
    """Seconds -> ``D-HH:MM:SS`` (Slurm accepts it everywhere)."""
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{days}-{hours:02d}:{minutes:02d}:{secs:02d}"


def check_module_name(name: str) -> str:
    """``name`` when it is a dotted Python module name (for ``-m``); :class:`UserError` otherwise."""
    if not _MODULE_NAME.fullmatch(name):
        raise UserError(f"-m {name!r} is not a Python module name (e.g. -m mypkg.train)")
    return name


def is_env_name(name: Any) -> bool:
    """True for a name the shell can export (``[A-Za-z_][A-Za-z0-9_]*``), but ``_``: bash sets that one
    itself after every command, so a value given for it never reaches the workers."""
    return isinstance(name, str) and name != "_" and ENV_NAME.fullmatch(name) is not None


def no_nul(value: str, what: str) -> None:
    """:class:`UserError` when ``value`` holds a NUL byte (no command line or environment carries one)."""
    if "\0" in value:
        raise UserError(f"{what} contains a NUL byte, which no command line or environment can carry")


def parse_env(items: Sequence[str]) -> dict[str, str]:
    """``["A=1", "B=x=y"]`` -> {"A": "1", "B": "x=y"}; :class:`UserError` for a malformed entry."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not is_env_name(key):
            raise UserError(
                f"--env {item!r} is not KEY=VALUE with a valid variable name (e.g. --env NCCL_DEBUG=INFO)"
            )
        no_nul(value, f"--env {key}")
        out[key] = value
    return out


def check_no_task_array(options: Sequence[str], where: str) -> None:
    """:class:`UserError` when the sbatch ``options`` ask for a job array of several tasks.

    Every task of an array would run the one batch script, so they would share one run directory,
    its attempts and its checkpoints. Recognised as sbatch parses them: ``--array=0-3``,
    ``--array 0-3``, an unambiguous prefix (``--arr=0-3``), ``-a0-3`` and ``-a 0-3``. A single
    index (``--array=3``) is one task and is accepted.
    """
    for i, opt in enumerate(options):
        name, eq, value = opt.partition("=")
        if len(name) >= 4 and "--array".startswith(name):
            spec = value if eq else (options[i + 1] if i + 1 < len(options) else "")
        elif opt.startswith("-a"):
            spec = opt[2:].removeprefix("=") or (options[i + 1] if i + 1 < len(options) else "")
        else:
            continue
        if not re.fullmatch(r"[0-9]+(%[0-9]+)?", spec):
            raise UserError(
                f"{where} {opt!r}: job arrays of several tasks are not supported (the tasks would share "
                "one run directory and its checkpoints); submit one job per task, each with its own --run-dir"
            )


def script_not_found(script: str, path: Path) -> UserError:
    """The error for a training script ``script`` that is no file at ``path``: a directory, or nothing."""
    if path.is_dir():
        return UserError(
            f"training script {script!r} is a directory; give the script in it "
            f"(e.g. {script.rstrip('/')}/train.py), or -m and a module name"
        )
    return UserError(f"training script {script!r} does not exist (looked for {path}); check the path")
