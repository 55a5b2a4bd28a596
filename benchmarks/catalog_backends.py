"""The catalog on SQLite and on PostgreSQL: the operations whose catalog work grows with model size.

Usage: ``python -m benchmarks.catalog_backends [--workload DIR] [--experts 8] [--plan-cases 70b:20]
[--skip-workload] [--workdir DIR]``

Part 1 (``--workload``, default the Qwen3-0.6B workload of ``benchmarks/workloads.py``: a base and eight
experts, bf16, 1.19 GB each): ``register`` of the base and K experts, ``analyze`` (reads and hashes every
byte: the same work on both backends, plus the catalog's writes), ``plan --save`` (TIES, K experts, 25%)
and ``explain`` of that plan, each timed through the application layer as the CLI runs it, once against a
SQLite file and once against a PostgreSQL database on a server started here on 127.0.0.1
(``tests/fixtures/postgres.py``, with PostgreSQL's default durability: fsync on, as SQLite's is).

Part 2 (``--plan-cases``): the synthetic catalog of ``benchmarks/planner_bench.py`` (Llama-2-70B layout,
bf16, 1 MiB blocks, K analysed experts; no weights) written into each backend, then the time to plan a
TIES merge at a 10% budget from it (reading 2.7 M block rows at 70B x 20). Prints tables; the server
runs on this machine, so the numbers hold no network round trips (a remote server adds one per query).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.planner_bench import LAYOUTS, build
from mergepipe.app.analysing import analyze
from mergepipe.app.views import explain
from mergepipe.app.planning import plan
from mergepipe.app.registering import init_db, register
from mergepipe.catalog import Catalog
from mergepipe.planner.planner import Planner
from mergepipe.spec.request import MergeRequest
from tests.fixtures.postgres import PostgresServer, find_binaries

DEFAULT_WORKLOAD = Path(__file__).parent / "workloads" / "qwen3-0.6b-s0"


def timed(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def workload_case(db: str, workload: Path, experts: list[str]) -> dict[str, float]:
    """Seconds of register (base and experts), analyze, plan --save and explain against ``db``."""
    init_db(db)
    out = {"register": timed(lambda: [register(db, m, workload / m) for m in ["base", *experts]])}
    out["analyze"] = timed(lambda: analyze(db, experts, base="base"))
    request = MergeRequest(base="base", experts=experts, operator="ties", params={"density": 0.5}, budget="25%")
    made = []
    out["plan"] = timed(lambda: made.append(plan(request, db, save=True)))
    out["explain"] = timed(lambda: explain(db, made[0].digest))
    return out


def plan_case(db: str, root: Path, layout: str, experts: int) -> dict[str, float]:
    """Seconds to write the synthetic catalog (and, as `analyze` does after its writes, refresh the server's
    planner statistics) and to plan from it."""
    ids: list[str] = []

    def write() -> None:
        ids.extend(build(db, root, LAYOUTS[layout], experts))
        with Catalog.open(db) as catalog:
            catalog.refresh_statistics()

    built = timed(write)
    request = MergeRequest(base="base", experts=ids, operator="ties", params={"density": 0.5}, budget="10%")
    with Catalog.open(db) as catalog:
        planned = timed(lambda: Planner(catalog).plan(request))
    return {"catalog": built, "plan": planned}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--plan-cases", default="70b:20", help="layout:experts, comma-separated ('' for none)")
    parser.add_argument("--skip-workload", action="store_true")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    binaries = find_binaries()
    if binaries is None:
        raise SystemExit("PostgreSQL's initdb and pg_ctl are needed (apt-get install postgresql)")
    scratch = Path(tempfile.mkdtemp(prefix="catalog-backends-", dir=args.workdir))
    try:
        with PostgresServer(binaries, settings=()) as server:
            if not args.skip_workload:
                experts = sorted(p.name for p in args.workload.iterdir() if p.is_dir() and p.name != "base")
                experts = experts[:args.experts]
                rows = {"sqlite": workload_case(str(scratch / "w.db"), args.workload, experts),
                        "postgresql": workload_case(server.new_database(), args.workload, experts)}
                print(f"\n{args.workload.name}, K = {len(experts)}: seconds")
                print(f"{'operation':10} {'sqlite':>8} {'postgresql':>11}")
                for op in rows["sqlite"]:
                    print(f"{op:10} {rows['sqlite'][op]:>8.2f} {rows['postgresql'][op]:>11.2f}")
            for case in filter(None, args.plan_cases.split(",")):
                layout, k = case.split(":")
                results = {"sqlite": plan_case(str(scratch / f"{case}.db"), scratch / f"{case}-sqlite", layout,
                                               int(k)),
                           "postgresql": plan_case(server.new_database(), scratch / f"{case}-pg", layout, int(k))}
                print(f"\nsynthetic {layout} x {k}: seconds")
                print(f"{'backend':11} {'catalog':>8} {'plan':>7}")
                for backend, r in results.items():
                    print(f"{backend:11} {r['catalog']:>8.1f} {r['plan']:>7.2f}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
