"""The ``hpcelastic`` command line (click).

Sub-commands live in their own modules and are imported only when they run, so
``hpcelastic --help`` loads neither torch nor the agent. This package parses and
delegates; logic worth testing lives elsewhere.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from hpcelastic import __version__
from hpcelastic.errors import EXIT_INTERNAL, HpcElasticError

# name -> (module, attribute, one-line help shown by `hpcelastic --help`)
_COMMANDS: dict[str, tuple[str, str, str]] = {
    "submit": ("hpcelastic.cli.submit_cmd", "submit", "Render a batch script and submit it to Slurm."),
    "sites": ("hpcelastic.cli.sites_cmd", "sites", "List, show and validate site configurations."),
    "run": ("hpcelastic.cli.agent_cmd", "run", "Run N node agents on this machine, without Slurm."),
    "agent": ("hpcelastic.cli.agent_cmd", "agent", "Node agent: run inside an allocation, once per node."),
    "status": ("hpcelastic.cli.status_cmd", "status", "Show what happened to a run, as a timeline."),
    "report": ("hpcelastic.cli.report_cmd", "report", "Write an HTML page of where a run's time went."),
    "logs": ("hpcelastic.cli.status_cmd", "logs", "Show a run's worker logs."),
    "cancel": ("hpcelastic.cli.status_cmd", "cancel", "Cancel a run's current Slurm job."),
    "finalize": (
        "hpcelastic.cli.status_cmd",
        "finalize",
        "(internal) end-of-step decision in the batch script.",
    ),
}
_HIDDEN = {"finalize"}


class LazyGroup(click.Group):
    """A click group that imports each sub-command's module on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [n for n in _COMMANDS if n not in _HIDDEN]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        spec = _COMMANDS.get(cmd_name)
        if spec is None:
            return None
        module = importlib.import_module(spec[0])
        return getattr(module, spec[1])

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(n, _COMMANDS[n][2]) for n in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hpcelastic")
def cli() -> None:
    """Elastic, fault-tolerant PyTorch training on Slurm.

    \b
    Typical use:
      hpcelastic submit --nodes 4 --gpus-per-node 8 --time 04:00:00 train.py --lr 3e-4
      hpcelastic status RUN_DIR
      hpcelastic run --nodes 2 --nproc-per-node 2 train.py      # one machine, no Slurm
    """


def one_line(text: str) -> str:
    """``text`` on one terminal line: line breaks and other control characters escaped as ``\\n``, ...

    Messages quote what the user typed (paths, names), which may hold a newline; the error must
    still be exactly one line. Printable non-ASCII text is kept as it is.
    """
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def main(argv: list[str] | None = None) -> Any:
    """Console-script entry point: one-line errors for the user's mistakes, exit code 2."""
    try:
        return cli.main(args=argv, prog_name="hpcelastic", standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.Abort:
        click.echo("hpcelastic: aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        click.echo(f"hpcelastic: error: {one_line(e.format_message())}", err=True)
        sys.exit(e.exit_code)
    except HpcElasticError as e:
        click.echo(f"hpcelastic: error: {one_line(str(e))}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception:  # a bug in hpcelastic: keep the traceback, it is ours to fix
        import traceback

        traceback.print_exc()
        sys.exit(EXIT_INTERNAL)
