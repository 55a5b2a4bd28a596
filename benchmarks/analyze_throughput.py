"""Throughput of ``mergepipe analyze`` for one expert vs reading and merging it.

Usage: ``python -m benchmarks.analyze_throughput [--layout qwen3-0.6b-8l]
[--expert multilingual] [--repeats 3]``

With a cold page cache before every run, on the same base and expert files:

- (a) ``read``: a plain sequential read of both weight files in 8 MiB reads
  (``dd bs=8M``), the floor for anything that looks at every byte;
- (b) ``naive merge``: a plain full-read task-arithmetic merge of the expert
  into the base (``benchmarks.naive_merge``: whole tensors in torch, output
  written);
- ``analyze``: ``mergepipe analyze --base base EXPERT`` into a fresh catalog
  (``init-db`` and ``register`` happen before the timed part). It hashes the
  base's blocks too, as a first analysis against a new base does.

Targets (issues 2 and 14): analyze takes no longer than (b), so the one-time
analysis has paid for itself after a single budgeted merge (stretch: half of
it), in at most 1.5 GB of peak RSS whatever the tensor sizes. Reported: median
wall seconds over the repeats, MB/s of input (base + expert), the largest
peak RSS, both ratios, each target met or missed, and the load average (the
machine may be shared: ratios are only comparable within one run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks import mergepipe_runner
from benchmarks.checkpoints import remove_tree, weight_bytes, weight_files
from benchmarks.coldcache import RunResult, drop_cache, run_measured
from benchmarks.suite import RESULTS_DIR
from benchmarks.workloads import DEFAULT_ROOT, EXPERTS, LAYOUTS, ensure_workload

READ_BLOCK = "8M"  # dd block size: large sequential reads, as a streaming reader would do
RSS_TARGET_BYTES = 1_500_000_000  # issue 14: analysis memory must not grow with tensor size


def _cold_run(cmd: list[str], inputs: list[Path]) -> RunResult:
    os.sync()
    drop_cache(inputs)
    return run_measured(cmd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="qwen3-0.6b-8l")
    parser.add_argument("--expert", choices=[p.name for p in EXPERTS], default="multilingual",
                        help="which expert to analyse (default: one that touches every kind "
                             "of tensor, embeddings included)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    args = parser.parse_args(argv)
    console = Console()

    index = [p.name for p in EXPERTS].index(args.expert)
    wl = ensure_workload(args.layout, index + 1, args.seed, args.root, log=console.log)
    base, expert = wl.base, wl.experts[index]
    files = [*weight_files(base), *weight_files(expert)]
    input_bytes = weight_bytes([base, expert])
    scratch = wl.root / "scratch-analyze"
    remove_tree(scratch)
    scratch.mkdir()
    db, out = scratch / "catalog.db", scratch / "merged"

    read_cmd = ["sh", "-c", " && ".join(
        f"dd if='{f}' of=/dev/null bs={READ_BLOCK} status=none" for f in files)]
    merge_cmd = [sys.executable, "-m", "benchmarks.naive_merge", "--base", str(base),
                 "--experts", str(expert), "--out", str(out), "--operator", "task_arithmetic"]
    availability = mergepipe_runner.probe()
    analyze_missing = [c for c in ("init-db", "register", "analyze") if c in availability.missing]

    runs: dict[str, list[RunResult]] = {"read": [], "naive merge": [], "analyze": []}
    failures: dict[str, str] = {}
    for _ in range(args.repeats):
        runs["read"].append(_cold_run(read_cmd, [base, expert]))
        remove_tree(out)
        runs["naive merge"].append(_cold_run(merge_cmd, [base, expert]))
        remove_tree(out)
        if analyze_missing:
            failures["analyze"] = availability.reason
            continue
        for path in scratch.glob("catalog.db*"):
            path.unlink()
        for cmd in (mergepipe_runner.init_db(db), mergepipe_runner.register(db, "base", base),
                    mergepipe_runner.register(db, args.expert, expert)):
            setup = run_measured(cmd)
            if not setup.ok:
                failures["analyze"] = f"set-up failed: {setup.stderr.strip()[-300:]}"
                break
        else:
            result = _cold_run(mergepipe_runner.analyze(db, "base", [args.expert]),
                               [base, expert, *scratch.glob("catalog.db*")])
            if result.ok:
                runs["analyze"].append(result)
            else:
                failures["analyze"] = f"exit {result.returncode}: {result.stderr.strip()[-300:]}"
    remove_tree(scratch)

    summary: dict[str, dict] = {}
    for name, results in runs.items():
        bad = [r for r in results if not r.ok]
        if bad:
            failures[name] = f"exit {bad[0].returncode}: {bad[0].stderr.strip()[-300:]}"
        good = [r for r in results if r.ok]
        if not good:
            continue
        wall = statistics.median(r.wall_seconds for r in good)
        summary[name] = {
            "wall_seconds": wall,
            "all_wall_seconds": [r.wall_seconds for r in good],
            "mb_per_second": input_bytes / 1e6 / wall,
            "read_bytes": statistics.median(r.read_bytes for r in good),
            "peak_rss_bytes": max(r.peak_rss_bytes for r in good),
        }
    ratios = {}
    if "analyze" in summary:
        for name in ("read", "naive merge"):
            if name in summary:
                ratios[f"analyze / {name}"] = summary["analyze"]["wall_seconds"] / summary[name]["wall_seconds"]

    table = Table(title=f"analyze throughput: {args.layout}, expert {args.expert}, "
                        f"{input_bytes / 1e6:.0f} MB of input (base + expert), cold cache, "
                        f"median of {args.repeats}")
    for column in ("run", "wall s", "MB/s", "physical read MB", "peak RSS MB"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for name, s in summary.items():
        table.add_row(name, f"{s['wall_seconds']:.2f}", f"{s['mb_per_second']:.0f}",
                      f"{s['read_bytes'] / 1e6:.0f}", f"{s['peak_rss_bytes'] / 1e6:.0f}")
    console.print(table)
    for name, ratio in ratios.items():
        console.print(f"{name}: {ratio:.2f}x")
    if "analyze / naive merge" in ratios:
        for limit, what in ((1.0, "target"), (0.5, "stretch target")):
            met = ratios["analyze / naive merge"] <= limit
            console.print(f"{what} analyze <= {limit:g}x naive merge: {'met' if met else 'MISSED'}")
    if "analyze" in summary:
        met = summary["analyze"]["peak_rss_bytes"] <= RSS_TARGET_BYTES
        console.print(f"target analyze peak RSS <= {RSS_TARGET_BYTES / 1e9:.1f} GB: {'met' if met else 'MISSED'}")
    console.print(f"load average during the run: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for name, why in failures.items():
        console.print(f"[yellow]{name}: {why}")

    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = RESULTS_DIR / f"analyze-throughput-{stamp}.json"
    path.write_text(json.dumps({
        "layout": args.layout, "expert": args.expert, "input_bytes": input_bytes,
        "repeats": args.repeats, "load_average": os.getloadavg(), "runs": summary,
        "ratios": ratios, "failures": failures,
        "command": "python -m benchmarks.analyze_throughput " + " ".join(argv or sys.argv[1:]),
    }, indent=1))
    console.print(f"wrote {path}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
