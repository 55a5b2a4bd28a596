"""The local file byte ranges a plan's execution reads, from the catalog alone.

``expert_ranges``: the planned blocks of every expert, less the blocks an
incremental merge reuses (what the benchmarks' I/O floor reads).
``read_order``: those and the base's blocks, tensor by tensor in the base's
file order, as the engine's units reach them; what ``storage/prefetch.py``
asks the kernel to read ahead while the command still starts up, the first
``startup_read_ahead`` bytes of it.

Only what a plain read of a local file gives is listed: remote inputs, LoRA
adapters (their reads are factors, ``engine/lora_reads.py``), delta-store
entries and sketches are left out. The ranges are a plan's *block* reads; the
engine reads exactly these, so prefetching them reads nothing the merge
would not.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from mergepipe.catalog import Catalog
from mergepipe.catalog.records import BlockRecord
from mergepipe.spec.plan import Plan
from mergepipe.spec.seconds import READ_AHEAD_BYTES, Rates
from mergepipe.storage.location import is_remote, location

#: (file, begin, end): a byte range of one local file.
FileRange = tuple[Path, int, int]

#: Expert kinds whose planned blocks are plain byte ranges of their own files.
_BLOCK_KINDS = ("checkpoint", "snapshot", "delta")


def expert_ranges(catalog: Catalog, plan: Plan) -> list[FileRange]:
    """Every expert's planned block ranges (reused blocks left out), coalesced per file."""
    return coalesce(r for per_tensor in _expert_blocks(catalog, plan).values()
                    for ranges in per_tensor.values() for r in ranges)


def read_order(catalog: Catalog, plan: Plan) -> list[FileRange]:
    """The base's blocks (reused ones left out) and the experts' planned blocks, per tensor in the base's
    file order: the base's ranges of a tensor, then each expert's, in the plan's expert order."""
    base = _files(catalog, plan.base.id)
    if base is None:
        return []
    files, blocks = base
    reused = plan.reuse.blocks if plan.reuse is not None else {}
    experts = _expert_blocks(catalog, plan)
    out: list[FileRange] = []
    for tensor, records in blocks.items():
        skip = set(reused.get(tensor, ()))
        out += coalesce((files[tensor], b.begin, b.end) for b in records if b.index not in skip)
        for per_tensor in experts.values():
            out += per_tensor.get(tensor, [])
    return out


def startup_read_ahead(rates: Rates | None) -> int:
    """Bytes to read ahead while an own-process command loads torch: what this machine's disk reads
    (calibrated ``sequential_read``) in the start-up a server saves, at most ``READ_AHEAD_BYTES``
    (``Rates.read_ahead_seconds``, as the cost model counts it); ``READ_AHEAD_BYTES`` without rates
    (about what a disk of 2 GB/s reads while torch loads; a 10% merge of a 0.6B model)."""
    if rates is None:
        return READ_AHEAD_BYTES
    return int(rates.sequential_read * rates.read_ahead_seconds)


def coalesce(ranges: Iterable[FileRange]) -> list[FileRange]:
    """Adjacent or overlapping ranges of one file merged (sorted by file, then offset)."""
    out: list[FileRange] = []
    for path, begin, end in sorted(ranges):
        if out and out[-1][0] == path and out[-1][2] >= begin:
            out[-1] = (path, out[-1][1], max(out[-1][2], end))
        else:
            out.append((path, begin, end))
    return out


def _expert_blocks(catalog: Catalog, plan: Plan) -> dict[str, dict[str, list[FileRange]]]:
    """Expert id -> tensor -> its planned block ranges, coalesced (experts without local block files
    left out)."""
    reused = plan.reuse.blocks if plan.reuse is not None else {}
    out: dict[str, dict[str, list[FileRange]]] = {}
    for expert in plan.merge.expert_ids:
        found = _files(catalog, expert)
        if found is None:
            continue
        files, blocks = found
        out[expert] = {}
        for tensor, per_expert in plan.reads.items():
            indices = set(per_expert.get(expert, ())) - set(reused.get(tensor, ()))
            if indices and tensor in blocks:
                out[expert][tensor] = coalesce((files[tensor], b.begin, b.end) for b in blocks[tensor]
                                               if b.index in indices)
    return out


def _files(catalog: Catalog, model_id: str) -> tuple[dict[str, Path], dict[str, list[BlockRecord]]] | None:
    """(tensor -> its local file, tensor -> its block records) of a model read as plain blocks, or None."""
    model = catalog.models.get(model_id)
    root = location(model.uri)
    if model.kind not in _BLOCK_KINDS or is_remote(root):
        return None
    files = {t.name: Path(root) / t.file for t in catalog.models.tensors(model_id)}
    return files, catalog.blocks.by_tensor(model_id)
