"""Training in a container: the agent (and so its workers) runs inside the image, one per node.

The site's ``container:`` section (``runtime``, ``image``, ``mounts``, ``workdir``, ``python``, ``args``;
``submit --container-image/--container-runtime``) picks one of :data:`RUNTIMES`. Each wraps the srun
step's command (the batch script, ``finalize`` and Slurm's commands stay on the host):

* ``pyxis`` (enroot): srun's own ``--container-image``, ``--container-mounts``, ``--container-workdir``;
* ``apptainer`` (or Singularity): ``apptainer exec [--nv] --bind ... --pwd ... IMAGE`` around the agent;
* ``podman`` (and podman-hpc): ``podman run --rm --network host --ipc host -v ... -w ... -e ... IMAGE``;
* ``oci``: Slurm's own OCI support, ``srun --container=BUNDLE`` with the site's ``oci.conf``; the
  mounts go into a bundle of the run's own (:func:`oci_bundle`), whose rootfs is the image's.

Every runtime mounts the run directory, the checkpoint directory, the script's directory and the
working directory at the same paths, and the site's ``mounts`` (``SRC[:DST[:OPTIONS]]``). The image must
have Python with hpcelastic (the same version as the submit host's) and the training's packages. Slurm's
commands need not be in the image: an agent that finds no ``scontrol`` leaves the end-of-attempt
decision to ``hpcelastic finalize``, which runs in the batch script outside the container.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcelastic.errors import UserError

RUNTIMES = ("pyxis", "apptainer", "podman", "oci")
#: What ``image`` names, per runtime (for messages).
IMAGE_OF = {
    "pyxis": "an enroot image (docker://..., a .sqsh file)",
    "apptainer": "a .sif file (or any image apptainer exec takes)",
    "podman": "an image name or id",
    "oci": "an OCI bundle directory (config.json and its rootfs)",
}
#: The interpreter inside the image unless ``container.python`` says otherwise.
DEFAULT_PYTHON = "python3"
#: The job's environment reaches a podman container only as named: these prefixes (podman's ``-e NAME*``)
#: carry what Slurm, hpcelastic, CUDA, NCCL, gloo and torch read.
PODMAN_ENV = (
    "SLURM_*",
    "SLURMD_*",
    "HPCELASTIC_*",
    "CUDA_*",
    "NVIDIA_*",
    "NCCL_*",
    "GLOO_*",
    "OMP_*",
    "TORCH*",
)
#: Where :func:`oci_bundle` writes the run's own bundle (its config.json), under the run directory.
OCI_BUNDLE_DIR = "oci-bundle"
#: Namespaces the run's OCI bundle shares with the host (:func:`oci_bundle`).
SHARED_NAMESPACES = ("network", "uts")
#: Set in the container's environment (the batch script exports it): which runtime the agent runs in.
CONTAINER_ENV = "HPCELASTIC_CONTAINER"


@dataclass(frozen=True)
class Container:
    """One job's container, validated."""

    runtime: str
    image: str
    mounts: tuple[str, ...] = ()  # the site's and user's, SRC[:DST[:OPTIONS]]
    workdir: str | None = None
    python: str = DEFAULT_PYTHON
    args: tuple[str, ...] = ()  # extra words for the runtime (podman run / apptainer exec / srun)


def from_config(values: Mapping[str, Any], site: str) -> Container | None:
    """The ``container.*`` keys as a :class:`Container`; None when no runtime is set. :class:`UserError`
    (one line) for an incomplete or contradictory section."""
    runtime, image = values.get("container.runtime"), values.get("container.image")
    if not runtime:
        if image:
            raise UserError(
                f"site {site!r}: container.image is set but no container.runtime; set it in the site's "
                f"container: section or with --container-runtime ({', '.join(RUNTIMES)})"
            )
        return None
    if not image:
        raise UserError(
            f"site {site!r}: container.runtime {runtime} needs container.image ({IMAGE_OF[runtime]}); "
            "set it in the site's container: section or with --container-image"
        )
    mounts = tuple(values.get("container.mounts") or ())
    for m in mounts:
        check_mount(m, site)
    python = values.get("container.python") or DEFAULT_PYTHON
    if any(c.isspace() for c in python):
        raise UserError(
            f"site {site!r}: container.python {python!r} must be one interpreter path, not a command"
        )
    return Container(
        runtime=runtime,
        image=image,
        mounts=mounts,
        workdir=values.get("container.workdir") or None,
        python=python,
        args=tuple(values.get("container.args") or ()),
    )


def check_mount(mount: str, site: str) -> None:
    """``SRC[:DST[:OPTIONS]]`` with absolute paths and no comma (pyxis and apptainer separate mounts with
    commas); :class:`UserError` otherwise."""
    parts = mount.split(":")
    if len(parts) > 3 or not all(parts[:2]) or not all(p.startswith("/") for p in parts[:2]):
        raise UserError(
            f"site {site!r}: container.mounts entry {mount!r} must be SRC[:DST[:OPTIONS]] with absolute paths"
        )
    if "," in mount or any(c.isspace() or c == "\0" for c in mount):
        raise UserError(
            f"site {site!r}: container.mounts entry {mount!r} must not contain a comma or a space"
        )


def job_mounts(
    run_dir: str, checkpoint_dir: str, script: str | None, cwd: str, extra: Sequence[str]
) -> tuple[str, ...]:
    """Every mount of a job's container, each ``SRC:DST``: the run directory, the checkpoint directory,
    the script's directory and the working directory at the same paths (the outermost of nested ones
    only), then ``extra``. Paths with a comma, a colon or a space cannot be mounted: :class:`UserError`."""
    paths = [run_dir, checkpoint_dir, *([str(Path(script).parent)] if script else []), cwd]
    kept: list[str] = []
    for p in sorted(dict.fromkeys(os.path.normpath(x) for x in paths), key=len):
        if not any(p == k or p.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(p)
    for p in kept:
        if p == "/":
            raise UserError(
                "/ cannot be mounted into a container (it would hide the image); submit from a directory of "
                "the job's, with the script and run directory below it or elsewhere"
            )
        if any(c in p for c in ",:") or any(c.isspace() or c == "\0" for c in p):
            raise UserError(
                f"{p!r} cannot be mounted into a container (a comma, colon or space in the path); "
                "use a run directory and checkpoint directory without them"
            )
    return (*(f"{p}:{p}" for p in kept), *extra)


def wrap(
    container: Container,
    agent: Sequence[str],
    *,
    mounts: Sequence[str],
    workdir: str,
    env_names: Sequence[str],
    gpus: bool,
    bundle: str,
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(srun's options, the command srun runs)`` of the step that runs ``agent`` in ``container``: the
    runtime's options go on srun (pyxis, oci) or before the agent's command (apptainer, podman).
    ``env_names``: variables the batch script exports (podman passes only what it is told); ``bundle``:
    the run's own OCI bundle directory."""
    c, work = container, container.workdir or workdir
    if c.runtime == "pyxis":
        opts = (
            f"--container-image={c.image}",
            f"--container-mounts={','.join(mounts)}",
            f"--container-workdir={work}",
        )
        return (*opts, *c.args), tuple(agent)
    if c.runtime == "oci":
        return (f"--container={bundle}", *c.args), tuple(agent)
    if c.runtime == "apptainer":
        binds = ("--bind", ",".join(mounts)) if mounts else ()
        words = ("apptainer", "exec", *(("--nv",) if gpus else ()), *binds, "--pwd", work, *c.args, c.image)
        return (), (*words, *agent)
    volumes = [w for m in mounts for w in ("-v", m)]
    named = [n for n in env_names if not any(n.startswith(p.rstrip("*")) for p in PODMAN_ENV)]
    envs = [w for name in (*PODMAN_ENV, *named) for w in ("-e", name)]
    words = (
        "podman",
        "run",
        "--rm",
        "--network",
        "host",
        "--ipc",
        "host",
        *volumes,
        "-w",
        work,
        *envs,
        *c.args,
        c.image,
    )
    return (), (*words, *agent)


def oci_bundle(image: str, mounts: Sequence[str], workdir: str) -> bytes:
    """The run's own OCI bundle's ``config.json``: the image bundle's, with its rootfs at its absolute
    path, the job's ``mounts`` (bind mounts at the same paths) added, the working directory set and the
    host's network and hostname (:data:`SHARED_NAMESPACES`); Slurm fills in the process (command,
    environment) itself. :class:`UserError` when ``image`` is no bundle."""
    path = Path(image) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"container.image {image!r} is no OCI bundle: cannot read {path} ({e})") from None
    root = config.get("root") if isinstance(config, dict) else None
    if not isinstance(root, dict) or not root.get("path"):
        raise UserError(f"{path} names no root.path (the bundle's rootfs)")
    root["path"] = str((Path(image) / root["path"]).resolve())
    existing = {m.get("destination") for m in config.get("mounts", []) if isinstance(m, dict)}
    for m in mounts:
        src, _, rest = m.partition(":")
        dst, _, opts = rest.partition(":")
        if (dst or src) in existing:
            continue
        options = ["rbind", "rw" if opts != "ro" else "ro"]
        config.setdefault("mounts", []).append(
            {"destination": dst or src, "type": "bind", "source": src, "options": options}
        )
    config.setdefault("process", {})["cwd"] = workdir
    # The host's network and hostname, as podman's --network host: the agents, the coordinator and
    # NCCL/gloo talk across nodes, which a network namespace of the container's own would cut off.
    linux = config.get("linux") if isinstance(config.get("linux"), dict) else {}
    linux["namespaces"] = [n for n in linux.get("namespaces", []) if n.get("type") not in SHARED_NAMESPACES]
    config["linux"] = linux
    config.pop("hostname", None)  # runc sets one only in a UTS namespace of the container's own
    return (json.dumps(config, indent=2) + "\n").encode()


def make_mount_points(config_json: bytes) -> None:
    """Create, in the bundle's rootfs, each bind mount's destination that is missing, before the job
    starts. Otherwise every node's runc creates it in the one shared rootfs at the same moment and all but
    one can lose that race (``mkdirat ...: file exists``, the step fails); runc would create the same
    empty directories itself. Best effort: a rootfs the submitter cannot write is left to runc."""
    config = json.loads(config_json)
    rootfs = Path(config["root"]["path"])
    for m in config.get("mounts", []):
        if m.get("type") != "bind" or not str(m.get("destination", "")).startswith("/"):
            continue
        dest = rootfs / m["destination"].lstrip("/")
        try:
            if os.path.lexists(dest):
                continue
            if Path(m["source"]).is_dir():
                dest.mkdir(parents=True, exist_ok=True)
            else:
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.touch(exist_ok=True)
        except OSError:
            continue


def check_release(container: Container | None, release: tuple[int, int] | None) -> None:
    """Refuse, before anything is submitted, a runtime this Slurm release cannot run the agents in:
    Slurm's OCI mode on 22.05 passes none of ``SLURM_PROCID``, ``SLURM_NODEID``, ``SLURM_LOCALID``,
    ``SLURMD_NODENAME`` into the container (measured; 24.11 does), and without them the agents
    cannot tell their nodes apart."""
    if container is not None and container.runtime == "oci" and release is not None and release < (23, 2):
        raise UserError(
            f"Slurm {release[0]}.{release[1]:02d}'s OCI mode (srun --container) does not pass SLURM_NODEID, "
            "SLURM_PROCID or SLURMD_NODENAME into the container, so the agents cannot tell their nodes "
            "apart; use container.runtime podman, apptainer or pyxis (Slurm 24.11's OCI mode passes them)"
        )


def bundle_files(container: Container | None, mounts: Sequence[str], workdir: str) -> dict[str, bytes]:
    """The files a run in ``container`` needs in its run directory: the OCI bundle's config.json."""
    if container is None or container.runtime != "oci":
        return {}
    return {f"{OCI_BUNDLE_DIR}/config.json": oci_bundle(container.image, mounts, workdir)}
