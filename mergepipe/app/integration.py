"""`integrate RECIPE`: one iteration of continuous integration: register what changed, analyse, merge
``--from`` the latest version, publish ``ROOT/<model_id>-v<N>``, verify it, prune older directories to ``keep``."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mergepipe.analysis.analyze import AnalyzeReport, analyze
from mergepipe.analysis.register import Registration, register
from mergepipe.app.merging import Execution, open_engine
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
from mergepipe.spec.request import MergeRequest, StrictModel
from mergepipe.storage.checkpoint import DERIVED_FILENAMES
from mergepipe.storage.location import Location, RemotePath, hub_uri, location
from mergepipe.txn.publish import remove_tree
from mergepipe.txn.verify import verify_or_raise

_Read = TypeVar("_Read", bound=BaseModel)


class _Base(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field("base", min_length=1)
    uri: str = Field(min_length=1)


class _Output(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    root: str = Field(min_length=1)
    model_id: str = Field(min_length=1)
    keep: int | None = Field(None, ge=1, strict=True)


class _Models(StrictModel):
    what: ClassVar[str] = ""

    base: str | _Base
    experts: dict[str, str] = Field(min_length=1)
    output: _Output


class Recipe(MergeRequest):
    """A recipe: the merge request of each run by recipe ids, where each model is, and where versions go."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    what: ClassVar[str] = ""

    path: Path
    locations: dict[str, Path | RemotePath]
    out_root: Path
    output: _Output

    @model_validator(mode="before")
    @classmethod
    def _located(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        taken = sorted({"locations", "out_root", "model_id", "previous", "notes"} & set(data))
        if taken:
            raise ConfigError(f"unknown key {taken[0]!r}")
        models = _Models(**{k: data[k] for k in ("base", "experts", "output") if k in data})
        here = Path(data.get("path", "recipe.yml")).absolute().parent
        base = models.base if isinstance(models.base, _Base) else _Base(uri=models.base)
        locations = {base.id: _model_location(base.uri, "base", here)}
        locations |= {name: _model_location(uri, f"experts.{name}", here) for name, uri in models.experts.items()}
        out_root = _location(models.output.root, "output.root", here)
        if isinstance(out_root, RemotePath):
            raise ConfigError(
                f"output.root {out_root} is remote; give a local directory (snapshots are published on this machine)"
            )
        return {
            **data,
            "base": base.id,
            "experts": tuple(models.experts),
            "model_id": models.output.model_id,
            "locations": locations,
            "out_root": out_root,
        }


def load_recipe(path: str | Path) -> Recipe:
    return read_yaml_model(Recipe, path, f"recipe {path}")


def read_yaml_model(model: type[_Read], path: str | Path, where: str) -> _Read:
    """The YAML file at ``path`` as ``model`` (its ``path`` set); ConfigError naming ``where`` and the problem."""
    try:
        content = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it ({exc.strerror})") from None
    data = yaml_document(content, where)
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ConfigError(f"{where}: expected a mapping of keys to values, got {type(data).__name__}")
    try:
        if "path" in data:
            raise ConfigError("unknown key 'path'")
        return model(**data, path=Path(path).resolve())
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _model_location(value: str, where: str, here: Path) -> Location:
    """Where a model of the recipe is (a bare Hub id that is no local path is that Hub model)."""
    found = _location(value, where, here)
    hub = hub_uri(value) if isinstance(found, Path) and not found.exists() else None
    return found if hub is None else RemotePath(hub)


def _location(value: str, where: str, here: Path) -> Location:
    """A URI as it is; a path or ``file://`` URI made absolute (relative to the recipe); other schemes refused."""
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
    """One iteration of ``recipe`` against catalog ``db``; ``on_step`` sees each publish step (tests)."""
    recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    execution = execution or Execution()
    _make_root(recipe)
    with (
        open_catalog(db, writing=True, out=recipe.out_root / recipe.output.model_id, reporter=reporter) as catalog,
        open_engine(catalog, execution, on_step) as engine,
    ):
        return _run(catalog, recipe, engine, execution.progress)


def _run(catalog: Catalog, recipe: Recipe, engine: Engine, progress: bool) -> Integration:
    catalog.models.next_snapshot_id(recipe.output.model_id)  # a name taken by a checkpoint fails here, first
    registrations = [register(catalog, name, uri, new_version=True) for name, uri in recipe.locations.items()]
    base = catalog.models.resolve(recipe.base)
    missing = [
        name for name in recipe.experts if not catalog.stats.is_analyzed(catalog.models.resolve(name).id, base.id)
    ]
    report = analyze(catalog, missing, base_id=recipe.base, progress=progress) if missing else None
    plan = Planner(catalog).plan(recipe)
    done = Integration(recipe, registrations, report, plan)
    latest = catalog.models.latest(recipe.output.model_id)
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
    out = recipe.out_root / f"{recipe.output.model_id}-v{version}"
    probe_kernels(catalog, str(engine.device), [plan.operator])  # once per device here: the prior's compute
    done.plan = plan = with_prediction(catalog, plan, str(engine.device))
    try:
        snapshot_id, manifest = engine.execute(plan, out=out, model_id=recipe.output.model_id)
    except PreviousChangedError as exc:  # nothing was written: from scratch gives the same bytes
        if plan.reuse is None:
            raise
        done.scratch = f"{latest.label if latest else recipe.output.model_id} cannot be reused: {exc.reason}"
        done.plan = plan = replace(plan, reuse=None)
        snapshot_id, manifest = engine.execute(plan, out=out, model_id=recipe.output.model_id)
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
    return f"not verified{', not pruned' if recipe.output.keep else ''}: run `mergepipe verify {out}`"


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
    """Remove the directories of all but the last ``keep`` versions (only provably ours); warn, never fail."""
    if recipe.output.keep is None:
        return
    for record in catalog.models.versions(recipe.output.model_id)[: -recipe.output.keep]:
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
