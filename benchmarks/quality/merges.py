"""Merge and score: the catalog, the budgeted merges and their held-out losses."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from benchmarks.quality import models
from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.deltastore import build_store
from mergepipe.analysis.register import register_model
from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.planner.planner import Planner
from mergepipe.txn.publish import remove_tree
from mergepipe.spec.request import MergeRequest

#: operator -> planner keyword arguments (K = 4 experts)
OPERATORS = {
    "ties": {"params": {"density": 0.5}},
    "task_arithmetic": {"params": {"lambda": 0.25}},  # the mean of the deltas
}


@dataclass(frozen=True)
class MergeRun:
    operator: str
    budget: str
    policy: str

    @property
    def label(self) -> str:
        return f"{self.operator} {self.budget}" + ("" if self.budget == "100%" else f" {self.policy}")


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            out.update({n: handle.get_tensor(n) for n in handle.keys()})  # noqa: SIM118 (a safe_open handle is not a dict)
    return out


def deviation(merged: Path, full: Path, base: Path) -> float:
    """``||M - M100|| / ||M100 - base||`` over every tensor, in float64."""
    m, f, b = tensors(merged), tensors(full), tensors(base)
    num = math.fsum(float(((m[n].double() - f[n].double()) ** 2).sum()) for n in f)
    den = math.fsum(float(((f[n].double() - b[n].double()) ** 2).sum()) for n in f)
    return math.sqrt(num / den) if den else 0.0


def run_merges(work: Path, base: Path, experts: dict[str, Path], held: dict, runs: list[MergeRun], log):
    """Rows for the base, the experts and every merge; analysis figures."""
    rows = [{"label": "base", "loss": models.held_out_loss(base, held)}]
    for name, path in experts.items():
        rows.append({"label": f"expert {name}", "loss": models.held_out_loss(path, held)})
    catalog = Catalog.create(work / "catalog.db")
    register_model(catalog, "base", base)
    for name, path in experts.items():
        register_model(catalog, name, path)
    started = time.perf_counter()
    report = analyze(catalog, list(experts), base_id="base", progress=False)
    analysis = {"seconds": time.perf_counter() - started, "bytes_read": report.bytes_read}
    log(f"analysed 4 experts in {analysis['seconds']:.1f} s")
    if any(run.policy == "entries" for run in runs):
        started = time.perf_counter()
        stores = [build_store(catalog, name, "base", work / "stores") for name in experts]
        analysis["store_seconds"] = time.perf_counter() - started
        analysis["store_bytes"] = sum(s.record.file_size for s in stores)
        analysis["expert_bytes"] = sum(catalog.models.get(name).total_bytes for name in experts)
        log(f"built 4 delta stores in {analysis['store_seconds']:.1f} s: {analysis['store_bytes'] / 1e6:.0f} MB "
            f"({100 * analysis['store_bytes'] / analysis['expert_bytes']:.0f}% of the experts' bytes)")
    full: dict[str, tuple[Path, dict]] = {}
    for run in runs:
        plan = Planner(catalog).plan(MergeRequest(base="base", experts=list(experts), operator=run.operator, budget=run.budget, policy=run.policy, **OPERATORS[run.operator]))
        out = work / run.label.replace(" ", "-").replace("%", "")
        started = time.perf_counter()
        _, manifest = Engine(catalog).execute(plan, out=out, model_id=out.name)
        merge_seconds = time.perf_counter() - started
        loss = models.held_out_loss(out, held)
        row = {"label": run.label, "operator": run.operator, "budget": run.budget, "policy": run.policy,
               "loss": loss, "expert_bytes": manifest.cost.realized.expert_bytes,
               "budget_bytes": plan.budget_bytes, "error_bound": plan.error_bound,
               "error_bound_kind": plan.error_bound_kind, "error_share": plan.error_share,
               "estimate": plan.estimate, "merge_seconds": merge_seconds}
        if run.budget == "100%":
            full[run.operator] = (out, loss)
        else:
            ref, ref_loss = full[run.operator]
            row["gap_pct"] = {n: 100 * (loss[n] - ref_loss[n]) / ref_loss[n] for n in loss}
            row["deviation"] = deviation(out, ref, base)
            remove_tree(out)
        rows.append(row)
        log(f"{run.label}: " + ", ".join(f"{n} {v:.3f}" for n, v in loss.items()))
    catalog.close()
    return rows, analysis
