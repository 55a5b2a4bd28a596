"""Continuous integration of experts: 10 iterations of retrains and new experts, three ways.

Usage: ``python -m benchmarks.continuous [--layout qwen3-0.6b] [--operator task_arithmetic]
[--iterations 10] [--no-mergekit]``.

On the benchmark workload (``benchmarks/workloads.py``): iteration 1 merges
the base with K = 4 experts; then each iteration either retrains one expert
in 25% of its layers (a new version: ``register --new-version``, then an
incremental ``analyze``) or adds the next expert (``register``, ``analyze``),
alternately, up to K = 8. Each iteration is merged at 100% budget by

* mergekit 0.1.5, from scratch (reads every expert in full);
* MergePipe from scratch (``mergepipe merge``);
* MergePipe incremental (``mergepipe merge --from`` the previous iteration's
  merged model): blocks whose inputs are unchanged are copied from it;
* MergePipe's pipeline command: one ``mergepipe integrate RECIPE.yml``
  process per iteration (its own catalog: it registers and analyses what
  changed, merges ``--from`` its latest version, publishes and verifies),
  where the columns above take a process per step;
* with ``--delta-update`` (task arithmetic only; its own chain of merged
  versions): blocks whose only change is a retrained or added expert are
  updated from the previous output, reading only that expert (and, for an
  added one, the base). Not bit-identical: the Frobenius distance to the
  from-scratch merge is measured and must be within the plan's bound.

(Iteration 1 has nothing to start from: one MergePipe merge from scratch
counts for both MergePipe columns.)

Every merge runs as its own CLI process with the page cache of its inputs
dropped first (start-up included, for all three). The two MergePipe outputs
must be byte-identical at every iteration (checked). The catalog work of an
iteration (register + analyze of what changed) is the same for both MergePipe
columns and is shown on its own; cumulative MergePipe walls include it.
Prints a table per iteration and the cumulative ratios; writes
``benchmarks/results/continuous-<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from benchmarks import mergekit_runner, mergepipe_runner
from benchmarks.coldcache import drop_cache
from benchmarks.incremental_analyze import retrain
from benchmarks.workloads import ensure_workload

RESULTS = Path(__file__).with_name("results")
START_K = 4


@dataclass
class Iteration:
    index: int
    change: str
    k: int
    catalog_s: float
    mergekit_s: float | None
    scratch_s: float
    incremental_s: float
    mergekit_bytes: int | None
    scratch_bytes: int
    incremental_bytes: int
    identical: bool
    update_s: float | None = None  # --delta-update column (task arithmetic)
    update_bytes: int | None = None
    update_distance: float | None = None  # Frobenius distance to the from-scratch output
    update_bound: float | None = None  # the plan's (prior) bound
    update_measured_bound: float | None = None  # the bound measured after the merge (a-posteriori)
    full_catalog_s: float | None = None  # a from-scratch iteration's catalog work: the new version analysed in full
    integrate_s: float | None = None  # one `mergepipe integrate` process: catalog work, merge, publish, verify
    integrate_bytes: int | None = None  # expert bytes its merge read (its manifest)
    integrate_identical: bool | None = None  # its output vs the from-scratch merge


def schedule(names: list[str], iterations: int) -> list[tuple[str, str]]:
    """(kind, expert) per iteration after the first: retrain and add alternately, adds up to K = 8."""
    steps, active, waiting = [], names[:START_K], names[START_K:]
    for i in range(iterations - 1):
        if i % 2 == 1 and waiting:
            name = waiting.pop(0)
            active.append(name)
            steps.append(("add", name))
        else:
            steps.append(("retrain", active[(i // 2) % len(active)]))
    return steps


def run(cmd: list, inputs: list[Path]) -> float:
    """Wall seconds of ``cmd`` with the page cache of ``inputs`` dropped first; fails loudly."""
    drop_cache(inputs)
    started = time.perf_counter()
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=mergekit_runner.environment())
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd[:3]))} failed:\n{proc.stderr[-2000:]}")
    return seconds


def weight_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.safetensors"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="qwen3-0.6b")
    parser.add_argument("--operator", default="task_arithmetic", choices=sorted(mergekit_runner.OPERATORS))
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--no-mergekit", action="store_true", help="skip the mergekit column")
    args = parser.parse_args()
    workload = ensure_workload(args.layout)
    names = [p.name for p in workload.experts]
    dirs = dict(zip(names, workload.experts))
    RESULTS.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="continuous-work-", dir=RESULTS))
    db = work / "catalog.db"
    rows: list[Iteration] = []
    try:
        for catalog in (db, work / "integrate.db"):
            subprocess.run([str(c) for c in mergepipe_runner.init_db(catalog)], check=True, capture_output=True)
        steps = [("start", ",".join(names[:START_K]))] + schedule(names, args.iterations)
        active: list[str] = []
        for index, (kind, what) in enumerate(steps, start=1):
            catalog_s = _update_catalog(db, kind, what, dirs, active, work, index, workload.layout.num_layers,
                                        workload.base)
            # from scratch, a retrained version is analysed in full like any new model (in a catalog of its own)
            full_s = _full_analysis(work, index, dirs[what], workload.base) if kind == "retrain" else catalog_s
            rows.append(_merge_three_ways(db, args, index, f"{kind} {what}", active, dirs, workload.base, work))
            rows[-1].catalog_s, rows[-1].full_catalog_s = catalog_s, full_s
            _print_row(rows[-1], catalog_s)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _summary(rows, args)


def _update_catalog(db: Path, kind: str, what: str, dirs: dict[str, Path], active: list[str], work: Path,
                    index: int, num_layers: int, base: Path) -> float:
    """Register and analyse what this iteration changed; the seconds it took (cold cache)."""
    exe = mergepipe_runner.executable()
    commands = []
    if kind == "start":
        active.extend(what.split(","))
        commands.append(mergepipe_runner.register(db, "base", base))
        commands += [mergepipe_runner.register(db, name, dirs[name]) for name in active]
        changed = list(active)
    elif kind == "add":
        active.append(what)
        commands.append(mergepipe_runner.register(db, what, dirs[what]))
        changed = [what]
    else:
        new_dir = work / f"{what}-v{index}"
        retrain(dirs[what], new_dir, 0.25, num_layers)
        dirs[what] = new_dir
        commands.append([*mergepipe_runner.register(db, what, new_dir), "--new-version"])
        changed = [what]
    commands.append([*exe, "analyze", "--db", db, "--base", "base", "--no-progress", *changed])
    return sum(run(cmd, [base, *(dirs[n] for n in changed)]) for cmd in commands)


def _full_analysis(work: Path, index: int, version: Path, base: Path) -> float:
    """Seconds to register and analyse ``version`` in full against the base (cold cache), as a from-scratch
    iteration must: in a catalog of its own where the base is analysed already."""
    db = work / f"full-{index}.db"
    exe = mergepipe_runner.executable()
    for cmd in (mergepipe_runner.init_db(db), mergepipe_runner.register(db, "base", base),
                [*exe, "analyze", "--db", db, "--no-progress", "base"]):
        run(cmd, [])
    seconds = sum(run(cmd, [base, version]) for cmd in (
        mergepipe_runner.register(db, "new", version),
        [*exe, "analyze", "--db", db, "--base", "base", "--no-progress", "new"]))
    db.unlink()
    return seconds


def _merge_three_ways(db: Path, args, index: int, change: str, active: list[str], dirs: dict[str, Path],
                      base: Path, work: Path) -> Iteration:
    inputs = [base, *(dirs[n] for n in active)]
    scratch_out, inc_out, previous = work / f"scratch-{index}", work / f"inc-{index}", work / f"inc-{index - 1}"
    summaries = (work / f"scratch-{index}.json", work / f"inc-{index}.json")
    merge = [mergepipe_runner.merge(db, "base", active, out, model_id, args.operator, "100%", "energy", summary)
             for out, model_id, summary in ((scratch_out, "scratch", summaries[0]), (inc_out, "inc", summaries[1]))]
    if index == 1:  # nothing to start from: one merge from scratch is both columns' first iteration
        scratch_s = incremental_s = run(merge[1], inputs)
        shutil.copytree(inc_out, scratch_out)
        shutil.copy(summaries[1], summaries[0])
    else:
        scratch_s = run(merge[0], inputs)
        incremental_s = run([*merge[1], "--from", "inc"], [*inputs, previous])
    identical = weight_files(scratch_out) == weight_files(inc_out)
    columns = {}  # the further columns, each merged after the two above
    if args.operator == "task_arithmetic":
        columns = _delta_update(db, args, index, active, inputs, scratch_out, work, (incremental_s, summaries[1]))
    columns.update(_integrate(args, index, active, dirs, base, work, scratch_out))
    mergekit_s = mergekit_bytes = None
    if not args.no_mergekit:
        mk_out = work / f"mergekit-{index}"
        config = mergekit_runner.write_config(work / "mergekit.yml", mergekit_runner.config(
            base, [dirs[n] for n in active], args.operator))
        mergekit_s = run(mergekit_runner.command(config, mk_out), inputs)
        mergekit_bytes = sum(p.stat().st_size for n in active for p in dirs[n].glob("*.safetensors"))
        shutil.rmtree(mk_out)
    shutil.rmtree(scratch_out)
    if previous.exists():
        shutil.rmtree(previous)
    scratch, inc = (mergepipe_runner.MergeSummary.from_json(s) for s in summaries)
    return Iteration(index, change, len(active), 0.0, mergekit_s, scratch_s, incremental_s, mergekit_bytes,
                     scratch.realized_expert_bytes or 0, inc.realized_expert_bytes or 0, identical, **columns)


def _delta_update(db: Path, args, index: int, active: list[str], inputs: list[Path], scratch_out: Path,
                  work: Path, first: tuple[float, Path]) -> dict:
    """The --delta-update column: each merge from the column's previous one (iteration 1: the first
    from-scratch merge, ``first`` = (seconds, summary)); its distance to the from-scratch output."""
    if index == 1:
        seconds, summary = first
        args.du_from, args.du_dir = json.loads(summary.read_text())["snapshot_id"], work / "inc-1"
        result = mergepipe_runner.MergeSummary.from_json(summary)
        return {"update_s": seconds, "update_bytes": result.realized_expert_bytes or 0, "update_distance": 0.0,
                "update_bound": 0.0, "update_measured_bound": 0.0}
    out, summary = work / f"du-{index}", work / f"du-{index}.json"
    cmd = mergepipe_runner.merge(db, "base", active, out, "du", args.operator, "100%", "energy", summary)
    seconds = run([*cmd, "--from", args.du_from, "--delta-update"], [*inputs, args.du_dir])
    if index > 2:  # inc-1 goes with the incremental column
        shutil.rmtree(args.du_dir)
    args.du_from, args.du_dir = "du", out
    result = mergepipe_runner.MergeSummary.from_json(summary)
    return {"update_s": seconds, "update_bytes": result.realized_expert_bytes or 0,
            "update_distance": frobenius_distance(out, scratch_out), "update_bound": result.error_bound or 0.0,
            "update_measured_bound": result.update_bound}


def _integrate(args, index: int, active: list[str], dirs: dict[str, Path], base: Path, work: Path,
               scratch_out: Path) -> dict:
    """The ``integrate`` column: one process runs the whole iteration from a recipe naming the active experts'
    directories (a retrained one's new directory becomes its next version); its output vs from scratch."""
    recipe = work / "recipe.yml"
    recipe.write_text(yaml.safe_dump({
        "base": str(base), "experts": {name: str(dirs[name]) for name in active}, "operator": args.operator,
        "params": {"density": 0.5} if args.operator == "ties" else {}, "budget": "100%", "policy": "energy",
        "output": {"root": str(work / "deploy"), "model_id": "merged", "keep": 1},
    }))
    previous = work / "deploy" / f"merged-v{index - 1}"
    cmd = [*mergepipe_runner.executable(), "integrate", "--db", work / "integrate.db", recipe,
           "--no-progress"]
    seconds = run(cmd, [base, *(dirs[n] for n in active), *([previous] if previous.exists() else [])])
    out = work / "deploy" / f"merged-v{index}"
    realized = json.loads((out / "manifest.json").read_text())["cost"]["realized"]
    return {"integrate_s": seconds, "integrate_bytes": realized["expert_bytes"],
            "integrate_identical": weight_files(out) == weight_files(scratch_out)}


def frobenius_distance(a: Path, b: Path) -> float:
    """‖a − b‖_F over every tensor of two checkpoints with the same layout (fp64)."""
    from safetensors import safe_open
    total = 0.0
    for file in sorted(a.glob("*.safetensors")):
        with safe_open(str(file), "pt") as fa, safe_open(str(b / file.name), "pt") as fb:
            for name in fa.keys():
                total += float(((fa.get_tensor(name).double() - fb.get_tensor(name).double()) ** 2).sum())
    return total ** 0.5


def _print_row(row: Iteration, catalog_s: float) -> None:
    if row.index == 1:
        print(f"{'it':>2} {'change':24} {'K':>2} {'catalog s':>9} {'mergekit s':>10} {'MP scratch s':>12} "
              f"{'MP incr s':>9} {'mergekit MB':>11} {'scratch MB':>10} {'incr MB':>8} identical "
              f"{'update s':>8} {'update MB':>9} {'distance':>9} {'bound':>9} {'integrate s':>11} {'integ MB':>8} "
              "integ identical")
    mk_s = "-" if row.mergekit_s is None else f"{row.mergekit_s:.1f}"
    mk_mb = "-" if row.mergekit_bytes is None else f"{row.mergekit_bytes / 1e6:.0f}"
    print(f"{row.index:>2} {row.change[:24]:24} {row.k:>2} {catalog_s:9.1f} {mk_s:>10} {row.scratch_s:12.1f} "
          f"{row.incremental_s:9.1f} {mk_mb:>11} {row.scratch_bytes / 1e6:10.0f} {row.incremental_bytes / 1e6:8.0f} "
          f"{str(row.identical):9} {_f(row.update_s, '.1f'):>8} "
          f"{_f(None if row.update_bytes is None else row.update_bytes / 1e6, '.0f'):>9} "
          f"{_f(row.update_distance, '.3g'):>9} {_f(row.update_bound, '.3g'):>9} {_f(row.integrate_s, '.1f'):>11} "
          f"{_f(None if row.integrate_bytes is None else row.integrate_bytes / 1e6, '.0f'):>8} "
          f"{row.integrate_identical}", flush=True)


def _f(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _per_kind(rows: list[Iteration], args) -> None:
    """Issue 41's targets, per kind of iteration, against a from-scratch MergePipe iteration (its catalog work:
    the new version analysed in full; its merge from scratch): a retrain, expert I/O ≤ 30% and wall ≤ 40%
    (bit-identical, ``--from``); an add under task arithmetic with ``--delta-update``, expert I/O ≤ 1.3/K of
    from scratch (K experts after the add) and wall ≤ 40%; an add under any other operator, bit-identical and
    wall ≤ 100%."""
    print(f"\nper kind of iteration ({args.operator}): walls include the catalog work")
    print(f"{'it':>2} {'change':24} {'K':>2} {'scratch it s':>12} {'incr it s':>9} {'wall':>6} {'I/O':>6} "
          f"{'update it s':>11} {'wall':>6} {'I/O':>6} {'distance':>9} {'prior':>8} {'measured':>9} target")
    for r in rows[1:]:
        scratch = (r.full_catalog_s or r.catalog_s) + r.scratch_s
        incr_wall, incr_io = (r.catalog_s + r.incremental_s) / scratch, r.incremental_bytes / r.scratch_bytes
        update_wall = update_io = None
        if r.update_s is not None and r.update_bytes is not None:
            update_wall, update_io = (r.catalog_s + r.update_s) / scratch, r.update_bytes / r.scratch_bytes
        if r.change.startswith("retrain"):
            verdict = "met" if incr_io <= 0.30 and incr_wall <= 0.40 else "missed"
            target = f"I/O ≤ 30%, wall ≤ 40%: {verdict}"
        elif update_wall is not None and update_io is not None:
            limit = 1.3 / r.k
            verdict = "met" if update_io <= limit and update_wall <= 0.40 else "missed"
            target = f"update I/O ≤ {limit:.0%}, wall ≤ 40%: {verdict}"
        else:
            verdict = "met" if r.identical and incr_wall <= 1.0 else "missed"
            target = f"identical, wall ≤ 100%: {verdict}"
        print(f"{r.index:>2} {r.change[:24]:24} {r.k:>2} {scratch:12.1f} {r.catalog_s + r.incremental_s:9.1f} "
              f"{incr_wall:6.0%} {incr_io:6.0%} "
              f"{_f(None if r.update_s is None else r.catalog_s + r.update_s, '.1f'):>11} "
              f"{_f(update_wall, '.0%'):>6} {_f(update_io, '.0%'):>6} {_f(r.update_distance, '.3g'):>9} "
              f"{_f(r.update_bound, '.3g'):>8} {_f(r.update_measured_bound, '.3g'):>9} {target}")


def _summary(rows: list[Iteration], args) -> None:
    _per_kind(rows, args)
    catalog = sum(r.catalog_s for r in rows)
    scratch_wall = catalog + sum(r.scratch_s for r in rows)
    inc_wall = catalog + sum(r.incremental_s for r in rows)
    scratch_io = sum(r.scratch_bytes for r in rows)
    inc_io = sum(r.incremental_bytes for r in rows)
    print(f"\ncumulative over {len(rows)} iterations ({args.operator}, 100% budget; MergePipe walls include "
          f"{catalog:.1f} s of register + analyze)")
    print(f"  expert bytes read: incremental {inc_io / 1e9:.2f} GB vs from scratch {scratch_io / 1e9:.2f} GB "
          f"= {inc_io / scratch_io:.1%}")
    print(f"  wall: incremental {inc_wall:.1f} s vs from scratch {scratch_wall:.1f} s = {inc_wall / scratch_wall:.1%}")
    if all(r.mergekit_s is not None for r in rows):
        mergekit = sum(r.mergekit_s for r in rows)
        mk_io = sum(r.mergekit_bytes for r in rows)
        print(f"  wall vs mergekit: incremental {inc_wall:.1f} s vs {mergekit:.1f} s = {inc_wall / mergekit:.1%}; "
              f"mergekit read {mk_io / 1e9:.2f} GB of experts")
    print(f"  outputs identical to from scratch at every iteration: {all(r.identical for r in rows)}")
    if all(r.update_s is not None for r in rows):
        update_wall = catalog + sum(r.update_s for r in rows)
        update_io = sum(r.update_bytes for r in rows)
        within = all(r.update_distance <= r.update_bound for r in rows)
        print(f"  --delta-update: expert bytes {update_io / 1e9:.2f} GB = {update_io / scratch_io:.1%} of from "
              f"scratch; wall {update_wall:.1f} s = {update_wall / scratch_wall:.1%}; distance within the plan's "
              f"bound at every iteration: {within}")
    if all(r.integrate_s is not None for r in rows):
        integrate_wall = sum(r.integrate_s for r in rows)  # its catalog work is inside
        integrate_io = sum(r.integrate_bytes for r in rows)
        versus = f"; vs mergekit {integrate_wall / mergekit:.1%}" if all(r.mergekit_s is not None for r in rows) else ""
        print(f"  integrate (one process per iteration): wall {integrate_wall:.1f} s = "
              f"{integrate_wall / scratch_wall:.1%} of from scratch{versus}; expert bytes {integrate_io / 1e9:.2f} GB "
              f"= {integrate_io / scratch_io:.1%}; identical to from scratch at every iteration: "
              f"{all(r.integrate_identical for r in rows)}")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"continuous-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"operator": args.operator, "layout": args.layout,
                                "iterations": [asdict(r) for r in rows]}, indent=2))
    print(f"  results: {path}")
    if not all(r.identical and r.integrate_identical is not False for r in rows):
        raise SystemExit("an incremental merge differs from the from-scratch merge")


if __name__ == "__main__":
    main()
