"""LoRA experts in the engine: the reads of a run of ΔW blocks, and ΔW from them in fp32.

Every block of a LoRA tensor needs all of factor A, so A is read once per
tensor (``analysis/expert_format.py``: it is the tensor's *shared* cost):
the first run of blocks read of an adapter's tensor is two reads, the rows
of B those blocks cover and A; later runs read only their rows of B. A is
kept, raw and as fp32, in the tensor's ``SharedFactors`` — one per tensor,
handed to each of its work items, which run in order in one unit — so what
is read is what was planned and a 100% budget reads every factor byte once.

A block's recorded hash covers its B rows followed by A (the bytes it
uses), so the check is made here, on the bytes read and the A kept, before
any value is used (the read-ahead's own checks cover one range each). A
transposed ΔW (``fan_in_fan_out``) reads both factors' span once, with the
first block; every block records that span's hash, and its rows come from
the kept factors. A tensor the adapter stores whole is one read of its
rows, checked by the read-ahead like a full expert's, and
Δ = fp32(saved) − fp32(base).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mergepipe.analysis.lora_expert import block_hash, block_ranges
from mergepipe.engine.job import Job
from mergepipe.errors import ModelChangedError
from mergepipe.storage.geometry import BlockSpec, block_at
from mergepipe.storage.convert import raw_view, to_float32
from mergepipe.storage.hashing import block_digest
from mergepipe.storage.lora import LoraTarget
from mergepipe.storage.lora_delta import delta_rows
from mergepipe.storage.readahead import BlockCheck, ByteRange


@dataclass
class Kept:
    """An adapter's shared factor bytes of one tensor, as read: A (raw, for block hashes) and fp32; for a
    transposed ΔW both factors in fp32 and the span's digest (every block's recorded hash)."""

    a32: torch.Tensor
    raw: bytes = b""
    b32: torch.Tensor | None = None
    digest: str = ""


@dataclass
class SharedFactors:
    """What one tensor's LoRA reads share across its work items (module docstring): ``requested``, when
    the items are made: adapters whose first read of the tensor is made already; ``kept``, when they are
    merged (in the same order): what that read brought."""

    requested: set[str] = field(default_factory=set)
    kept: dict[str, Kept] = field(default_factory=dict)


def lora_reads(inputs: Job, expert_id: str, tensor: str, first: BlockSpec, last: BlockSpec,
               shared: SharedFactors) -> list[ByteRange]:
    """The reads of blocks ``first..last`` (the base's geometry) of an adapter's tensor: B's rows, and A
    with the tensor's first run; or the rows of a replacement."""
    adapter = inputs.loras[expert_id]
    if tensor in adapter.saved:
        entry = adapter.saved[tensor].entry
        recorded = inputs.hashes[expert_id][tensor]
        checks = tuple(BlockCheck(b.index, entry.begin + b.row_start * entry.row_bytes,
                                  entry.begin + b.row_end * entry.row_bytes, recorded[b.index])
                       for b in _run(inputs, tensor, first, last))
        return [ByteRange(adapter.weights, checks[0].begin, checks[-1].end, expert_id, tensor, checks)]
    target = adapter.targets[tensor]
    first_read = expert_id not in shared.requested
    shared.requested.add(expert_id)
    if target.transposed:
        span = (min(target.a.begin, target.b.begin), max(target.a.end, target.b.end))
        return [ByteRange(target.path, *span, expert_id, tensor)] if first_read else []
    (b_begin, b_end), (a_begin, a_end) = block_ranges(target, first.row_start, last.row_end)
    reads = [ByteRange(target.path, b_begin, b_end, expert_id, tensor)]
    if first_read:
        reads.append(ByteRange(target.path, a_begin, a_end, expert_id, tensor))
    return reads


def _run(inputs: Job, tensor: str, first: BlockSpec, last: BlockSpec) -> list[BlockSpec]:
    entry = inputs.base.tensor(tensor)
    return [block_at(entry, inputs.plan.block_bytes, i) for i in range(first.index, last.index + 1)]


def replacement_delta(inputs: Job, expert_id: str, tensor: str, view: memoryview, shape: tuple[int, ...],
                      base: torch.Tensor) -> torch.Tensor:
    """Δ = fp32(saved) − fp32(base) of a replaced tensor's rows (``base``: the base's values, on the device)."""
    dtype = inputs.loras[expert_id].saved[tensor].entry.dtype
    return raw_view(view, dtype, shape).to(torch.float32, copy=True).to(base.device).sub_(base)


def lora_delta(inputs: Job, expert_id: str, tensor: str, blocks: list[BlockSpec], views: Iterator[memoryview],
               shared: SharedFactors) -> torch.Tensor:
    """fp32 ΔW of consecutive ``blocks`` from their reads, the next of ``views`` (and the kept A), each
    block checked against its recorded hash."""
    target = inputs.loras[expert_id].targets[tensor]
    recorded = inputs.hashes[expert_id][tensor]
    start, end = blocks[0].row_start, blocks[-1].row_end
    if target.transposed:
        if expert_id not in shared.kept:
            shared.kept[expert_id] = _keep_span(target, next(views))
        kept = shared.kept[expert_id]
        _check(expert_id, tensor, target.path, [b.index for b in blocks if recorded.get(b.index) != kept.digest])
        assert kept.b32 is not None
        delta = delta_rows(kept.b32, kept.a32[:, start:end], target.scale, True)
        return delta.to(inputs.device)
    b_view = next(views)
    if expert_id not in shared.kept:
        raw = bytes(next(views))
        shared.kept[expert_id] = Kept(to_float32(raw, target.a.dtype, tuple(target.a.shape)), raw)
    kept, row_bytes = shared.kept[expert_id], target.b.row_bytes
    _check(expert_id, tensor, target.path, [
        b.index for b in blocks
        if block_hash(b_view[(b.row_start - start) * row_bytes : (b.row_end - start) * row_bytes], kept.raw)
        != recorded.get(b.index)])
    b_part = to_float32(b_view, target.b.dtype, (end - start, target.rank))
    return delta_rows(b_part, kept.a32, target.scale, False).to(inputs.device)


def _keep_span(target: LoraTarget, view: memoryview) -> Kept:
    """Both factors of a transposed ΔW from their span, as read once (``raw``: the span's digest)."""
    begin = min(target.a.begin, target.b.begin)
    a32 = to_float32(view[target.a.begin - begin : target.a.end - begin], target.a.dtype, tuple(target.a.shape))
    b32 = to_float32(view[target.b.begin - begin : target.b.end - begin], target.b.dtype, tuple(target.b.shape))
    return Kept(a32, b32=b32, digest=block_digest(view))


def _check(expert_id: str, tensor: str, path: Path, mismatched: list[int]) -> None:
    if mismatched:
        raise ModelChangedError(
            f"model '{expert_id}' changed on disk since it was analysed: block {mismatched[0]} of tensor '{tensor}' "
            f"in {path} no longer matches its recorded hash; nothing was published. Re-register it "
            "(`mergepipe register --force`), analyse it and plan again")
