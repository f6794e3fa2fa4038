"""``hpcelastic sites list | show NAME [--json] | validate FILE | check [SITE] [--probe] [--json]``."""

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


@sites.command("check")
@click.argument("site", required=False)
@click.option("--probe", is_flag=True, help="Also run a short job step on two nodes (see below).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def check(site: str | None, probe: bool, as_json: bool) -> None:
    """Check SITE (a name or a YAML file; default: the one submit would use here) against the live cluster.

    \b
    Asks Slurm (scontrol show config/partition/node, sbatch --version, and sacctmgr
    where an accounting database answers) about every key the site sets and every
    assumption hpcelastic makes: partition, account, QOS, constraint, time limit,
    GPUs and how they are requested, the signal's lead and the grace period against
    preemption's GraceTime and mode, Slurm's timeouts and release.
    With --probe, one job step on two nodes of the partition checks what only the
    nodes can tell: the run root is shared, the rendezvous interface exists and the
    nodes reach each other on it, the fixed port is free, the Python the nodes run
    imports hpcelastic and torch, the checkpoint tier's directory and size, the
    container runtime, NVML where GPUs are expected.

    \b
    Each finding is one line with the key to change.
    Exit codes: 0 nothing to change, 1 findings, 2 bad input or Slurm did not answer.
    """
    from hpcelastic import sites as s
    from hpcelastic.errors import SlurmError, UserError
    from hpcelastic.sitecheck import facts as site_facts
    from hpcelastic.sitecheck import probe as site_probe
    from hpcelastic.sitecheck.rules import check as run_rules

    resolved = s.resolve(site)
    try:
        facts = site_facts.gather()
    except SlurmError as e:
        raise UserError(f"cannot check site {resolved.site}: Slurm did not answer ({e})") from None
    report = run_rules(resolved.values, facts)
    partition = report.partition
    if probe and partition is not None:
        nodes = min(2, len(facts.nodes_of(partition))) or 1
        if not as_json:
            click.echo(f"probing {nodes} node(s) of partition {partition} (up to a few minutes)...", err=True)
        reports, error = site_probe.run(resolved.values, partition, nodes)
        site_probe.judge(reports, nodes, resolved.values, error, report)
    elif probe:
        report.notes.append("no probe: no partition to run it in")
    release = f"{facts.release[0]}.{facts.release[1]:02d}" if facts.release else "unknown"
    if as_json:
        findings = [{"key": f.key, "severity": str(f.severity), "text": f.text} for f in report.findings]
        out = {
            "site": resolved.site,
            "sources": resolved.sources,
            "slurm": release,
            "partition": partition,
            "probe": probe,
            "findings": findings,
            "notes": report.notes,
        }
        click.echo(json.dumps(out))
    else:
        click.echo(f"site {resolved.site} ({' < '.join(resolved.sources)}) against Slurm {release}")
        for f in report.findings:
            click.echo(f.line())
        for note in report.notes:
            click.echo(f"note: {note}")
        if report.findings:
            click.echo(f"{len(report.findings)} finding(s): change the keys named above and run this again")
        else:
            click.echo("nothing to change" + ("" if probe else "; --probe also checks the nodes"))
    sys.exit(1 if report.findings else 0)
