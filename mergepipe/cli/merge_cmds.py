"""Merge commands: plan, merge (plan + execute + publish), execute.

``--base``/``--experts`` take registered ids or checkpoint directories; a
directory that is not registered yet is registered on the fly
(``merge_inputs.py`` says under which name). ``--config`` takes MergePipe's
parameter file or a whole mergekit config. A catalog that does not exist yet is created, so the one-line
form ``mergepipe --db DB --base B --experts A C --out DIR --model-id M``
works on a fresh machine.
"""

from __future__ import annotations

import gc
import json
from importlib import import_module
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from mergepipe.catalog import Catalog
from mergepipe.cli.common import plain_console, predicted_text
from mergepipe.cli.executor_options import executor_options
from mergepipe.cli.merge_inputs import MergeInputs, model_ref, print_notes, read_inputs, registered_ref
from mergepipe.cli.writing import open_for_writing
from mergepipe.engine.defaults import DEFAULT_MAX_MEMORY
from mergepipe.errors import BudgetError, ConfigError, MergePipeError
from mergepipe.planner.budget import parse_budget
from mergepipe.planner.planner import POLICIES, Planner
from mergepipe.spec.operators import OPERATORS
from mergepipe.spec.params import PARAMS
from mergepipe.spec.plan import Plan
from mergepipe.txn.outpath import refuse_inside_models, writable_file
from mergepipe.txn.publish import refuse_existing
from mergepipe.units import format_bytes

_DB = click.option("--db", "db_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
                   help="Catalog file (created if missing).")


def _merge_options(func):
    """Options shared by `plan` and `merge`: what to merge and how. Parameter
    help comes from the parameter catalogue (``spec/params.py``)."""
    options = [
        click.option("--base", "base", help="Base model: a registered id or a checkpoint directory."),
        click.option("--experts", "experts", multiple=True,
                     help="Expert models (ids or directories): --experts A B C."),
        click.option("--operator", default=None,
                     help="Merge operator: " + ", ".join(OPERATORS) + " (dare = dare_linear) [default: ties]."),
        click.option("--weights", multiple=True, type=float, help="One weight per expert: --weights 0.5 0.3."),
        click.option("--density", type=float, help=PARAMS["density"].help()),
        click.option("--lambda", "lambda_", type=float, help=PARAMS["lambda"].help()),
        click.option("--gamma", type=float, help=PARAMS["gamma"].help()),
        click.option("--epsilon", type=float, help=PARAMS["epsilon"].help()),
        click.option("--t", "t", type=float, help=PARAMS["t"].help()),
        click.option("--rescale", type=click.Choice(list(PARAMS["rescale"].choices)), help=PARAMS["rescale"].help()),
        click.option("--normalize/--no-normalize", default=None, help=PARAMS["normalize"].help()),
        click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     help="A mergekit config as it is (merge_method, base_model, models, parameters, ..., and a "
                     "`mergepipe:` section with budget, policy, seed, block_bytes, model_id, out_shard_size), "
                     "instead of --base/--experts/--operator; or MergePipe's `params:` (global) and "
                     "`expert_params: {ID: {...}}`. Values may be gradients (lists) or "
                     "[{filter: SUBSTRING, value: X}] rules. Flags override the config."),
        click.option("--seed", default=None, type=int, help="Seed of random operators [default: 0]."),
        click.option("--budget", default=None,
                     help="Expert-I/O budget: bytes, a size (906MB, 8GiB), a fraction (25%) or none; or a time "
                     "(20s, 2min: the merge's own seconds, start-up not included, converted into bytes through the "
                     "time model this catalog learnt on this machine), alone or with a byte budget (20s,8GiB: the "
                     "tighter wins) [default: 100%]."),
        click.option("--policy", type=click.Choice(POLICIES), default=None,
                     help="How to spend the budget: energy (blocks by weighted delta norm per byte), uniform "
                     "(the same share of every tensor), full, or entries (sketches and exact deltas from the "
                     "experts' delta stores, built by `analyze --store-deltas`; keeps the most quality per byte) "
                     "[default: energy]."),
        click.option("--out-dtype", default=None, help="Output dtype (bf16, f16, f32) [default: the base's]."),
        click.option("--out-shard-size", default=None,
                     help="Largest output shard, e.g. 5GB (model-0000i-of-0000N.safetensors plus an index, as "
                     "transformers writes) [default: the base's sharding]."),
        click.option("--from", "previous", default=None, metavar="SNAPSHOT",
                     help="Merge incrementally: copy the output blocks whose inputs are unchanged from this "
                     "snapshot (a snapshot id, or a merged model id: its latest version). Bit-identical to "
                     "merging from scratch; reads experts only for what changed."),
        click.option("--delta-update", is_flag=True,
                     help="With --from, for linear/avg/task_arithmetic: update blocks whose only change is a new "
                     "version of an expert from the previous output (reads that expert's old and new blocks "
                     "only). Not bit-identical; the plan's error bound includes the rounding."),
        click.option("--no-progress", is_flag=True, help="Do not show progress bars."),
        click.option("--strict", is_flag=True,
                     help="Refuse a plan whose output equals the base (a budget that reads nothing, or experts "
                     "identical to the base) instead of warning."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _analyze_missing_option(default: bool):
    what = "analyse them first" if default else "analyse them first instead of failing"
    return click.option(
        "--analyze-missing/--no-analyze-missing", default=default, show_default=True,
        help=f"Experts not yet analysed against the base: {what} (reads each such expert once, in full).",
    )


def _make_plan(catalog: Catalog, inputs: MergeInputs, kwargs: dict[str, Any]) -> Plan:
    """Register directories given on the fly, analyse what is missing if asked,
    plan. If this fails, the models registered on the fly are taken back: a
    failed command leaves the catalog as it found it."""
    registered: list[str] = []
    try:
        return _plan_registering(catalog, inputs, kwargs, registered)
    except MergePipeError:
        for model_id in registered:
            catalog.models.delete(model_id)
        raise


def _plan_registering(catalog: Catalog, inputs: MergeInputs, kwargs: dict[str, Any], registered: list[str]) -> Plan:
    request = inputs.request
    base = model_ref(catalog, request.base, registered)
    experts = [model_ref(catalog, e, registered) for e in request.experts]
    refs = dict(zip(request.experts, experts))
    # a key that is not written as in the expert list may be another spelling of one (name vs name@N);
    # an unknown one stays as written, and the planner says it is no expert
    expert_params = {refs.get(k) or registered_ref(catalog, k) or k: v for k, v in request.expert_params.items()}
    if kwargs["analyze_missing"]:
        _analyze_missing(catalog, base, experts, kwargs["no_progress"])
    return Planner(catalog, kwargs["device"]).plan(
        base,
        experts,
        request.operator,
        weights=list(kwargs["weights"]) or None,
        params=request.params,
        expert_params=expert_params,
        seed=inputs.seed,
        budget=inputs.budget,
        policy=inputs.policy,
        out_dtype=request.out_dtype,
        previous=kwargs["previous"],
        delta_update=kwargs["delta_update"],
        out_shard_bytes=inputs.out_shard_bytes,
        chat_template=request.chat_template,
    )


def _analyze_missing(catalog: Catalog, base: str, experts: list[str], no_progress: bool) -> None:
    """Analyse the experts not yet analysed against ``base``. Finding them is a catalog query; only
    analysing loads torch, so a merge with nothing to analyse plans before it loads torch (in
    ``_execute``), and a refused plan costs no import."""
    base_id = catalog.models.resolve(base).id
    missing = [e for e in experts
               if e != base and not catalog.stats.is_analyzed(catalog.models.resolve(e).id, base_id)]
    if missing:
        import_module("mergepipe.cli.merge_run").analyze_missing(catalog, base, missing, no_progress)


def _read(kwargs: dict[str, Any]) -> MergeInputs:
    """The merge's inputs, read before the catalog is opened; a malformed budget fails here too."""
    inputs = read_inputs(kwargs)
    parse_budget(inputs.budget)
    return inputs


def warn_about(plan: Plan, strict: bool) -> None:
    """Say on stderr, whatever the progress settings, what a plan's table would bury: that its output
    equals the base, and its warnings; with ``strict`` the first is an error."""
    cost = plan.cost
    if cost.expert_bytes == 0:
        why = (f"the budget ({plan.budget_text}) is below the cheapest useful read" if cost.full_expert_bytes
               else "every expert block is identical to the base")
        message = f"{why}: the plan reads nothing from the experts and the output equals the base"
        if strict:
            raise BudgetError(f"{message} (--strict); raise --budget, or check the experts")
        click.echo(f"warning: {message}", err=True)
    for note in plan.notes:
        if note.startswith("warning: "):
            click.echo(note, err=True)


def plan_summary(plan: Plan) -> Table:
    """The table `plan` and `merge` print."""
    cost = plan.cost
    table = Table(title=f"plan {plan.digest[:12]} — {plan.operator}, policy {plan.policy}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("budget", f"{plan.budget_text} = {format_bytes(plan.budget_bytes)}")
    table.add_row("expert bytes planned", f"{format_bytes(cost.expert_bytes)} of {format_bytes(cost.full_expert_bytes)}"
                  " changed (blocks identical to the base cost nothing)")
    reduction = cost.reduction
    table.add_row("expert I/O reduction", "no expert reads" if reduction is None else f"{reduction:.2f}x")
    table.add_row("base bytes / output bytes", f"{format_bytes(cost.base_bytes)} / {format_bytes(cost.output_bytes)}")
    table.add_row("error bound", f"{plan.error_bound:.6g} ({plan.error_bound_kind}); "
                  f"{100 * plan.error_share:.1f}% of the weighted task vectors (norm) left out")
    for expert, n in cost.expert_bytes_by_model.items():
        table.add_row(f"  {expert}", format_bytes(n))
    if plan.reuse is not None:
        table.add_row("reused", f"{plan.reuse.block_count} blocks ({format_bytes(plan.reuse.output_bytes)}) of "
                      f"'{plan.reuse.snapshot}'; expert bytes to read: "
                      f"{format_bytes(cost.expert_bytes - plan.reuse.saved_bytes)}")
    table.add_row("predicted seconds", predicted_text(plan.seconds.flat() if plan.seconds else None))
    for note in plan.notes:
        table.add_row("note", note)
    return table


@click.command("plan")
@_DB
@_merge_options
@_analyze_missing_option(default=False)
@click.option("--device", default="cpu", show_default=True,
              help="Device the merge will run on (cpu or cuda): its predicted seconds, and a time budget, come from "
              "that device's merges here.")
@click.option("--save", is_flag=True, help="Store the plan in the catalog and print its id.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole plan as JSON.")
def plan_cmd(db_path: Path, save: bool, as_json: bool, **kwargs: Any) -> None:
    """Plan a merge under a budget without reading any expert byte.

    Needs the experts analysed against the base (`mergepipe analyze`); with
    --analyze-missing it analyses them first, which does read them.
    """
    inputs = _read(kwargs)
    with open_for_writing(db_path, block_bytes=inputs.block_bytes) as catalog:
        plan = _make_plan(catalog, inputs, kwargs)
        print_notes(inputs.request)  # once the plan exists: a refusal stays one line
        warn_about(plan, kwargs["strict"])
        if save:
            catalog.plans.save(plan.digest, plan.to_json_str())
    if as_json:
        click.echo(json.dumps(plan.to_json(), indent=2, sort_keys=True))
        return
    plain_console().print(plan_summary(plan))
    if save:
        click.echo(f"plan id: {plan.digest}")


def _execute(catalog: Catalog, plan: Plan, out: Path, model_id: str | None, kwargs: dict[str, Any]) -> None:
    """Run the plan (``merge_run.py``).

    Why the engine's module is imported here and not at the top: importing
    it loads torch, about a second of CPU, which `plan` (in this module)
    never needs; so only a command that executes pays for it."""
    run = import_module("mergepipe.cli.merge_run")
    gc.freeze()  # the ~10^5 objects of the imports and the plan live to the end: collections skip them
    run.execute_plan(catalog, plan, out, model_id, kwargs)


def _engine_options(func):
    options = [
        click.option("--out", required=True, type=click.Path(path_type=Path),
                     help="Output directory (must not exist)."),
        click.option("--model-id", default=None,
                     help="Id of the merged model in the catalog. A plan executed before gives the same snapshot, "
                     "re-materialised at --out: omit it, or name the model the snapshot belongs to."),
        click.option("--device", default="cpu", show_default=True, help="cpu or cuda."),
        click.option("--max-memory", default=DEFAULT_MAX_MEMORY, show_default=True,
                     help="Bound on the engine's buffers (streaming operators)."),
        click.option("--json-summary", type=click.Path(dir_okay=False, path_type=Path),
                     help="Also write the cost summary as JSON here (bytes, seconds, and this command's CPU "
                     "seconds, peak RSS and disk I/O); an existing file is refused unless --force."),
        click.option("--force", is_flag=True, help="Overwrite an existing --json-summary file (never a checkpoint: "
                     "--out must not exist)."),
    ]
    for option in reversed(options):
        func = option(func)
    return executor_options(func)


def _refuse_outputs(catalog: Catalog, out: Path, kwargs: dict[str, Any]) -> None:
    """Refuse, before any work, an --out that exists or lies inside a model, and a --json-summary that
    would overwrite a file (without --force) or write inside a model."""
    refuse_inside_models(catalog, refuse_existing(out))
    if kwargs.get("json_summary") is not None:
        kwargs["json_summary"] = writable_file(catalog, kwargs["json_summary"], kwargs["force"], "--json-summary")


@click.command("merge")
@_DB
@_merge_options
@_analyze_missing_option(default=True)
@_engine_options
def merge_cmd(db_path: Path, out: Path, model_id: str, **kwargs: Any) -> None:
    """Plan, execute and publish a merge in one step."""
    inputs = _read({**kwargs, "model_id": model_id})
    if inputs.model_id is None:
        raise ConfigError("give --model-id (or `model_id:` in the config's `mergepipe:` section)")
    model_id = inputs.model_id
    with open_for_writing(db_path, out, block_bytes=inputs.block_bytes) as catalog:
        _refuse_outputs(catalog, out, kwargs)  # after recover, before any planning
        plan = _make_plan(catalog, inputs, kwargs)
        print_notes(inputs.request)  # once the plan exists: a refusal stays one line
        warn_about(plan, kwargs["strict"])
        if not kwargs["no_progress"]:
            plain_console(stderr=True).print(plan_summary(plan))
        _execute(catalog, plan, out, model_id, kwargs)


@click.command("execute")
@_DB
@click.option("--plan", "plan_id", required=True, help="Plan id (or a unique prefix) from `mergepipe plan --save`.")
@_engine_options
@click.option("--no-progress", is_flag=True, help="Do not show progress bars.")
def execute_cmd(db_path: Path, plan_id: str, out: Path, model_id: str | None, **kwargs: Any) -> None:
    """Execute a stored plan and publish the snapshot.

    A plan executed before gives the same snapshot: it is re-materialised at --out (after its
    directory was deleted, or as a copy), checked byte for byte against the recorded manifest hash,
    and recorded as another location of that snapshot (`mergepipe snapshots`); --model-id may be
    omitted then, and naming another model is refused (a snapshot belongs to one model).
    """
    with open_for_writing(db_path, out) as catalog:
        _refuse_outputs(catalog, out, kwargs)
        plan = Plan.from_json(catalog.plans.get(plan_id))
        _execute(catalog, plan, out, model_id, kwargs)


COMMANDS = [plan_cmd, merge_cmd, execute_cmd]
