"""The local checkpoint tier's settings: site keys ``checkpoint_tier.*`` (:data:`hpcelastic.sites.SCHEMA`),
checked at submit (:meth:`TierSettings.from_config`), carried to the agents as one JSON option
(``--local-tier``) and checked again on each node (:func:`check_node`), where the local directory, its
filesystem and its size can be seen. Every refusal is one line naming the setting.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import string
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from hpcelastic import sites
from hpcelastic.errors import UserError

SECTION = "checkpoint_tier"
#: What a local directory template may name.
PLACEHOLDERS = ("node", "job", "user")
RESTORE_MODES: tuple[str, ...] = sites.SCHEMA[f"{SECTION}.restore"].choices or ()
#: Filesystems that are shared between nodes (``/proc/self/mountinfo`` types): never a local tier.
NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "lustre",
        "gpfs",
        "beegfs",
        "cifs",
        "smb3",
        "ceph",
        "fuse.glusterfs",
        "glusterfs",
        "panfs",
        "wekafs",
        "fuse.sshfs",
        "9p",
        "afs",
        "orangefs",
        "pvfs2",
    }
)
MB = 1 << 20
#: Filesystems held in memory: their bytes count against the node's RAM, whatever their own size says.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})
#: Without a budget, the tier may use half the local filesystem, and of a memory filesystem at most this
#: share of the node's memory (the training needs the rest).
DEFAULT_MEMORY_SHARE = 0.25
#: A copy into a memory filesystem is refused when it would leave the node less available memory than this
#: share of its total: the tier never drives the node into the out-of-memory killer.
MEMORY_RESERVE = 0.10


def key(name: str) -> str:
    """The schema key of setting ``name``: ``replicas`` -> ``checkpoint_tier.replicas``."""
    return f"{SECTION}.{name}"


@dataclass(frozen=True)
class TierSettings:
    """One job's local tier (the field names are the schema keys' last parts)."""

    local_checkpoint_dir: str
    local_checkpoint_mb: int | None = sites.default(key("local_checkpoint_mb"))
    replicas: int = sites.default(key("replicas"))
    persist_every: int = sites.default(key("persist_every"))
    keep: int = sites.default(key("keep"))
    replication_mb_s: int = sites.default(key("replication_mb_s"))
    restore: str = sites.default(key("restore"))

    def __post_init__(self) -> None:
        problem = template_problem(self.local_checkpoint_dir)
        if problem:
            raise UserError(f"{key('local_checkpoint_dir')}: {problem}")
        for name, low in (("replicas", 0), ("persist_every", 1), ("keep", 1), ("replication_mb_s", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise UserError(f"{key(name)}: must be an integer of at least {low}, got {value!r}")
        mb = self.local_checkpoint_mb
        if mb is not None and (not isinstance(mb, int) or isinstance(mb, bool) or mb < 1):
            raise UserError(f"{key('local_checkpoint_mb')}: must be a positive number of MB, got {mb!r}")
        if self.restore not in RESTORE_MODES:
            raise UserError(
                f"{key('restore')}: must be one of {', '.join(RESTORE_MODES)}, got {self.restore!r}"
            )

    @classmethod
    def from_config(cls, get: Any) -> TierSettings | None:
        """From a resolved configuration's ``get`` (None when ``local_checkpoint_dir`` is unset: no tier)."""
        template = get(key("local_checkpoint_dir"))
        if not template:
            return None
        values = {f.name: get(key(f.name)) for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if v is not None or k == "local_checkpoint_mb"})

    def to_text(self) -> str:
        """The agent option's value: one JSON object."""
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def parse(cls, text: str) -> TierSettings:
        """The agent option ``--local-tier``'s value; one-line :class:`UserError` when it is not valid."""
        try:
            obj = json.loads(text)
        except ValueError:
            raise UserError(
                f"--local-tier {text!r} is not a JSON object of checkpoint_tier settings"
            ) from None
        if not isinstance(obj, dict):
            raise UserError(f"--local-tier {text!r} is not a JSON object of checkpoint_tier settings")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(obj) - known)
        if unknown:
            raise UserError(
                f"--local-tier: unknown setting {unknown[0]!r} (known: {', '.join(sorted(known))})"
            )
        if "local_checkpoint_dir" not in obj:
            raise UserError("--local-tier: local_checkpoint_dir is missing")
        return cls(**obj)

    def local_dir(self, node: str, job: str) -> Path:
        """This node's local directory for job (or run) ``job``."""
        return Path(self.local_checkpoint_dir.format(node=node, job=job, user=_user()))

    @property
    def rate_bytes_s(self) -> float:
        return float(self.replication_mb_s) * MB


def _user() -> str:
    with contextlib.suppress(Exception):
        return getpass.getuser()
    return str(os.getuid())


def template_problem(template: Any) -> str | None:
    """Why ``template`` is not a usable local directory template, or None."""
    if not isinstance(template, str) or not template.strip():
        return "must be a directory path"
    if not os.path.isabs(template):
        return f"{template!r} is not an absolute path (e.g. /dev/shm/hpcelastic-{{user}}-{{job}}-{{node}})"
    try:
        names = [name for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        return f"{template!r} is not a valid template: {e}"
    bad = [n for n in names if n not in PLACEHOLDERS]
    if bad:
        known = ", ".join("{" + p + "}" for p in PLACEHOLDERS)
        return f"{template!r} names {{{bad[0]}}}; only {known} are known"
    if "\0" in template:
        return "contains a NUL byte"
    return None


def filesystem_type(path: Path) -> str:
    """The type of the filesystem ``path`` (an existing path) is on, from ``/proc/self/mountinfo``."""
    real = os.path.realpath(path)
    best, best_type = "", ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            parts = line.split(" - ", 1)
            if len(parts) != 2:
                continue
            mount = parts[0].split()[4].encode().decode("unicode_escape")
            fstype = parts[1].split()[0]
            inside = real == mount or real.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best):
                best, best_type = mount, fstype
    return best_type


def existing_parent(path: Path) -> Path:
    """``path`` if it exists, else its parent (the directory the agent creates it in)."""
    return path if path.exists() else path.parent


@dataclass(frozen=True)
class NodeTier:
    """What :func:`check_node` found on this node: the directory and the budget in bytes."""

    root: Path
    budget: int
    fstype: str

    @property
    def in_memory(self) -> bool:
        return self.fstype in MEMORY_FILESYSTEMS


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (``MemTotal``, ``MemAvailable``, ...); empty when unreadable."""
    out = {}
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, value = line.split(":", 1)
            out[name] = int(value.split()[0]) * 1024
    return out


def memory_left_after(size: int) -> str | None:
    """Why ``size`` more bytes in a memory filesystem would put the node at risk of the out-of-memory killer
    (less than :data:`MEMORY_RESERVE` of its memory available afterwards), or None."""
    info = meminfo()
    total, available = info.get("MemTotal"), info.get("MemAvailable")
    if not total or available is None:
        return None
    if available - size >= int(total * MEMORY_RESERVE):
        return None
    return (
        f"the node would have {max(0, available - size) // MB} MB of memory available, less than its reserve"
    )


def check_node(settings: TierSettings, root: Path, run_dir: Path, checkpoint_bytes: int = 0) -> NodeTier:
    """This node's local directory and budget, or a one-line :class:`UserError` naming the setting.

    Refused: a directory whose parent does not exist or cannot be written, one on the filesystem of the run
    directory (the same device) or on a network filesystem, a budget above the filesystem's size, and a
    budget smaller than ``checkpoint_bytes`` (the checkpoint the job resumes from). Without a budget the
    tier may use half the local filesystem, and of a memory filesystem (``/dev/shm``) at most
    :data:`DEFAULT_MEMORY_SHARE` of the node's memory.
    """
    name = key("local_checkpoint_dir")
    parent = existing_parent(root)
    if not parent.is_dir():
        raise UserError(f"{name}: {parent} does not exist on this node; create it or pick another directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{name}: {parent} is not writable on this node; pick a writable local directory")
    fstype = filesystem_type(parent)
    if os.stat(parent).st_dev == os.stat(run_dir).st_dev:
        raise UserError(
            f"{name}: {root} is on the same filesystem as the run directory {run_dir}; the local tier must "
            "be node-local (/dev/shm or a local disk)"
        )
    if fstype in NETWORK_FILESYSTEMS:
        raise UserError(
            f"{name}: {root} is on a shared {fstype} filesystem; the local tier must be node-local "
            "(/dev/shm or a local disk)"
        )
    st = os.statvfs(parent)
    size = st.f_blocks * st.f_frsize
    mb = settings.local_checkpoint_mb
    budget = size // 2 if mb is None else mb * MB
    memory = meminfo().get("MemTotal")
    if mb is None and fstype in MEMORY_FILESYSTEMS and memory:
        budget = min(budget, int(memory * DEFAULT_MEMORY_SHARE))
    if mb is not None and budget > size:
        raise UserError(
            f"{key('local_checkpoint_mb')}={mb} is more than {fstype or 'the'} filesystem of {parent} holds "
            f"({size // MB} MB); lower it or give the node more room"
        )
    if checkpoint_bytes > budget:
        raise UserError(
            f"{key('local_checkpoint_mb')}={budget // MB} is smaller than one checkpoint of this job "
            f"({-(-checkpoint_bytes // MB)} MB); raise it"
        )
    return NodeTier(root, budget, fstype)
