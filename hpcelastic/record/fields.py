"""Reading an event record's fields, shared by the ledger, its replica lanes and the report: times and
steps that may be missing or damaged in a log, the silence a failure's text names, JSON-ready values."""

from __future__ import annotations

import enum
import re
from typing import Any

from hpcelastic.events import Record

#: The silence before a failure was seen, as the coordinator's ``node_lost`` reason ("no heartbeat for
#: 5.2 s ...", hpcelastic/agent/coordinator.py) and a stall's error ("no progress for 30 s",
#: hpcelastic/agent/job_state.py) name it: the failure itself lies that long before the record.
_SILENCE = re.compile(r"no (?:heartbeat|progress) for (?:more than )?([0-9.]+) s")


def ts_of(r: Record | None, key: str = "ts") -> float | None:
    """Field ``key`` of ``r`` as a time in seconds; None when the record or a number is missing."""
    v = r.get(key) if r is not None else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def step_field(r: Record) -> int | None:
    """The record's ``step``, None unless it is an integer."""
    v = r.get("step")
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def silence_s(text: str) -> float | None:
    """The seconds of silence a failure's text names (see :data:`_SILENCE`), None when it names none."""
    found = _SILENCE.search(text)
    return float(found.group(1)) if found else None


def plain(value: Any) -> Any:
    """``value`` with enums as their values and keys as strings, nested: ready for ``json.dumps``."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value
