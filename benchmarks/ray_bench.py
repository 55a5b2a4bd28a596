"""The Ray executor: its overhead on one machine, and how TIES at 100% scales with simulated nodes.

Usage: ``python -m benchmarks.ray_bench [--layout qwen3-tiny] [--experts 2] [--nodes 1 2 4]
[--node-read-mb-s 5] [--repeats 1]``

The workload is ``workloads.py``'s (a base and K experts at a real layout),
merged with TIES (density 0.5). Three tables:

A. **One machine** (cold page cache before every run): TIES at 100% and 10%
   by the local executor (1 thread, the default; 2 threads) and by Ray (1
   and 2 workers, one core each; Ray started once beforehand, its start-up
   reported apart). ``units s`` is the executor's wall time for all units;
   ``total s`` the whole ``Engine.execute`` (checks, staging, units, hashing
   the output, fsync, publish). Snapshot ids must be equal across executors.
B. **Simulated nodes**: TIES at 100% on N Ray workers, each one "node": its
   process pinned to one core and its reads capped at ``--node-read-mb-s``
   (a token bucket over the worker's file reads: one node's disk), page cache
   warm so the cap is the only disk. The speed-up is the units' wall time at
   N = 1 over that at N; on this machine's few cores it holds while N workers
   need no more CPU than there is (the cap keeps each below a core).
C. **Projection** for a 70B base (Llama-3-70B's shapes: 70.6 B parameters,
   141 GB in bf16; the embedding and the LM head 128256 × 8192, 2.1 GB each)
   with 20 experts at 100% and 10%, on 1, 4 and 16 nodes, from the per-worker
   rates measured in A:
   ``T(N) = S + max(W / (N · min(c · r, d)), U / r) + O / h`` with W the
   bytes read (base + experts at the budget, every expert block assumed
   changed), r the measured input bytes per second of one Ray worker (one
   core) at that budget, c cores per node (``--node-cores``), d a node's read
   bandwidth (``--node-read-gb-s``), U the input bytes of the largest unit (a
   tensor is never split across units: the embedding with its 20 experts'
   blocks, at the budget), O the output bytes, h the coordinator's measured
   rate for hashing the output (it re-reads the files after remote workers
   wrote them) and S the measured fixed cost (Ray connection). Linear in cores
   and nodes otherwise, so optimistic: the shared filesystem must also serve
   N · d.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.coldcache import drop_cache
from benchmarks.workloads import ensure_workload
from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.register import register_model
from mergepipe.catalog import Catalog
from mergepipe.engine.engine import Engine
from mergepipe.engine.stream import LocalExecutor, UnitTask
from mergepipe.engine.ray_executor import RayExecutor, import_ray
from mergepipe.engine.stream import UnitRecord
from mergepipe.engine.job import WorkUnit
from mergepipe.planner.planner import Planner
from mergepipe.storage import source as source_module
from mergepipe.spec.request import MergeRequest

MB = 1_000_000
REPO = Path(__file__).resolve().parent.parent
DENSITY = 0.5
BLOCK_BYTES = 1 << 20


# ------------------------------------------------------------------ in the Ray workers (simulated nodes)


class _Bucket:
    """A worker's read rate cap: every read waits for its turn at ``rate`` bytes per second."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.lock = threading.Lock()
        self.free_at = time.monotonic()

    def take(self, nbytes: int) -> None:
        with self.lock:
            start = max(time.monotonic(), self.free_at)
            self.free_at = start + nbytes / self.rate
            done_at = self.free_at
        time.sleep(max(0.0, done_at - time.monotonic()))


_NODE: dict[str, object] = {}  # per worker process: the installed cap, and the original read


def _become_node(rate: float, slots: str, pin: bool) -> None:
    """Pin this worker process to one core (``pin``: the first free slot, round robin over the machine's
    cores; else it may run on any) and cap its file reads at ``rate`` bytes per second; once per run."""
    if _NODE.get("rate") == rate and _NODE.get("slots") == slots:
        return
    cores = sorted(os.sched_getaffinity(0)) if not _NODE else _NODE["cores"]
    slot = 0
    while True:
        try:
            os.close(os.open(Path(slots) / f"slot-{slot}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            break
        except FileExistsError:
            slot += 1
    os.sched_setaffinity(0, {cores[slot % len(cores)]} if pin else set(cores))
    original = _NODE.setdefault("read", source_module.CheckpointSource.read)
    bucket = _Bucket(rate)

    def read(self, path, begin, end, out=None, tag=None):
        bucket.take(end - begin)
        return original(self, path, begin, end, out=out, tag=tag)

    source_module.CheckpointSource.read = read
    _NODE.update(rate=rate, slots=slots, cores=cores)


@dataclass(frozen=True)
class NodeTask(UnitTask):
    """The engine's task, run as one simulated node (see ``_become_node``)."""

    read_bytes_per_second: float = 0.0
    slots: str = ""
    pin: bool = True

    def __call__(self, unit: WorkUnit) -> UnitRecord:
        _become_node(self.read_bytes_per_second, self.slots, self.pin)
        return super().__call__(unit)


# ------------------------------------------------------------------ the coordinator


class Timed:
    """An executor that also times its ``run`` (all units, wall) and can run the task as a node."""

    def __init__(self, inner, node: tuple[float, str, bool] | None = None) -> None:
        self.inner, self.node = inner, node
        self.workers, self.in_process = inner.workers, inner.in_process
        self.seconds = 0.0

    def status(self) -> str:
        return self.inner.status()

    def run(self, units, task):
        if self.node is not None:
            task = NodeTask(task.job, task.advance, task.run, *self.node)
        started = time.perf_counter()
        try:
            return self.inner.run(units, task)
        finally:
            self.seconds = time.perf_counter() - started


@dataclass
class Row:
    table: str
    executor: str
    budget: str
    units_seconds: float
    total_seconds: float
    input_bytes: int
    output_bytes: int
    hash_seconds: float
    snapshot_id: str
    per_worker_mb_s: list[float]

    @property
    def input_mb_s(self) -> float:
        return self.input_bytes / self.units_seconds / MB


def prepare(layout: str, experts: int, work: Path) -> tuple[Path, list[str], list[Path]]:
    """A catalog with the workload registered and analysed; its path, the expert ids and the model dirs."""
    wl = ensure_workload(layout, experts, log=lambda line: print(line, flush=True))
    db = work / "template.db"
    ids = [p.name for p in wl.expert_dirs(experts)]
    with Catalog.create(db, BLOCK_BYTES) as catalog:
        register_model(catalog, "base", wl.base)
        for path in wl.expert_dirs(experts):
            register_model(catalog, path.name, path)
        analyze(catalog, ids, base_id="base", progress=False)
    return db, ids, [wl.base, *wl.expert_dirs(experts)]


def run_once(template: Path, work: Path, ids: list[str], budget: str, executor: Timed, name: str, table: str,
             cold: list[Path] | None) -> Row:
    root = Path(tempfile.mkdtemp(dir=work))
    try:
        db = Path(shutil.copyfile(template, root / "c.db"))
        with Catalog.open(db) as catalog:
            plan = Planner(catalog).plan(MergeRequest(base="base", experts=ids, operator="ties", params={"density": DENSITY}, budget=budget))
            if cold:
                drop_cache(cold)
            started = time.perf_counter()
            snapshot_id, manifest = Engine(catalog, executor=executor).execute(plan, out=root / "out", model_id="m")
            total = time.perf_counter() - started
        realized = manifest.cost.realized
        progress = getattr(executor.inner, "progress", None)
        rates = [w.bytes_read / w.seconds / MB for w in progress.workers.values()] if progress else []
        return Row(table, name, budget, executor.seconds, total, realized.base_bytes + realized.expert_bytes,
                   realized.output_bytes, realized.seconds.get("hash", 0.0), snapshot_id, sorted(rates))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def best(rows: list[Row]) -> Row:
    """The run with the median units time (repeats smooth a shared machine's noise)."""
    return sorted(rows, key=lambda r: r.units_seconds)[len(rows) // 2]


def warm_up(ray, template, work, ids, workers: int) -> None:
    """One unmeasured merge on ``workers`` Ray workers: their processes started and MergePipe imported."""
    run_once(template, work, ids, "100%", Timed(RayExecutor(ray, workers)), "warm-up", "-", None)


def table_a(ray, template, work, ids, paths, repeats) -> list[Row]:
    warm_up(ray, template, work, ids, 2)
    rows = []
    for budget in ("100%", "10%"):
        for name, make in (("local, 1 thread", lambda: LocalExecutor(1)),
                           ("local, 2 threads", lambda: LocalExecutor(2)),
                           ("ray, 1 worker", lambda: RayExecutor(ray, 1)),
                           ("ray, 2 workers", lambda: RayExecutor(ray, 2))):
            runs = [run_once(template, work, ids, budget, Timed(make()), name, "A", paths) for _ in range(repeats)]
            rows.append(best(runs))
            print(format_row(rows[-1]), flush=True)
        assert len({r.snapshot_id for r in rows if r.budget == budget}) == 1, "executors disagree on the bytes"
    return rows


def table_b(ray, template, work, ids, nodes, rate, repeats, pin) -> list[Row]:
    warm_up(ray, template, work, ids, max(nodes))
    rows = []
    for n in nodes:
        runs = []
        for _ in range(repeats):
            slots = Path(tempfile.mkdtemp(dir=work))
            runs.append(run_once(template, work, ids, "100%", Timed(RayExecutor(ray, n), (rate, str(slots), pin)),
                                 f"{n} node(s)", "B", None))
        rows.append(best(runs))
        print(format_row(rows[-1]), flush=True)
    return rows


def format_row(r: Row) -> str:
    rates = ", ".join(f"{x:.0f}" for x in r.per_worker_mb_s) or "-"
    return (f"| {r.table} | {r.executor} | {r.budget} | {r.units_seconds:.2f} | {r.total_seconds:.2f} | "
            f"{r.input_bytes / MB:.0f} | {r.input_mb_s:.0f} | {rates} |")


def projection(rows: list[Row], startup: float, cores: int, node_read: float) -> list[str]:
    """Table C (see the module docstring)."""
    base = 70.6e9 * 2
    largest = 128256 * 8192 * 2
    hash_rate = statistics.median(r.output_bytes / r.hash_seconds for r in rows
                                  if r.executor.startswith("ray") and r.hash_seconds > 0)
    lines = [f"per-worker r, hash rate h = {hash_rate / 1e9:.2f} GB/s, S = {startup:.1f} s, c = {cores}, "
             f"d = {node_read / 1e9:.1f} GB/s", "",
             "| budget | W (GB) | U (GB) | r (MB/s/core) | 1 node | 4 nodes | 16 nodes |",
             "|---|---|---|---|---|---|---|"]
    for budget, share in (("100%", 1.0), ("10%", 0.1)):
        row = next(r for r in rows if r.executor == "ray, 1 worker" and r.budget == budget)
        r = row.per_worker_mb_s[0] * MB
        read, unit = base * (1 + share * 20), largest * (1 + share * 20)
        cells = []
        for n in (1, 4, 16):
            seconds = startup + max(read / (n * min(cores * r, node_read)), unit / r) + base / hash_rate
            cells.append(f"{seconds / 60:.1f} min")
        lines.append(f"| {budget} | {read / 1e9:.0f} | {unit / 1e9:.1f} | {r / MB:.0f} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", default="qwen3-tiny")
    parser.add_argument("--experts", type=int, default=2)
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--node-read-mb-s", type=float, default=5.0, help="simulated read rate of one node")
    parser.add_argument("--node-cores", type=int, default=32, help="projection: cores per node")
    parser.add_argument("--node-read-gb-s", type=float, default=2.0, help="projection: read rate of one node")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--no-pin", action="store_true", help="B: let the OS place the workers (a shared machine)")
    parser.add_argument("--skip", choices=["A", "B"], nargs="*", default=[])
    args = parser.parse_args(argv)
    ray = import_ray()
    with tempfile.TemporaryDirectory(prefix="ray-bench-") as tmp:  # catalogs and outputs; removed at the end
        work = Path(tmp)
        template, ids, paths = prepare(args.layout, args.experts, work)
        started = time.perf_counter()
        ray.init(num_cpus=max([2, *args.nodes]), include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}})
        startup = time.perf_counter() - started
        print(f"Ray started in {startup:.1f} s; {args.layout}, {args.experts} experts, TIES density {DENSITY}")
        print("| table | executor | budget | units s | total s | input MB | input MB/s | per-worker MB/s |")
        print("|---|---|---|---|---|---|---|---|")
        try:
            rows = [] if "A" in args.skip else table_a(ray, template, work, ids, paths, args.repeats)
            if "B" not in args.skip:
                rows_b = table_b(ray, template, work, ids, args.nodes, args.node_read_mb_s * MB, args.repeats,
                                  not args.no_pin)
                one = rows_b[0].units_seconds
                for r in rows_b:
                    n = int(r.executor.split()[0])
                    print(f"{n} node(s): speed-up {one / r.units_seconds:.2f}x, efficiency "
                          f"{one / r.units_seconds / n:.0%}")
            if rows:
                print("\n".join(["", *projection(rows, startup, args.node_cores, args.node_read_gb_s * 1e9)]))
        finally:
            ray.shutdown()


if __name__ == "__main__":
    main()
