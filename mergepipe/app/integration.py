"""`integrate RECIPE`: one iteration of continuous integration of experts.

Each run: registers every model of the recipe (a changed one as the next
version of its id: change is seen from file sizes, mtimes and headers, for a
remote model from its Hub commit or its files' ETags, with no header read
when nothing changed; block hashes say what changed), analyses what is new
(incrementally: a new version recomputes only its changed tensors), plans
the merge, and, unless nothing changed since the latest published version
of the merged model, merges incrementally from that version (``--from``:
bit-identical to a merge from scratch), publishes ``ROOT/<model_id>-v<N>``
atomically, verifies it, and says what changed and what it cost.
``keep: N`` removes the published directories of older versions
(MergePipe's own outputs; the catalog keeps their history), also on a run
that publishes nothing, and skips (with a warning) a directory it cannot
tell is MergePipe's.

A run never gets stuck on the previous version: when its directory is gone
or changed, the run merges from scratch instead (bit-identical by contract)
and says so. Ctrl-C after the new version is published reports what was
published and what was skipped, never "aborted". A pipeline of many runs
(and, later, a search over many merges) stays in one process: each run is
this one call.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from mergepipe.analysis.analyze import AnalyzeReport, analyze
from mergepipe.analysis.register import Registration, register
from mergepipe.app.merging import Execution, open_executor
from mergepipe.app.session import SILENT, Catalogish, Reporter, open_catalog
from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.engine.probe import probe_kernels
from mergepipe.errors import ConfigError, InterruptedAfterPublish, PreviousChangedError
from mergepipe.manifest.manifest import MANIFEST_FILENAME, Manifest
from mergepipe.planner.planner import Planner, with_prediction
from mergepipe.planner.reuse import with_reuse
from mergepipe.spec.mergekit import yaml_document
from mergepipe.spec.plan import Plan
from mergepipe.spec.request import MergeRequest, Policy, StrictModel
from mergepipe.storage.checkpoint import DERIVED_FILENAMES
from mergepipe.storage.location import Location, RemotePath, hub_uri, location
from mergepipe.txn.publish import remove_tree
from mergepipe.txn.verify import verify_or_raise


class _Base(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")  # checked as part of the recipe: one message

    id: str = Field("base", min_length=1)
    uri: str = Field(min_length=1)


class _Output(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    root: str = Field(min_length=1)
    model_id: str = Field(min_length=1)
    keep: int | None = Field(None, ge=1, strict=True)


class _RecipeFile(StrictModel):
    """A recipe as written (see the module docstring)."""

    what: ClassVar[str] = ""  # the caller names the recipe file

    base: str | _Base
    experts: dict[str, str] = Field(min_length=1)
    operator: str
    params: dict[str, Any] = Field(default_factory=dict)
    expert_params: dict[str, dict[str, Any]] = Field(default_factory=dict)
    weights: list[float] | None = None
    seed: int = Field(0, strict=True)
    budget: str | int = "100%"
    policy: Policy | None = None
    out_dtype: str | None = None
    output: _Output


@dataclass(frozen=True)
class Recipe:
    """A parsed recipe: its merge request (models named by their recipe ids, ``model_id`` the merged
    model's), where each model is (base first), and where versions are published."""

    path: Path
    request: MergeRequest
    locations: dict[str, Path | RemotePath]
    out_root: Path
    keep: int | None

    @property
    def base_id(self) -> str:
        return self.request.base

    @property
    def model_id(self) -> str:
        assert self.request.model_id is not None, "a recipe always names its merged model"
        return self.request.model_id


def load_recipe(path: str | Path) -> Recipe:
    """Parse the recipe at ``path``; ConfigError naming the first problem."""
    path = Path(path)
    where = f"recipe {path}"
    data = read_yaml_mapping(path, where)
    try:
        written = _RecipeFile(**data)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    here = path.resolve().parent
    base = written.base if isinstance(written.base, _Base) else _Base(uri=written.base)
    locations = {base.id: _model_location(base.uri, f"{where}: base", here)}
    for name, value in written.experts.items():
        locations[name] = _model_location(value, f"{where}: experts.{name}", here)
    out_root = _location(written.output.root, f"{where}: output.root", here)
    if isinstance(out_root, RemotePath):
        raise ConfigError(
            f"{where}: output.root {out_root} is remote; give a local directory (snapshots are "
            "published on this machine)"
        )
    try:
        request = MergeRequest(
            base=base.id,
            experts=tuple(written.experts),
            operator=written.operator,
            weights=written.weights,
            params=written.params,
            expert_params=written.expert_params,
            seed=written.seed,
            budget=written.budget,
            policy=written.policy,
            out_dtype=written.out_dtype,
            model_id=written.output.model_id,
        )
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return Recipe(path.resolve(), request, locations, out_root, written.output.keep)


def read_yaml_mapping(path: Path, where: str) -> dict[str, Any]:
    """The YAML file at ``path`` as a mapping of string keys (read as every config is); ConfigError naming
    ``where`` for a file that cannot be read, is not YAML, or is not such a mapping."""
    try:
        content = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it ({exc.strerror})") from None
    data = yaml_document(content, where)
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ConfigError(f"{where}: expected a mapping of keys to values, got {type(data).__name__}")
    return data


def _model_location(value: str, where: str, here: Path) -> Location:
    """Where a model of the recipe is: as ``_location`` says, except that mergekit's bare Hub id
    ``ORG/NAME[@REVISION]`` that is no local path (relative to the recipe's folder) is that Hub model."""
    found = _location(value, where, here)
    hub = hub_uri(value) if isinstance(found, Path) and not found.exists() else None
    return found if hub is None else RemotePath(hub)


def _location(value: str, where: str, here: Path) -> Location:
    """An s3://, http(s):// or hf:// URI as it is; a ``file://`` URI or a path made absolute (relative to the
    recipe's folder); another ``scheme://`` refused by ``location``."""
    try:
        found = location(value)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return found if isinstance(found, RemotePath) else (here / Path(found).expanduser()).resolve()


@dataclass
class Integration:
    """What one run did."""

    recipe: Recipe
    registrations: list[Registration]
    analysis: AnalyzeReport | None
    plan: Plan
    current: str | None = None  # the published version that is already up to date (nothing changed)
    published: tuple[str, Path, Manifest] | None = None  # (snapshot id, directory, manifest)
    removed: list[Path] = field(default_factory=list)
    scratch: str | None = None  # why the previous version could not be reused (merged from scratch)
    warnings: list[str] = field(default_factory=list)


def integrate(
    recipe: Recipe | str | Path,
    db: Catalogish,
    *,
    execution: Execution | None = None,
    reporter: Reporter = SILENT,
    on_step: Callable[[str], None] | None = None,
) -> Integration:
    """One iteration of ``recipe`` (or the recipe file at that path) against catalog ``db``; the merge runs
    as `merge` runs it (``execution``). ``on_step`` sees each publish step (crash-injection tests)."""
    recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    execution = execution or Execution()
    _make_root(recipe)
    with (
        open_catalog(db, writing=True, out=recipe.out_root / recipe.model_id, reporter=reporter) as catalog,
        open_executor(execution) as executor,
    ):
        engine = Engine(
            catalog,
            device=execution.device,
            max_memory=execution.max_memory,
            progress=execution.progress,
            executor=executor,
            on_step=on_step,
        )
        return _run(catalog, recipe, engine, execution.progress)


def _run(catalog: Catalog, recipe: Recipe, engine: Engine, progress: bool) -> Integration:
    catalog.models.next_snapshot_id(recipe.model_id)  # a name taken by a checkpoint fails here, first
    registrations = [register(catalog, name, uri, new_version=True) for name, uri in recipe.locations.items()]
    base = catalog.models.resolve(recipe.base_id)
    missing = [
        name
        for name in recipe.request.experts
        if not catalog.stats.is_analyzed(catalog.models.resolve(name).id, base.id)
    ]
    report = analyze(catalog, missing, base_id=recipe.base_id, progress=progress) if missing else None
    plan = Planner(catalog).plan(recipe.request)
    done = Integration(recipe, registrations, report, plan)
    latest = catalog.models.latest(recipe.model_id)
    previous = None if latest is None else catalog.snapshots.of_model(latest.id)
    if previous is not None:
        earlier = Plan.from_json(catalog.plans.get(previous.plan_id))
        if replace(earlier, reuse=None).digest == plan.digest:  # the same inputs, settings and reads
            done.current = latest.label if latest is not None else None
            _prune(catalog, recipe, done)
            return done
        if catalog.snapshots.outputs(previous.model_id):
            done.plan = plan = with_reuse(catalog, plan, previous)
    version = 1 if latest is None else latest.version + 1
    out = recipe.out_root / f"{recipe.model_id}-v{version}"
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
        raise exc.skipping(_skipped(recipe, out)) from None
    done.published = (snapshot_id, out, manifest)
    try:
        verify_or_raise(out, published=True)
    except KeyboardInterrupt:
        raise InterruptedAfterPublish(out, snapshot_id, _skipped(recipe, out)) from None
    try:
        _prune(catalog, recipe, done)
    except KeyboardInterrupt:
        raise InterruptedAfterPublish(out, snapshot_id, "verified; pruning stopped: the next run prunes") from None
    return done


def _skipped(recipe: Recipe, out: Path) -> str:
    return f"not verified{', not pruned' if recipe.keep else ''}: run `mergepipe verify {out}`"


def _make_root(recipe: Recipe) -> None:
    """Create the recipe's output root; one line if that cannot be done."""
    root = recipe.out_root
    if root.exists() and not root.is_dir():
        raise ConfigError(f"recipe {recipe.path}: output.root {root} exists and is not a directory; give a directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"recipe {recipe.path}: cannot create output.root {root} ({exc.strerror}); check the path and free space"
        ) from None


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
            done.warnings.append(
                f"not pruned: {path} holds files that are not {record.label}'s ({', '.join(sorted(left - ours)[:3])})"
            )
            continue
        try:
            remove_tree(path)
        except OSError as exc:
            done.warnings.append(f"not pruned: {path} ({exc.strerror or exc})")
            continue
        done.removed.append(path)
