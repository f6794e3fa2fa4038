"""Every process a bench starts dies with it, whatever sessions they made (torchrun's workers too).

:func:`tracked` tags this process's environment with a fresh token that every child and grandchild
inherits, and makes this process the child subreaper so that orphans stay its descendants. On exit
it kills every process carrying the token (several passes: a dying parent may spawn) and checks with
psutil that none is left.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import signal
import time
from collections.abc import Iterator

import psutil

TOKEN_VARIABLE = "HPCELASTIC_BENCH_TOKEN"
PR_SET_CHILD_SUBREAPER = 36


def marked(token: str) -> list[psutil.Process]:
    """Live processes (not zombies, not this one) whose environment holds ``token``."""
    found = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(TOKEN_VARIABLE) == token:
                found.append(p)
    return found


def kill_marked(token: str, timeout: float = 10.0) -> list[psutil.Process]:
    """SIGKILL every process holding ``token`` until none is left; returns the survivors (none, normally)."""
    deadline = time.monotonic() + timeout
    left = marked(token)
    while left and time.monotonic() < deadline:
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGKILL)
        psutil.wait_procs(left, timeout=1.0)
        _reap_children()
        left = marked(token)
    return left


def _reap_children() -> None:
    """Collect adopted orphans (this process is their subreaper) so they do not linger as zombies."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


@contextlib.contextmanager
def tracked() -> Iterator[str]:
    """Tag every process started inside the block; kill them all at its end (and say if any survived)."""
    token = secrets.token_hex(8)
    os.environ[TOKEN_VARIABLE] = token
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        yield token
    finally:
        survivors = kill_marked(token)
        os.environ.pop(TOKEN_VARIABLE, None)
        if survivors:
            raise RuntimeError(f"bench processes survived cleanup: {[p.pid for p in survivors]}")
