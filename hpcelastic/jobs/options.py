"""The options of one submission, declared once: `hpcelastic submit`'s flags, `hpcelastic.submit`'s keywords.

Options that set a site key are derived from :data:`hpcelastic.sites.SCHEMA` (keys with an
``option`` text; type, choices and default from the key); the others (node count, paths, ...) are
declared here. The CLI generates its click options from :data:`SUBMIT_OPTIONS`; the Python API
accepts the same names as keywords and :func:`split` sorts a call's values into config overrides
and :func:`~hpcelastic.jobs.spec.build_spec` arguments.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hpcelastic import sites
from hpcelastic.parse import parse_env, parse_signal_lead

ENV_PREFIX = "HPCELASTIC_"
DEFAULT_NODES = "1"
SIGNAL = "signal"  # --signal SIG@SECONDS sets two keys: signal.name and signal.lead_time


@dataclass(frozen=True)
class SubmitOption:
    """One submission option: its keyword, flag, value type and ``--help`` text."""

    name: str  # the Python keyword and click parameter name
    help: str
    type: type = str
    key: str | None = None  # the schema key it sets, if any
    choices: tuple[str, ...] | None = None
    default: Any = None
    multiple: bool = False
    is_flag: bool = False
    short: str | None = None
    cli_only: bool = False  # not a keyword of the Python API (how the CLI reports, not what it submits)
    negatable: bool = False  # a boolean with an off switch: --warm-start/--no-warm-start (unset: the site's)
    shown_default: Any = None  # the default --help shows when the site layers decide it (not set on click)

    @property
    def flag(self) -> str:
        """``--gpus-per-node`` for ``gpus_per_node``; list options are singular (``--sbatch-arg``)."""
        name = self.name.removesuffix("s") if self.multiple and self.name.endswith("_args") else self.name
        return "--" + name.replace("_", "-")

    @property
    def envvar(self) -> str:
        """``HPCELASTIC_<FLAG>``, e.g. ``HPCELASTIC_GPUS_PER_NODE``."""
        return ENV_PREFIX + self.flag[2:].upper().replace("-", "_")


def _from_schema(name: str) -> SubmitOption:
    key = sites.option_keys()[name]
    spec = sites.SCHEMA[key]
    return SubmitOption(
        name,
        spec.option or "",
        spec.type,
        key=key,
        choices=spec.choices,
        negatable=spec.type is bool,
        shown_default=spec.default,
    )


def _signal_help() -> str:
    return (
        f"SIG@SECONDS before the limit [{sites.default('signal.name')}@{sites.default('signal.lead_time')}]."
    )


# In the order `hpcelastic submit --help` lists them.
SUBMIT_OPTIONS: tuple[SubmitOption, ...] = (
    SubmitOption("nodes", "N, or N_MIN:N_MAX (elastic).", default=DEFAULT_NODES),
    _from_schema("spare_nodes"),
    _from_schema("gpus_per_node"),
    SubmitOption(
        "nproc_per_node", "Workers per node: N or auto.", shown_default="--gpus-per-node, else auto"
    ),
    _from_schema("time"),
    _from_schema("partition"),
    _from_schema("account"),
    _from_schema("qos"),
    _from_schema("constraint"),
    _from_schema("exclude"),
    SubmitOption("job_name", "Job name [default: the script's name]."),
    SubmitOption("site", "Site config name or YAML file [default: detected]."),
    _from_schema("max_restarts"),
    _from_schema("max_requeues"),
    _from_schema("stall_timeout"),
    _from_schema("replica_groups"),
    _from_schema("min_replica_groups"),
    _from_schema("warm_start"),
    _from_schema("console"),
    SubmitOption("checkpoint_dir", "[default: RUN_DIR/checkpoints]"),
    _from_schema("local_checkpoint_dir"),
    _from_schema("local_checkpoint_mb"),
    *(
        SubmitOption(
            f"slow_{name}",
            sites.SCHEMA[f"slow.{name}"].doc + ".",
            sites.SCHEMA[f"slow.{name}"].type,
            key=f"slow.{name}",
            choices=sites.SCHEMA[f"slow.{name}"].choices,
            shown_default=sites.default(f"slow.{name}"),
        )
        for name in ("action", "min_slowdown", "windows")
    ),
    SubmitOption("run_dir", "[default: ./hpcelastic-runs/NAME-DATE-TIME]"),
    SubmitOption(SIGNAL, _signal_help()),
    SubmitOption("env", "KEY=VALUE for the job (repeatable).", multiple=True),
    SubmitOption("sbatch_args", "Passed to sbatch.", multiple=True),
    SubmitOption(
        "container_image",
        "Run in this image (the site's container runtime).",
        key="container.image",
    ),
    SubmitOption(
        "container_runtime",
        "Container runtime [site's, else none].",
        key="container.runtime",
        choices=sites.SCHEMA["container.runtime"].choices,
    ),
    _from_schema("template"),
    _from_schema("backend"),
    SubmitOption("dry_run", "Print the script; submit nothing.", is_flag=True, cli_only=True),
    SubmitOption("json", "Print one JSON object.", is_flag=True, cli_only=True),
    SubmitOption("module", "SCRIPT is a module (python -m).", is_flag=True, short="-m"),
)
BY_NAME: dict[str, SubmitOption] = {o.name: o for o in SUBMIT_OPTIONS}
API_NAMES: tuple[str, ...] = tuple(o.name for o in SUBMIT_OPTIONS if not o.cli_only)


def split(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Sort one call's option values into (config overrides by schema key, the other options).

    Unknown names raise TypeError (with the closest name), as a misspelt keyword would.
    """
    overrides: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for name, value in values.items():
        option = BY_NAME.get(name)
        if option is None or option.cli_only:
            hint = difflib.get_close_matches(name, API_NAMES, n=1)
            fix = f"; did you mean {hint[0]!r}?" if hint else ""
            raise TypeError(f"unknown submit option {name!r}{fix}")
        if name == SIGNAL:
            sig, lead = parse_signal_lead(value) if value else (None, None)
            overrides.update({"signal.name": sig, "signal.lead_time": lead})
        elif option.key is not None:
            overrides[option.key] = value
        elif name == "env":
            rest[name] = dict(value) if isinstance(value, Mapping) else parse_env(list(value or ()))
        else:
            rest[name] = value
    return overrides, rest
