"""One node's side of ``hpcelastic sites check --probe`` (``python -m hpcelastic.sitecheck.node SPEC``):
what only a node can tell, printed as one JSON line for :mod:`hpcelastic.sitecheck.probe` to judge.

Each node listens on its rendezvous address (the site's ``rdzv_interface``, else a routable one), writes
that address to ``<dir>/<node>.json`` in the probe's directory under the site's run root, waits for the
other nodes' files there (the directory is shared when they appear), connects to each, and answers their
connections. Beside that: the interpreter and what it imports, the fixed rendezvous port, the checkpoint
tier's directory and budget, the container runtime and image, NVML where GPUs are expected.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

#: Executables a container runtime needs on the node (any one of them).
RUNTIME_BINARIES = {
    "pyxis": ("enroot",),
    "apptainer": ("apptainer", "singularity"),
    "podman": ("podman",),
    "oci": ("runc", "crun"),
}
#: Images that are paths on the node (checked to exist there).
PATH_IMAGES = frozenset({"apptainer", "oci"})
GREETING = b"hpcelastic-sites-check\n"


def node_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _error(e: BaseException) -> str:
    return f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}"


def _imports() -> dict[str, str]:
    import hpcelastic

    out = {"hpcelastic": hpcelastic.__version__}
    try:
        import torch

        out["torch"] = torch.__version__
    except Exception as e:  # noqa: BLE001 - reported, whatever it is
        out["torch"] = _error(e)
    return out


def _address(iface: str | None) -> str:
    from hpcelastic.env.base import routable_address

    return routable_address(iface)


def _port_free(address: str, port: int | None) -> str | None:
    if not port:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
        except OSError as e:
            return f"error: port {port} is in use here ({e.strerror})"
    return "free"


def _tier(text: str | None, run_root: Path) -> str | None:
    if not text:
        return None
    from hpcelastic.errors import UserError
    from hpcelastic.tier.settings import TierSettings, check_node

    settings = TierSettings.parse(text)
    root = settings.local_dir(node_name(), "sites-check")
    try:
        tier = check_node(settings, root, run_root)
    except UserError as e:
        return f"error: {e}"
    return f"ok: {root}, {tier.budget // 2**20} MB"


def _runtime(runtime: str | None, image: str | None) -> str | None:
    if not runtime:
        return None
    found = next((p for b in RUNTIME_BINARIES.get(runtime, ()) if (p := shutil.which(b))), None)
    if found is None:
        return f"error: {' or '.join(RUNTIME_BINARIES.get(runtime, (runtime,)))} not found on PATH"
    if image and runtime in PATH_IMAGES and not Path(image).exists():
        return f"error: image {image} does not exist here"
    return f"ok: {found}"


def _nvml(expected: bool) -> str | None:
    if not expected:
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return f"ok: {pynvml.nvmlDeviceGetCount()} GPU(s)"
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # noqa: BLE001 - NVML's errors are many; each is reported
        return _error(e)


def _serve(sock: socket.socket, stop: threading.Event) -> None:
    sock.settimeout(0.5)
    while not stop.is_set():
        try:
            conn, _ = sock.accept()
        except TimeoutError:
            continue
        except OSError:
            return
        with conn, contextlib.suppress(OSError):
            conn.sendall(GREETING)


def _reach(peers: dict[str, dict[str, Any]]) -> dict[str, str]:
    out = {}
    for name, peer in sorted(peers.items()):
        try:
            with socket.create_connection((peer["address"], peer["port"]), timeout=5) as c:
                c.settimeout(5)
                out[name] = "ok" if c.recv(len(GREETING)) == GREETING else "error: another program answered"
        except OSError as e:
            out[name] = f"error: {peer['address']}:{peer['port']}: {e.strerror or e}"
    return out


def probe(spec: dict[str, Any]) -> dict[str, Any]:
    """This node's report (see the module docstring)."""
    directory, me = Path(spec["dir"]), node_name()
    report: dict[str, Any] = {"node": me, "python": sys.executable, **_imports()}
    try:
        address = _address(spec.get("iface"))
    except Exception as e:  # noqa: BLE001
        report["iface"] = _error(e)
        address = "0.0.0.0"  # noqa: S104 - the reachability test still runs, on every interface
    else:
        report["iface"] = f"ok: {address}"
    report["port"] = _port_free(address, spec.get("port"))
    report["tier"] = _tier(spec.get("tier"), directory.parent)
    report["runtime"] = _runtime(spec.get("runtime"), spec.get("image"))
    report["nvml"] = _nvml(bool(spec.get("gpus")))
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((address, 0))
    listener.listen(64)
    stop = threading.Event()
    server = threading.Thread(target=_serve, args=(listener, stop), daemon=True)
    server.start()
    mine = {"address": address if address != "0.0.0.0" else _address(None), "port": listener.getsockname()[1]}  # noqa: S104
    (directory / f"{me}.json").write_text(json.dumps(mine))
    end = time.monotonic() + float(spec.get("wait_s", 60))
    peers: dict[str, dict[str, Any]] = {}
    while time.monotonic() < end:
        peers = {
            f.stem: json.loads(f.read_text())
            for f in directory.glob("*.json")
            if f.stem != me and not f.stem.endswith(".done")
        }
        if len(peers) >= int(spec["nodes"]) - 1:
            break
        time.sleep(0.2)
    report["seen"] = sorted(peers)
    report["reach"] = _reach(peers)
    (directory / f"{me}.done.json").write_text("{}")
    while time.monotonic() < end and len(list(directory.glob("*.done.json"))) < len(peers) + 1:
        time.sleep(0.2)  # keep answering until every node seen has tried this one
    stop.set()
    listener.close()
    return report


def main() -> None:
    print(json.dumps(probe(json.loads(sys.argv[1]))), flush=True)


if __name__ == "__main__":
    main()
