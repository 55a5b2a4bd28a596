"""`mergepipe integrate RECIPE.yml`: one iteration of continuous integration of experts.

Each run: registers every directory of the recipe (a changed one as the next
version of its id: change is seen from file sizes, mtimes and headers, and
block hashes say what changed), analyses what is new (incrementally: a new
version recomputes only its changed tensors), plans the merge, and, unless
nothing changed since the latest published version of the merged model,
merges incrementally from that version (``--from``: bit-identical to a merge
from scratch), publishes ``ROOT/<model_id>-v<N>`` atomically, verifies it,
and prints what changed and what it cost. ``keep: N`` removes the published
directories of older versions (MergePipe's own outputs; the catalog keeps
their history), also on a run that publishes nothing, and skips (with a
warning) a directory it cannot tell is MergePipe's.

A run never gets stuck on the previous version: when its directory is gone
or changed, the run merges from scratch instead (bit-identical by contract)
and says so. Ctrl-C after the new version is published reports what was
published and what was skipped, never "aborted".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from mergepipe.analysis.analyze import AnalyzeReport, analyze
from mergepipe.analysis.register import Registration, register
from mergepipe.catalog import Catalog
from mergepipe.cli.common import DB_OPTION, plain_console, predicted_text
from mergepipe.cli.executor_options import executor_options
from mergepipe.cli.merge_run import open_executor
from mergepipe.cli.recipe import Recipe, load_recipe
from mergepipe.cli.writing import open_for_writing
from mergepipe.engine.defaults import DEFAULT_MAX_MEMORY
from mergepipe.engine.engine import Engine
from mergepipe.engine.probe import probe_kernels
from mergepipe.errors import ConfigError, InterruptedAfterPublish, PreviousChangedError
from mergepipe.manifest.card import DERIVED_FILENAMES
from mergepipe.manifest.manifest import MANIFEST_FILENAME, Manifest
from mergepipe.planner.planner import Planner
from mergepipe.planner.reuse import with_reuse
from mergepipe.planner.seconds import with_prediction
from mergepipe.spec.plan import Plan
from mergepipe.txn.fsync import remove_tree
from mergepipe.txn.verify import verify_or_raise
from mergepipe.units import format_bytes


@dataclass
class Integration:
    """What one run did."""

    registrations: list[Registration]
    analysis: AnalyzeReport | None
    plan: Plan
    current: str | None = None  # the published version that is already up to date (nothing changed)
    published: tuple[str, Path, Manifest] | None = None  # (snapshot id, directory, manifest)
    removed: list[Path] = field(default_factory=list)
    scratch: str | None = None  # why the previous version could not be reused (merged from scratch)
    warnings: list[str] = field(default_factory=list)


@click.command("integrate")
@DB_OPTION
@click.argument("recipe_path", metavar="RECIPE", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda.")
@click.option("--max-memory", default=DEFAULT_MAX_MEMORY, show_default=True,
              help="Bound on the engine's buffers (streaming operators).")
@executor_options
@click.option("--no-progress", is_flag=True, help="Do not show progress bars.")
def integrate_cmd(db_path: Path, recipe_path: Path, no_progress: bool, **kwargs: Any) -> None:
    """Run one iteration of the pipeline RECIPE describes (a YAML file: base, experts, merge, output).

    Registers changed expert directories as new versions, analyses incrementally, merges incrementally
    from the latest published version and publishes the next one; publishes nothing when nothing changed.
    The merge runs as `merge` runs it (--device, --max-memory, --executor, --workers).
    """
    recipe = load_recipe(recipe_path)
    _make_root(recipe)
    with open_for_writing(db_path, recipe.out_root / recipe.model_id) as catalog, \
            open_executor(kwargs) as executor:
        engine = Engine(catalog, device=kwargs["device"], max_memory=kwargs["max_memory"],
                        progress=not no_progress, executor=executor)
        done = integrate(catalog, recipe, progress=not no_progress, engine=engine)
        _print(catalog, recipe, done)


def integrate(catalog: Catalog, recipe: Recipe, progress: bool = True, engine: Engine | None = None) -> Integration:
    """One iteration of ``recipe`` against ``catalog`` (see the module docstring), merged by ``engine`` (by
    default one on the CPU, in this process); its plan predicts seconds for the engine's device from this
    catalog's timings on this machine (and the merge adds its own)."""
    catalog.models.next_snapshot_id(recipe.model_id)  # a name taken by a checkpoint fails here, first
    models = [(recipe.base_id, recipe.base_uri), *recipe.experts.items()]
    registrations = [register(catalog, name, uri, new_version=True) for name, uri in models]
    base = catalog.models.resolve(recipe.base_id)
    missing = [name for name in recipe.experts
               if not catalog.stats.is_analyzed(catalog.models.resolve(name).id, base.id)]
    report = analyze(catalog, missing, base_id=recipe.base_id, progress=progress) if missing else None
    plan = Planner(catalog).plan(
        recipe.base_id, list(recipe.experts), recipe.operator, weights=recipe.weights, params=recipe.params,
        expert_params=recipe.expert_params, seed=recipe.seed, budget=recipe.budget, policy=recipe.policy,
        out_dtype=recipe.out_dtype,
    )
    done = Integration(registrations, report, plan)
    latest = catalog.models.latest(recipe.model_id)
    previous = None if latest is None else catalog.snapshots.of_model(latest.id)
    if previous is not None:
        earlier = Plan.from_json(catalog.plans.get(previous.plan_id))
        if replace(earlier, reuse=None).digest == plan.digest:  # the same inputs, settings and reads
            done.current = latest.label
            _prune(catalog, recipe, done)
            return done
        if catalog.snapshots.outputs(previous.model_id):
            done.plan = plan = with_reuse(catalog, plan, previous)
    version = 1 if latest is None else latest.version + 1
    out = recipe.out_root / f"{recipe.model_id}-v{version}"
    engine = engine or Engine(catalog, progress=progress)
    probe_kernels(catalog, str(engine.device), [plan.operator])  # once per device here: the prior's compute
    done.plan = plan = with_prediction(catalog, plan, str(engine.device))
    try:
        snapshot_id, manifest = engine.execute(plan, out=out, model_id=recipe.model_id)
    except PreviousChangedError as exc:  # nothing was written: from scratch gives the same bytes
        if plan.reuse is None:
            raise
        done.scratch = f"{latest.label if latest else recipe.model_id} cannot be reused: {exc.reason}"
        done.plan = plan = replace(plan, reuse=None)
        snapshot_id, manifest = engine.execute(plan, out=out, model_id=recipe.model_id)
    except InterruptedAfterPublish as exc:
        raise exc.skipping(f"not verified{', not pruned' if recipe.keep else ''}: run `mergepipe verify {out}`"
                           ) from None
    done.published = (snapshot_id, out, manifest)
    try:
        verify_or_raise(out)
    except KeyboardInterrupt:
        raise InterruptedAfterPublish(out, snapshot_id, f"not verified{', not pruned' if recipe.keep else ''}: "
                                      f"run `mergepipe verify {out}`") from None
    try:
        _prune(catalog, recipe, done)
    except KeyboardInterrupt:
        raise InterruptedAfterPublish(out, snapshot_id, "verified; pruning stopped: the next run prunes"
                                      ) from None
    return done


def _make_root(recipe: Recipe) -> None:
    """Create the recipe's output root; one line if that cannot be done."""
    root = recipe.out_root
    if root.exists() and not root.is_dir():
        raise ConfigError(f"recipe {recipe.path}: output.root {root} exists and is not a directory; give a "
                          "directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"recipe {recipe.path}: cannot create output.root {root} ({exc.strerror}); check the "
                          "path and free space") from None


def _prune(catalog: Catalog, recipe: Recipe, done: Integration) -> None:
    """Remove the published directories of all but the last ``keep`` versions: only MergePipe snapshots of
    this model under the output root (the catalog keeps their rows: lineage stays whole). A directory a
    prune left half-removed is removed when every file left in it is one its recorded manifest lists;
    anything else is left alone with a warning, never an error (the new version is published already)."""
    if recipe.keep is None:
        return
    for record in catalog.models.versions(recipe.model_id)[: -recipe.keep]:
        snapshot = catalog.snapshots.of_model(record.id)
        if snapshot is None or snapshot.manifest is None:
            continue
        path = Path(snapshot.out_path)
        if not path.is_dir() or recipe.out_root not in path.parents:
            continue
        ours = {f.name for f in Manifest.from_json(json.loads(snapshot.manifest)).files}
        ours |= {MANIFEST_FILENAME, *DERIVED_FILENAMES}
        left = {str(p.relative_to(path)) for p in path.rglob("*") if not p.is_dir()}
        if not left <= ours:
            done.warnings.append(f"not pruned: {path} holds files that are not {record.label}'s "
                                 f"({', '.join(sorted(left - ours)[:3])})")
            continue
        try:
            remove_tree(path)
        except OSError as exc:
            done.warnings.append(f"not pruned: {path} ({exc.strerror or exc})")
            continue
        done.removed.append(path)


def _print(catalog: Catalog, recipe: Recipe, done: Integration) -> None:
    console = plain_console()
    table = Table(title=f"integrate {recipe.path.name}: inputs", show_header=True)
    for column in ("model", "version", "status", "directory"):
        table.add_column(column)
    for r in done.registrations:
        table.add_row(r.record.name, r.record.label, r.status, r.record.uri)
    console.print(table)
    if done.analysis is not None:
        for expert, (unchanged, total) in done.analysis.inherited.items():
            console.print(f"  {expert}: analysed {total - unchanged} of {total} tensors ({unchanged} unchanged)")
        fresh = [e for e in done.analysis.analyzed if e not in done.analysis.inherited]
        if fresh:
            console.print(f"  analysed {', '.join(fresh)} in full")
    for path in done.removed:
        console.print(f"  removed {path} (older than the last {recipe.keep} versions)")
    for warning in done.warnings:
        click.echo(f"warning: {warning}", err=True)
    if done.current is not None:
        console.print(f"nothing changed since {done.current}: nothing published")
        return
    assert done.published is not None
    snapshot_id, out, manifest = done.published
    realized, plan = manifest.cost.realized, done.plan
    if done.scratch is not None:
        console.print(f"merged from scratch (the same bytes as incrementally): {done.scratch}")
    console.print(f"published {manifest.model_id} ({snapshot_id}) at {out}; verified")
    console.print(f"  expert bytes read {format_bytes(realized.expert_bytes)} of "
                  f"{format_bytes(plan.cost.expert_bytes)} planned; base {format_bytes(realized.base_bytes)}; "
                  f"{realized.seconds.get('total', 0.0):.1f} s")
    if manifest.cost.estimated.seconds:
        console.print(f"  predicted {predicted_text(manifest.cost.estimated.seconds)}")
    if plan.reuse is not None:
        console.print(f"  reused {plan.reuse.block_count} output blocks ({format_bytes(plan.reuse.output_bytes)}) "
                      f"of {plan.reuse.snapshot}: {format_bytes(plan.reuse.saved_bytes)} of expert reads saved")


COMMANDS = [integrate_cmd]
