"""A warm worker's ``destroy_process_group`` settles (``agent/pg_teardown.py``): the GIL released after it,
once however often installed, the original's result and errors passed through."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from hpcelastic.agent import pg_teardown


def test_the_wrapper_sleeps_after_the_original_and_returns_what_it_returns() -> None:
    calls: list[float] = []

    def destroy(group: object = None) -> str:
        calls.append(time.monotonic())
        return f"destroyed {group}"

    wrapped = pg_teardown.settling(destroy, settle_s=0.05)
    began = time.monotonic()
    assert wrapped("pg") == "destroyed pg"
    assert calls and time.monotonic() - calls[0] >= 0.05
    assert time.monotonic() - began >= 0.05
    assert wrapped.__name__ == "destroy"
    assert pg_teardown.settling(wrapped) is wrapped  # never twice


def test_an_error_of_the_original_still_settles_and_reaches_the_script() -> None:
    def destroy() -> None:
        raise ValueError("Invalid process group specified")

    began = time.monotonic()
    with pytest.raises(ValueError, match="Invalid process group"):
        pg_teardown.settling(destroy, settle_s=0.05)()
    assert time.monotonic() - began >= 0.05


def test_install_wraps_both_names_a_script_imports_and_a_real_gloo_group_is_destroyed() -> None:
    """In a fresh interpreter with torch imported (as a warm worker has it): both names wrapped, the one a
    script takes with ``from torch.distributed import destroy_process_group`` too, and a real one-rank
    gloo group destroyed through it."""
    code = """
import sys, time, torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from hpcelastic.agent import pg_teardown
assert pg_teardown.install()
assert pg_teardown.install()  # again: still wrapped once
from torch.distributed import destroy_process_group
assert destroy_process_group is dist.destroy_process_group is c10d.destroy_process_group
assert destroy_process_group.__wrapped__.__name__ == "destroy_process_group"
assert not hasattr(destroy_process_group.__wrapped__, "__wrapped__")
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
began = time.monotonic()
destroy_process_group()
assert time.monotonic() - began >= pg_teardown.SETTLE_S
assert not dist.is_initialized()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_install_without_torch_imported_changes_nothing() -> None:
    code = (
        "import sys\nfrom hpcelastic.agent import pg_teardown as t\n"
        + "print(t.install(), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr
