"""Incremental analyze: a new version that changed 25% of its layers vs a full analysis of it.

Usage: ``python -m benchmarks.incremental_analyze [--layout qwen3-0.6b] [--changed 0.25]``

Takes the benchmark workload's base and ``math`` expert, writes ``math``
version 2 with every tensor of a quarter of its layers retrained (bf16
noise of the delta's scale), then times, each with a cold page cache:
analysing version 2 against the base in a catalog where version 1 is
analysed (incremental: hash v2 once, recompute only the changed tensors)
and analysing the same files as a new model in a fresh catalog (full).
Prints a table; the results must be equal row for row (checked).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from benchmarks.coldcache import drop_cache
from benchmarks.workloads import ensure_workload
from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.register import register
from mergepipe.catalog import Catalog


def retrain(expert: Path, out: Path, fraction: float, num_layers: int) -> list[int]:
    """Copy ``expert`` to ``out`` with the tensors of ``fraction`` of its layers changed; those layers."""
    shutil.copytree(expert, out)
    step = max(1, round(1 / fraction))
    layers = list(range(0, num_layers, step))
    gen = torch.Generator().manual_seed(11)
    for path in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(path))
        for name, t in tensors.items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) in layers and t.is_floating_point():
                noise = torch.randn(t.shape, generator=gen) * float(t.float().std()) * 0.01
                tensors[name] = (t.float() + noise).to(t.dtype)
        save_file(tensors, str(path), metadata={"format": "pt"})
    return layers


def timed_analyze(catalog: Catalog, ref: str, files: list[Path]) -> tuple[float, object]:
    drop_cache(files)
    started = time.perf_counter()
    report = analyze(catalog, [ref], base_id="base", progress=False)
    return time.perf_counter() - started, report


def cold_read(files: list[Path]) -> float:
    """Seconds to read ``files`` once from a cold page cache, 16 MiB at a time (what one pass costs here)."""
    drop_cache(files)
    buffer = bytearray(16 << 20)
    started = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as fh:
            while fh.readinto(buffer):
                pass
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="qwen3-0.6b")
    parser.add_argument("--changed", type=float, default=0.25, help="fraction of layers retrained")
    args = parser.parse_args()
    workload = ensure_workload(args.layout, num_experts=1)
    work = Path(tempfile.mkdtemp(prefix="mergepipe-incr-"))
    try:
        v2 = work / "math-v2"
        layers = retrain(workload.experts[0], v2, args.changed, workload.layout.num_layers)
        files = [*workload.base.glob("*.safetensors"), *v2.glob("*.safetensors")]
        with Catalog.create(work / "incremental.db") as catalog:
            register(catalog, "base", workload.base)
            register(catalog, "math", workload.experts[0])
            analyze(catalog, ["math"], base_id="base", progress=False)
            v2_files = list(v2.glob("*.safetensors"))
            v2_bytes, read_s = sum(f.stat().st_size for f in v2_files), cold_read(v2_files)
            drop_cache(files)
            started = time.perf_counter()
            register(catalog, "math", v2, new_version=True)
            register_s = time.perf_counter() - started
            incremental_s, incremental = timed_analyze(catalog, "math", files)
            rows = (catalog.stats.block_deltas("math@2", "base"), catalog.stats.tensor_stats("math@2", "base"))
        with Catalog.create(work / "full.db") as catalog:
            register(catalog, "base", workload.base)
            register(catalog, "v2", v2)
            full_s, full = timed_analyze(catalog, "v2", files)
            same = rows == (catalog.stats.block_deltas("v2", "base"), catalog.stats.tensor_stats("v2", "base"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    unchanged, total = incremental.inherited["math@2"]
    print(f"{args.layout}: version 2 of 'math' retrained in {len(layers)} of {workload.layout.num_layers} layers; "
          f"{total - unchanged} of {total} tensors changed; results equal: {same}")
    print(f"{'analysis':14} {'seconds':>8} {'MB read':>9} {'base MB':>8}")
    for label, seconds, report in (("full", full_s, full), ("incremental", incremental_s, incremental)):
        print(f"{label:14} {seconds:8.2f} {report.bytes_read / 1e6:9.0f} {report.bytes_by_model.get('base', 0) / 1e6:8.0f}")
    print(f"{'register':14} {register_s:8.2f}")
    print(f"{'cold read':14} {read_s:8.2f} {v2_bytes / 1e6:9.0f}"
          "   (version 2's files, sequential 16 MiB reads: the disk's speed)")
    print(f"incremental / full: {incremental_s / full_s:.2f}x time; register + incremental / cold read of version 2: "
          f"{(register_s + incremental_s) / read_s:.2f}x")
    if not same:
        raise SystemExit("the incremental analysis differs from the full one")


if __name__ == "__main__":
    main()
