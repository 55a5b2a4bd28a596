"""`mergepipe plan`, `merge` (plan, execute and publish), `execute` (a stored plan), `integrate` and `push`."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from mergepipe.app.merging import Execution, Merged, execute, merge
from mergepipe.app.planning import plan
from mergepipe.app.publishing import HubTarget, Pushed, push
from mergepipe.app.reports import time_rows
from mergepipe.cli.common import (
    CUDA_TYPO_OPTION,
    DB_OPTION,
    NO_PROGRESS_OPTION,
    QUIET_OPTION,
    ConsoleReporter,
    OperatorsHelp,
    echo,
    echo_json,
    execution_options,
    merge_options,
    output_options,
    plain_console,
    plan_summary,
    print_summary,
    request_from,
    summary_table,
    table,
)
from mergepipe.errors import ConfigError
from mergepipe.sizes import format_bytes
from mergepipe.spec.plan import describe

if TYPE_CHECKING:
    from mergepipe.app.integration import Integration

_PRIVATE_HELP = "Create the repository private if it does not exist (an existing public one is refused)."
_REVISION_HELP = "Branch to commit to [default: main]; created from main if missing."


def push_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--push-to-hub ORG/NAME [--private] [--revision BRANCH]``: push the published snapshot too."""
    for option in (
        click.option("--revision", default=None, metavar="BRANCH", help=f"With --push-to-hub. {_REVISION_HELP}"),
        click.option("--private", is_flag=True, help=f"With --push-to-hub. {_PRIVATE_HELP}"),
        click.option(
            "--push-to-hub",
            "push_to_hub",
            default=None,
            metavar="ORG/NAME",
            help="Then push the published snapshot to this Hugging Face Hub repository, as one commit of "
            "every file (as `mergepipe push` does; credentials from HF_TOKEN or `hf auth login`). A failed "
            "push leaves the snapshot published and prints the command that retries it.",
        ),
    ):
        func = option(func)
    return func


def hub_target(kwargs: dict[str, Any]) -> HubTarget | None:
    """The Hub target the ``push_options`` ask for (None without ``--push-to-hub``); they are removed from
    ``kwargs``."""
    repo_id, private, revision = kwargs.pop("push_to_hub"), kwargs.pop("private"), kwargs.pop("revision")
    if repo_id is None:
        if private or revision is not None:
            raise ConfigError(f"{'--private' if private else '--revision'} needs --push-to-hub ORG/NAME")
        return None
    return HubTarget(repo_id=repo_id, private=private, revision=revision)


def print_pushed(pushed: Pushed) -> None:
    """Where the snapshot is on the Hub now."""
    hub = pushed.location
    where = f"branch {hub.revision}{', private' if hub.private else ''}"
    if not pushed.created:
        echo(
            f"snapshot {pushed.snapshot_id} of model '{pushed.model_id}' is on the Hub already: {hub.uri} "
            f"({where}; it holds these {len(pushed.files)} files, so no commit was made)"
        )
        return
    removed = f"; removed {len(pushed.deleted)} file(s) the snapshot does not have" if pushed.deleted else ""
    echo(
        f"pushed snapshot {pushed.snapshot_id} of model '{pushed.model_id}' to {hub.uri} "
        f"({where}; {len(pushed.files)} files, {format_bytes(pushed.total_bytes)}{removed})"
    )


@click.command("push")
@DB_OPTION
@click.argument("target", metavar="SNAPSHOT|DIR")
@click.argument("repo_id", metavar="ORG/NAME")
@click.option("--private", is_flag=True, help=_PRIVATE_HELP)
@click.option("--revision", default=None, metavar="BRANCH", help=_REVISION_HELP)
def push_cmd(db_path: Path, target: str, repo_id: str, private: bool, revision: str | None) -> None:
    """Push a published snapshot to a Hugging Face Hub repository as one commit.

    SNAPSHOT is a snapshot id (or a unique prefix), a merged model id (name@N), or a snapshot's
    directory. Its files are verified, then all of them (weights, manifest.json, the model card,
    mergepipe_config.yml, config and tokenizer files) are committed at once, replacing whatever else
    the branch held (.gitattributes stays); the commit is recorded as a location of the snapshot,
    hf://ORG/NAME@COMMIT (`mergepipe snapshots`, `lineage`). Credentials come from HF_TOKEN or
    `hf auth login` and are never stored. A push that fails makes no commit and leaves the local
    snapshot as it was; running it again retries it.
    """
    print_pushed(push(db_path, target, repo_id, private=private, revision=revision, reporter=ConsoleReporter()))


@click.command("plan")
@DB_OPTION
@merge_options
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
        echo_json(made.to_json())
        return
    print_summary(plan_summary(made), made.notes)
    if save:
        echo(f"plan id: {made.digest}")


def _execution(kwargs: dict[str, Any]) -> Execution:
    return Execution(
        device=kwargs["device"],
        max_memory=kwargs["max_memory"],
        executor=kwargs["executor"],
        workers=kwargs["workers"],
        ray_address=kwargs["ray_address"],
        progress=not (kwargs["no_progress"] or kwargs["quiet"]),
    )


@click.command("merge", cls=OperatorsHelp)
@DB_OPTION
@merge_options
@output_options
@execution_options
@push_options
@QUIET_OPTION
def merge_cmd(db_path: Path, out: Path, json_summary: Path | None, force: bool, **kwargs: Any) -> None:
    """Plan, execute and publish a merge in one step."""
    hub = hub_target(kwargs)
    merged = merge(
        request_from(kwargs),
        db_path,
        out,
        execution=_execution(kwargs),
        analyze_missing=kwargs["analyze_missing"],
        strict=kwargs["strict"],
        json_summary=json_summary,
        force=force,
        push_to_hub=hub,
        reporter=ConsoleReporter(quiet=kwargs["quiet"]),
    )
    print_merged(merged, kwargs["quiet"])


@click.command("execute")
@DB_OPTION
@click.option("--plan", "plan_id", required=True, help="Plan id (or a unique prefix) from `mergepipe plan --save`.")
@output_options
@execution_options
@push_options
@NO_PROGRESS_OPTION
@QUIET_OPTION
def execute_cmd(
    db_path: Path, plan_id: str, out: Path, model_id: str | None, json_summary: Path | None, force: bool, **kwargs: Any
) -> None:
    """Execute a stored plan and publish the snapshot.

    A plan executed before gives the same snapshot: it is re-materialised at --out (after its
    directory was deleted, or as a copy), checked byte for byte against the recorded manifest hash,
    and recorded as another location of that snapshot (`mergepipe snapshots`); --model-id may be
    omitted then, and naming another model is refused (a snapshot belongs to one model).
    """
    hub = hub_target(kwargs)
    merged = execute(
        plan_id,
        db_path,
        out,
        model_id=model_id,
        execution=_execution(kwargs),
        json_summary=json_summary,
        force=force,
        push_to_hub=hub,
        reporter=ConsoleReporter(quiet=kwargs["quiet"]),
    )
    print_merged(merged, kwargs["quiet"])


def print_merged(merged: Merged, quiet: bool = False) -> None:
    """What was published, in one line; unless ``quiet``, what it cost against what was planned and predicted."""
    made, manifest = merged.plan, merged.manifest
    if merged.unchanged:
        echo(
            f"{merged.out} already holds snapshot {merged.snapshot_id} (model '{merged.model_id}'), which this "
            f"merge makes: nothing to do (`mergepipe verify {merged.out}` checks every byte)"
        )
        if merged.pushed is not None:
            print_pushed(merged.pushed)
        return
    if merged.rematerialised:
        echo(
            f"re-materialised snapshot {merged.snapshot_id} of model '{manifest.model_id}' at {merged.out}: "
            f"plan {made.digest[:12]} was executed before, so this is the same snapshot (byte-identical) at "
            "another location, not a new version"
        )
    else:
        echo(f"snapshot {merged.snapshot_id} published at {merged.out}")
    realized = manifest.cost.realized
    rows = [
        ("model id", manifest.model_id),
        ("manifest hash", manifest.manifest_hash),
        (
            "expert bytes planned / read",
            f"{format_bytes(made.cost.expert_bytes)} / {format_bytes(realized.expert_bytes)}",
        ),
        ("base bytes / output bytes", f"{format_bytes(realized.base_bytes)} / {format_bytes(realized.output_bytes)}"),
        *time_rows(realized.seconds, realized.output_bytes_by_method),
        ("predicted seconds", describe(manifest.cost.estimated.seconds)),
    ]
    if merged.update_bound is not None:
        rows.append(
            (
                "delta-update bound",
                f"{merged.update_bound:.6g} measured after the merge (the plan's: {made.error_bound:.6g}); "
                "Frobenius, vs the from-scratch merge",
            )
        )
    if not quiet:
        print_summary(summary_table(None, rows))
    if merged.pushed is not None:
        print_pushed(merged.pushed)


@click.command("integrate")
@DB_OPTION
@click.argument("recipe_path", metavar="RECIPE", type=click.Path(dir_okay=False, path_type=Path))
@execution_options
@NO_PROGRESS_OPTION
def integrate_cmd(db_path: Path, recipe_path: Path, no_progress: bool, **kwargs: Any) -> None:
    """Run one iteration of the pipeline RECIPE describes (a YAML file: base, experts, merge, output).

    Registers changed expert directories as new versions (a Hub, S3 or HTTP expert is re-checked by its
    commit or ETags, its headers read only when they changed), analyses incrementally, merges incrementally
    from the latest published version and publishes the next one; publishes nothing when nothing changed.
    The merge runs as `merge` runs it (--device, --max-memory, --executor, --workers).
    """
    execution = Execution(**kwargs, progress=not no_progress)
    integration = import_module("mergepipe.app.integration")  # it loads the engine, and torch
    _print(integration.integrate(recipe_path, db_path, execution=execution, reporter=ConsoleReporter()))


def _print(done: Integration) -> None:
    console = plain_console()
    recipe, analysis = done.recipe, done.analysis
    inputs = [(r.record.name, r.record.label, r.status, r.record.uri) for r in done.registrations]
    console.print(table(f"integrate {recipe.path.name}: inputs", ("model", "version", "status", "directory"), inputs))
    if analysis is not None:
        for expert, (unchanged, total) in analysis.inherited.items():
            console.print(f"  {expert}: analysed {total - unchanged} of {total} tensors ({unchanged} unchanged)")
        if fresh := [e for e in analysis.analyzed if e not in analysis.inherited]:
            console.print(f"  analysed {', '.join(fresh)} in full")
    for path in done.removed:
        console.print(f"  removed {path} (older than the last {recipe.output.keep} versions)")
    for warning in done.warnings:
        echo(f"warning: {warning}", err=True)
    if done.published is None:
        console.print(f"nothing changed since {done.current}: nothing published")
        return
    snapshot_id, out, manifest = done.published
    realized, reuse = manifest.cost.realized, done.plan.reuse
    if done.scratch is not None:
        console.print(f"merged from scratch (the same bytes as incrementally): {done.scratch}")
    console.print(f"published {manifest.model_id} ({snapshot_id}) at {out}; verified")
    console.print(
        f"  expert bytes read {format_bytes(realized.expert_bytes)} of "
        f"{format_bytes(done.plan.cost.expert_bytes)} planned; base {format_bytes(realized.base_bytes)}; "
        f"{realized.seconds.get('total', 0.0):.1f} s"
    )
    if manifest.cost.estimated.seconds:
        console.print(f"  predicted {describe(manifest.cost.estimated.seconds)}")
    if reuse is not None:
        console.print(
            f"  reused {reuse.block_count} output blocks ({format_bytes(reuse.output_bytes)}) "
            f"of {reuse.snapshot}: {format_bytes(reuse.saved_bytes)} of expert reads saved"
        )


COMMANDS = [plan_cmd, merge_cmd, execute_cmd, integrate_cmd, push_cmd]
