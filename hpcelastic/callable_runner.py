"""``python -m hpcelastic.callable_runner <run>/callable.pkl``: a worker that calls a submitted callable.

The agent starts this module as each worker's script, with the torchrun environment set. It loads
``(function, args, kwargs)`` pickled by :func:`hpcelastic.api.submit` (cloudpickle), calls it, and
rank 0 stores the return value as ``<run>/result.pkl``. An exception propagates, so the worker exits
non-zero with its traceback and the agent treats it like any failed worker.
"""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path
from typing import Any

RESULT_FILE = "result.pkl"


def run(pickle_path: str | os.PathLike[str]) -> Any:
    """Load and call the pickled callable; rank 0 writes its result next to the pickle."""
    path = Path(pickle_path)
    with path.open("rb") as f:
        function, args, kwargs = pickle.load(f)  # written by cloudpickle; plain pickle loads it
    result = function(*args, **kwargs)
    if os.environ.get("RANK", "0") == "0":
        import cloudpickle

        from hpcelastic.rundir import write_atomic

        write_atomic(path.parent / RESULT_FILE, cloudpickle.dumps(result))
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point: exactly one argument, the pickle file."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m hpcelastic.callable_runner <run>/callable.pkl", file=sys.stderr)
        return 2
    run(args[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
