"""The `mergepipe` command line: thin click adapters around library calls.

Every expected failure is a ``MergePipeError``; ``main`` prints its one-line
message and exits non-zero without a traceback. Commands live in small
modules by theme (which never import this package module) and are attached
to the one group here.
"""

from __future__ import annotations

import sys

import click

from mergepipe import __version__
from mergepipe.cli import bench_cmd, catalog_cmds, demo_cmd, integrate_cmd, merge_cmds, snapshot_cmds
from mergepipe.errors import MergePipeError

#: Options that take several values, written ``--experts A B C`` as in the
#: seed's scripts; click options take one value each, so the group rewrites
#: them to ``--experts A --experts B --experts C`` before parsing.
_MULTI_VALUE_OPTIONS = ("--experts", "--weights")


def _expand_multi_values(args: list[str]) -> list[str]:
    out: list[str] = []
    current: str | None = None
    for arg in args:
        if arg in _MULTI_VALUE_OPTIONS:
            current = arg
            continue
        if current is not None and not (arg.startswith("--") or (arg.startswith("-") and not _is_number(arg))):
            out += [current, arg]
            continue
        current = None
        out.append(arg)
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class MergePipeGroup(click.Group):
    """The `mergepipe` group; also accepts the seed's short form
    ``mergepipe --db DB --base B --experts A C --out DIR --model-id M``,
    which is `merge` with its defaults."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        args = list(args)
        if args and args[0].startswith("--") and args[0] not in ("--help", "-h", "--version"):
            args = ["merge", *args]
        return super().parse_args(ctx, _expand_multi_values(args))


@click.group(cls=MergePipeGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mergepipe")
def cli() -> None:
    """MergePipe: budget-aware parameter management for LLM merging.

    \b
    The loop: init-db -> register -> analyze -> plan -> merge/execute ->
    verify / explain / lineage. Short form of a merge:
      mergepipe --db DB --base ID --experts A B --out DIR --model-id ID [--budget 25%]
    """


for _module in (catalog_cmds, merge_cmds, integrate_cmd, snapshot_cmds, demo_cmd, bench_cmd):
    for _command in _module.COMMANDS:
        cli.add_command(_command)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the CLI, turning MergePipeError into one line."""
    try:
        cli.main(args=argv, prog_name="mergepipe", standalone_mode=False)
    except MergePipeError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
