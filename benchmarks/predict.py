"""Predicted vs realized seconds: the time model of a fresh catalog learning from its own merges.

Usage: ``python -m benchmarks.predict [--quick]``.

On the suite's workload (``benchmarks/suite.py``: the same generated
checkpoints; Qwen3-0.6B's layout, or qwen3-tiny with ``--quick``), in a fresh
catalog: register the base and experts, ``mergepipe analyze`` them (which
records this machine's read rate and probes the kernels: the prior), then
run every MergePipe merge of the suite, in the suite's order, each a
``mergepipe merge`` process of its own with a cold page cache. Per merge: the
seconds its plan predicted (``--json-summary``'s ``predicted_seconds``, from
every merge before it), the engine's realized seconds (the manifest's
``total``: what the model predicts; the process's start-up is not in it) and
their ratio. Then the first merge's ratio and the median absolute error of
the merges after the third. Targets: the first within 2x of realized, the
median error at most 25%.

Results: ``benchmarks/results/predict-<suite>-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.table import Table

from benchmarks import mergepipe_runner, report
from benchmarks.checkpoints import remove_tree, weight_bytes
from benchmarks.suite import BASE_ID, RESULTS_DIR, SUITES, Row, SuiteRun, SuiteSpec
from benchmarks.workloads import DEFAULT_ROOT, EXPERTS, ensure_workload

FIRST_TARGET = 2.0  # the first merge (the prior alone): predicted / realized within this factor either way
ERROR_TARGET = 0.25  # the median |predicted - realized| / realized of the merges after the third
AFTER = 3


@dataclass
class Merge:
    operator: str
    k: int
    budget: str
    policy: str
    status: str = "ok"
    expert_bytes: int | None = None
    predicted: dict | None = None  # the plan's predicted_seconds: total, uncertainty, terms, merges fitted to
    realized_seconds: float | None = None  # the engine's total (the manifest's)
    wall_seconds: float | None = None  # the whole process, start-up included

    @property
    def ratio(self) -> float | None:
        if not self.predicted or not self.realized_seconds:
            return None
        return self.predicted["total"] / self.realized_seconds


def sequence(spec: SuiteSpec, fixed_budget: int) -> list[tuple[str, int, str, str]]:
    """Every MergePipe merge of the suite: ``(operator, K, budget, policy)``, in the suite's order."""
    out = []
    for g in spec.groups:
        out += [(g.operator, g.k, b, p) for b, p in g.mergepipe]
        if g.operator == spec.fixed_budget_operator and g.k in spec.fixed_budget_ks:
            out.append((g.operator, g.k, str(fixed_budget), spec.fixed_budget_policy))
    return out


def run_merge(run: SuiteRun, operator: str, k: int, budget: str, policy: str, index: int) -> Merge:
    merge = Merge(operator, k, budget, policy)
    target, summary = run.scratch / f"out-{index}", run.scratch / "summary.json"
    summary.unlink(missing_ok=True)
    cmd = mergepipe_runner.merge(run.db, BASE_ID, [p.name for p in EXPERTS[:k]], target, f"predict-{index}",
                                 operator, budget, policy, summary, run.spec.density, run.spec.lam)
    row = Row("predict", "mergepipe", operator, k, budget, policy)
    run.measure(row, [*cmd, "--no-progress"], target)
    remove_tree(target)
    merge.status, merge.wall_seconds = row.status, row.wall_seconds
    if row.status == "ok" and summary.exists():
        result = mergepipe_runner.MergeSummary.from_json(summary)
        merge.expert_bytes = result.realized_expert_bytes
        merge.predicted = result.predicted_seconds or None
        merge.realized_seconds = result.seconds.get("total")
    return merge


def scores(merges: list[Merge]) -> tuple[float | None, float | None]:
    """The first merge's ratio, and the median absolute relative error of the merges after the third."""
    ratios = [m.ratio for m in merges]
    later = [abs(r - 1) for r in ratios[AFTER:] if r is not None]
    return ratios[0] if ratios else None, statistics.median(later) if later else None


def print_table(merges: list[Merge], console) -> None:
    table = Table(title="predicted vs realized seconds of the engine (start-up excluded), fresh catalog")
    for column in ("#", "op", "K", "budget", "policy", "expert GB", "predicted s", "fitted to", "realized s",
                   "predicted / realized", "process wall s"):
        table.add_column(column, justify="left" if column in ("op", "policy") else "right")
    for i, m in enumerate(merges, start=1):
        p = m.predicted
        budget = m.budget if m.budget.endswith("%") else f"{int(m.budget) / 1e6:.0f}MB fixed"
        table.add_row(str(i), m.operator, str(m.k), budget, m.policy,
                      "-" if m.expert_bytes is None else f"{m.expert_bytes / 1e9:.2f}",
                      "-" if not p else f"{p['total']:.2f} ± {100 * p['uncertainty']:.0f}%",
                      "-" if not p else _fitted(int(p["merges"])),
                      "-" if m.realized_seconds is None else f"{m.realized_seconds:.2f}",
                      m.status if m.ratio is None else f"{m.ratio:.2f}",
                      "-" if m.wall_seconds is None else f"{m.wall_seconds:.1f}")
    console.print(table)
    first, median = scores(merges)
    if first is not None:
        verdict = "met" if 1 / FIRST_TARGET <= first <= FIRST_TARGET else "NOT met"
        console.print(f"first merge (prior only): predicted / realized = {first:.2f} (target within "
                      f"{FIRST_TARGET:g}x: {verdict})")
    if median is not None:
        verdict = "met" if median <= ERROR_TARGET else "NOT met"
        console.print(f"median |error| of merges {AFTER + 1}-{len(merges)}: {100 * median:.0f}% "
                      f"(target <= {100 * ERROR_TARGET:.0f}%: {verdict})")


def _fitted(merges: int) -> str:
    return "prior" if not merges else f"{merges} merge{'s' * (merges != 1)}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the quick suite's merges (qwen3-tiny)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    spec = SUITES["quick" if args.quick else "standard"]
    console = report.console()
    started = time.perf_counter()
    workload = ensure_workload(spec.layout, max(g.k for g in spec.groups), args.seed, args.root, log=console.log)
    scratch = workload.root / f"scratch-predict-{spec.name}"
    remove_tree(scratch)
    scratch.mkdir()
    run = SuiteRun(spec, workload, scratch, ("mergepipe",), console.log)
    run.setup_mergepipe()  # init-db, register, analyze: the prior
    if run.mergepipe_ready is not None:
        raise SystemExit(f"MergePipe is not ready: {run.mergepipe_ready}")
    load_before = os.getloadavg()
    fixed = int(spec.fixed_budget_fraction * weight_bytes(workload.expert_dirs(min(spec.fixed_budget_ks))))
    merges = []
    for index, (operator, k, budget, policy) in enumerate(sequence(spec, fixed)):
        merges.append(run_merge(run, operator, k, budget, policy, index))
        m = merges[-1]
        console.log(f"{operator} K={k} {budget} {policy}: predicted "
                    f"{(m.predicted or {}).get('total', float('nan')):.2f} s, realized {m.realized_seconds or 0:.2f} s")
    remove_tree(scratch)
    print_table(merges, console)
    first, median = scores(merges)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / f"predict-{spec.name}-{stamp}.json"
    path.write_text(json.dumps({
        "suite": spec.name, "timestamp": stamp,
        "command": "python -m benchmarks.predict " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": report.machine_info(workload.root), "analysis": run.analysis,
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "merges": [{**asdict(m), "ratio": m.ratio} for m in merges],
        "first_ratio": first, "median_error_after_third": median,
        "total_seconds": time.perf_counter() - started,
    }, indent=1))
    console.log(f"wrote {path}")


if __name__ == "__main__":
    main()
