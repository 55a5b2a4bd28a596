"""Is a cold read cold? The same checkpoints read cold several rounds in a row.

Usage: ``python -m benchmarks.host_cache [--layout qwen3-0.6b] [--experts 8] [--rounds 3]``.

Every round evicts the workload's checkpoints (the base and its experts) from
this machine's page cache (``coldcache.drop_cache``) and reads each one
through in order (``coldcache.read_through``), timing each. On a disk nothing
else caches, every round reads at the disk's speed. On a virtual machine whose
host caches its disk, the first round reads what the host has not seen lately
at the disk's speed and later rounds at the host cache's: "cold" for this
machine is then two states, and which one a benchmark run meets depends on
what ran before it. That is why the suite and ``benchmarks.predict`` read
each run's inputs through before it (``--no-warm-host`` to leave it). The
first round shows the disk only when the checkpoints were not read lately
(e.g. the first run of the day).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.table import Table

from benchmarks import report
from benchmarks.coldcache import drop_cache, read_through
from benchmarks.suite import RESULTS_DIR
from benchmarks.workloads import DEFAULT_ROOT, ensure_workload


def rounds(checkpoints: list[Path], count: int) -> list[list[float]]:
    """Bytes per second reading each checkpoint cold, per round."""
    out = []
    for _ in range(count):
        drop_cache(checkpoints)
        speeds = []
        for path in checkpoints:
            started = time.perf_counter()
            read = read_through([path])
            speeds.append(read / (time.perf_counter() - started))
        out.append(speeds)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", default="qwen3-0.6b")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    console = report.console()
    workload = ensure_workload(args.layout, args.experts, args.seed, args.root, log=console.log)
    checkpoints = [workload.base, *workload.expert_dirs(args.experts)]
    speeds = rounds(checkpoints, args.rounds)
    table = Table(title="cold reads, round after round (GB/s; this machine's page cache dropped before each round)")
    table.add_column("round", justify="right")
    for path in checkpoints:
        table.add_column(path.name, justify="right")
    for index, row in enumerate(speeds, 1):
        table.add_row(str(index), *(f"{s / 1e9:.2f}" for s in row))
    console.print(table)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / f"host-cache-{stamp}.json"
    command = "python -m benchmarks.host_cache " + " ".join(argv if argv is not None else sys.argv[1:])
    path.write_text(json.dumps({"command": command,
                                "machine": report.machine_info(workload.root),
                                "checkpoints": [p.name for p in checkpoints], "bytes_per_second": speeds}, indent=1))
    console.log(f"wrote {path}")


if __name__ == "__main__":
    main()
