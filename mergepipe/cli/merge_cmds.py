"""`mergepipe merge` (plan, execute and publish in one step) and `mergepipe execute` (a stored plan).

``--base``/``--experts`` take registered ids or checkpoint directories (a
directory not registered yet is registered on the fly: ``app/registering.py``);
``--config`` takes MergePipe's parameter file or a whole mergekit config. A
catalog that does not exist yet is created (without ``--db``, the default
catalog), and the model id defaults to the ``--out`` folder's name, so
``mergepipe merge --config merge.yml --out ./merged`` works on a fresh
machine, as does the one-line form ``mergepipe --base B --experts A C --out
DIR``. ``--no-progress`` hides the progress bars, ``--quiet`` the tables too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from mergepipe.app.merging import Execution, Merged, execute, merge
from mergepipe.cli.common import (
    DB_OPTION,
    NO_PROGRESS_OPTION,
    QUIET_OPTION,
    ConsoleReporter,
    echo,
    predicted_text,
    print_summary,
    summary_table,
)
from mergepipe.cli.options import (
    analyze_missing_option,
    execution_options,
    merge_options,
    output_options,
    request_from,
)
from mergepipe.cli.push_cmd import hub_target, print_pushed, push_options
from mergepipe.planner.explain import copies_in_write, time_rows
from mergepipe.sizes import format_bytes

def _execution(kwargs: dict[str, Any]) -> Execution:
    return Execution(device=kwargs["device"], max_memory=kwargs["max_memory"], executor=kwargs["executor"],
                     workers=kwargs["workers"], ray_address=kwargs["ray_address"],
                     progress=not (kwargs["no_progress"] or kwargs["quiet"]))


@click.command("merge")
@DB_OPTION
@merge_options
@analyze_missing_option
@output_options
@execution_options
@push_options
@QUIET_OPTION
def merge_cmd(db_path: Path, out: Path, json_summary: Path | None, force: bool, **kwargs: Any) -> None:
    """Plan, execute and publish a merge in one step."""
    hub = hub_target(kwargs)
    merged = merge(request_from(kwargs), db_path, out, execution=_execution(kwargs),
                   analyze_missing=kwargs["analyze_missing"], strict=kwargs["strict"], json_summary=json_summary,
                   force=force, push_to_hub=hub, reporter=ConsoleReporter(quiet=kwargs["quiet"]))
    print_merged(merged, kwargs["quiet"])


@click.command("execute")
@DB_OPTION
@click.option("--plan", "plan_id", required=True, help="Plan id (or a unique prefix) from `mergepipe plan --save`.")
@output_options
@execution_options
@push_options
@NO_PROGRESS_OPTION
@QUIET_OPTION
def execute_cmd(db_path: Path, plan_id: str, out: Path, model_id: str | None, json_summary: Path | None, force: bool,
                **kwargs: Any) -> None:
    """Execute a stored plan and publish the snapshot.

    A plan executed before gives the same snapshot: it is re-materialised at --out (after its
    directory was deleted, or as a copy), checked byte for byte against the recorded manifest hash,
    and recorded as another location of that snapshot (`mergepipe snapshots`); --model-id may be
    omitted then, and naming another model is refused (a snapshot belongs to one model).
    """
    hub = hub_target(kwargs)
    merged = execute(plan_id, db_path, out, model_id=model_id, execution=_execution(kwargs),
                     json_summary=json_summary, force=force, push_to_hub=hub,
                     reporter=ConsoleReporter(quiet=kwargs["quiet"]))
    print_merged(merged, kwargs["quiet"])


def print_merged(merged: Merged, quiet: bool = False) -> None:
    """What was published, in one line; unless ``quiet``, what it cost against what was planned and predicted."""
    plan, manifest = merged.plan, merged.manifest
    if merged.unchanged:
        echo(f"{merged.out} already holds snapshot {merged.snapshot_id} (model '{merged.model_id}'), which this "
             f"merge makes: nothing to do (`mergepipe verify {merged.out}` checks every byte)")
        if merged.pushed is not None:
            print_pushed(merged.pushed)
        return
    if merged.rematerialised:
        echo(f"re-materialised snapshot {merged.snapshot_id} of model '{manifest.model_id}' at {merged.out}: "
             f"plan {plan.digest[:12]} was executed before, so this is the same snapshot (byte-identical) at "
             "another location, not a new version")
    else:
        echo(f"snapshot {merged.snapshot_id} published at {merged.out}")
    realized = manifest.cost.realized
    table = summary_table()
    table.add_row("model id", manifest.model_id)
    table.add_row("manifest hash", manifest.manifest_hash)
    table.add_row("expert bytes planned / read",
                  f"{format_bytes(plan.cost.expert_bytes)} / {format_bytes(realized.expert_bytes)}")
    table.add_row("base bytes / output bytes",
                  f"{format_bytes(realized.base_bytes)} / {format_bytes(realized.output_bytes)}")
    for label, text in time_rows(realized.seconds, kernel_copies=copies_in_write(realized.output_bytes_by_method)):
        table.add_row(label, text)
    table.add_row("predicted seconds", predicted_text(manifest.cost.estimated.seconds))
    if merged.update_bound is not None:
        table.add_row("delta-update bound", f"{merged.update_bound:.6g} measured after the merge (the plan's: "
                                            f"{plan.error_bound:.6g}); Frobenius, vs the from-scratch merge")
    if not quiet:
        print_summary(table)
    if merged.pushed is not None:
        print_pushed(merged.pushed)


COMMANDS = [merge_cmd, execute_cmd]
