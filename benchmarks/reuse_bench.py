"""Output reuse without rewriting (issue 41): one incremental ``merge --from`` by this code and by HEAD's.

Usage: ``python -m benchmarks.reuse_bench [--layout qwen3-0.6b] [--experts 5] [--operator task_arithmetic]
[--shards none 100MB] [--repeat 2] [--old DIR]``.

On the benchmark workload (``benchmarks/workloads.py``) the base and K experts are registered and analysed
once; then, per output layout (one file as the base has it, or ``--out-shard-size`` shards), ``v1`` is merged
from scratch, the first expert is retrained in a quarter of its layers (``incremental_analyze.retrain``: a
new version, analysed incrementally), and the incremental merge ``--from v1`` runs, each time in its own copy
of that catalog, by

* ``new``: this working tree (shards wholly reused are reflinked, or copied by the kernel where the filesystem
  has no reflinks, and read back once, checked against the file hash the previous manifest records; reused
  runs of the others are copied by the kernel and read back once for their check and the file hash);
* ``old``: HEAD's package (``git archive HEAD mergepipe``; ``--old DIR`` for another one), to compare with
  (issue 41's baseline read every reused block, checked it and wrote it again; issue 52's hard-linked whole
  shards without reading them);

alternately, ``--repeat`` times, each as its own process with the page cache of its inputs (base, experts,
``v1``) dropped first. Per run: wall seconds, the process's physical bytes read and written
(``/proc/PID/io``: ``write_bytes`` is page cache dirtied for writing, so a kernel copy counts and a link does
not), the engine's ``total`` and how the output's bytes got there (``output_bytes_by_method``, new only). Both
must publish the same snapshot (checked). Writes ``benchmarks/results/reuse-<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

from benchmarks.coldcache import drop_cache, run_measured
from benchmarks.incremental_analyze import retrain
from benchmarks.mergepipe_runner import compile_package
from benchmarks.workloads import ensure_workload

RESULTS = Path(__file__).with_name("results")
REPO = Path(__file__).resolve().parent.parent


def old_package(into: Path) -> Path:
    """HEAD's ``mergepipe`` package extracted under ``into`` (read from git; the working tree is untouched)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "HEAD", "mergepipe"], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def cli(pythonpath: Path, *args: object) -> list[str]:
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(pythonpath)!r}); "
            "from mergepipe.cli import main; main()", *map(str, args)]


def run(pythonpath: Path, *args: object) -> None:
    proc = subprocess.run(cli(pythonpath, *args), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"mergepipe {' '.join(map(str, args[:1]))} failed:\n{proc.stderr[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="qwen3-0.6b")
    parser.add_argument("--experts", type=int, default=5)
    parser.add_argument("--operator", default="task_arithmetic")
    parser.add_argument("--shards", nargs="+", default=["none", "100MB"])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--old", type=Path, help="a directory holding the `mergepipe` package to compare with")
    parser.add_argument("--work", type=Path, help="where to work (default: a temporary directory)")
    args = parser.parse_args()

    workload = ensure_workload(args.layout, num_experts=args.experts)
    work = Path(args.work or tempfile.mkdtemp(prefix="mergepipe-reuse-"))
    work.mkdir(parents=True, exist_ok=True)
    packages = {"old": args.old or old_package(work / "old"), "new": REPO}
    for package in packages.values():
        compile_package(package / "mergepipe")
    template = analysed(packages["old"], workload, work / "template.db")  # the older schema: both open it
    retrained = work / f"{workload.experts[0].name}-v2"
    if not retrained.exists():
        retrain(workload.experts[0], retrained, 0.25, workload.layout.num_layers)
    merge = ["--base", "base", "--experts", *(p.name for p in workload.experts), "--operator", args.operator,
             "--no-progress"]
    results = []
    for shards in args.shards:
        layout = [] if shards == "none" else ["--out-shard-size", shards]
        here = work / f"shards-{shards}"
        db = incremental_catalog(packages["old"], template, here, [*merge, *layout], workload.experts[0].name,
                                 retrained)
        inputs = [workload.base, *workload.experts, retrained, here / "v1"]
        for rep in range(args.repeat):
            for variant, package in packages.items():
                row = measured_merge(package, db, here / variant, [*merge, *layout], inputs)
                results.append({"shards": shards, "variant": variant, "repeat": rep, **row})
                print(json.dumps(results[-1]), flush=True)
        ids = {row["snapshot_id"] for row in results if row["shards"] == shards}
        if len(ids) != 1:
            raise SystemExit(f"[{shards}] old and new published different snapshots: {sorted(ids)}")
        shutil.rmtree(here / "v1")
    report(results, {"layout": args.layout, "experts": args.experts, "operator": args.operator})


def analysed(package: Path, workload, template: Path) -> Path:
    """A catalog with the workload's base and experts registered and analysed by ``package`` (kept between runs)."""
    if not template.exists():
        print("registering and analysing the workload", flush=True)
        run(package, "init-db", "--db", template)
        for path in (workload.base, *workload.experts):
            run(package, "register", "--db", template, "--model-id", path.name, "--uri", path)
        run(package, "analyze", "--db", template, "--base", "base", *(p.name for p in workload.experts),
            "--no-progress")
    return template


def incremental_catalog(package: Path, template: Path, here: Path, merge: list[str], expert: str,
                        retrained: Path) -> Path:
    """``here/c.db``: ``v1`` merged from scratch by ``package``, then ``expert`` retrained (``retrained``) as its
    next version, analysed."""
    shutil.rmtree(here, ignore_errors=True)
    here.mkdir()
    db = here / "c.db"
    shutil.copyfile(template, db)
    print(f"[{here.name}] v1 from scratch", flush=True)
    run(package, "merge", "--db", db, *merge, "--out", here / "v1", "--model-id", "merged")
    run(package, "register", "--db", db, "--model-id", expert, "--uri", retrained, "--new-version")
    run(package, "analyze", "--db", db, "--base", "base", expert, "--no-progress")
    return db


def measured_merge(package: Path, db: Path, prefix: Path, merge: list[str], inputs: list[Path]) -> dict:
    """``merge --from merged`` by ``package`` in a copy of ``db``, the inputs' page cache dropped first."""
    run_db, out, summary = prefix.with_suffix(".db"), prefix.with_name(prefix.name + "-v2"), prefix.with_suffix(".json")
    shutil.copyfile(db, run_db)
    shutil.rmtree(out, ignore_errors=True)
    summary.unlink(missing_ok=True)
    os.sync()
    drop_cache(inputs)
    measured = run_measured(cli(package, "merge", "--db", run_db, *merge, "--from", "merged", "--out", out,
                                "--model-id", "merged", "--json-summary", summary))
    if not measured.ok:
        raise SystemExit(f"{package} merge --from failed:\n{measured.stderr[-2000:]}")
    data = json.loads(summary.read_text())
    shutil.rmtree(out)
    return {"wall_s": measured.wall_seconds, "engine_total_s": data["seconds"].get("total"),
            "read_bytes": measured.read_bytes, "write_bytes": measured.write_bytes,
            "output_bytes": data["realized"]["output_bytes"],
            "by_method": data["realized"].get("output_bytes_by_method"), "snapshot_id": data["snapshot_id"]}


def report(results: list[dict], setting: dict) -> None:
    print(f"\n{'layout':>8} {'code':>4} {'wall s':>8} {'engine s':>8} {'read MB':>8} {'written MB':>10}  how")
    for row in results:
        how = ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in (row["by_method"] or {}).items() if v)
        print(f"{row['shards']:>8} {row['variant']:>4} {row['wall_s']:8.2f} {row['engine_total_s']:8.2f} "
              f"{row['read_bytes'] / 1e6:8.0f} {row['write_bytes'] / 1e6:10.0f}  {how}")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"reuse-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({**setting, "runs": results}, indent=2))
    print(f"written {path}")


if __name__ == "__main__":
    main()
