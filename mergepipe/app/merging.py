"""`merge` and `execute`: plan (or load a stored plan), execute it and publish the snapshot.

``merge`` is what ``mergepipe merge`` does, as one call: recover, refuse an
output path that exists or lies inside a model, resolve and register the
inputs, analyse what is missing (by default), plan, say the plan, execute it
on the executor asked for and publish. ``execute`` runs a plan stored with
``plan --save``; a plan executed before re-materialises its snapshot at the
new path (the same bytes, another location, no new version).

Importing this module loads the engine and torch, which planning never
needs: the command line imports it only for the commands that execute.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from mergepipe.app.planning import make_plan
from mergepipe.app.session import SILENT, Catalogish, Reporter, open_catalog
from mergepipe.catalog import Catalog
from mergepipe.engine.defaults import DEFAULT_MAX_MEMORY
from mergepipe.engine.engine import Engine
from mergepipe.engine.executor import Executor, LocalExecutor
from mergepipe.engine.probe import probe_kernels
from mergepipe.engine.ray_executor import ray_executor
from mergepipe.errors import ConfigError
from mergepipe.manifest.manifest import Manifest
from mergepipe.planner.seconds import with_prediction
from mergepipe.spec.plan import Plan
from mergepipe.spec.request import MergeRequest, StrictModel
from mergepipe.txn.outpath import refuse_inside_models, writable_file, write_report
from mergepipe.txn.publish import refuse_existing
from mergepipe.usage import process_usage


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
    been executed before (the same snapshot at another location)."""

    plan: Plan
    snapshot_id: str
    manifest: Manifest
    out: Path
    rematerialised: bool

    def summary(self) -> dict[str, Any]:
        """The cost summary ``--json-summary`` writes: bytes, seconds, and this process's usage."""
        realized = self.manifest.cost.realized
        return {
            "snapshot_id": self.snapshot_id,
            "model_id": self.manifest.model_id,
            "rematerialised": self.rematerialised,
            "manifest_hash": self.manifest.manifest_hash,
            "plan_id": self.plan.digest,
            "budget_bytes": self.plan.budget_bytes,
            "error_bound": self.plan.error_bound,
            "error_share": self.plan.error_share,
            "planned": self.plan.cost.to_json(),
            "realized": {
                "base_bytes": realized.base_bytes,
                "expert_bytes": realized.expert_bytes,
                "output_bytes": realized.output_bytes,
                "expert_bytes_by_model": dict(realized.expert_bytes_by_model),
            },
            "seconds": dict(realized.seconds),
            "predicted_seconds": dict(self.manifest.cost.estimated.seconds or {}),
            "process": process_usage(),
        }


# the public call behind `mergepipe merge` (PLR0913): its options are keyword-only, as the command's flags are
def merge(  # noqa: PLR0913
    request: MergeRequest, db: Catalogish, out: str | Path, *, execution: Execution | None = None,
    analyze_missing: bool = True, strict: bool = False, json_summary: str | Path | None = None,
    force: bool = False, reporter: Reporter = SILENT,
) -> Merged:
    """Plan ``request``, execute it and publish the snapshot at ``out`` (see the module docstring)."""
    execution = execution or Execution()
    if request.model_id is None:
        raise ConfigError("give --model-id (or `model_id:` in the config's `mergepipe:` section)")
    with open_catalog(db, writing=True, out=out, block_bytes=request.block_bytes, reporter=reporter) as catalog:
        out_path, summary = _refuse_outputs(catalog, out, json_summary, force)  # before any planning
        made = make_plan(catalog, request, analyze_missing=analyze_missing, strict=strict,
                         device=execution.device, progress=execution.progress, reporter=reporter)
        reporter.planned(made)
        return _run(catalog, made, out_path, request.model_id, execution, summary)


def execute(plan_id: str, db: Catalogish, out: str | Path, *, model_id: str | None = None,
            execution: Execution | None = None, json_summary: str | Path | None = None, force: bool = False,
            reporter: Reporter = SILENT) -> Merged:
    """Execute the stored plan ``plan_id`` (a digest or unique prefix) and publish its snapshot at ``out``."""
    execution = execution or Execution()
    with open_catalog(db, writing=True, out=out, reporter=reporter) as catalog:
        out_path, summary = _refuse_outputs(catalog, out, json_summary, force)
        stored = Plan.from_json(catalog.plans.get(plan_id))
        return _run(catalog, stored, out_path, model_id, execution, summary)


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
    merged = Merged(made, snapshot_id, manifest, out, rerun)
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

