"""`merge` and `execute`: plan (or load a stored plan), execute it and publish the snapshot.

``merge`` is what ``mergepipe merge`` does, as one call: refuse a device
this machine does not have (before any I/O), recover, refuse an output path
that exists or lies inside a model, resolve and register the inputs,
analyse what is missing (by default), plan, say the plan, execute it on the
executor asked for and publish. Without a model id (flag or config)
the merged model is named after the output folder, as mergekit names its
model card after it. ``execute`` runs a plan stored with ``plan --save``; a
plan executed before re-materialises its snapshot at the new path (the same
bytes, another location, no new version), published under another model id
as an alias of it. ``merge_config`` is ``mergepipe-yaml CONFIG OUT``: a
config file (a mergekit YAML as it is) merged in one call. Each may push the
published snapshot to the Hugging Face Hub (``push_to_hub``, as
``app/publishing.py`` pushes): checked before any work, pushed once the
snapshot is published; a failed push leaves it published and says how to retry.

Importing this module loads the engine and torch, which planning never
needs: the command line imports it only for the commands that execute.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from mergepipe.app.planning import make_plan, read_config
from mergepipe.app.publishing import HubTarget, Pushed, push_snapshot
from mergepipe.app.session import SILENT, Catalogish, Reporter, open_catalog
from mergepipe.catalog import Catalog
from mergepipe.engine.defaults import DEFAULT_MAX_MEMORY
from mergepipe.engine.engine import Engine, compute_device
from mergepipe.engine.executor import Executor, LocalExecutor
from mergepipe.engine.probe import probe_kernels
from mergepipe.engine.ray_executor import ray_executor
from mergepipe.errors import ConfigError
from mergepipe.manifest.manifest import Manifest
from mergepipe.planner.seconds import with_prediction
from mergepipe.spec.merge_config import merge_request
from mergepipe.spec.plan import Plan
from mergepipe.spec.request import MergeRequest, StrictModel
from mergepipe.txn.hub_push import check_online
from mergepipe.txn.outpath import refuse_inside_models, writable_file, write_report
from mergepipe.txn.publish import refuse_existing
from mergepipe.usage import process_usage

#: Runs of characters a folder name may have and a model id may not (ids: letters, digits and . _ : + -;
#: ``/`` and ``@`` are kept out too: a folder's name is one name, never a path or a version).
_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._:+-]+")
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
    """What a merge published: its plan, snapshot id and manifest; ``rematerialised`` when the plan had
    been executed before (the same snapshot at another location); ``model_id``, the model published
    at ``out``: the manifest's (the snapshot's own model), or an alias of it; ``pushed``, the Hub commit
    it was pushed to (``push_to_hub``)."""

    plan: Plan
    snapshot_id: str
    manifest: Manifest
    out: Path
    rematerialised: bool
    model_id: str = ""
    pushed: Pushed | None = None
    # a merge with delta updates: the bound on its distance to the from-scratch merge measured after it
    # (planner/delta_update.py: never above the plan's, usually far below); None otherwise
    update_bound: float | None = None

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
            "realized": {
                "base_bytes": realized.base_bytes,
                "expert_bytes": realized.expert_bytes,
                "output_bytes": realized.output_bytes,
                "expert_bytes_by_model": dict(realized.expert_bytes_by_model),
                # an incremental merge: output bytes reflinked, copied by the kernel, written
                **({"output_bytes_by_method": dict(realized.output_bytes_by_method)}
                   if realized.output_bytes_by_method else {}),
            },
            "seconds": dict(realized.seconds),
            "predicted_seconds": dict(self.manifest.cost.estimated.seconds or {}),
            "process": process_usage(),
        }


# the public call behind `mergepipe merge` (PLR0913): its options are keyword-only, as the command's flags are
def merge(  # noqa: PLR0913
    request: MergeRequest, db: Catalogish, out: str | Path, *, execution: Execution | None = None,
    analyze_missing: bool = True, strict: bool = False, json_summary: str | Path | None = None,
    force: bool = False, push_to_hub: HubTarget | None = None, reporter: Reporter = SILENT,
) -> Merged:
    """Plan ``request``, execute it and publish the snapshot at ``out`` (see the module docstring), then push
    it to ``push_to_hub`` if given; ``db`` None is the default catalog."""
    execution = execution or Execution()
    compute_device(execution.device)  # a device this machine lacks is refused before the catalog is touched
    if push_to_hub is not None:
        check_online()  # as is a push that could not be made
    model_id = request.model_id
    if model_id is None:
        model_id = output_model_id(out)
        reporter.note(f"model id: {model_id} (the --out folder's name; --model-id to choose another)")
    with open_catalog(db, writing=True, out=out, block_bytes=request.block_bytes, reporter=reporter) as catalog:
        out_path, summary = _refuse_outputs(catalog, out, json_summary, force)  # before any planning
        made = make_plan(catalog, request, analyze_missing=analyze_missing, strict=strict,
                         device=execution.device, progress=execution.progress, reporter=reporter)
        reporter.planned(made)
        merged = _run(catalog, made, out_path, model_id, execution, summary)
        if merged.alias:
            reporter.note(f"published snapshot {merged.snapshot_id} as '{merged.model_id}' too: the same merge as "
                          f"model '{merged.manifest.model_id}' (same bytes and snapshot id; `mergepipe lineage "
                          f"{merged.model_id}` shows it)")
        return _pushed(catalog, merged, push_to_hub, reporter)


# the public one-call of `mergepipe-yaml` (PLR0913): its options are keyword-only, as the command's flags are
def merge_config(  # noqa: PLR0913
    config: str | Path, out: str | Path, *, db: Catalogish = None, budget: str | int | None = None,
    policy: str | None = None, model_id: str | None = None, seed: int | None = None, copy_tokenizer: bool = True,
    out_shard_bytes: int | None = None, execution: Execution | None = None, analyze_missing: bool = True,
    push_to_hub: HubTarget | None = None, reporter: Reporter = SILENT,
) -> Merged:
    """Merge what the config file ``config`` says (a mergekit YAML as it is, or MergePipe's own form) into
    ``out``, as ``mergepipe-yaml CONFIG OUT`` does: in the default catalog unless ``db`` names one, as the
    model the config's ``mergepipe: model_id``, ``model_id`` or else ``out``'s folder name names. The
    keywords win over the config's ``mergepipe:`` section; ``copy_tokenizer=False`` leaves the base's
    tokenizer files out; ``push_to_hub``: then pushed there."""
    flags = {"budget": budget, "policy": policy, "model_id": model_id, "seed": seed,
             "out_shard_bytes": out_shard_bytes, "copy_tokenizer": copy_tokenizer}
    request = merge_request(flags, read_config(config))
    return merge(request, db, out, execution=execution, analyze_missing=analyze_missing, push_to_hub=push_to_hub,
                 reporter=reporter)


def output_model_id(out: str | os.PathLike[str]) -> str:
    """The model id a merge gets from its output folder's name: characters an id may not have become
    ``-``, it starts with a letter or digit, and an empty result is ``merged``."""
    name = Path(os.path.abspath(out)).name
    cleaned = _ID_UNSAFE.sub("-", name).lstrip("-._:+")[:_MAX_ID_CHARS].rstrip("-._:+")
    return cleaned or "merged"


# the public call behind `mergepipe execute` (PLR0913): its options are keyword-only, as the command's flags are
def execute(  # noqa: PLR0913
    plan_id: str, db: Catalogish, out: str | Path, *, model_id: str | None = None,
    execution: Execution | None = None, json_summary: str | Path | None = None, force: bool = False,
    push_to_hub: HubTarget | None = None, reporter: Reporter = SILENT,
) -> Merged:
    """Execute the stored plan ``plan_id`` (a digest or unique prefix) and publish its snapshot at ``out``, then
    push it to ``push_to_hub`` if given."""
    execution = execution or Execution()
    compute_device(execution.device)
    if push_to_hub is not None:
        check_online()
    with open_catalog(db, writing=True, out=out, reporter=reporter) as catalog:
        out_path, summary = _refuse_outputs(catalog, out, json_summary, force)
        stored = Plan.from_json(catalog.plans.get(plan_id))
        merged = _run(catalog, stored, out_path, model_id, execution, summary)
        return _pushed(catalog, merged, push_to_hub, reporter)


def _pushed(catalog: Catalog, merged: Merged, hub: HubTarget | None, reporter: Reporter) -> Merged:
    """``merged``, pushed to ``hub`` first when given (its snapshot is published whatever the push does)."""
    if hub is None:
        return merged
    reporter.note(f"published snapshot {merged.snapshot_id} at {merged.out}")
    pushed = push_snapshot(catalog, catalog.snapshots.get(merged.snapshot_id), merged.out, hub)
    return replace(merged, pushed=pushed)


def _refuse_outputs(catalog: Catalog, out: str | Path, json_summary: str | Path | None,
                    force: bool) -> tuple[Path, Path | None]:
    """The output directory and the summary file, refused before any work: an output that exists or lies
    inside a model, a summary that would overwrite a file (without ``force``) or write inside a model."""
    out_path = refuse_existing(out)
    refuse_inside_models(catalog, out_path)
    summary = None if json_summary is None else writable_file(catalog, json_summary, force, "--json-summary")
    return out_path, summary


def _run(catalog: Catalog, made: Plan, out: Path, model_id: str | None, execution: Execution,
         summary: Path | None) -> Merged:
    rerun = catalog.snapshots.committed_for_plan(made.digest) is not None
    probe_kernels(catalog, execution.device, [made.operator])  # once per device here: the prior's compute
    made = with_prediction(catalog, made, execution.device)  # this machine's prediction, for the device it runs on
    with open_executor(execution) as executor:  # threads here, or Ray tasks (Ray connected for this merge only)
        engine = Engine(catalog, device=execution.device, max_memory=execution.max_memory,
                        progress=execution.progress, executor=executor)
        snapshot_id, manifest = engine.execute(made, out=out, model_id=model_id)
    published = catalog.snapshots.model_at(snapshot_id, out) or manifest.model_id
    updated = made.reuse is not None and bool(made.reuse.updated)
    bound = catalog.snapshots.error_norm(manifest.model_id) if updated else None
    merged = Merged(made, snapshot_id, manifest, out, rerun, published, update_bound=bound)
    if summary is not None:
        write_report(summary, json.dumps(merged.summary(), indent=2, sort_keys=True))
    return merged


@contextmanager
def open_executor(execution: Execution) -> Iterator[Executor]:
    """The executor ``execution`` asks for, for the duration of one merge: threads of this process, or Ray
    (connected to, or a Ray instance of the command's own, only when asked for, and disconnected when the
    merge is done; Ray itself is imported only then)."""
    if execution.executor == "local":
        if execution.ray_address is not None:
            raise ConfigError("--ray-address needs --executor ray")
        yield LocalExecutor(execution.workers or 1)
        return
    with ray_executor(execution.ray_address, execution.workers) as executor:
        yield executor

