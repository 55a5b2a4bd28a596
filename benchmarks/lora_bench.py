"""K LoRA adapters merged into their base: MergePipe vs mergekit's LoRA path vs peft in Python.

Usage: ``python -m benchmarks.lora_bench --layout qwen3-0.6b --adapters 8 --rank 16``
(``--layout qwen3-tiny --adapters 2`` for a one-minute check).

Inputs: ``lora_workloads.py`` (the workload base and K PEFT adapters of rank R
on every projection). Each run starts with a cold page cache for the base and
the adapters and is measured as one child process (wall, peak RSS, physical
reads): ``coldcache.run_measured``.

* mergepipe: ``register --kind lora --base`` and ``analyze`` once (timed as
  "catalog"), then ``merge`` at a 100% budget (timed as "merge").
* mergekit 0.1.5: ``model: BASE+ADAPTER`` per expert; it merges each adapter
  into a full copy of the base first (``--lora-merge-cache``, emptied before
  each run, so every run pays it as a first run does).
* peft: ``peft_merge.py`` (``add_weighted_adapter`` "cat" for task
  arithmetic, "ties_svd" for TIES, then ``merge_and_unload``).

Task-arithmetic outputs are compared with MergePipe's (relative Frobenius
distance of the merged delta); peft's TIES is TIES on each ΔW followed by an
SVD back to low rank, a different merge, so its distance is only reported.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

from benchmarks.checkpoints import remove_tree, weight_files
from benchmarks.coldcache import drop_cache, run_measured
from benchmarks.lora_workloads import LoraWorkload, ensure_lora_workload
from benchmarks.mergekit_runner import FLAGS, executable
from benchmarks.mergepipe_runner import executable as mergepipe_executable
from benchmarks.workloads import DEFAULT_ROOT, LAYOUTS

RESULTS = Path(__file__).resolve().parent / "results"


def _mergekit_config(wl: LoraWorkload, operator: str, density: float) -> dict:
    params = {"weight": 1.0, **({"density": density} if operator == "ties" else {})}
    return {"merge_method": operator, "base_model": str(wl.base), "dtype": "bfloat16",
            "parameters": {"normalize": operator == "ties"},
            "models": [{"model": f"{wl.base}+{a}", "parameters": params} for a in wl.adapters]}


def _commands(system: str, wl: LoraWorkload, operator: str, density: float, scratch: Path, out: Path) -> list[str]:
    if system == "peft":
        return [sys.executable, "-m", "benchmarks.peft_merge", "--base", str(wl.base), "--adapters",
                *map(str, wl.adapters), "--out", str(out), "--operator", operator, "--density", str(density)]
    if system == "mergekit":
        config = scratch / f"mergekit-{operator}.yml"
        config.write_text(json.dumps(_mergekit_config(wl, operator, density)))
        cache = scratch / "lora-merge-cache"
        remove_tree(cache)
        return [executable(), str(config), str(out), *FLAGS, "--lora-merge-cache", str(cache)]
    names = [a.name for a in wl.adapters]
    return [*mergepipe_executable(), "merge", "--db", str(scratch / "catalog.db"), "--base", "base", "--experts",
            *names, "--operator", operator, "--density", str(density), "--budget", "100%", "--out", str(out),
            "--model-id", f"lora-{operator}", "--no-progress"]


def _catalog(wl: LoraWorkload, scratch: Path) -> dict:
    """MergePipe's one-time cost: register the base and the adapters, analyse the adapters."""
    db = str(scratch / "catalog.db")
    cli = mergepipe_executable()
    steps = [[*cli, "register", "--db", db, "--model-id", "base", "--uri", str(wl.base)]]
    steps += [[*cli, "register", "--db", db, "--model-id", a.name, "--uri", str(a), "--kind", "lora", "--base", "base"]
              for a in wl.adapters]
    steps.append([*cli, "analyze", "--db", db, "--base", "base", *(a.name for a in wl.adapters), "--no-progress"])
    total = {"wall_seconds": 0.0, "read_bytes": 0, "peak_rss_bytes": 0}
    drop_cache([wl.base, *wl.adapters])
    for step in steps:
        result = run_measured(step)
        if not result.ok:
            raise SystemExit(f"mergepipe catalog step failed: {' '.join(step)}\n{result.stderr[-1500:]}")
        total["wall_seconds"] += result.wall_seconds
        total["read_bytes"] += result.read_bytes
        total["peak_rss_bytes"] = max(total["peak_rss_bytes"], result.peak_rss_bytes)
    return total


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in weight_files(path):
        with safe_open(str(f), "pt") as handle:
            out.update({k: handle.get_tensor(k).float() for k in handle.keys()})
    return out


def delta_distance(candidate: Path, reference: Path, base: Path) -> float:
    """‖Δcandidate − Δreference‖ / ‖Δreference‖ over every tensor (Δ = output − base)."""
    b, c, r = _tensors(base), _tensors(candidate), _tensors(reference)
    num = sum(float((c[k] - r[k]).double().pow(2).sum()) for k in r if k in c)
    den = sum(float((r[k] - b[k]).double().pow(2).sum()) for k in r)
    return (num / den) ** 0.5 if den else 0.0


def run(wl: LoraWorkload, operators: list[str], systems: list[str], density: float, scratch: Path) -> dict:
    rows, outputs = [], {}
    catalog = _catalog(wl, scratch) if "mergepipe" in systems else None
    for operator in operators:
        for system in systems:
            out = scratch / f"out-{system}-{operator}"
            remove_tree(out)
            cmd = _commands(system, wl, operator, density, scratch, out)
            drop_cache([wl.base, *wl.adapters])
            result = run_measured(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=Path.cwd())
            if not result.ok:
                raise SystemExit(f"{system} {operator} failed:\n{result.stderr[-2000:]}")
            outputs[(system, operator)] = out
            rows.append({"system": system, "operator": operator, "wall_seconds": result.wall_seconds,
                         "peak_rss_bytes": result.peak_rss_bytes, "read_bytes": result.read_bytes})
        reference = outputs.get(("mergepipe", operator))
        for row in rows:
            if row["operator"] == operator and reference is not None and row["system"] != "mergepipe":
                row["delta_distance_vs_mergepipe"] = delta_distance(outputs[(row["system"], operator)], reference,
                                                                    wl.base)
    return {"catalog": catalog, "rows": rows}


def print_table(report: dict) -> None:
    if report["catalog"] is not None:
        c = report["catalog"]
        print(f"mergepipe catalog (once): register + analyze {c['wall_seconds']:.1f} s, "
              f"read {c['read_bytes'] / 1e6:.0f} MB, peak RSS {c['peak_rss_bytes'] / 1e9:.2f} GB")
    print(f"{'operator':<16} {'system':<10} {'wall s':>8} {'peak RSS GB':>12} {'read MB':>9} "
          f"{'Δ dist vs mergepipe':>20}")
    for r in report["rows"]:
        dist = r.get("delta_distance_vs_mergepipe")
        print(f"{r['operator']:<16} {r['system']:<10} {r['wall_seconds']:>8.1f} {r['peak_rss_bytes'] / 1e9:>12.2f} "
              f"{r['read_bytes'] / 1e6:>9.0f} {'-' if dist is None else f'{dist:.2e}':>20}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="qwen3-0.6b")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--operators", default="task_arithmetic,ties")
    parser.add_argument("--systems", default="mergepipe,mergekit,peft")
    parser.add_argument("--density", type=float, default=0.5)
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    args = parser.parse_args(argv)
    wl = ensure_lora_workload(args.layout, args.adapters, args.rank, root=args.root)
    scratch = args.root / f"{args.layout}-s0" / f"lora-bench-r{args.rank}"
    remove_tree(scratch)
    scratch.mkdir(parents=True)
    report = run(wl, args.operators.split(","), args.systems.split(","), args.density, scratch)
    print_table(report)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"lora-{args.layout}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({**report, "args": {k: str(v) for k, v in vars(args).items()}}, indent=2))
    print(f"results: {path}")
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
