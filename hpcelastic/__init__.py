"""hpcelastic: elastic, fault-tolerant PyTorch training on Slurm clusters.

The control path (CLI, agent) never imports torch. Heavy entry points are
imported lazily so that ``hpcelastic --help`` stays fast on a login node.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "submit"]


def submit(*args: Any, **kwargs: Any) -> Any:
    """Submit a job from Python; see :func:`hpcelastic.api.submit`."""
    from hpcelastic.api import submit as _submit

    return _submit(*args, **kwargs)
