"""Merge walls on the quality models: ``entries`` against ``energy`` and the 100% merge, code trees side by side.

Usage: ``python -m benchmarks.quality.walls [--trees A,B] [--repeat 2]``

The quality benchmark's base and four experts (``benchmarks/quality-cache``, built by ``make bench-quality``)
are registered, analysed and given delta stores once, by this tree. Then each repeat runs, for every tree of
``--trees`` in turn (default: this one alone; another is a checkout such as a ``git worktree`` of an earlier
commit, imported through ``PYTHONPATH`` in its own process), TIES and task arithmetic at 100% and at
50/25/10% under ``energy`` and ``entries``, each merge timed around ``Engine.execute`` (fsync included) on a
private copy of the catalog. Reported: median walls per tree, each entries merge against the energy merge
and the 100% merge of its operator, and whether every tree wrote the same bytes for each merge. The stores
are this tree's: a tree whose store format differs cannot be compared this way.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

BUDGETS = ("50%", "25%", "10%")
POLICIES = ("energy", "entries")


def _experts(cache: Path, names: tuple[str, ...]) -> dict[str, Path]:
    experts = {name: cache / f"expert-{name}-s32" for name in names}
    missing = [str(p) for p in [cache / "base", *experts.values()] if not (p / "config.json").exists()]
    if missing:
        raise SystemExit(f"no quality models at {', '.join(missing)}: run `make bench-quality` once first")
    return experts


def _setup(work: Path, cache: Path) -> None:
    """The catalog with the four experts analysed and their delta stores built, and what the children merge
    (``merges.json``: they import nothing but ``mergepipe``, the tree's own)."""
    from benchmarks.quality import corpora
    from benchmarks.quality.merges import OPERATORS
    from mergepipe.analysis.analyze import analyze
    from mergepipe.analysis.deltastore import build_store
    from mergepipe.analysis.register import register_model
    from mergepipe.catalog import Catalog

    experts = _experts(cache, corpora.NAMES)
    merges = [(op, budget, policy, OPERATORS[op]) for op in OPERATORS
              for budget, policy in [("100%", "energy")] + [(b, p) for b in BUDGETS for p in POLICIES]]
    (work / "merges.json").write_text(json.dumps({"experts": list(experts), "merges": merges}))
    with Catalog.create(work / "catalog.db") as catalog:
        register_model(catalog, "base", cache / "base")
        for name, path in experts.items():
            register_model(catalog, name, path)
        analyze(catalog, list(experts), base_id="base", progress=False)
        for name in experts:
            build_store(catalog, name, "base", work / "stores")


def _child(work: Path) -> None:
    """Time every merge on a copy of the catalog; print one JSON line: label -> [seconds, output sha256]."""
    from mergepipe.catalog import Catalog
    from mergepipe.engine.engine import Engine
    from mergepipe.planner.planner import Planner
    from mergepipe.spec.request import MergeRequest

    spec = json.loads((work / "merges.json").read_text())
    run = work / f"run-{os.getpid()}"
    run.mkdir()
    shutil.copy(work / "catalog.db", run / "catalog.db")
    results = {}
    with Catalog.open(run / "catalog.db") as catalog:
        for op, budget, policy, keywords in spec["merges"]:
            plan = Planner(catalog).plan(MergeRequest(base="base", experts=spec["experts"], operator=op,
                                                      budget=budget, policy=policy, **keywords))
            out = run / f"{op}-{budget[:-1]}-{policy}"
            started = time.perf_counter()
            Engine(catalog).execute(plan, out=out, model_id=out.name)
            seconds = time.perf_counter() - started
            digest = hashlib.sha256()
            for path in sorted(out.glob("*.safetensors")):
                digest.update(path.read_bytes())
            results[f"{op} {budget} {policy}"] = [seconds, digest.hexdigest()]
            shutil.rmtree(out)
    shutil.rmtree(run)
    print(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", default=str(Path(__file__).resolve().parents[2]),
                        help="comma-separated checkouts to compare (default: this one)")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=Path(__file__).resolve().parents[1] / "quality-cache")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child)
        return
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    work = args.cache / "walls"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    print("analysing the four experts and building their delta stores", flush=True)
    _setup(work, args.cache)
    runs: dict[Path, list[dict]] = {tree: [] for tree in trees}
    for repeat in range(args.repeat):
        for tree in trees:
            print(f"run {repeat + 1}/{args.repeat}: {tree}", flush=True)
            env = {**os.environ, "PYTHONPATH": str(tree)}
            # -P and this file's path: the child imports this script and the tree's ``mergepipe``, nothing else
            out = subprocess.run([sys.executable, "-P", __file__, "--child", str(work)],
                                 cwd=tree, env=env, check=True, capture_output=True, text=True).stdout
            runs[tree].append(json.loads(out.strip().splitlines()[-1]))
    shutil.rmtree(work)
    print(f"load average {os.getloadavg()[0]:.1f}; medians of {args.repeat} runs, seconds")
    for tree in trees:
        print(f"\n{tree}")
        wall = {key: statistics.median(r[key][0] for r in runs[tree]) for key in runs[tree][0]}
        for op in dict.fromkeys(key.split()[0] for key in wall):
            full = wall[f"{op} 100% energy"]
            print(f"  {op} 100%: {full:.2f}")
            for budget in BUDGETS:
                energy, entries = wall[f"{op} {budget} energy"], wall[f"{op} {budget} entries"]
                print(f"  {op} {budget}: energy {energy:.2f}, entries {entries:.2f} "
                      f"({entries / energy:.2f}x energy, {entries / full:.2f}x the 100% merge)")
    keys = runs[trees[0]][0]
    differ = [key for key in keys if len({r[key][1] for tree in trees for r in runs[tree]}) > 1]
    print("\nevery tree and run wrote the same bytes for every merge" if not differ
          else f"\nbytes differ for: {', '.join(differ)}")


if __name__ == "__main__":
    main()
