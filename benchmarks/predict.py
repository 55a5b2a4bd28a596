"""Predicted vs realized seconds: MergePipe's cost model against the standard suite's merges.

Usage: ``python -m benchmarks.predict [--quick] [--only ties:8,task_arithmetic:4] [--passes N]``.

On the suite's workload (``benchmarks/suite.py``: the same checkpoints, the
same MergePipe rows: every (budget, policy) of each group, and the
fixed-budget series), it registers and analyses the experts, runs
``mergepipe calibrate`` once, then runs every MergePipe merge of the suite
with a cold page cache, its inputs read through first (as the suite does)
and compares the total the plan
predicted (``--json-summary``'s ``predicted_seconds.total``, start-up
included) with the wall seconds of the ``mergepipe merge`` process (with
``--serve``, of the `mergepipe` command a `mergepipe serve` started after the
calibration runs: its start-up is then the served one). Rows run
in the suite's order, so each merge's realized phases refine the rates the
next one is predicted with (``spec/seconds.py``): the table shows the model
as a user meets it after one calibration. Target (issue 14): within ±20% on
every row.

With ``--passes N`` the whole list of rows runs N times over, one pass after
another (each merge still predicted by the rates every merge before it
refined; each pass merges in a copy of the calibrated catalog with the rates the
passes before it left: a plan executed before would only re-materialise its
snapshot), and a second table gives each row's median predicted and median
realized seconds, the error of the medians, how many of its N single runs
were within ±20%, and the spread of its realized seconds (slowest over
fastest): on a noisy machine that spread says how close any prediction of
one run can be.

Results: ``benchmarks/results/predict-<suite>-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import sys
import time
from contextlib import closing
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from rich.table import Table

from benchmarks import mergepipe_runner, report
from benchmarks.checkpoints import remove_tree, weight_bytes
from benchmarks.coldcache import run_measured
from benchmarks.mergepipe_runner import Server
from benchmarks.suite import BASE_ID, RESULTS_DIR, SUITES, WARM_HOST_HELP, Row, SuiteRun, SuiteSpec, copy_catalog
from benchmarks.workloads import DEFAULT_ROOT, EXPERTS, ensure_workload
from mergepipe.catalog import Catalog
from mergepipe.spec.plan import Plan

TARGET = 0.20  # |predicted - realized| / realized on every row


@dataclass
class Prediction:
    operator: str
    k: int
    budget: str
    policy: str
    status: str = "ok"
    load1: float | None = None
    wall_seconds: float | None = None  # the merge process, start to exit
    predicted_seconds: dict = field(default_factory=dict)  # per phase and total, as the plan predicted
    realized_seconds: dict = field(default_factory=dict)  # the manifest's phases
    expert_bytes: int | None = None
    error: float | None = None  # (predicted total - wall) / wall
    work: dict = field(default_factory=dict)  # the bytes the plan's prediction was made for (spec/seconds.Work)
    served: bool = False  # run by `mergepipe serve`
    pass_index: int = 0  # which pass over the rows (``--passes``)


def calibrate(run: SuiteRun, device: str = "cpu") -> dict:
    """``mergepipe calibrate`` on the suite's catalog for ``device``, its scratch files beside the workload."""
    cmd = [*mergepipe_runner.executable(), "calibrate", "--db", str(run.db), "--dir", str(run.scratch),
           "--device", device, "--no-progress"]
    result = run_measured(cmd)
    if not result.ok:
        raise SystemExit(f"calibrate failed: {result.stderr.strip()[-500:]}")
    run.log(result.stdout)
    with Catalog.open(run.db) as catalog:
        values = {r.name: r.value for r in catalog.rates.records()}
    return {"wall_seconds": result.wall_seconds, "table": result.stdout, "rates": values}


def variants(spec: SuiteSpec, fixed_budget: int) -> list[tuple[str, int, str, str]]:
    """Every MergePipe merge of the suite: ``(operator, K, budget, policy)``, in the suite's order."""
    out = []
    for g in spec.groups:
        out += [(g.operator, g.k, b, p) for b, p in g.mergepipe]
        if g.operator == spec.fixed_budget_operator and g.k in spec.fixed_budget_ks:
            out.append((g.operator, g.k, str(fixed_budget), spec.fixed_budget_policy))
    return out


def run_row(run: SuiteRun, operator: str, k: int, budget: str, policy: str, index: int,
            device: str = "cpu") -> Prediction:
    row = Prediction(operator, k, budget, policy, served=run.server is not None)
    model_id = f"predict-{index}-{operator}-k{k}"
    target = run.scratch / f"out-{model_id}"
    summary = run.scratch / "summary.json"
    summary.unlink(missing_ok=True)
    cmd = mergepipe_runner.merge(run.db, BASE_ID, [p.name for p in EXPERTS[:k]], target, model_id, operator,
                                 budget, policy, summary, run.spec.density, run.spec.lam, device=device,
                                 server=run.server.socket if run.server else None)
    measured = Row("predict", "mergepipe", operator, k, budget, policy)
    run.measure(measured, cmd + ["--no-progress"], target)
    remove_tree(target)
    row.status, row.load1, row.wall_seconds = measured.status, measured.load1, measured.wall_seconds
    if measured.status != "ok" or not summary.exists():
        return row
    data = json.loads(summary.read_text())
    row.predicted_seconds, row.realized_seconds = data.get("predicted_seconds", {}), data.get("seconds", {})
    row.expert_bytes = data.get("realized", {}).get("expert_bytes")
    with Catalog.open(run.db) as catalog:  # the work, to replay the model's refinement offline from the results
        seconds = Plan.from_json(catalog.plans.get(data["plan_id"])).seconds
        row.work = seconds.work.to_json() if seconds is not None else {}
    if "total" in row.predicted_seconds and row.wall_seconds:
        row.error = (row.predicted_seconds["total"] - row.wall_seconds) / row.wall_seconds
    else:
        row.status = "ok, but the plan predicted nothing (uncalibrated?)"
    return row


def medians(rows: list[Prediction]) -> list[dict]:
    """Per row of the suite (operator, K, budget, policy), over its passes: the median predicted and
    realized totals, the error of the medians, the single runs within ``TARGET`` and the realized spread
    (slowest / fastest); rows without a prediction are left out."""
    groups: dict[tuple, list[Prediction]] = {}
    for r in rows:
        if r.error is not None:
            groups.setdefault((r.operator, r.k, r.budget, r.policy), []).append(r)
    out = []
    for (operator, k, budget, policy), runs in groups.items():
        predicted = statistics.median(r.predicted_seconds["total"] for r in runs)
        realized = statistics.median(r.wall_seconds for r in runs)
        walls = [r.wall_seconds for r in runs]
        out.append({"operator": operator, "k": k, "budget": budget, "policy": policy, "runs": len(runs),
                    "predicted_seconds": predicted, "realized_seconds": realized,
                    "error": (predicted - realized) / realized,
                    "runs_within": sum(abs(r.error) <= TARGET for r in runs), "spread": max(walls) / min(walls)})
    return out


def print_medians(summary: list[dict], console) -> None:
    table = Table(title="medians over the passes")
    for column in ("op", "K", "budget", "policy", "predicted s", "realized s", "error", "runs within ±20%",
                   "realized spread"):
        table.add_column(column, justify="left" if column in ("op", "policy") else "right")
    for m in summary:
        table.add_row(m["operator"], str(m["k"]), m["budget"], m["policy"], f"{m['predicted_seconds']:.1f}",
                      f"{m['realized_seconds']:.1f}", f"{100 * m['error']:+.0f}%", f"{m['runs_within']} of {m['runs']}",
                      f"{m['spread']:.2f}x")
    console.print(table)
    within = sum(abs(m["error"]) <= TARGET for m in summary)
    console.print(f"medians within ±{100 * TARGET:.0f}%: {within} of {len(summary)} rows"
                  + (f"; largest error {100 * max(abs(m['error']) for m in summary):.0f}%" if summary else ""))


def catalog_for_pass(index: int, calibrated: Path, current: Path) -> Path:
    """A copy of the ``calibrated`` catalog (analysed and calibrated, no merge yet) holding the rates of
    ``current`` as the merges so far refined them: pass ``index`` merges there, because a plan executed
    before in ``current`` would not merge again but re-materialise its snapshot."""
    target = copy_catalog(calibrated, calibrated.with_name(f"catalog-pass{index}.db"))
    columns = "machine, name, value, samples, updated_at"
    with closing(sqlite3.connect(current)) as source, closing(sqlite3.connect(target)) as copy, copy:
        rates = source.execute(f"SELECT {columns} FROM rates").fetchall()
        copy.execute("DELETE FROM rates")
        copy.executemany(f"INSERT INTO rates ({columns}) VALUES (?, ?, ?, ?, ?)", rates)
    return target


def print_table(rows: list[Prediction], console) -> None:
    served = " (each merge served by `mergepipe serve`)" if any(r.served for r in rows) else ""
    table = Table(title=f"predicted vs realized seconds (after one `mergepipe calibrate`){served}")
    for column in ("op", "K", "budget", "policy", "expert MB", "load", "start-up", "reads", "compute+write",
                   "publish", "predicted s", "realized s", "error"):
        table.add_column(column, justify="left" if column in ("op", "policy") else "right")
    for r in rows:
        p = r.predicted_seconds
        phases = ("-",) * 4 if "total" not in p else (
            f"{p['startup']:.1f}", f"{p['base_read'] + p['expert_read']:.1f}", f"{p['compute'] + p['write']:.1f}",
            f"{p['publish']:.1f}")
        table.add_row(r.operator, str(r.k), r.budget, r.policy,
                      "-" if r.expert_bytes is None else f"{r.expert_bytes / 1e6:,.0f}",
                      "-" if r.load1 is None else f"{r.load1:.1f}", *phases,
                      "-" if "total" not in p else f"{p['total']:.1f}",
                      "-" if r.wall_seconds is None else f"{r.wall_seconds:.1f}",
                      r.status if r.error is None else f"{100 * r.error:+.0f}%")
    console.print(table)
    errors = [abs(r.error) for r in rows if r.error is not None]
    within = sum(e <= TARGET for e in errors)
    console.print(f"within ±{100 * TARGET:.0f}%: {within} of {len(rows)} rows"
                  + (f"; largest error {100 * max(errors):.0f}%" if errors else ""))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the quick suite's rows (qwen3-tiny)")
    parser.add_argument("--only", default="", help="comma-separated groups, e.g. ties:8,task_arithmetic:4")
    parser.add_argument("--device", default="cpu", help="cpu or cuda: calibrate and merge on it")
    parser.add_argument("--serve", action="store_true",
                        help="run every merge through a `mergepipe serve` started after the calibration")
    parser.add_argument("--passes", type=int, default=1,
                        help="run the whole list of rows this many times over, and compare medians too")
    parser.add_argument("--no-warm-host", action="store_true", help=WARM_HOST_HELP)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.passes < 1:
        raise SystemExit(f"--passes {args.passes}: give 1 or more")
    spec = SUITES["quick" if args.quick else "standard"]
    if args.only:
        wanted = {tuple(item.split(":")) for item in args.only.split(",")}
        groups = tuple(g for g in spec.groups if (g.operator, str(g.k)) in wanted)
        if len(groups) != len(wanted):
            raise SystemExit(f"--only {args.only}: unknown group; this suite has "
                             + ", ".join(f"{g.operator}:{g.k}" for g in spec.groups))
        spec = replace(spec, groups=groups)
    console = report.console()
    started = time.perf_counter()
    workload = ensure_workload(spec.layout, max(g.k for g in spec.groups), args.seed, args.root, log=console.log)
    scratch = workload.root / f"scratch-predict-{spec.name}"
    remove_tree(scratch)
    scratch.mkdir()
    run = SuiteRun(spec, workload, scratch, ("mergepipe",), console.log, warm_host=not args.no_warm_host)
    run.setup_mergepipe()
    if run.mergepipe_ready is not None:
        raise SystemExit(f"MergePipe is not ready: {run.mergepipe_ready}")
    load_before = os.getloadavg()
    calibration = calibrate(run, args.device)
    calibrated = copy_catalog(run.db, scratch / "catalog-calibrated.db")
    if args.serve:
        run.server = Server.start(scratch / "server", console.log)
    fixed = int(spec.fixed_budget_fraction * weight_bytes(workload.expert_dirs(min(spec.fixed_budget_ks))))
    rows = []
    todo = variants(spec, fixed)
    for index, (operator, k, budget, policy) in enumerate(todo * args.passes):
        if index and index % len(todo) == 0:
            run.db = catalog_for_pass(index // len(todo), calibrated, run.db)
        rows.append(run_row(run, operator, k, budget, policy, index, args.device))
        r = rows[-1]
        r.pass_index = index // len(todo)
        console.log(f"{operator} K={k} {budget} {policy}: predicted "
                    f"{r.predicted_seconds.get('total', float('nan')):.1f} s, realized {r.wall_seconds or 0:.1f} s")
    if run.server is not None:
        run.server.stop()
    remove_tree(scratch)
    print_table(rows, console)
    summary = medians(rows) if args.passes > 1 else []
    if summary:
        print_medians(summary, console)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / f"predict-{spec.name}-{stamp}.json"
    path.write_text(json.dumps({
        "suite": spec.name, "timestamp": stamp,
        "command": "python -m benchmarks.predict " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": report.machine_info(workload.root), "device": args.device, "served": args.serve,
        "warm_host": run.warm_host,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(), "analysis": run.analysis, "calibration": calibration,
        "rows": [asdict(r) for r in rows], "passes": args.passes, "medians": summary, "target": TARGET,
        "total_seconds": time.perf_counter() - started,
    }, indent=1))
    console.log(f"wrote {path}")


if __name__ == "__main__":
    main()
