"""What Slurm prints, parsed: the one place that knows the formats of its commands (22.05 to 25.11).

Pure functions over text; :mod:`hpcelastic.jobs.slurm` runs the commands. What is stable and what
is not (measured on 22.05 and 24.11, the release notes for the rest; captured outputs in
``tests/unit/slurm_outputs/``):

* ``scontrol show job -o`` (one ``Key=Value`` line) has kept its keys and formats since long
  before 22.05: the fallback for every release.
* ``scontrol --json show job`` exists in 24.11, not in 22.05 (hpcelastic asks each scontrol once). Its shape
  follows the data_parser plugin, which changes with every release: v0.0.38 (22.05, ``squeue
  --json`` only) gives ``job_state`` as a string and times as integers; v0.0.40 (23.11) and later
  give ``job_state`` as a list (the base state, then flags) and numbers as ``{"set", "infinite",
  "number"}`` objects. :func:`job_records_from_json` accepts both shapes and returns the text
  record's keys, so callers read one thing whatever the release.
* ``squeue -o`` and ``sinfo -o`` with explicit formats are stable; 22.05's ``squeue --json``
  ignores ``-j`` and lists every job, so hpcelastic never uses squeue's JSON.
* hpcelastic does not call ``sacct`` (no accounting database is assumed).
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

#: A key of ``scontrol show -o``: starts where a space is followed by ``Name=``.
_RECORD = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=(.*?)(?=\s[A-Za-z][A-Za-z0-9_:/]*=|$)")
#: Slurm's own text for a time that is not set.
UNSET_TIMES = frozenset({"", "Unknown", "None", "(null)", "N/A"})
TIME_FORMAT = "%Y-%m-%dT%H:%M:%S"
#: ``job_state`` flags, in the order Slurm's text output lets them name the state (a completing job
#: shows COMPLETING, a requeued one REQUEUED...); otherwise the base state (the list's first entry).
STATE_FLAGS = (
    "COMPLETING",
    "STAGE_OUT",
    "CONFIGURING",
    "RESIZING",
    "EXPEDITING",
    "REQUEUED",
    "REQUEUE_FED",
    "REQUEUE_HOLD",
    "SPECIAL_EXIT",
    "STOPPED",
    "REVOKED",
    "RESV_DEL_HOLD",
    "SIGNALING",
)


def parse_record(line: str) -> dict[str, str]:
    """One ``scontrol show -o`` line (``Key=Value Key=Value ...``) as a dict.

    Values may contain spaces (``Command=``, ``Reason=``); a key starts only where a space is
    followed by ``Name=``.
    """
    return {m.group(1): m.group(2) for m in _RECORD.finditer(line.strip())}


def parse_records(text: str) -> list[dict[str, str]]:
    """Every non-empty line of ``scontrol show ... -o`` output, parsed."""
    return [parse_record(line) for line in text.splitlines() if line.strip()]


def _number(value: Any) -> tuple[bool, bool, Any]:
    """``(set, infinite, number)`` of a JSON number of any data_parser version (plain or an object)."""
    if isinstance(value, Mapping):
        return bool(value.get("set")), bool(value.get("infinite")), value.get("number")
    return value is not None, False, value


def _time_text(value: Any) -> str:
    """An epoch of the JSON output as the text output writes it (local time); ``Unknown`` when unset."""
    is_set, infinite, number = _number(value)
    if not is_set or infinite or not isinstance(number, int) or number <= 0:
        return "Unknown"
    return datetime.datetime.fromtimestamp(number).strftime(TIME_FORMAT)


def _limit_text(value: Any) -> str:
    """A time limit in minutes (JSON) as the text output writes it (``1-02:03:00``, ``UNLIMITED``)."""
    is_set, infinite, number = _number(value)
    if infinite or not is_set or not isinstance(number, int):
        return "UNLIMITED"
    days, minutes = divmod(number, 24 * 60)
    text = f"{minutes // 60:02d}:{minutes % 60:02d}:00"
    return f"{days}-{text}" if days else text


def _int_text(value: Any) -> str:
    is_set, _, number = _number(value)
    return str(number) if is_set and isinstance(number, int) else ""


def _state_text(value: Any) -> str:
    """``job_state`` (a string, or the base state and its flags) as the text output's JobState."""
    if isinstance(value, str):
        return value
    states = [str(s) for s in value or ()]
    for flag in STATE_FLAGS:
        if flag in states:
            return flag
    return states[0] if states else ""


def _exit_text(value: Any) -> str:
    """``exit_code`` as the text output's ``ExitCode=STATUS:SIGNAL`` (v0.0.38: the raw wait status)."""
    if isinstance(value, Mapping):
        code = _int_text(value.get("return_code")) or "0"
        signal = _int_text((value.get("signal") or {}).get("id")) or "0"
        return f"{code}:{signal}"
    if isinstance(value, int):
        return f"{(value >> 8) & 0xFF}:{value & 0x7F}"
    return ""


def _nodes_text(value: Any) -> str:
    return str(value) if value else "(null)"


#: Text key -> (JSON key, how its value is written as text).
JOB_FIELDS: dict[str, tuple[str, Any]] = {
    "JobId": ("job_id", _int_text),
    "ArrayJobId": ("array_job_id", _int_text),
    "ArrayTaskId": ("array_task_id", _int_text),
    "JobState": ("job_state", _state_text),
    "Reason": ("state_reason", str),
    "Restarts": ("restart_cnt", _int_text),
    "Requeue": ("requeue", lambda v: "1" if v is True or v == 1 else "0"),
    "ExitCode": ("exit_code", _exit_text),
    "SubmitTime": ("submit_time", _time_text),
    "EligibleTime": ("eligible_time", _time_text),
    "StartTime": ("start_time", _time_text),
    "EndTime": ("end_time", _time_text),
    "PreemptTime": ("preempt_time", _time_text),
    "TimeLimit": ("time_limit", _limit_text),
    "Partition": ("partition", str),
    "NodeList": ("nodes", _nodes_text),
    "ExcNodeList": ("excluded_nodes", _nodes_text),
    "BatchHost": ("batch_host", str),
    "NumNodes": ("node_count", _int_text),
    "TresPerNode": ("tres_per_node", str),
    "TresPerJob": ("tres_per_job", str),
    "WorkDir": ("current_working_directory", str),
    "Dependency": ("dependency", _nodes_text),
}


def job_record_from_json(job: Mapping[str, Any]) -> dict[str, str]:
    """One job object of ``scontrol --json show job`` (any data_parser version) with the text record's
    keys and value formats (:data:`JOB_FIELDS`); keys the object lacks are left out."""
    out = {}
    for key, (name, text) in JOB_FIELDS.items():
        if name in job and job[name] is not None:
            out[key] = text(job[name])
    if out.get("ArrayJobId") in ("", "0"):  # not an array task: the text output has no such keys
        out.pop("ArrayJobId", None)
        out.pop("ArrayTaskId", None)
    return out


def job_records_from_json(text: str) -> list[dict[str, str]]:
    """Every job of ``scontrol --json show job`` (or ``squeue --json``) output, as text records;
    :class:`ValueError` when the output is not such a document."""
    doc = json.loads(text)
    jobs = doc.get("jobs") if isinstance(doc, Mapping) else None
    if not isinstance(jobs, list):
        raise ValueError("no 'jobs' list in Slurm's JSON output")
    return [job_record_from_json(job) for job in jobs if isinstance(job, Mapping)]


def parse_exit_code(value: str | None) -> tuple[int, int] | None:
    """``ExitCode=STATUS:SIGNAL`` as two numbers; None when absent or malformed. A job Slurm ended for a
    node's failure shows ``0:0`` up to 23.11 and ``0:1`` (SIGHUP) from 24.11 (measured)."""
    m = re.fullmatch(r"(\d+):(\d+)", (value or "").strip())
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_release(version_text: str) -> tuple[int, int] | None:
    """``sbatch --version`` (``slurm 22.05.8``, ``slurm-wlm 24.11.5``) as ``(year, month)``."""
    m = re.search(r"\b(\d{2})\.(\d{2})(?:\.\d+)?\b", version_text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_rows(text: str, columns: int) -> list[list[str]]:
    """``squeue``/``sinfo -h -o 'A|B|...'`` output: each line split on ``|``; lines with another
    number of fields (a value holding ``|``, an error on stdout) are left out."""
    rows = (line.strip().split("|") for line in text.splitlines() if line.strip())
    return [row for row in rows if len(row) == columns]


def parse_config(text: str) -> dict[str, str]:
    """Every ``Key = Value`` line of ``scontrol show config`` (the header and blank lines left out)."""
    found = {}
    for line in text.splitlines():
        name, sep, value = line.partition("=")
        if sep and name.strip() and " " not in name.strip():
            found[name.strip()] = value.strip()
    return found


def seconds_of(value: str | None) -> int | None:
    """``60 sec`` / ``60`` (``scontrol show config``'s timeouts, a partition's ``GraceTime``) in seconds."""
    m = re.fullmatch(r"\s*(\d+)(?:\s*sec)?\s*", value or "")
    return int(m.group(1)) if m else None


def gpu_count(gres: str | None) -> int:
    """The GPUs in a node's ``Gres`` (``gpu:4``, ``gpu:a100:4(S:0-1)``, ``gpu:a:2,gpu:b:2``; ``(null)``)."""
    total = 0
    for item in (gres or "").split(","):
        item = item.split("(", 1)[0]
        parts = item.split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def config_values(text: str, keys: Iterable[str]) -> dict[str, str]:
    """The values of ``keys`` in ``scontrol show config`` output (``SlurmdTimeout = 60 sec``)."""
    wanted = set(keys)
    found = {}
    for line in text.splitlines():
        name, sep, value = line.partition("=")
        if sep and name.strip() in wanted:
            found[name.strip()] = value.strip()
    return found


def cred_expire_s(auth_info: str | None) -> int:
    """``cred_expire`` of ``AuthInfo`` (``cred_expire=10``; Slurm's default 120 s): how long a job
    credential lives, and so how long Slurm holds a requeued job before it may start again (+1 s)."""
    m = re.search(r"\bcred_expire=(\d+)", auth_info or "")
    return int(m.group(1)) if m else DEFAULT_CRED_EXPIRE_S


#: Slurm's default ``AuthInfo=cred_expire``.
DEFAULT_CRED_EXPIRE_S = 120
