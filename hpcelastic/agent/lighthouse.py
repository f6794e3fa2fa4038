"""The torchft lighthouse and the replica groups' stores, hosted by the coordinator's agent.

In replica-group mode (``--replica-groups R``) the coordinator's agent starts torchft's own
``LighthouseServer`` in a child process (``python -m hpcelastic.agent.lighthouse``) whose output, one
INFO line per quorum from torchft's Rust side, goes to ``<run>/logs/lighthouse.log`` instead of the
job's output. The child dies with the agent (parent-death signal and end of its standard input).

Every group round gets a fresh ``MASTER_PORT`` with a ``TCPStore`` served from the coordinator's
agent (:class:`GroupStores`): torchft's Manager connects to it as a client, as it does to torchrun's
agent store, so a script written as torchft's examples runs unchanged.

If the coordinator's node dies, the lighthouse and the stores go with it: the groups' quorums fail
after torchft's quorum timeout, the agents lose their coordinator and stop their workers, and the
job-wide path (requeue) applies, as for any job whose coordinator is lost.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcelastic.errors import UserError

if TYPE_CHECKING:
    from hpcelastic.agent.job_state import JobState
    from hpcelastic.agent.spec import AgentSpec
    from hpcelastic.env.base import Rendezvous

#: How long a joining group waits for the others before a quorum forms without them (torchft's join timeout).
JOIN_TIMEOUT_MS = 5_000
_READY_TIMEOUT_S = 30.0


def lighthouse_url(master_addr: str, port: int) -> str:
    """``TORCHFT_LIGHTHOUSE`` for the lighthouse listening on ``port`` of the coordinator's node."""
    host = f"[{master_addr}]" if ":" in master_addr else master_addr
    return f"http://{host}:{port}"


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)


class Lighthouse:
    """torchft's lighthouse in a child process; :meth:`close` stops it."""

    def __init__(self, master_addr: str, min_replicas: int, log_path: Path) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hpcelastic.agent.lighthouse", "--min-replicas", str(min_replicas)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                preexec_fn=_die_with_parent,
            )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode().strip()
        if not line.isdigit():
            self.close()
            raise UserError(
                f"the torchft lighthouse did not start (see {log_path}); install it with "
                "`pip install 'hpcelastic[torchft]'`"
            )
        self.url = lighthouse_url(master_addr, int(line))

    def close(self) -> None:
        """Stop the lighthouse (end of its input, then SIGKILL if it lingers)."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class GroupStores:
    """A fresh ``MASTER_PORT`` per group round, with a TCPStore served on it from this process."""

    def __init__(self, master_addr: str, keep: int) -> None:
        self.master_addr = master_addr
        self.keep = keep
        self._stores: list[Any] = []
        from torch.distributed import TCPStore

        self._store_type = TCPStore

    def new_port(self) -> int:
        """Start a store on a free port; the oldest store is dropped beyond ``keep``."""
        store = self._store_type("0.0.0.0", 0, is_master=True, wait_for_workers=False, use_libuv=True)
        self._stores.append(store)
        del self._stores[: -self.keep]
        return int(store.port)

    def close(self) -> None:
        self._stores.clear()


def replica_state_factory(
    spec: AgentSpec, rdzv: Rendezvous, stack: contextlib.ExitStack
) -> Callable[..., JobState]:
    """Builds the coordinator's :class:`~hpcelastic.agent.replicas.ReplicaJobState` from :class:`JobState`'s
    keywords, after starting the lighthouse and the group stores (stopped with ``stack``)."""
    from hpcelastic.agent.replicas import ReplicaJobState, check_groups

    def make(**kw: Any) -> JobState:
        problem = check_groups(kw["round_size"], spec.replica_groups, spec.min_replica_groups)
        if problem:
            raise UserError(problem)
        lighthouse = Lighthouse(
            rdzv.master_addr, spec.min_replica_groups, rdzv.run_dir.path / "logs" / "lighthouse.log"
        )
        stack.callback(lighthouse.close)
        # torch is imported here, before the coordinator serves: importing it in a round would stall it.
        stores = GroupStores(rdzv.master_addr, keep=2 * spec.replica_groups)
        stack.callback(stores.close)
        kw["new_port"] = stores.new_port
        return ReplicaJobState(
            replica_groups=spec.replica_groups,
            min_replica_groups=spec.min_replica_groups,
            lighthouse=lighthouse.url,
            stall_timeout=spec.stall_timeout or 0.0,
            **kw,
        )

    return make


def _lighthouse_server_type() -> Any:
    """torchft's ``LighthouseServer`` from its Rust extension alone: ``import torchft`` would import torch
    (seconds to tens of seconds on a busy node) before the lighthouse could answer."""
    import importlib.util

    found = importlib.util.find_spec("torchft")
    if found is None or not found.submodule_search_locations:
        raise SystemExit("torchft is not installed: pip install 'hpcelastic[torchft]'")
    folder = Path(list(found.submodule_search_locations)[0])
    library = next(folder.glob("_torchft*.so"), None)
    spec = importlib.util.spec_from_file_location("torchft._torchft", library) if library else None
    if spec is None or spec.loader is None:
        from torchft._torchft import LighthouseServer  # an unusual layout: the ordinary import

        return LighthouseServer
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LighthouseServer


def main() -> None:
    """Child process: serve torchft's lighthouse on a free port, print the port, run until stdin ends."""
    p = argparse.ArgumentParser(description="torchft lighthouse for hpcelastic")
    p.add_argument("--min-replicas", type=int, required=True)
    p.add_argument("--join-timeout-ms", type=int, default=JOIN_TIMEOUT_MS)
    args = p.parse_args()
    server = _lighthouse_server_type()(
        bind="[::]:0", min_replicas=args.min_replicas, join_timeout_ms=args.join_timeout_ms
    )
    port = server.address().rsplit(":", 1)[1].strip("/")
    print(port, flush=True)
    sys.stdin.read()
    server.shutdown()


if __name__ == "__main__":
    main()
