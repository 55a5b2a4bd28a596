"""Planner at scale: how long planning takes for large models and many experts.

Usage: ``python -m benchmarks.planner_bench [--cases 7b:4,70b:20] [--workdir DIR]``

Planning reads only the catalog, so this benchmark needs no weights: it
writes a synthetic catalog at a real layout (Llama-2-7B, Llama-2-70B shapes,
bf16, 1 MiB blocks) with block hashes and delta statistics as ``analyze``
would record them (about 15% of each expert's blocks identical to the base,
random norms elsewhere), backed by sparse files of the right sizes so the
planner's change detection has something to stat. Then it times, per case:
reading the catalog and planning (``Planner.plan``, TIES at a 10% budget),
the plan digest (first access, then cached) and its canonical JSON. Prints a
table; nothing is compared with another system.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mergepipe.catalog import Catalog
from mergepipe.catalog.records import (
    BlockDelta,
    BlockRecord,
    FileRecord,
    ModelContent,
    ModelRecord,
    TensorRecord,
    TensorStats,
)
from mergepipe.planner.planner import Planner
from mergepipe.spec.operators import DENSITY_GRID, TrimThreshold
from mergepipe.storage.format import tensor_blocks
from mergepipe.storage.format import TensorEntry
from mergepipe.spec.request import MergeRequest

BLOCK_BYTES = 1 << 20
HEADER_BYTES = 4096  # a plausible header size; only offsets depend on it
IDENTICAL_SHARE = 0.15


@dataclass(frozen=True)
class Layout:
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    kv: int  # width of the k and v projections (grouped-query attention)

    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        h, i = self.hidden, self.intermediate
        out = [("model.embed_tokens.weight", (self.vocab, h))]
        for n in range(self.layers):
            p = f"model.layers.{n}."
            out += [
                (p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.k_proj.weight", (self.kv, h)), (p + "self_attn.v_proj.weight", (self.kv, h)),
                (p + "self_attn.o_proj.weight", (h, h)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i)),
            ]
        return out + [("model.norm.weight", (h,)), ("lm_head.weight", (self.vocab, h))]


LAYOUTS = {
    "7b": Layout(hidden=4096, intermediate=11008, layers=32, vocab=32000, kv=4096),
    "70b": Layout(hidden=8192, intermediate=28672, layers=80, vocab=32000, kv=1024),
}


def content(model_id: str, layout: Layout, root: Path, created_at: str) -> ModelContent:
    """Catalog rows of a one-file bf16 model at ``layout``, backed by a sparse file."""
    tensors, blocks, offset = [], [], HEADER_BYTES
    for ordinal, (name, shape) in enumerate(layout.shapes()):
        nbytes = int(np.prod(shape)) * 2
        entry = TensorEntry(name, "BF16", shape, offset, offset + nbytes)
        tensors.append(TensorRecord(name, "model.safetensors", "BF16", shape, offset, offset + nbytes, ordinal))
        blocks += [BlockRecord(name, b.index, b.row_start, b.row_end, b.begin, b.end, None)
                   for b in tensor_blocks(entry, BLOCK_BYTES)]
        offset += nbytes
    root.mkdir(parents=True)
    path = root / "model.safetensors"
    with open(path, "wb") as fh:
        fh.truncate(offset)
    st = os.stat(path)
    files = (FileRecord("model.safetensors", st.st_size, st.st_mtime_ns, hashlib.sha256(model_id.encode()).hexdigest()),)
    record = ModelRecord(model_id, str(root), "checkpoint", hashlib.sha256(b"layout").hexdigest(), "LlamaForCausalLM",
                         layout.layers, offset - HEADER_BYTES, len(tensors), len(blocks), created_at)
    return ModelContent(record, files, tuple(tensors), tuple(blocks))


def build(db: Path, root: Path, layout: Layout, experts: int, seed: int = 0) -> list[str]:
    """A catalog with a base and ``experts`` analysed experts; their ids."""
    rng = np.random.default_rng(seed)
    ids = [f"expert-{i}" for i in range(experts)]
    with Catalog.create(db, BLOCK_BYTES) as catalog:
        base = content("base", layout, root / "base", catalog.now())
        catalog.models.add(base)
        base_hashes = [hashlib.blake2b(f"{b.tensor}:{b.index}".encode(), digest_size=16).hexdigest()
                       for b in base.blocks]
        catalog.blocks.set_hashes("base", [(b.tensor, b.index, h) for b, h in zip(base.blocks, base_hashes)])
        for expert in ids:
            catalog.models.add(content(expert, layout, root / expert, catalog.now()))
            same = rng.random(len(base.blocks)) < IDENTICAL_SHARE
            norms = rng.gamma(2.0, 0.05, len(base.blocks))
            hashes = [h if s else h[::-1] for h, s in zip(base_hashes, same)]
            catalog.blocks.set_hashes(expert, [(b.tensor, b.index, h) for b, h in zip(base.blocks, hashes)])
            deltas = [BlockDelta(b.tensor, b.index, 0.0, 0.0, 0, True) if s
                      else BlockDelta(b.tensor, b.index, float(n), float(n), 1, False)
                      for b, s, n in zip(base.blocks, same, norms)]
            thresholds = {d: TrimThreshold(d, 1, 0.0, 0) for d in DENSITY_GRID}
            stats = [TensorStats(t.name, t.numel, True, False, thresholds) for t in base.tensors]
            catalog.stats.record(expert, "base", deltas, stats)
    return ids


def run_case(name: str, experts: int, workdir: Path) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix=f"planner-{name}-", dir=workdir))
    try:
        started = time.perf_counter()
        ids = build(scratch / "catalog.db", scratch / "models", LAYOUTS[name], experts)
        built = time.perf_counter() - started
        with Catalog.open(scratch / "catalog.db") as catalog:
            started = time.perf_counter()
            plan = Planner(catalog).plan(MergeRequest(base="base", experts=ids, operator="ties", params={"density": 0.5}, budget="10%"))
            planned = time.perf_counter() - started
        started = time.perf_counter()
        plan.digest
        first = time.perf_counter() - started
        started = time.perf_counter()
        plan.digest
        cached = time.perf_counter() - started
        started = time.perf_counter()
        plan.to_json_str()
        serialised = time.perf_counter() - started
        reads = sum(len(ix) for per in plan.reads.values() for ix in per.values())
        return {"case": f"{name} x {experts}", "reads": reads,
                "catalog_s": built, "plan_s": planned, "digest_ms": first * 1e3, "cached_ms": cached * 1e3,
                "json_ms": serialised * 1e3}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="7b:4,70b:20", help="layout:experts, comma-separated")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    print(f"{'case':12} {'reads':>9} {'catalog s':>10} {'plan s':>8} {'digest ms':>10} {'cached ms':>10} {'json ms':>8}")
    for case in args.cases.split(","):
        name, experts = case.split(":")
        r = run_case(name, int(experts), args.workdir)
        print(f"{r['case']:12} {r['reads']:>9} {r['catalog_s']:>10.1f} {r['plan_s']:>8.2f} {r['digest_ms']:>10.1f} "
              f"{r['cached_ms']:>10.4f} {r['json_ms']:>8.1f}")


if __name__ == "__main__":
    main()
