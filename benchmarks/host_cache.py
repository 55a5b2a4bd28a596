"""Is a cold read cold? The same checkpoints read cold several rounds in a row.

Usage: ``python -m benchmarks.host_cache [--layout qwen3-0.6b] [--experts 8] [--rounds 3] [--push-out GB]``.

Every round evicts the workload's checkpoints (the base and its experts) from
this machine's page cache (``coldcache.drop_cache``) and reads each one
through in order (``coldcache.read_through``), timing each. On a disk nothing
else caches, every round reads at the disk's speed. On a virtual machine whose
host caches its disk, the first round reads what the host has not seen lately
at the disk's speed and later rounds at the host cache's: "cold" for this
machine is then two states, and which one a benchmark run meets depends on
what ran before it. That is why the suite and ``benchmarks.predict`` read
each run's inputs through before it (``--no-warm-host`` to leave it). The
first round shows the disk only when the host has not seen the checkpoints
lately: ``--push-out GB`` first writes that many GB of other data beside the
workload and reads it back (then deletes it), so that a host cache smaller
than that, and keeping what was read last, holds none of the checkpoints any
more. On the VM of 2026-12-06 16 GB did not (all three rounds at 3.2–3.5
GB/s): its host's cache is larger, or keeps what is read often; the slow
state (0.6 GB/s) was the first read of the checkpoints in hours.
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
from benchmarks.floor import write_file
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


def push_out(root: Path, gigabytes: float) -> float:
    """Write ``gigabytes`` of other data under ``root``, fsync'd, read it back cold and delete it: what
    a host caches of this machine's disk is then that data, not the checkpoints. Returns seconds."""
    started = time.perf_counter()
    path = root / "host-cache-push-out.bin"
    try:
        write_file(path, int(gigabytes * 1e9))
        read_through([path])
    finally:
        path.unlink(missing_ok=True)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", default="qwen3-0.6b")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--push-out", type=float, default=0.0, metavar="GB",
                        help="first write and read back this many GB of other data (module docstring)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    console = report.console()
    workload = ensure_workload(args.layout, args.experts, args.seed, args.root, log=console.log)
    checkpoints = [workload.base, *workload.expert_dirs(args.experts)]
    if args.push_out > 0:
        seconds = push_out(workload.root, args.push_out)
        console.log(f"pushed {args.push_out:g} GB of other data through in {seconds:.1f} s")
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
                                "push_out_gigabytes": args.push_out, "checkpoints": [p.name for p in checkpoints],
                                "bytes_per_second": speeds}, indent=1))
    console.log(f"wrote {path}")


if __name__ == "__main__":
    main()
