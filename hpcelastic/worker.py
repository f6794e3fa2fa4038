"""The API training scripts import (no agent imports, no torch import).

Only the heartbeat lives here for now: ``heartbeat(step)`` tells the node agent this worker is
making progress, so ``--stall-timeout`` can fail a worker that hangs.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time

_HEARTBEAT_SOCKET_ENV = "HPCELASTIC_HEARTBEAT_SOCKET"
_sock: socket.socket | None = None


def _send_heartbeat(path: str, step: int | None) -> None:
    """Send one heartbeat datagram to the agent's unix socket; never raises, never blocks."""
    global _sock
    if _sock is None:
        _sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        _sock.setblocking(False)
    payload = json.dumps({"pid": os.getpid(), "step": step, "ts": time.time()}).encode()
    with contextlib.suppress(OSError):
        _sock.sendto(payload, path)


def heartbeat(step: int | None = None) -> None:
    """Tell the agent this worker is alive (at training step ``step``); a no-op outside an agent."""
    path = os.environ.get(_HEARTBEAT_SOCKET_ENV)
    if path:
        _send_heartbeat(path, step)
