"""Locate the data directories shipped with hpcelastic (templates, site configs).

In an installed wheel they live in ``hpcelastic/_data/<name>``; in a source
checkout (editable install) they are top-level folders of the repository.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def data_dir(name: str) -> Path:
    """Directory of the shipped data set ``name`` ("sbatch_templates" or "site_configs")."""
    installed = _PACKAGE_DIR / "_data" / name
    if installed.is_dir():
        return installed
    checkout = _PACKAGE_DIR.parent / name
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError(f"hpcelastic data directory {name!r} is missing from this installation")
