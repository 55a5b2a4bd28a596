"""The `mergepipe` command line: thin click adapters around the application calls (``mergepipe.app``).

``main`` prints a ``MergePipeError`` as one line and exits non-zero; a command's module is imported only
when it runs (``COMMANDS``), so ``--help`` and the views never load torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from importlib import import_module

import click

from mergepipe import __version__
from mergepipe.cli.common import run_command_line

#: Every command and the line `mergepipe --help` shows for it (a test checks it is the command's own first help
#: line), in that order; ``COMMANDS`` adds the module under ``mergepipe.cli`` that defines it.
_HELP = {
    "init-db": "Create a catalog, or check an existing one (idempotent).",
    "register": "Record a checkpoint's files, tensors and blocks (reads headers and side files only).",
    "analyze": "Hash blocks and compute expert-vs-base delta statistics, once.",
    "export-delta": "Write an expert as a delta checkpoint (Δ = expert − base), for `register --kind delta`.",
    "models": "List registered models with size, counts and analysis state.",
    "show": "Show one model: files, tensors, parents and analyses.",
    "plan": "Plan a merge under a budget without reading any expert byte.",
    "merge": "Plan, execute and publish a merge in one step.",
    "execute": "Execute a stored plan and publish the snapshot.",
    "integrate": "Run one iteration of the pipeline RECIPE describes (a YAML file: base, experts, merge, output).",
    "verify": "Recompute every file hash and the manifest hash of a snapshot (id or directory).",
    "explain": "Where the budget went: per tensor and per expert.",
    "snapshots": "List publish attempts: committed snapshots, pending and aborted intents.",
    "lineage": "The tree of a model's parents (base and experts, with their versions), "
    "recursively; for a merged model also its earlier versions.",
    "diff": "What differs from snapshot A to snapshot B: inputs, and the tensors that changed most.",
    "gc": "Remove aborted staging directories and killed delta-store builds' staging files "
    "(never a committed snapshot, a saved plan or a user file).",
    "recover": "Finish or roll back interrupted publishes (idempotent).",
    "eval": "Mean token loss and perplexity of a model on held-out data (--data), or its lm-eval "
    "task scores (--tasks), kept in the catalog.",
    "bisect": "Find the changes, then the tensors, that make merge BAD worse than merge GOOD.",
    "search": "Search merge parameters (operator, weights, density, lambda) for the best held-out score.",
    "push": "Push a published snapshot to a Hugging Face Hub repository as one commit.",
    "rm": "Delete a snapshot's directory; the catalog keeps the snapshot, so executing its plan re-materialises it.",
    "catalog": "Operations on a whole catalog: export copies it to another file or PostgreSQL database.",
}
_MODULES = {
    "catalog_cmds": "init-db register analyze export-delta gc recover rm catalog",
    "view_cmds": "models show verify explain snapshots lineage diff",
    "merge_cmds": "plan merge execute integrate push",
    "eval_cmds": "eval bisect search",
}
COMMANDS: dict[str, tuple[str, str]] = {
    name: (next(module for module, names in _MODULES.items() if name in names.split()), text)
    for name, text in _HELP.items()
}


class _LazyCommands(Mapping[str, click.Command]):
    """The group's commands, each imported on first access (listing names imports nothing)."""

    def __init__(self) -> None:
        self._loaded: dict[str, click.Command] = {}

    def __getitem__(self, name: str) -> click.Command:
        if name not in self._loaded:
            module = import_module(f"mergepipe.cli.{COMMANDS[name][0]}")  # KeyError for an unknown name
            self._loaded[name] = next(c for c in module.COMMANDS if c.name == name)
        return self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(COMMANDS)

    def __len__(self) -> int:
        return len(COMMANDS)


#: Options written ``--experts A B C`` as in the seed's scripts: rewritten to ``--experts A --experts B
#: --experts C`` (click options take one value each) before parsing.
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

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command list from ``COMMANDS``: no command module is imported to print it."""
        with formatter.section("Commands"):
            formatter.write_dl([(name, text) for name, (_, text) in COMMANDS.items()])

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
    A mergekit config, as mergekit-yaml runs it (its own command, see
    `mergepipe-yaml --help`):
      mergepipe-yaml config.yml ./out [--budget 25%]
    The loop: init-db -> register -> analyze -> plan -> merge/execute ->
    verify / explain / lineage. Short form of a merge:
      mergepipe --db DB --base ID --experts A B --out DIR --model-id ID [--budget 25%]
    """


cli.commands = _LazyCommands()  # type: ignore[assignment]  # click only reads it through Mapping methods


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the CLI, turning MergePipeError into one line."""
    run_command_line(cli, argv)
