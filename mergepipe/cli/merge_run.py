"""The torch side of `merge` and `execute`: run the engine on a plan and print what it published; and
analyse experts a plan is missing. ``merge_cmds.py`` imports this module only once a plan exists (it
says why)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from mergepipe.analysis.analyze import analyze
from mergepipe.catalog import Catalog
from mergepipe.cli.common import plain_console, predicted_text
from mergepipe.engine.engine import Engine
from mergepipe.engine.executor import Executor, LocalExecutor
from mergepipe.engine.probe import probe_kernels
from mergepipe.engine.ray_executor import ray_executor
from mergepipe.errors import ConfigError
from mergepipe.spec.operators import OPERATORS
from mergepipe.planner.seconds import with_prediction
from mergepipe.spec.plan import Plan
from mergepipe.units import format_bytes
from mergepipe.usage import process_usage
from mergepipe.txn.outpath import write_report


@contextmanager
def open_executor(kwargs: dict[str, Any]) -> Iterator[Executor]:
    """The executor the options ask for, for the duration of one merge: threads of this process, or Ray
    (connected to, or a Ray instance of the command's own, only when ``--executor ray`` is asked for, and
    disconnected when the merge is done; Ray itself is imported only then)."""
    if kwargs["executor"] == "local":
        if kwargs["ray_address"] is not None:
            raise ConfigError("--ray-address needs --executor ray")
        yield LocalExecutor(kwargs["workers"] or 1)
        return
    with ray_executor(kwargs["ray_address"], kwargs["workers"]) as executor:
        yield executor


def analyze_missing(catalog: Catalog, base: str, missing: list[str], no_progress: bool) -> None:
    """Analyse ``missing`` (experts ``merge_cmds`` found not analysed against ``base``) and say so; probe the
    kernels as `analyze` does (``engine/probe.py``), so that the plan to come predicts its compute."""
    report = analyze(catalog, missing, base_id=base, progress=not no_progress)
    probe_kernels(catalog, "cpu", OPERATORS)
    click.echo(f"analysed {', '.join(missing)} against '{base}' in {report.seconds:.1f} s "
               "(once: later plans reuse it)", err=True)


def execute_plan(catalog: Catalog, plan: Plan, out: Path, model_id: str | None, kwargs: dict[str, Any]) -> None:
    """Run the engine and print what it published. A plan executed before re-materialises its
    snapshot (the same bytes, another location, no new version): say so."""
    rerun = catalog.snapshots.committed_for_plan(plan.digest) is not None
    probe_kernels(catalog, kwargs["device"], [plan.operator])  # once per device here: the prior's compute
    plan = with_prediction(catalog, plan, kwargs["device"])  # this machine's model now, for the device it runs on
    with open_executor(kwargs) as executor:  # threads here, or Ray tasks (Ray connected for this merge only)
        engine = Engine(catalog, device=kwargs["device"], max_memory=kwargs["max_memory"],
                        progress=not kwargs["no_progress"], executor=executor)
        snapshot_id, manifest = engine.execute(plan, out=out, model_id=model_id)
    if rerun:
        click.echo(f"re-materialised snapshot {snapshot_id} of model '{manifest.model_id}' at {out}: plan "
                   f"{plan.digest[:12]} was executed before, so this is the same snapshot (byte-identical) at "
                   "another location, not a new version")
    realized = manifest.cost.realized
    table = Table(title=f"snapshot {snapshot_id} {'re-materialised' if rerun else 'published'} at {out}",
                  show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("model id", manifest.model_id)
    table.add_row("manifest hash", manifest.manifest_hash)
    table.add_row("expert bytes estimated / realized",
                  f"{format_bytes(plan.cost.expert_bytes)} / {format_bytes(realized.expert_bytes)}")
    table.add_row("base bytes / output bytes",
                  f"{format_bytes(realized.base_bytes)} / {format_bytes(realized.output_bytes)}")
    table.add_row("time", ", ".join(f"{k} {v:.2f}s" for k, v in realized.seconds.items()))
    table.add_row("predicted seconds", predicted_text(manifest.cost.estimated.seconds))
    plain_console().print(table)
    summary_path = kwargs.get("json_summary")
    if summary_path is not None:
        write_report(Path(summary_path), json.dumps(_summary(plan, snapshot_id, manifest, rerun), indent=2,
                                                    sort_keys=True))


def _summary(plan: Plan, snapshot_id: str, manifest, rematerialised: bool = False) -> dict:
    realized = manifest.cost.realized
    return {
        "snapshot_id": snapshot_id,
        "model_id": manifest.model_id,
        "rematerialised": rematerialised,
        "manifest_hash": manifest.manifest_hash,
        "plan_id": plan.digest,
        "budget_bytes": plan.budget_bytes,
        "error_bound": plan.error_bound,
        "error_share": plan.error_share,
        "planned": plan.cost.to_json(),
        "realized": {
            "base_bytes": realized.base_bytes,
            "expert_bytes": realized.expert_bytes,
            "output_bytes": realized.output_bytes,
            "expert_bytes_by_model": dict(realized.expert_bytes_by_model),
        },
        "seconds": dict(realized.seconds),
        "predicted_seconds": dict(manifest.cost.estimated.seconds or {}),
        "process": process_usage(),  # this command's own CPU seconds, peak RSS and storage I/O
    }


