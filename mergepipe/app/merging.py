"""`merge`, `execute` and `merge_config` (``mergepipe-yaml``): plan, execute on the executor asked for,
publish, push if asked; outputs refused before any work, the engine (and torch) imported only when a plan runs."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from mergepipe.analysis.register import check_model_id
from mergepipe.app.planning import make_plan, read_config
from mergepipe.app.publishing import HubTarget, Pushed, push_snapshot
from mergepipe.app.registering import ID_UNSAFE
from mergepipe.app.session import SILENT, Catalogish, Reporter, open_catalog
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import SnapshotRecord
from mergepipe.engine import DEFAULT_MAX_MEMORY, device_name
from mergepipe.errors import ConfigError, OutputExistsError
from mergepipe.manifest.manifest import MANIFEST_FILENAME, Manifest
from mergepipe.planner.planner import with_prediction
from mergepipe.spec.mergekit import merge_request
from mergepipe.spec.plan import Plan
from mergepipe.spec.request import MergeRequest, StrictModel
from mergepipe.txn.publish import check_online
from mergepipe.txn.outpath import refuse_inside_models, writable_file, write_report
from mergepipe.txn.publish import refuse_existing, resolve_output
from mergepipe.txn.verify import foreign_files
from mergepipe.runtime import process_usage

if TYPE_CHECKING:
    from mergepipe.engine.engine import Engine

#: A model id is at most this long (``analysis/register.py``).
_MAX_ID_CHARS = 200


class Execution(StrictModel):
    """Where and how a plan runs; none of it changes the output's bytes."""

    what: ClassVar[str] = "execution options"

    device: str = "cpu"
    #: Bound on the engine's buffers (streaming operators).
    max_memory: str | int = DEFAULT_MAX_MEMORY
    executor: Literal["local", "ray"] = "local"
    #: Work units at once: threads (local), or Ray tasks; None: 1 thread, or the Ray cluster's cores.
    workers: int | None = Field(None, ge=1)
    ray_address: str | None = None
    progress: bool = False


@dataclass(frozen=True)
class Merged:
    """What a merge published; ``model_id``: the model at ``out``; ``pushed``: its Hub commit, if any."""

    plan: Plan
    snapshot_id: str
    manifest: Manifest
    out: Path
    rematerialised: bool
    model_id: str = ""
    pushed: Pushed | None = None
    # a merge with delta updates: the bound on its distance to the from-scratch merge measured after it
    update_bound: float | None = None
    # nothing was written: ``out`` held this snapshot already (``merge_config``'s re-run)
    unchanged: bool = False

    @property
    def alias(self) -> bool:
        """Whether ``out`` publishes the snapshot under another id than its own model's."""
        return bool(self.model_id) and self.model_id != self.manifest.model_id

    def summary(self) -> dict[str, Any]:
        """The cost summary ``--json-summary`` writes: bytes, seconds, and this process's usage."""
        realized = self.manifest.cost.realized
        return {
            "snapshot_id": self.snapshot_id,
            "model_id": self.model_id or self.manifest.model_id,
            "same_snapshot_as": self.manifest.model_id if self.alias else None,
            "rematerialised": self.rematerialised,
            "manifest_hash": self.manifest.manifest_hash,
            "plan_id": self.plan.digest,
            "budget_bytes": self.plan.budget_bytes,
            "error_bound": self.plan.error_bound,
            "update_bound": self.update_bound,
            "error_share": self.plan.error_share,
            "planned": self.plan.cost.to_json(),
            "realized": {k: v for k, v in realized.to_json().items() if k not in ("seconds", "requests_by_model")},
            "seconds": dict(realized.seconds),
            "predicted_seconds": dict(self.manifest.cost.estimated.seconds or {}),
            "process": process_usage(),
        }


def merge(  # noqa: PLR0913
    request: MergeRequest,
    db: Catalogish,
    out: str | Path,
    *,
    execution: Execution | None = None,
    analyze_missing: bool = True,
    strict: bool = False,
    json_summary: str | Path | None = None,
    force: bool = False,
    push_to_hub: HubTarget | None = None,
    reporter: Reporter = SILENT,
    rerun: bool = False,
) -> Merged:
    """Plan ``request``, execute it, publish the snapshot at ``out``, push it if asked; ``rerun``: ``out`` may exist."""
    execution = _preflight(execution, push_to_hub)
    if request.model_id is not None:
        check_model_id(request.model_id)  # refused before any work
    with open_catalog(db, writing=True, out=out, block_bytes=request.block_bytes, reporter=reporter) as catalog:
        out_path, summary = _refuse_outputs(catalog, out, json_summary, force, rerun)  # before any planning
        held = _held(catalog, out_path) if rerun else None
        model_id = request.model_id
        if model_id is None:
            model_id = output_model_id(catalog, out_path)
            why = (
                ""
                if model_id == _folder_id(out_path)
                else (" and a hash of its path: a model of that name was published from another folder")
            )
            reporter.note(f"model id: {model_id} (the output folder's name{why}; --model-id to choose another)")
        made = make_plan(
            catalog,
            request,
            analyze_missing=analyze_missing,
            strict=strict,
            device=execution.device,
            progress=execution.progress,
            reporter=reporter,
        )
        reporter.planned(made)
        if held is not None and held.plan_id == made.digest and _intact(out_path, held):
            manifest = Manifest.from_json(held.manifest_data())
            unchanged = Merged(
                made,
                manifest.snapshot_id,
                manifest,
                out_path,
                False,
                catalog.snapshots.model_at(manifest.snapshot_id, out_path) or "",
                unchanged=True,
            )
            return _pushed(catalog, unchanged, push_to_hub, reporter)
        merged = _run(catalog, made, out_path, model_id, execution, summary, replace=rerun)
        if held is not None and held.id != merged.snapshot_id:
            reporter.note(
                f"replaced snapshot {held.id} (model '{held.model_id}') at {out_path}; the catalog keeps "
                f"it: `mergepipe execute --plan {held.plan_id[:12]} --out DIR` re-materialises it"
            )
        if merged.alias:
            reporter.note(
                f"published snapshot {merged.snapshot_id} as '{merged.model_id}' too: the same merge as "
                f"model '{merged.manifest.model_id}' (same bytes and snapshot id; `mergepipe lineage "
                f"{merged.model_id}` shows it)"
            )
        return _pushed(catalog, merged, push_to_hub, reporter)


def merge_config(  # noqa: PLR0913
    config: str | Path,
    out: str | Path,
    *,
    db: Catalogish = None,
    budget: str | int | None = None,
    policy: str | None = None,
    model_id: str | None = None,
    seed: int | None = None,
    copy_tokenizer: bool = True,
    out_shard_bytes: int | None = None,
    execution: Execution | None = None,
    analyze_missing: bool = True,
    push_to_hub: HubTarget | None = None,
    reporter: Reporter = SILENT,
) -> Merged:
    """Merge what the config file says into ``out``, as ``mergepipe-yaml CONFIG OUT`` does."""
    flags = {
        "budget": budget,
        "policy": policy,
        "model_id": model_id,
        "seed": seed,
        "out_shard_bytes": out_shard_bytes,
        "copy_tokenizer": copy_tokenizer,
    }
    request = merge_request(flags, read_config(config))
    return merge(
        request,
        db,
        out,
        execution=execution,
        analyze_missing=analyze_missing,
        push_to_hub=push_to_hub,
        reporter=reporter,
        rerun=True,
    )


def output_model_id(catalog: Catalog, out: Path) -> str:
    """The folder's name, or with 8 hex digits of its path's hash when another folder published that name."""
    name = _folder_id(out)
    versions = catalog.models.versions(name)
    if (not versions and not catalog.models.exists(name)) or any(Path(m.uri) == out for m in versions):
        return name
    return f"{name[: _MAX_ID_CHARS - 9]}-{hashlib.sha256(str(out).encode()).hexdigest()[:8]}"


def _folder_id(out: Path) -> str:
    """A folder's name as a model id (characters an id may not have become ``-``), else ``merged``."""
    cleaned = ID_UNSAFE.sub("-", out.name).lstrip("-._:+")[:_MAX_ID_CHARS].rstrip("-._:+")
    return cleaned or "merged"


def execute(  # noqa: PLR0913
    plan_id: str,
    db: Catalogish,
    out: str | Path,
    *,
    model_id: str | None = None,
    execution: Execution | None = None,
    json_summary: str | Path | None = None,
    force: bool = False,
    push_to_hub: HubTarget | None = None,
    reporter: Reporter = SILENT,
) -> Merged:
    """Execute the stored plan ``plan_id`` and publish its snapshot at ``out``, then push it if asked."""
    execution = _preflight(execution, push_to_hub)
    with open_catalog(db, writing=True, out=out, reporter=reporter) as catalog:
        out_path, summary = _refuse_outputs(catalog, out, json_summary, force)
        stored = Plan.from_json(catalog.plans.get(plan_id))
        merged = _run(catalog, stored, out_path, model_id, execution, summary)
        return _pushed(catalog, merged, push_to_hub, reporter)


def _preflight(execution: Execution | None, hub: HubTarget | None) -> Execution:
    """Refuse, before the catalog is touched, a device this machine lacks (``cpu``: no torch) or a push offline."""
    execution = execution or Execution()
    if device_name(execution.device) != "cpu":
        import_module("mergepipe.engine.engine").compute_device(execution.device)
    if hub is not None:
        check_online()
    return execution


def _pushed(catalog: Catalog, merged: Merged, hub: HubTarget | None, reporter: Reporter) -> Merged:
    """``merged``, pushed to ``hub`` when given."""
    if hub is None:
        return merged
    reporter.note(f"published snapshot {merged.snapshot_id} at {merged.out}")
    pushed = push_snapshot(catalog, catalog.snapshots.get(merged.snapshot_id), merged.out, hub)
    return replace(merged, pushed=pushed)


def _refuse_outputs(
    catalog: Catalog, out: str | Path, json_summary: str | Path | None, force: bool, rerun: bool = False
) -> tuple[Path, Path | None]:
    """The output directory and the summary file, refused before any work."""
    option = "OUT" if rerun else "--out"
    out_path = resolve_output(out) if rerun and os.path.isdir(os.path.expanduser(out)) else refuse_existing(out, option)
    refuse_inside_models(catalog, out_path, option=option, replacing=rerun)
    summary = None if json_summary is None else writable_file(catalog, json_summary, force, "--json-summary")
    return out_path, summary


def _held(catalog: Catalog, out: Path) -> SnapshotRecord | None:
    """The snapshot of this catalog whose directory ``out`` is, if any; OutputExistsError for anything else."""
    if not out.is_dir():
        return None
    live = [
        loc
        for loc in catalog.snapshots.location_intents("committed")
        if Path(loc.path) == out and loc.removed_at is None
    ]
    held = catalog.snapshots.get(live[0].snapshot_id) if live else None
    if held is None and (out / MANIFEST_FILENAME).is_file():
        raise OutputExistsError(
            f"OUT {out} holds a snapshot that catalog {catalog.path} did not publish; give the "
            "catalog that did (--db), or choose another OUT"
        )
    foreign = foreign_files(out, None if held is None else Manifest.from_json(held.manifest_data()))
    if foreign:
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        raise OutputExistsError(
            f"OUT {out} holds files MergePipe did not write ({', '.join(foreign[:5])}{more}); "
            "move them away, or choose another OUT"
        )
    return held


def _intact(out: Path, held: SnapshotRecord) -> bool:
    """Whether ``out`` still has every file of snapshot ``held`` at its size (a missing or cut one is made again)."""
    files = Manifest.from_json(held.manifest_data()).files
    return (out / MANIFEST_FILENAME).is_file() and all(
        (out / f.name).is_file() and (out / f.name).stat().st_size == f.size for f in files
    )


def _run(
    catalog: Catalog,
    made: Plan,
    out: Path,
    model_id: str | None,
    execution: Execution,
    summary: Path | None,
    replace: bool = False,
) -> Merged:
    rerun = catalog.snapshots.committed_for_plan(made.digest) is not None
    probe = import_module("mergepipe.engine.probe")  # the engine, and torch, from here on
    probe.probe_kernels(catalog, execution.device, [made.operator])  # once per device here: the prior's compute
    made = with_prediction(catalog, made, execution.device)  # this machine's prediction, for the device it runs on
    with open_engine(catalog, execution) as engine:
        snapshot_id, manifest = engine.execute(made, out=out, model_id=model_id, replace=replace)
    published = catalog.snapshots.model_at(snapshot_id, out) or manifest.model_id
    updated = made.reuse is not None and bool(made.reuse.updated)
    bound = catalog.snapshots.error_norm(manifest.model_id) if updated else None
    merged = Merged(made, snapshot_id, manifest, out, rerun, published, update_bound=bound)
    if summary is not None:
        write_report(summary, json.dumps(merged.summary(), indent=2, sort_keys=True))
    return merged


@contextmanager
def open_engine(
    catalog: Catalog, execution: Execution, on_step: Callable[[str], None] | None = None
) -> Iterator[Engine]:
    """The engine on the executor ``execution`` asks for; the engine, torch and Ray load only here."""
    if execution.executor == "local" and execution.ray_address is not None:
        raise ConfigError("--ray-address needs --executor ray")
    if execution.executor == "local":
        opened: Any = nullcontext(import_module("mergepipe.engine.stream").LocalExecutor(execution.workers or 1))
    else:
        opened = import_module("mergepipe.engine.ray_executor").ray_executor(execution.ray_address, execution.workers)
    with opened as executor:
        yield import_module("mergepipe.engine.engine").Engine(
            catalog,
            device=execution.device,
            max_memory=execution.max_memory,
            progress=execution.progress,
            executor=executor,
            on_step=on_step,
        )
