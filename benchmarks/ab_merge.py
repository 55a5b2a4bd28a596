"""One-shot merges of two code trees side by side: the same workload, cold page cache, alternating runs.

Usage: ``python -m benchmarks.ab_merge --trees OLD,NEW [--layouts qwen3-0.6b,qwen3-1.7b] [--experts 4]
[--budgets 10%,100%] [--repeat 5]``. Each tree (a checkout, e.g. a ``git worktree`` of an earlier commit)
gets its own catalog of the same generated checkpoints (registered and analysed by that tree); then each
repeat runs every (layout, budget) once per tree, the trees' order alternating, each run cold
(``os.sync``, every input and the catalog evicted). Prints wall seconds per tree (median, min-max), the
median of the per-pair ratios NEW/OLD, and checks that both trees wrote the same weight bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.coldcache import drop_cache, run_measured
from benchmarks.mergepipe_runner import compile_package
from benchmarks.workloads import DEFAULT_ROOT, ensure_workload

WORK = Path(__file__).resolve().parent / "results" / "ab-merge"


def _cli(tree: Path) -> tuple[list[str], dict[str, str]]:
    """The command that runs ``tree``'s MergePipe, and its environment."""
    return [sys.executable, "-m", "mergepipe"], {**os.environ, "PYTHONPATH": str(tree)}


def _run(tree: Path, args: list[str]) -> None:
    cmd, env = _cli(tree)
    proc = subprocess.run([*cmd, *args], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{tree}: mergepipe {' '.join(args[:1])} failed: {proc.stderr.strip()[-400:]}")


def _catalog(tree: Path, name: str, layout: str, workload) -> Path:
    db = WORK / name / f"{layout}.db"
    if db.exists():
        return db
    db.parent.mkdir(parents=True, exist_ok=True)
    ids = [f"e{i}" for i in range(len(workload.experts))]
    _run(tree, ["init-db", "--db", str(db)])
    _run(tree, ["register", "--db", str(db), "--model-id", "base", "--uri", str(workload.base)])
    for model_id, path in zip(ids, workload.experts):
        _run(tree, ["register", "--db", str(db), "--model-id", model_id, "--uri", str(path)])
    _run(tree, ["analyze", "--db", str(db), "--base", "base", *ids])
    _run(tree, ["models", "--db", str(db)])  # a read: the WAL checkpointed into the file we copy
    return db


def _weights(out: Path) -> dict[str, str]:
    manifest = json.loads((out / "manifest.json").read_text())
    # a file's hash is keyed by its algorithm (blake3; sha256 in schema 1)
    return {f["name"]: f.get("blake3") or f["sha256"] for f in manifest["files"] if f["name"].endswith(".safetensors")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", required=True, help="OLD,NEW: two checkouts")
    parser.add_argument("--layouts", default="qwen3-0.6b,qwen3-1.7b")
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--budgets", default="10%,100%")
    parser.add_argument("--operator", default="ties")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    args = parser.parse_args(argv)
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    names = [f"{i}-{t.name}" for i, t in enumerate(trees)]
    for tree in trees:
        compile_package(tree / "mergepipe")
    walls: dict[tuple[str, str, str], list[float]] = {}
    ratios: dict[tuple[str, str], list[float]] = {}
    same: dict[tuple[str, str], bool] = {}
    for layout in args.layouts.split(","):
        workload = ensure_workload(layout, args.experts, root=args.root)
        dbs = [_catalog(tree, name, layout, workload) for tree, name in zip(trees, names)]
        inputs = [workload.base, *workload.experts]
        for rep in range(args.repeat):
            for budget in args.budgets.split(","):
                pair = []
                order = list(range(len(trees)))[:: 1 if rep % 2 == 0 else -1]
                for i in order:
                    out = WORK / names[i] / f"{layout}-{budget.rstrip('%')}"
                    if out.exists():
                        _remove(out)
                    db = dbs[i].with_name("run.db")  # a fresh copy: every run is a first merge
                    shutil.copyfile(dbs[i], db)
                    os.sync()
                    drop_cache([*inputs, db])
                    cmd, env = _cli(trees[i])
                    merge = [*cmd, "merge", "--db", str(db), "--base", "base", "--experts",
                             *[f"e{k}" for k in range(args.experts)], "--operator", args.operator,
                             "--density", "0.5", "--budget", budget, "--out", str(out), "--model-id",
                             "merged", "--no-progress"]
                    result = run_measured(merge, env=env)
                    if not result.ok:
                        raise SystemExit(f"{names[i]} {layout} {budget}: {result.stderr.strip()[-400:]}")
                    walls.setdefault((layout, budget, names[i]), []).append(result.wall_seconds)
                    pair.append((i, result.wall_seconds, _weights(out)))
                    print(f"rep {rep} {layout} {budget} {names[i]}: {result.wall_seconds:.2f} s", flush=True)
                by_tree = {i: (wall, weights) for i, wall, weights in pair}
                ratios.setdefault((layout, budget), []).append(by_tree[1][0] / by_tree[0][0])
                same[(layout, budget)] = same.get((layout, budget), True) and by_tree[0][1] == by_tree[1][1]
    print(f"\n| layout | budget | {names[0]} wall s (median, min-max) | {names[1]} wall s | "
          "NEW/OLD (median of pairs, min-max) | same weights |")
    print("|---|---|---|---|---|---|")
    for (layout, budget), pairs in ratios.items():
        cells = []
        for name in names:
            w = walls[(layout, budget, name)]
            cells.append(f"{statistics.median(w):.2f} ({min(w):.2f}-{max(w):.2f})")
        print(f"| {layout} | {budget} | {cells[0]} | {cells[1]} | {statistics.median(pairs):.2f} "
              f"({min(pairs):.2f}-{max(pairs):.2f}) | {same[(layout, budget)]} |")


def _remove(path: Path) -> None:
    """Remove a published (read-only) snapshot folder."""
    for dirpath, dirnames, _ in os.walk(path):
        os.chmod(dirpath, 0o755)
    shutil.rmtree(path)


if __name__ == "__main__":
    main()
