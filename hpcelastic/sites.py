"""Site configurations: load, layer and validate YAML; the one place that knows config keys.

Layers, lowest first: built-in defaults (:data:`SCHEMA`) < the site file (``site_configs/<name>.yaml``)
< the user file (``$XDG_CONFIG_HOME/hpcelastic/config.yaml``) < the command line. Mappings merge key by
key; scalars and lists replace. Every problem in a file is reported as one line naming the file, the key
path and, for a misspelt key, the closest valid one.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcelastic.errors import UserError
from hpcelastic.jobs.container import RUNTIMES, from_config
from hpcelastic.parse import (
    CONSOLE_MODES,
    MAX_GRACE_PERIOD_S,
    MAX_SIGNAL_LEAD_S,
    MIN_STALL_TIMEOUT_S,
    is_env_name,
    parse_time,
    signal_name,
    uncatchable,
)
from hpcelastic.resources import data_dir

USER_CONFIG_ENV = "XDG_CONFIG_HOME"
#: Directories of site files searched before the user's, the system's and the packaged ones (``:``-separated).
SITE_DIR_ENV = "HPCELASTIC_SITE_DIR"
SYSTEM_SITES_DIR = Path("/etc/hpcelastic/sites")
SITE_SUFFIX = ".yaml"

Validator = Callable[[Any], str | None]


@dataclass(frozen=True)
class Key:
    """One configuration key: its type(s), default, one-line doc and an optional extra check.

    ``option``: the ``--help`` text of the ``hpcelastic submit`` option (and ``hpcelastic.submit``
    keyword) that sets this key, named after the key's last part; None when no option sets it.
    """

    type: type
    default: Any
    doc: str
    check: Validator | None = None
    item: type | None = None  # element type of a list, or value type of a mapping
    nullable: bool = True
    option: str | None = None
    choices: tuple[str, ...] | None = None  # the allowed values (checked; a click.Choice on the CLI)


def _choice(*allowed: str) -> Validator:
    def check(value: Any) -> str | None:
        if value in allowed:
            return None
        hint = difflib.get_close_matches(str(value), allowed, n=1)
        return f"must be one of {', '.join(allowed)}" + (f" (did you mean {hint[0]!r}?)" if hint else "")

    return check


def _at_least(low: float) -> Validator:
    return lambda value: None if value >= low else f"must be at least {low:g}, got {value:g}"


def _between(low: int, high: int) -> Validator:
    return lambda value: None if low <= value <= high else f"must be between {low} and {high}, got {value}"


def _share_between(low: float, high: float) -> Validator:
    return lambda value: (
        None if low <= value <= high else f"must be between {low:g} and {high:g}, got {value:g}"
    )


def _signal_name(value: Any) -> str | None:
    name = signal_name(value)
    return uncatchable(name) if name else f"{value!r} is not a signal name (try USR2, USR1 or TERM)"


def _env_names(value: Mapping[str, Any]) -> str | None:
    bad = [k for k in value if not is_env_name(k)]
    if bad:
        return f"{bad[0]!r} is not a valid environment variable name"
    nul = [k for k, v in value.items() if "\0" in str(v)]
    return f"{nul[0]}: the value contains a NUL byte, which no environment can carry" if nul else None


def _interpreter(value: Any) -> str | None:
    if any(c.isspace() for c in value):
        return (
            f"{value!r} is a command, not an interpreter path: to run the agent in a container "
            "(apptainer, podman, pyxis, Slurm's OCI), set the site's container: section (runtime, image)"
        )
    return None


def _time_value(value: Any) -> str | None:
    try:
        parse_time(value)
    except ValueError as e:
        return str(e)
    return None


# The schema: dotted key -> Key. Sections (mappings of keys) are the prefixes before a dot.
SCHEMA: dict[str, Key] = {
    "description": Key(str, None, "one line shown by `hpcelastic sites list`"),
    "cluster_names": Key(list, [], "Slurm ClusterName values that select this site automatically", item=str),
    "partition": Key(str, None, "default partition (--partition)", option="Slurm partition."),
    "account": Key(str, None, "default account (--account)", option="Slurm account."),
    "qos": Key(str, None, "default QOS (--qos)", option="Slurm QOS."),
    "constraint": Key(str, None, "default node constraint (--constraint)", option="Node feature constraint."),
    "exclude": Key(
        str,
        None,
        "nodes never to use, a Slurm hostlist (--exclude)",
        option="Nodes never to use (a hostlist).",
    ),
    "time": Key(
        str,
        None,
        "default time limit in Slurm format, e.g. 04:00:00 (--time)",
        check=_time_value,
        option="Time limit: MM, HH:MM:SS, D-HH:MM, ...",
    ),
    "gpus_per_node": Key(
        int,
        None,
        "default GPUs requested per node (--gpus-per-node)",
        check=_at_least(0),
        option="GPUs to request on each node.",
    ),
    "max_gpus_per_node": Key(
        int, None, "largest --gpus-per-node this site's nodes serve", check=_at_least(1)
    ),
    "gpu_request": Key(
        str,
        "gpus-per-node",
        "how GPUs are requested: 'gpus-per-node' (--gpus-per-node=N) or 'gres' (--gres=gpu:N)",
        nullable=False,
        choices=("gpus-per-node", "gres"),
    ),
    "max_restarts": Key(
        int,
        3,
        "job-wide worker restarts per attempt (--max-restarts)",
        check=_at_least(0),
        nullable=False,
        option="Job-wide worker restarts.",
    ),
    "spare_nodes": Key(
        int,
        0,
        "hot spare nodes allocated on top of --nodes; a spare takes a lost node's place (--spare-nodes)",
        check=_at_least(0),
        nullable=False,
        option="Hot spare nodes on top of --nodes.",
    ),
    "modules": Key(list, [], "environment modules loaded before the job step (`module load X`)", item=str),
    "setup": Key(
        list, [], "shell lines run before the job step (trusted: written by the site admin)", item=str
    ),
    "env": Key(dict, {}, "environment exported to the job step, e.g. NCCL_SOCKET_IFNAME", _env_names, str),
    "rdzv_interface": Key(str, None, "network interface whose address the agents rendezvous on"),
    "rdzv_port": Key(int, None, "fixed TCP port for the agents' coordinator", check=_between(1, 65535)),
    "warm_start": Key(
        bool,
        True,
        "fork Python workers from a per-node server that has imported torch; false: a new interpreter "
        "each (--no-warm-start)",
        nullable=False,
        option="Fork workers from a server that imported torch.",
    ),
    "stall_timeout": Key(
        float,
        None,
        "seconds without progress on any rank (stacks, I/O, heartbeats) before a hang restarts the job",
        check=_at_least(MIN_STALL_TIMEOUT_S),
        option="Seconds without progress before a hang is declared.",
    ),
    "replica_groups": Key(
        int,
        1,
        "torchft replica groups the nodes are split into; 1: off (--replica-groups)",
        check=_at_least(1),
        nullable=False,
        option="torchft replica groups; a failure restarts only its group.",
    ),
    "min_replica_groups": Key(
        int,
        1,
        "fewest replica groups the job goes on with before the job-wide restart (--min-replica-groups)",
        check=_at_least(1),
        nullable=False,
        option="Fewest replica groups to go on with.",
    ),
    "console": Key(
        str,
        "all",
        "what the job's output shows: 'all' ranks, 'rank0' (rank 0 of each replica group) or 'failures' "
        "(hpcelastic's lines and root causes only); every rank's output is always in its rank log",
        nullable=False,
        option="Worker output on the console: all, rank0 or failures.",
        choices=CONSOLE_MODES,
    ),
    "metrics.port": Key(
        int,
        None,
        "TCP port of the coordinator's OpenMetrics endpoint (null: a free one, published in "
        "<run>/metrics.json for Prometheus' file_sd_configs)",
        check=_between(1, 65535),
    ),
    "metrics.enabled": Key(
        bool, True, "serve the run's figures (OpenMetrics) from the coordinator", nullable=False
    ),
    "metrics.textfile_dir": Key(
        str,
        None,
        "node-exporter textfile collector directory: the coordinator writes hpcelastic_<run id>.prom",
    ),
    "sbatch_directives": Key(list, [], "extra #SBATCH options, e.g. '--mem=0' or '--exclusive'", item=str),
    "python": Key(
        str,
        None,
        "interpreter that runs the agent (and finalize) on the nodes (default: the one running submit); "
        "one path: a container goes in container:",
        check=_interpreter,
    ),
    "container.runtime": Key(
        str,
        None,
        "run the agent and its workers in a container: pyxis (enroot), apptainer (or singularity), podman, "
        "or oci (Slurm's own, srun --container with the site's oci.conf)",
        choices=RUNTIMES,
    ),
    "container.image": Key(
        str,
        None,
        "the image: pyxis an enroot image (docker://...), apptainer a .sif, podman a name, oci a bundle "
        "directory; it must have Python with hpcelastic",
    ),
    "container.mounts": Key(
        list,
        [],
        "more SRC[:DST[:OPTIONS]] mounts (the run, checkpoint, script and working directories always are)",
        item=str,
    ),
    "container.workdir": Key(str, None, "working directory inside the container (default: the job's)"),
    "container.python": Key(
        str, None, "the interpreter inside the image (default: python3)", check=_interpreter
    ),
    "container.args": Key(
        list,
        [],
        "extra words for the runtime, e.g. podman's ['--device', 'nvidia.com/gpu=all'] (apptainer exec, "
        "podman run; srun's for pyxis and oci)",
        item=str,
    ),
    "run_root": Key(str, "./hpcelastic-runs", "where run directories are created", nullable=False),
    "template": Key(
        str,
        "default.sbatch.j2",
        "batch script template (name in sbatch_templates/ or a path)",
        option="Batch script template name or file.",
    ),
    "backend": Key(
        str,
        "sbatch",
        "submission backend",
        nullable=False,
        option="[sbatch]",
        choices=("sbatch", "submitit"),
    ),
    "signal.name": Key(
        str, "USR2", "signal sent before the time limit (and on preemption)", check=_signal_name
    ),
    "signal.lead_time": Key(
        int, 180, "seconds before the time limit the signal is sent", check=_between(0, MAX_SIGNAL_LEAD_S)
    ),
    "requeue.mode": Key(
        str,
        "requeue",
        "after preemption/time limit: 'requeue' (same job id) or 'resubmit' (new job)",
        nullable=False,
        choices=("requeue", "resubmit"),
    ),
    "requeue.max_requeues": Key(
        int,
        5,
        "requeues after failures before giving up",
        check=_at_least(0),
        nullable=False,
        option="Requeues after failures.",
    ),
    "requeue.expedite": Key(
        bool,
        True,
        "submit with Slurm's expedited requeue (--requeue=expedite) where Slurm offers it (25.11 and later, "
        "SlurmctldParameters=enable_expedited_requeue): a job a node failure ends is requeued at once, at "
        "top priority, on its healthy nodes",
        nullable=False,
    ),
    "requeue.grace_period": Key(
        int,
        60,
        "seconds workers get to checkpoint after the signal",
        check=_between(0, MAX_GRACE_PERIOD_S),
    ),
    "checkpoint_tier.local_checkpoint_dir": Key(
        str,
        None,
        "node-local directory for checkpoints (/dev/shm or a local disk; {node}, {job}, {user} are "
        "replaced): set, workers save there, the agents replicate each checkpoint to peer nodes and "
        "persist it to the checkpoint directory in the background",
        option="Node-local checkpoint directory (turns the local tier on).",
    ),
    "checkpoint_tier.local_checkpoint_mb": Key(
        int,
        None,
        "the tier's size per node in MB (own checkpoints + peers' replicas + a restore); default: half "
        "the local filesystem",
        check=_at_least(1),
        option="Local checkpoint tier size per node, MB.",
    ),
    "checkpoint_tier.replicas": Key(
        int,
        1,
        "peer nodes that hold a copy of each node's part of a checkpoint",
        check=_at_least(0),
        nullable=False,
    ),
    "checkpoint_tier.persist_every": Key(
        int,
        1,
        "persist every M-th complete checkpoint to the checkpoint directory (the last one always, at a stop)",
        check=_at_least(1),
        nullable=False,
    ),
    "checkpoint_tier.keep": Key(
        int,
        1,
        "complete checkpoints each node keeps (an older one goes only once a newer one has its replicas)",
        check=_at_least(1),
        nullable=False,
    ),
    "checkpoint_tier.replication_mb_s": Key(
        int,
        1000,
        "the most MB a second each node sends to its peers and the shared directory (training traffic first)",
        check=_at_least(1),
        nullable=False,
    ),
    "checkpoint_tier.restore": Key(
        str,
        "all",
        "what a node restores: 'all' (every node's files of the checkpoint: DCP, a file rank 0 saved, a "
        "changed world size) or 'own' (its own files only: each rank loads what it saved)",
        nullable=False,
        choices=("all", "own"),
    ),
    "slow.action": Key(
        str,
        "swap",
        "what a node found slow gets: 'report' (an event), 'exclude' (also excluded at the next requeue) or "
        "'swap' (also replaced by a checked hot spare at the next checkpoint, when the time it saves exceeds "
        "the swap's measured cost); 'off': no slow-node detection",
        nullable=False,
        choices=("off", "report", "exclude", "swap"),
    ),
    "slow.min_slowdown": Key(
        float,
        0.2,
        "the least share of the job's pace a node must cost before it counts as slow (healthy GPUs differ "
        "by up to 14 %, a rank's steps by up to 15 %)",
        check=_share_between(0.05, 0.9),
        nullable=False,
    ),
    "slow.windows": Key(
        int,
        5,
        "consecutive detection windows a node must be named slow in (one of them may be missed) before "
        "anything is done about it; as many windows without it end its slowdown",
        check=_between(2, 100),
        nullable=False,
    ),
}


def default(key: str) -> Any:
    """The built-in default of schema key ``key``: the one place each default is declared."""
    return SCHEMA[key].default


def option_keys() -> dict[str, str]:
    """Submit option name -> the schema key it sets (``max_requeues`` -> ``requeue.max_requeues``)."""
    return {k.rsplit(".", 1)[-1]: k for k, key in SCHEMA.items() if key.option is not None}


COMMAND_LINE = "command line"
# Keys whose command-line flag is not simply --<last part of the key>.
FLAG_OF = {
    "signal.name": "--signal",
    "signal.lead_time": "--signal",
    "container.image": "--container-image",
    "container.runtime": "--container-runtime",
    "slow.action": "--slow-action",
    "slow.min_slowdown": "--slow-min-slowdown",
    "slow.windows": "--slow-windows",
}
FLAG_OF.update({k: "--" + k.rsplit(".", 1)[-1].replace("_", "-") for k in SCHEMA if k not in FLAG_OF})

SECTIONS = sorted({k.split(".", 1)[0] for k in SCHEMA if "." in k})


def defaults() -> dict[str, Any]:
    """The built-in defaults as a nested dict (the lowest layer)."""
    return unflatten({k: _copy(key.default) for k, key in SCHEMA.items()})


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, list):
        return list(value)
    return value


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"signal": {"name": "USR2"}}`` -> ``{"signal.name": "USR2"}`` (only known sections descend)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        path = f"{prefix}{k}"
        if not prefix and k in SECTIONS and isinstance(v, Mapping):
            out.update(flatten(v, f"{k}."))
        else:
            out[path] = v
    return out


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`flatten`."""
    out: dict[str, Any] = {}
    for path, v in flat.items():
        head, _, tail = path.partition(".")
        if tail:
            out.setdefault(head, {})[tail] = v
        else:
            out[head] = v
    return out


def validate(tree: Any, source: str) -> dict[str, Any]:
    """Check one layer (a parsed YAML document) against :data:`SCHEMA`; return it flattened.

    ``source`` names the file in error messages. Raises :class:`UserError` naming every problem.
    """
    flat, found = check(tree, source)
    if found:
        more = f" (and {len(found) - 1} more: {'; '.join(found[1:])})" if len(found) > 1 else ""
        raise UserError(f"{found[0]}{more}")
    return flat


def check(tree: Any, source: str) -> tuple[dict[str, Any], list[str]]:
    """One layer flattened, and every problem in it (``source: key: why``), in the file's order."""
    if tree is None:
        return {}, []
    if not isinstance(tree, Mapping):
        return {}, [f"{source}: the top level must be a mapping of keys, not {_type_name(tree)}"]
    found = [
        f"{source}: {section}: must be a mapping, not {_type_name(tree[section])}"
        for section in SECTIONS
        if section in tree and tree[section] is not None and not isinstance(tree[section], Mapping)
    ]
    flat = flatten({k: v for k, v in tree.items() if v is not None or k not in SECTIONS})
    for path, value in flat.items():
        if path in SECTIONS:
            continue  # reported above
        key = SCHEMA.get(path)
        if key is None:
            hint = difflib.get_close_matches(path, list(SCHEMA), n=1, cutoff=0.6)
            fix = f"did you mean {hint[0]!r}?" if hint else "see `hpcelastic sites show default` for the keys"
            found.append(f"{source}: {path}: unknown key; {fix}")
            continue
        problem = _check_value(key, value)
        if problem:
            where = FLAG_OF.get(path, path) if source == COMMAND_LINE else path
            found.append(f"{source}: {where}: {problem}")
    container = any(k.startswith("container.") and v is not None for k, v in flat.items())
    if not found and source != COMMAND_LINE and container:
        # A file's container: section stands alone (the command line may add only --container-image).
        try:
            from_config(flat, source)
        except UserError as e:
            found.append(str(e))
    return flat, found


def _type_name(value: Any) -> str:
    names = {dict: "a mapping", list: "a list", str: "a string", int: "an integer", float: "a number"}
    return {**names, bool: "true/false"}.get(type(value), type(value).__name__)


def _check_value(key: Key, value: Any) -> str | None:
    if value is None:
        return None if key.nullable else "must not be empty"
    # bool is an int subclass in Python; YAML's `yes` must not pass as a number. A whole number is a float.
    accepted = (int, float) if key.type is float else key.type
    if (isinstance(value, bool) and key.type is not bool) or not isinstance(value, accepted):
        hint = " (quote it: YAML reads an unquoted 4:00:00 as a number)" if key.type is str else ""
        return f"must be {_type_name(key.type())}, not {_type_name(value)} ({value!r}){hint}"
    if key.item is not None:
        items = value.values() if isinstance(value, Mapping) else value
        for item in items:
            if isinstance(item, bool) or not isinstance(item, key.item):
                if isinstance(value, Mapping) and isinstance(item, int | float):
                    continue  # numbers in env are fine: they are exported as text
                return f"every entry must be {_type_name(key.item())}, not {_type_name(item)} ({item!r})"
    if key.choices is not None:
        problem = _choice(*key.choices)(value)
        if problem:
            return problem
    return key.check(value) if key.check else None


def load_yaml(path: Path) -> Any:
    """Parse one YAML file; malformed YAML becomes a one-line :class:`UserError`."""
    import yaml  # only on the submit/sites path: keeps `hpcelastic --help` lean

    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise UserError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start}); save it as UTF-8 YAML") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"{path}: invalid YAML: {where}{problem}") from None


def sites_dir() -> Path:
    """The directory of the site configs shipped with hpcelastic (examples; the last place searched)."""
    return data_dir("site_configs")


@dataclass(frozen=True)
class SiteDir:
    """A directory ``--site NAME`` is looked for in, and what it is."""

    path: Path
    origin: str  # "$HPCELASTIC_SITE_DIR", "user", "system" or "packaged"


def site_dirs() -> list[SiteDir]:
    """Where ``--site NAME`` is looked for, the first match winning: each directory of
    ``$HPCELASTIC_SITE_DIR`` (``:``-separated), the user's (``$XDG_CONFIG_HOME/hpcelastic/sites``), the
    system's (``/etc/hpcelastic/sites``), then the examples shipped with hpcelastic."""
    dirs = [
        SiteDir(Path(d).expanduser(), f"${SITE_DIR_ENV}")
        for d in os.environ.get(SITE_DIR_ENV, "").split(":")
        if d
    ]
    dirs.append(SiteDir(user_config_path().parent / "sites", "user"))
    dirs.append(SiteDir(SYSTEM_SITES_DIR, "system"))
    dirs.append(SiteDir(sites_dir(), "packaged"))
    return dirs


def site_files() -> dict[str, tuple[Path, str]]:
    """Every site name found, with its file and origin (the first directory of :func:`site_dirs` that has
    it), sorted by name."""
    found: dict[str, tuple[Path, str]] = {}
    for d in site_dirs():
        if d.path.is_dir():
            for f in sorted(d.path.glob(f"*{SITE_SUFFIX}")):
                found.setdefault(f.name.removesuffix(SITE_SUFFIX), (f, d.origin))
    return dict(sorted(found.items()))


def site_names() -> list[str]:
    """Names of the sites found (:func:`site_dirs`), sorted."""
    return list(site_files())


def is_site_file(name: str) -> bool:
    """``name`` is a path to a site file, not a name."""
    return name.endswith((".yaml", ".yml")) or os.sep in name


def site_path(name: str) -> Path:
    """The file of site ``name`` (a name found in :func:`site_dirs`, or a path to a YAML file)."""
    if is_site_file(name):
        path = Path(name).expanduser()
        if not path.is_file():
            raise UserError(f"site file {path} does not exist")
        return path
    files = site_files()
    if name not in files:
        hint = difflib.get_close_matches(name, list(files), n=1)
        fix = f"did you mean {hint[0]!r}?" if hint else f"known sites: {', '.join(files)}"
        searched = ", ".join(str(d.path) for d in site_dirs())
        raise UserError(
            f"unknown site {name!r}; {fix} (looked in {searched}; a path to a YAML file works too)"
        )
    return files[name][0]


def detect_site(cluster: str | None) -> str:
    """The site for Slurm cluster ``cluster``: the file named after it, one listing it, else ``default``."""
    if not cluster:
        return "default"
    files = site_files()
    if cluster in files:
        return cluster
    for name, (path, _origin) in files.items():
        tree = load_yaml(path) or {}
        if isinstance(tree, Mapping) and cluster in (tree.get("cluster_names") or []):
            return name
    return "default"


def user_config_path() -> Path:
    """``$XDG_CONFIG_HOME/hpcelastic/config.yaml`` (``~/.config`` when unset)."""
    base = os.environ.get(USER_CONFIG_ENV) or str(Path.home() / ".config")
    return Path(base) / "hpcelastic" / "config.yaml"


@dataclass(frozen=True)
class Resolved:
    """The merged configuration and where each layer came from."""

    site: str
    values: dict[str, Any]  # flat: dotted key -> value
    sources: list[str] = field(default_factory=list)

    def get(self, key: str) -> Any:
        """The value of one schema key."""
        if key not in SCHEMA:
            raise KeyError(key)
        return self.values.get(key)

    def as_tree(self) -> dict[str, Any]:
        """Nested dict, as written to ``<run>/config.yaml``."""
        return unflatten(self.values)


def merge(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Merge flat layers, later wins; the ``env`` mapping merges key by key."""
    out: dict[str, Any] = {}
    for layer in layers:
        for k, v in layer.items():
            if v is None:
                continue
            if k == "env" and isinstance(v, Mapping):
                out[k] = {**out.get(k, {}), **{ek: str(ev) for ek, ev in v.items()}}
            else:
                out[k] = _copy(v)
    return out


def _site_layers(site: str) -> tuple[str, list[dict[str, Any]], list[str]]:
    path = site_path(site)
    name = str(path) if is_site_file(site) else site
    return name, [flatten(defaults()), validate(load_yaml(path), str(path))], ["built-in defaults", str(path)]


def site_config(site: str) -> Resolved:
    """One site on top of the built-in defaults (what ``hpcelastic sites show`` prints)."""
    name, layers, sources = _site_layers(site)
    return Resolved(site=name, values=merge(*layers), sources=sources)


def resolve(site: str | None = None, overrides: Mapping[str, Any] | None = None) -> Resolved:
    """Build the configuration for a submission.

    ``site``: a site name or file; None means ``$HPCELASTIC_SITE`` or auto-detection from slurm.conf.
    ``overrides``: flat dotted keys from the command line (highest layer; None values are ignored).
    """
    if not site:
        site = os.environ.get("HPCELASTIC_SITE") or None
    if not site:
        from hpcelastic.jobs.slurm import cluster_name

        site = detect_site(cluster_name())
    name, layers, sources = _site_layers(site)
    user = user_config_path()
    if user.is_file():
        layers.append(validate(load_yaml(user), str(user)))
        sources.append(str(user))
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    if given:
        layers.append(validate(unflatten(given), COMMAND_LINE))
        sources.append(COMMAND_LINE)
    return Resolved(site=name, values=merge(*layers), sources=sources)
