"""The local file byte ranges a plan's execution reads, from the catalog alone.

``expert_ranges``: the planned blocks of every expert, less the blocks an
incremental merge reuses (what the benchmarks' I/O floor reads).
``read_order``: those and the base's blocks, tensor by tensor in the base's
file order, as the engine's units reach them, up to a number of bytes: what
``storage/prefetch.py`` asks the kernel to read ahead while the command
still starts up (``startup_read_ahead`` bytes). It looks up only the tensors
it reaches, one at a time: it runs before torch loads, and a 70B model
merged with 20 experts has millions of blocks, most of them far past the
limit.

Only what a plain read of a local file gives is listed: remote inputs, LoRA
adapters (their reads are factors, ``engine/lora_reads.py``), delta-store
entries and sketches are left out. The ranges are a plan's *block* reads; the
engine reads exactly these, so prefetching them reads nothing the merge
would not.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from mergepipe.catalog import Catalog
from mergepipe.spec.plan import Plan
from mergepipe.spec.seconds import READ_AHEAD_BYTES, Rates
from mergepipe.storage.location import is_remote, location

#: (file, begin, end): a byte range of one local file.
FileRange = tuple[Path, int, int]

#: Expert kinds whose planned blocks are plain byte ranges of their own files.
_BLOCK_KINDS = ("checkpoint", "snapshot", "delta")


def expert_ranges(catalog: Catalog, plan: Plan) -> list[FileRange]:
    """Every expert's planned block ranges (reused blocks left out), coalesced per file."""
    return coalesce(r for _, experts in _per_tensor(catalog, plan) for r in experts)


def read_order(catalog: Catalog, plan: Plan, limit_bytes: float = math.inf) -> list[FileRange]:
    """The base's blocks (reused ones left out) and the experts' planned blocks, per tensor in the base's
    file order: the base's ranges of a tensor, then each expert's, in the plan's expert order; no tensor
    after the one that reaches ``limit_bytes``."""
    out: list[FileRange] = []
    total = 0
    for base, experts in _per_tensor(catalog, plan, with_base=True):
        out += base + experts
        total += sum(end - begin for _, begin, end in base + experts)
        if total >= limit_bytes:
            break
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


def _per_tensor(catalog: Catalog, plan: Plan, with_base: bool = False) -> Iterator[tuple[list[FileRange],
                                                                                     list[FileRange]]]:
    """Per tensor of the base, in file order, lazily: (the base's ranges, or [] without ``with_base`` or
    for a base that is not local; the experts' planned ranges, expert by expert), each coalesced. Blocks
    are looked up per tensor, and only where a range is not the whole tensor."""
    base = _local_files(catalog, plan.base.id) if with_base else None
    experts = {e: files for e in plan.merge.expert_ids if (files := _local_files(catalog, e)) is not None}
    reused = plan.reuse.blocks if plan.reuse is not None else {}
    for tensor in catalog.models.tensors(plan.base.id):
        skip = set(reused.get(tensor.name, ()))
        base_ranges: list[FileRange] = []
        if base is not None:
            base_ranges = (_blocks(catalog, plan.base.id, tensor.name, base[tensor.name], lambda i: i not in skip)
                           if skip else [(base[tensor.name], tensor.begin, tensor.end)])
        expert_ranges: list[FileRange] = []
        for expert, files in experts.items():
            planned = set(plan.reads_of(tensor.name, expert)) - skip
            if planned and tensor.name in files:
                expert_ranges += _blocks(catalog, expert, tensor.name, files[tensor.name], planned.__contains__)
        yield base_ranges, expert_ranges


def _blocks(catalog: Catalog, model_id: str, tensor: str, file: Path, keep: Callable[[int], bool]) -> list[FileRange]:
    """The byte ranges in ``file`` of ``model_id``'s blocks of ``tensor`` whose index ``keep`` accepts,
    coalesced."""
    return coalesce((file, b.begin, b.end) for b in catalog.blocks.of_tensor(model_id, tensor) if keep(b.index))


def _local_files(catalog: Catalog, model_id: str) -> dict[str, Path] | None:
    """Tensor -> its local file, for a model read as plain blocks; None for others (remote, LoRA)."""
    model = catalog.models.get(model_id)
    root = location(model.uri)
    if model.kind not in _BLOCK_KINDS or is_remote(root):
        return None
    return {t.name: Path(root) / t.file for t in catalog.models.tensors(model_id)}
