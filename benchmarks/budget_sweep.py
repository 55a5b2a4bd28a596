"""Physical expert reads against the budget, over random budgets.

Usage: ``python -m benchmarks.budget_sweep [--runs 24] [--layout qwen3-tiny] [--seed 1]``

The budget promises a bound on bytes *read from expert files*; this measures
what the disk really served. Per run: a random operator, 1-8 experts and a
budget drawn log-uniformly between 0.5% and 100% (or a fixed byte size);
every expert file is dropped from the page cache, the merge runs in its own
process (``mergepipe merge``), and afterwards ``mincore`` says how many bytes
of the expert files are in the page cache, i.e. were read from disk. The
allowance is the files' headers plus one page at each end of every read
(reads are not page-aligned). Prints one row per run and the worst overshoot.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import tempfile
from pathlib import Path

from benchmarks import mergepipe_runner
from benchmarks.coldcache import drop_cache, resident_bytes
from benchmarks.workloads import ensure_workload
from mergepipe.storage.format import read_header

PAGE = os.sysconf("SC_PAGE_SIZE")
OPERATORS = (
    ("task_arithmetic", []), ("ties", ["--density", "0.5"]), ("dare_ties", ["--density", "0.5"]),
    ("breadcrumbs", ["--density", "0.6", "--gamma", "0.05"]), ("slerp", ["--t", "0.4"]), ("avg", []),
)


def header_bytes(files: list[Path]) -> int:
    return sum(math.ceil((8 + read_header(f).header_len) / PAGE) * PAGE for f in files)


def run(db: Path, base: str, experts: list[str], files: list[Path], op: tuple[str, list[str]], budget: str,
        out: Path) -> dict:
    summary = out.with_suffix(".json")
    drop_cache(files)
    cmd = [*mergepipe_runner.executable(), "merge", "--db", str(db), "--base", base, "--experts", *experts,
           "--operator", op[0], *op[1], "--budget", budget, "--out", str(out), "--model-id", out.name,
           "--no-progress", "--json-summary", str(summary)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"merge failed: {proc.stderr.strip()}")
    data = json.loads(summary.read_text())
    physical = resident_bytes(files)
    plan = json.loads(subprocess.run([*mergepipe_runner.executable(), "explain", "--db", str(db), out.name,
                                      "--json"], capture_output=True, text=True, check=True).stdout)
    reads = sum(sum(t["read"].values()) for t in plan["tensors"])
    allowance = header_bytes(files) + 2 * PAGE * reads
    shutil.rmtree(out, ignore_errors=True)
    return {"op": op[0], "k": len(experts), "budget": budget, "budget_bytes": data["budget_bytes"],
            "planned": data["planned"]["expert_bytes"], "counted": data["realized"]["expert_bytes"],
            "physical": physical, "allowance": allowance, "over": physical - data["budget_bytes"],
            "ok": data["realized"]["expert_bytes"] <= data["budget_bytes"]
            and physical <= data["budget_bytes"] + allowance}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=24)
    parser.add_argument("--layout", default="qwen3-tiny")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    wl = ensure_workload(args.layout, 8, log=lambda _: None)
    scratch = Path(tempfile.mkdtemp(prefix="budget-sweep-"))
    try:
        db = scratch / "catalog.db"
        names = [p.name for p in wl.experts]
        subprocess.run(mergepipe_runner.init_db(db), check=True, capture_output=True)
        for name, path in [("base", wl.base), *zip(names, wl.experts)]:
            subprocess.run(mergepipe_runner.register(db, name, path), check=True, capture_output=True)
        subprocess.run([*mergepipe_runner.executable(), "analyze", "--db", str(db), "--base", "base", *names,
                        "--no-progress"], check=True, capture_output=True)
        rows = []
        print(f"{'op':16} {'K':>2} {'budget':>8} {'budget B':>11} {'counted B':>11} {'physical B':>11} "
              f"{'allowance B':>11} {'ok':>3}")
        for i in range(args.runs):
            op = rng.choice(OPERATORS)
            k = 1 if op[0] == "slerp" else rng.randint(2, 8)
            experts = names[:k]
            budget = f"{math.exp(rng.uniform(math.log(0.5), math.log(100))):.2f}%" if i % 4 else \
                f"{rng.randint(1, 40)}MB"
            files = [f for e in experts for f in sorted((wl.root / e).glob("*.safetensors"))]
            r = run(db, "base", experts, files, op, budget, scratch / f"m{i}")
            rows.append(r)
            print(f"{r['op']:16} {r['k']:>2} {r['budget']:>8} {r['budget_bytes']:>11,} {r['counted']:>11,} "
                  f"{r['physical']:>11,} {r['allowance']:>11,} {'yes' if r['ok'] else 'NO':>3}")
        worst = max(rows, key=lambda r: r["over"])
        print(f"{sum(r['ok'] for r in rows)}/{len(rows)} runs within budget + allowance; largest physical - budget: "
              f"{worst['over']:,} bytes ({worst['op']}, {worst['budget']})")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
