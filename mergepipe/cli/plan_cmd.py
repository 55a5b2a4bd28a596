"""`mergepipe plan`: a merge planned under a budget, without reading any expert byte (and without torch)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from mergepipe.app.planning import plan
from mergepipe.cli.common import DB_OPTION, ConsoleReporter, echo, plan_summary, print_summary
from mergepipe.cli.common import CUDA_TYPO_OPTION, analyze_missing_option, merge_options, request_from


@click.command("plan")
@DB_OPTION
@merge_options
@analyze_missing_option
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    help="Device the merge will run on (cpu or cuda): its predicted seconds, and a time budget, use what "
    "merges on that device took.",
)
@CUDA_TYPO_OPTION
@click.option("--save", is_flag=True, help="Store the plan in the catalog and print its id.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole plan as JSON.")
def plan_cmd(db_path: Path, save: bool, as_json: bool, **kwargs: Any) -> None:
    """Plan a merge under a budget without reading any expert byte.

    Experts not analysed against the base yet are analysed first, as `merge`
    does (that reads each of them once); --no-analyze-missing refuses instead.
    """
    made = plan(
        request_from(kwargs),
        db_path,
        save=save,
        analyze_missing=kwargs["analyze_missing"],
        strict=kwargs["strict"],
        device=kwargs["device"],
        progress=not kwargs["no_progress"],
        reporter=ConsoleReporter(),
    )
    if as_json:
        click.echo(json.dumps(made.to_json(), indent=2, sort_keys=True))
        return
    print_summary(plan_summary(made), made.notes)
    if save:
        echo(f"plan id: {made.digest}")


COMMANDS = [plan_cmd]
