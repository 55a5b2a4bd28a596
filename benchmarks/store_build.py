"""Memory and time of building a delta store for a fully fine-tuned expert: whole tensors vs bands.

Usage: ``python -m benchmarks.store_build [--layout qwen3-0.6b-8l] [--repeats 2]``

The suite's experts leave most of the embedding alone, but a real full fine-tune changes every tensor. This
benchmark writes such an expert (every weight of the workload's base times ``1 + N(0, 0.01)``, rounded to
bf16: most entries of every tensor change, the 155M-entry embedding included), analyses it once, and then
builds its delta store (``build_store``, what ``analyze --store-deltas`` runs) in a child process per run,
page cache dropped before each, alternating two ways on copies of the same catalog:

- ``whole``: every tensor read and ordered whole (``band_entries`` above every tensor: the build before
  bands, whose memory grows with the largest tensor);
- ``bands``: the default ``BAND_ENTRIES``: a larger tensor is ordered a band of magnitudes per pass.

A third row runs the user's command, ``mergepipe analyze --store-deltas`` on a catalog where the expert is
registered but not analysed: its wall includes the analysis (not comparable with the two above), its peak RSS
is what issue 14 bounds. A fourth runs ``mergepipe analyze`` alone on the same registered catalog: the wall the
others are compared with. Reported: median wall seconds, peak RSS, physical reads, whether every way wrote
the same store (its digest), and the build's wall against the analysis'. Targets: peak RSS ≤ 1.5 GB whatever
the tensor sizes (issue 14); a store build ≤ 2× the analysis (issue 40).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from benchmarks import mergepipe_runner
from benchmarks.checkpoints import remove_tree
from benchmarks.coldcache import RunResult, drop_cache, run_measured
from benchmarks.suite import RESULTS_DIR
from benchmarks.workloads import (
    DEFAULT_ROOT,
    DTYPE,
    GENERATION_CONSTANTS,
    LAYOUTS,
    Layout,
    _ensure_model,
    _generator,
    _row_chunks,
    derived_model,
    ensure_workload,
)

RELATIVE_CHANGE = 0.01  # std of the multiplicative change of every weight
RSS_TARGET_BYTES = 1_500_000_000
WAYS = {"whole": 1 << 62, "bands": None, "cli": None, "analyze": None}  # band_entries; None: the library's default
LABELS = {"whole": "whole tensors (before)", "bands": "bands", "cli": "analyze --store-deltas (+ analysis)",
          "analyze": "analyze alone (no store)"}


def _write_full(layout: Layout, seed: int, base: Path, out: Path) -> None:
    with derived_model(layout, base, out) as (fb, w):
        for spec in layout.tensors():
            weights = fb.get_tensor(spec.name)
            gen = _generator(seed, "full-finetune", spec.name)
            chunks = _row_chunks(spec.shape[0], math.prod(spec.shape[1:])) if len(spec.shape) > 1 else [(0, None)]
            for start, stop in chunks:
                part = weights[start:stop].float()
                noise = torch.randn(part.shape, generator=gen).mul_(RELATIVE_CHANGE).add_(1.0)
                w.write_rows(spec.name, part.mul_(noise).to(DTYPE))


def _child(db: Path, directory: Path, band_entries: int | None) -> None:
    """One build, in this process: prints its record as JSON."""
    from mergepipe.analysis.deltastore import BAND_ENTRIES, build_store
    from mergepipe.catalog import Catalog

    with Catalog.open(db) as catalog:
        report = build_store(catalog, "full", "base", directory, band_entries=band_entries or BAND_ENTRIES)
    print(json.dumps({"digest": report.record.digest, "entries": report.entries, "chunks": report.chunks,
                      "file_size": report.record.file_size, "seconds": report.seconds}))


def _prepare(args: argparse.Namespace, console: Console) -> tuple[Path, Path, Path, Path]:
    """``(base, expert, analysed catalog, scratch directory)``."""
    layout = LAYOUTS[args.layout]
    wl = ensure_workload(layout, 1, args.seed, args.root, log=console.log)
    expert = wl.root / "full-finetune"
    spec = {"generator": GENERATION_CONSTANTS, "layout": layout.name, "seed": args.seed, "role": "full-finetune",
            "relative_change": RELATIVE_CHANGE, "base": str(wl.base)}
    _ensure_model(expert, layout, spec, lambda o: _write_full(layout, args.seed, wl.base, o), console.log)
    scratch = wl.root / "scratch-store-build"
    remove_tree(scratch)
    scratch.mkdir()
    registered, db = scratch / "registered.db", scratch / "analysed.db"
    _setup([mergepipe_runner.init_db(registered), mergepipe_runner.register(registered, "base", wl.base),
            mergepipe_runner.register(registered, "full", expert)])
    shutil.copyfile(registered, db)
    _setup([mergepipe_runner.analyze(db, "base", ["full"])])
    return wl.base, expert, db, scratch


def _setup(commands: list[list[str]]) -> None:
    for cmd in commands:
        result = run_measured(cmd)
        if not result.ok:
            raise SystemExit(f"set-up failed: {' '.join(cmd)}: {result.stderr.strip()[-300:]}")


def _run(way: str, db: Path, scratch: Path, inputs: list[Path]) -> tuple[RunResult, dict]:
    run_db, directory = scratch / f"{way}.db", scratch / f"stores-{way}"
    remove_tree(directory)
    for path in scratch.glob(f"{way}.db*"):
        path.unlink()
    if way in ("cli", "analyze"):
        shutil.copyfile(db.with_name("registered.db"), run_db)
        cmd = [*mergepipe_runner.analyze(run_db, "base", ["full"]), "--no-progress"]
        if way == "cli":
            cmd += ["--store-deltas", str(directory)]
    else:
        shutil.copyfile(db, run_db)
        cmd = [sys.executable, "-m", "benchmarks.store_build", "--child", str(run_db), str(directory)]
        if WAYS[way] is not None:
            cmd += ["--band-entries", str(WAYS[way])]
    os.sync()
    drop_cache(inputs)
    result = run_measured(cmd)
    if not result.ok:
        raise SystemExit(f"{way} build failed: {result.stderr.strip()[-500:]}")
    if way == "analyze":
        return result, {"digest": None, "entries": None}
    if way == "cli":
        from mergepipe.catalog import Catalog

        with Catalog.open(run_db) as catalog:
            record = catalog.deltas.find("full", "base")
        return result, {"digest": record.digest, "entries": None}
    return result, json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="qwen3-0.6b-8l")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    parser.add_argument("--child", nargs=2, type=Path, metavar=("DB", "DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--band-entries", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(*args.child, args.band_entries)
        return 0
    console = Console()
    base, expert, db, scratch = _prepare(args, console)
    runs: dict[str, list[tuple[RunResult, dict]]] = {way: [] for way in WAYS}
    for _ in range(args.repeats):
        for way in WAYS:
            runs[way].append(_run(way, db, scratch, [base, expert, db]))
    remove_tree(scratch)

    digests = {way: {record["digest"] for _, record in results} for way, results in runs.items() if way != "analyze"}
    same = len(set().union(*digests.values())) == 1
    summary = {
        way: {"wall_seconds": statistics.median(r.wall_seconds for r, _ in results),
              "all_wall_seconds": [r.wall_seconds for r, _ in results],
              "peak_rss_bytes": max(r.peak_rss_bytes for r, _ in results),
              "read_bytes": statistics.median(r.read_bytes for r, _ in results),
              "record": results[0][1]}
        for way, results in runs.items()
    }
    record = summary["bands"]["record"]
    table = Table(title=f"delta store build: {args.layout}, a fully fine-tuned expert "
                        f"({record['entries'] / 1e6:.0f} M changed entries), cold cache, median of {args.repeats}")
    for column in ("way", "wall s", "peak RSS MB", "physical read MB"):
        table.add_column(column, justify="left" if column == "way" else "right")
    for way, s in summary.items():
        table.add_row(LABELS[way], f"{s['wall_seconds']:.1f}", f"{s['peak_rss_bytes'] / 1e6:.0f}",
                      f"{s['read_bytes'] / 1e6:.0f}")
    console.print(table)
    ratio = summary["bands"]["wall_seconds"] / summary["whole"]["wall_seconds"]
    rss = max(summary[way]["peak_rss_bytes"] for way in ("bands", "cli"))
    analysis = summary["analyze"]["wall_seconds"]
    over_analysis = {"build": summary["bands"]["wall_seconds"] / analysis,
                     "analyze_store": summary["cli"]["wall_seconds"] / analysis}
    console.print(f"bands / whole wall: {ratio:.2f}; same store bytes: {'yes' if same else 'NO'}; peak RSS "
                  f"{rss / 1e6:.0f} MB (target ≤ {RSS_TARGET_BYTES / 1e6:.0f} MB: "
                  f"{'met' if rss <= RSS_TARGET_BYTES else 'missed'}); load average {os.getloadavg()[0]:.1f}")
    console.print(f"store build / analyze wall: {over_analysis['build']:.2f} (target ≤ 2); analyze --store-deltas "
                  f"/ analyze: {over_analysis['analyze_store']:.2f}")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / f"store-build-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"layout": args.layout, "repeats": args.repeats, "same_store": same,
                               "bands_over_whole": ratio, "over_analysis": over_analysis, "summary": summary,
                               "load_average": os.getloadavg()}, indent=1))
    console.print(f"results: {out}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
