"""Each round's ``MASTER_PORT``, and the TCPStore behind it where the coordinator's process serves it.

Under torch's ``env://`` rendezvous rank 0's worker serves the store (``TORCHELASTIC_USE_AGENT_STORE=False``)
and every other rank's client connects to it. After a restart every worker starts at once, and a client whose
first connect comes before rank 0 listens retries on torch's backoff: a store that starts listening 50 ms
after its client tried is reached about 0.5 s later (torch 2.13, loopback). Served from the coordinator's
process instead (``TORCHELASTIC_USE_AGENT_STORE=True``, as torchrun's agent serves its own store), the store
listens before any worker of the round starts, and every client connects at once.

Serving needs torch in the coordinator's process. The job-wide path imports it in the background from the
coordinator's start (while the agents meet and each node's fork server imports its own) and serves every
round opened after; until then, or where the agent's Python has no torch, the port is only reserved
(:class:`PortReservation`) and rank 0's worker serves the store as before. Replica groups import it at once:
torchft's Manager needs the store.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Mapping
from typing import Any

from hpcelastic.errors import UserError

#: Rounds whose stores stay served (a worker of the round before may still be reading its store).
KEEP_ROUNDS = 2
#: ``0``: rank 0's worker serves every round's store, as before (a script that serves its own on MASTER_PORT).
VARIABLE = "HPCELASTIC_AGENT_STORE"


def wanted(environ: Mapping[str, str]) -> bool:
    """Whether the job-wide path may serve its rounds' stores (:data:`VARIABLE`, default yes)."""
    value = environ.get(VARIABLE, "")
    if value not in ("", "0", "1"):
        raise UserError(f"{VARIABLE}={value!r} is not 0 or 1")
    return value != "0"


class PortReservation:
    """Fresh ``MASTER_PORT`` values without a check-then-use race.

    The port is bound with ``SO_REUSEADDR`` but never listened on, and held until the next round:
    no other process can take it, while the rank-0 worker's TCPStore (which also sets
    ``SO_REUSEADDR``) can still bind and listen on it.
    """

    def __init__(self) -> None:
        self._sock: socket.socket | None = None

    def new_port(self) -> int:
        """Release the previous round's port and reserve a new one."""
        self.release()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("", 0))
        self._sock = sock
        return sock.getsockname()[1]

    def release(self) -> None:
        """Give the current port back."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class RoundStores:
    """``new_port`` for :class:`~hpcelastic.agent.job_state.JobState`: a port with a store served from this
    process once torch is imported here, a reserved port for rank 0's store before (see the module)."""

    def __init__(self, keep: int = KEEP_ROUNDS, *, import_now: bool = False, serve: bool = True) -> None:
        self.keep = keep
        self.serve = serve or import_now
        self._reservation = PortReservation()
        self._stores: list[Any] = []
        self._served: frozenset[int] = frozenset()
        self._store_type: Any = None
        self._importing: threading.Thread | None = None
        if import_now:
            self._import()
        elif self.serve:  # while the agents meet and the fork servers import theirs
            self._importing = threading.Thread(
                target=self._import_quietly, name="hpcelastic-store-import", daemon=True
            )
            self._importing.start()

    def _import(self) -> None:
        from torch.distributed import TCPStore

        self._store_type = TCPStore

    def _import_quietly(self) -> None:
        with contextlib.suppress(Exception):  # no usable torch in the agent's Python: rank 0 serves
            self._import()

    def new_port(self) -> int:
        """The next round's port: served here once torch is imported, else reserved for rank 0's store."""
        store = self._serve()
        if store is None:
            return self._reservation.new_port()
        self._reservation.release()
        self._stores.append(store)
        del self._stores[: -self.keep]
        self._served = frozenset(int(s.port) for s in self._stores)
        return int(store.port)

    def _serve(self) -> Any:
        if self._store_type is None:
            return None
        try:
            return self._store_type("0.0.0.0", 0, is_master=True, wait_for_workers=False, use_libuv=True)
        except (RuntimeError, OSError):  # no port or descriptor left: this round's rank 0 serves its store
            return None

    def serves(self, port: int) -> bool:
        """Whether ``port``'s store is served from this process (the workers connect as clients only)."""
        return port in self._served

    def close(self) -> None:
        self._stores.clear()
        self._served = frozenset()
        self._reservation.release()
