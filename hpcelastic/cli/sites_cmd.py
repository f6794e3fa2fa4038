"""``hpcelastic sites list | show NAME [--json] | validate FILE``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from hpcelastic.errors import EXIT_USAGE


@click.group(short_help="List, show and validate site configurations.")
def sites() -> None:
    """List, show and validate site configurations.

    \b
    --site NAME is looked for, the first match winning, in:
      each directory of $HPCELASTIC_SITE_DIR (colon-separated)
      $XDG_CONFIG_HOME/hpcelastic/sites (~/.config/hpcelastic/sites)
      /etc/hpcelastic/sites
      the examples shipped with hpcelastic (site_configs/)
    A path to a YAML file works wherever a name does."""


@sites.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def list_sites(as_json: bool) -> None:
    """List the sites found, where each comes from, and which one this host would use."""
    from hpcelastic import sites as s
    from hpcelastic.jobs.slurm import cluster_name

    cluster = cluster_name()
    detected = s.detect_site(cluster)
    rows = []
    for name, (path, origin) in s.site_files().items():
        cfg = s.site_config(name)
        rows.append(
            {
                "name": name,
                "description": cfg.get("description") or "",
                "detected": name == detected,
                "from": origin,
                "path": str(path),
            }
        )
    if as_json:
        click.echo(json.dumps({"cluster_name": cluster, "detected": detected, "sites": rows}))
        return
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        mark = "*" if r["detected"] else " "
        origin = "" if r["from"] == "packaged" else f"  [{r['from']}: {r['path']}]"
        click.echo(f"{mark} {r['name']:<{width}}  {r['description']}{origin}")
    click.echo(f"(* = used on this host; Slurm ClusterName: {cluster or 'not found'}; override with --site)")
    click.echo("(where sites are looked for: hpcelastic sites --help)")


@sites.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print the merged configuration as JSON.")
def show(name: str, as_json: bool) -> None:
    """Show site NAME (a name found by `sites list`, or a YAML file) merged over the built-in defaults."""
    from hpcelastic import sites as s

    cfg = s.site_config(name)
    if as_json:
        click.echo(
            json.dumps({"site": cfg.site, "sources": cfg.sources, "config": cfg.as_tree()}, sort_keys=True)
        )
        return
    click.echo(f"# site {cfg.site} (layers: {' < '.join(cfg.sources)})")
    for key, spec in s.SCHEMA.items():
        value = cfg.values.get(key)
        click.echo(f"{key}: {json.dumps(value)}")
        click.echo(f"    {spec.doc}")


@sites.command("validate")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
def validate(file: Path) -> None:
    """Check a site (or user config) YAML FILE: unknown keys, wrong types, impossible values."""
    from hpcelastic import sites as s

    if not file.is_file():
        from hpcelastic.errors import UserError

        raise UserError(f"{file} does not exist")
    flat, found = s.check(s.load_yaml(file), str(file))
    if found:
        for line in found:
            click.echo(f"hpcelastic: error: {line}", err=True)
        if len(found) > 1:
            click.echo(f"{file}: {len(found)} problems; fix them and run again", err=True)
        sys.exit(EXIT_USAGE)
    click.echo(f"{file}: OK ({len(flat)} key{'s' if len(flat) != 1 else ''} set)")
