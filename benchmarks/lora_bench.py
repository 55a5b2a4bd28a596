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

Task-arithmetic outputs are compared with the exact sum B + Σ ΔWi computed in
float64 from the factors (``exact_sum_error``: relative to ‖Σ ΔWi‖, bf16
rounding of the output included). TIES differs by system by design (peft:
TIES on each ΔW then an SVD back to low rank; mergekit: TIES on each adapter
merged into a bf16 copy of the base), so only its cost is compared.
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
            *names, "--operator", operator, *(["--density", str(density)] if operator == "ties" else []),
            "--budget", "100%", "--out", str(out),
            "--model-id", f"lora-{operator}", "--no-progress"]


def _catalog(wl: LoraWorkload, scratch: Path) -> dict:
    """MergePipe's one-time cost: register the base and the adapters, analyse the adapters."""
    db = str(scratch / "catalog.db")
    cli = mergepipe_executable()
    steps = [[*cli, "init-db", "--db", db], [*cli, "register", "--db", db, "--model-id", "base", "--uri", str(wl.base)]]
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


def _dtypes(path: Path) -> dict[str, torch.dtype]:
    out = {}
    for f in weight_files(path):
        with safe_open(str(f), "pt") as handle:
            out.update({k: handle.get_slice(k).get_dtype() for k in handle.keys()})
    names = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    return {k: names[v] for k, v in out.items()}


def exact_sum_error(candidate: Path, wl: LoraWorkload) -> tuple[float, float]:
    """‖out − (B + Σ ΔWi)‖ / ‖Σ ΔWi‖ over every weight, against the exact task-arithmetic sum computed
    here in float64 from the adapters' factors (ΔWi = (α/r)·Bi·Ai, plain torch): the error a merge adds,
    bf16 rounding of the output included; and the floor, the same error of the exact sum rounded once."""
    out, base = _tensors(candidate), _tensors(wl.base)
    base_dtypes = _dtypes(wl.base)  # the output keeps the base's dtype (bf16): the floor rounds to it
    factors = []
    for adapter in wl.adapters:
        config = json.loads((adapter / "adapter_config.json").read_text())
        with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as handle:
            factors.append((config["lora_alpha"] / config["r"], {k: handle.get_tensor(k) for k in handle.keys()}))
    num = den = floor = 0.0
    for name, b in base.items():
        module = "base_model.model." + name.removesuffix(".weight")
        delta = torch.zeros_like(b, dtype=torch.float64)
        for scale, f in factors:
            if f"{module}.lora_A.weight" in f:
                delta += scale * (f[f"{module}.lora_B.weight"].double() @ f[f"{module}.lora_A.weight"].double())
        exact = b.double() + delta
        num += float((out[name].double() - exact).pow(2).sum())
        floor += float((exact.to(base_dtypes[name]).double() - exact).pow(2).sum())
        den += float(delta.pow(2).sum())
    return ((num / den) ** 0.5, (floor / den) ** 0.5) if den else (0.0, 0.0)


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
        if operator == "task_arithmetic":
            for row in rows:
                if row["operator"] == operator:
                    row["error_vs_exact_sum"], floor = exact_sum_error(outputs[(row["system"], operator)], wl)
                    row["rounding_floor"] = floor
    return {"catalog": catalog, "rows": rows}


def print_table(report: dict) -> None:
    if report["catalog"] is not None:
        c = report["catalog"]
        print(f"mergepipe catalog (once): register + analyze {c['wall_seconds']:.1f} s, "
              f"read {c['read_bytes'] / 1e6:.0f} MB, peak RSS {c['peak_rss_bytes'] / 1e9:.2f} GB")
    print(f"{'operator':<16} {'system':<10} {'wall s':>8} {'peak RSS GB':>12} {'read MB':>9} "
          f"{'err vs exact ΣΔW':>20}")
    for r in report["rows"]:
        dist = r.get("error_vs_exact_sum")
        if r.get("rounding_floor") is not None and r["system"] == report["rows"][0]["system"]:
            print(f"  (task arithmetic: the exact sum rounded once to bf16 is off by {r['rounding_floor']:.3e})")
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
