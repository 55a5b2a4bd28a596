"""LoRA experts in the engine: the reads of a run of ΔW blocks, and ΔW from them in fp32.

A run of blocks ``first..last`` of an adapter's tensor is two reads
(``analysis/lora_expert.py``): the rows of B those blocks cover, then all of
A, both counted under the expert's tag. Per block the recorded hash covers
its B rows followed by A, so the check is made here, on the bytes read,
before any value is used (the read-ahead's own checks cover one range each).
A is read with every run (no cache): what is read is what was planned. A
transposed ΔW (``fan_in_fan_out``) is one read of both factors' span per
block, whose hash each block records; its rows are sliced from the whole ΔW. A
tensor the adapter stores whole is one read of its rows, checked by the
read-ahead like a full expert's, and Δ = fp32(saved) − fp32(base).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mergepipe.analysis.lora_expert import block_hash, block_ranges, decode_rows, decode_span
from mergepipe.engine.inputs import MergeInputs
from mergepipe.errors import ModelChangedError
from mergepipe.storage.blocks import BlockSpec, block_at
from mergepipe.storage.convert import raw_view
from mergepipe.storage.hashing import block_digest
from mergepipe.storage.readahead import BlockCheck, ByteRange


def lora_reads(inputs: MergeInputs, expert_id: str, tensor: str, first: BlockSpec, last: BlockSpec) -> list[ByteRange]:
    """The reads of blocks ``first..last`` (the base's geometry) of an adapter's tensor: B's rows and A, or
    the rows of a replacement."""
    adapter = inputs.loras[expert_id]
    if tensor in adapter.saved:
        entry = adapter.saved[tensor].entry
        recorded = inputs.hashes[expert_id][tensor]
        checks = tuple(BlockCheck(b.index, entry.begin + b.row_start * entry.row_bytes,
                                  entry.begin + b.row_end * entry.row_bytes, recorded[b.index])
                       for b in _run(inputs, tensor, first, last))
        return [ByteRange(adapter.weights, checks[0].begin, checks[-1].end, expert_id, tensor, checks)]
    target = adapter.targets[tensor]
    if target.transposed:
        return [ByteRange(target.path, min(target.a.begin, target.b.begin), max(target.a.end, target.b.end),
                          expert_id, tensor)]
    (b_begin, b_end), (a_begin, a_end) = block_ranges(target, first.row_start, last.row_end)
    return [ByteRange(target.path, b_begin, b_end, expert_id, tensor),
            ByteRange(target.path, a_begin, a_end, expert_id, tensor)]


def _run(inputs: MergeInputs, tensor: str, first: BlockSpec, last: BlockSpec) -> list[BlockSpec]:
    entry = inputs.base.tensor(tensor)
    return [block_at(entry, inputs.plan.block_bytes, i) for i in range(first.index, last.index + 1)]


def replacement_delta(inputs: MergeInputs, expert_id: str, tensor: str, view: memoryview, shape: tuple[int, ...],
                      base: torch.Tensor) -> torch.Tensor:
    """Δ = fp32(saved) − fp32(base) of a replaced tensor's rows (``base``: the base's values, on the device)."""
    dtype = inputs.loras[expert_id].saved[tensor].entry.dtype
    return raw_view(view, dtype, shape).to(torch.float32, copy=True).to(base.device).sub_(base)


def lora_delta(inputs: MergeInputs, expert_id: str, tensor: str, blocks: list[BlockSpec], views: list[memoryview],
               at: int) -> tuple[torch.Tensor, int]:
    """fp32 ΔW of consecutive ``blocks`` from their reads at ``views[at]``, each block checked against its
    recorded hash; and the position of the next reads' views."""
    target = inputs.loras[expert_id].targets[tensor]
    recorded = inputs.hashes[expert_id][tensor]
    start, end = blocks[0].row_start, blocks[-1].row_end
    if target.transposed:
        digest = block_digest(views[at])
        _check(expert_id, tensor, target.path, [b.index for b in blocks if recorded.get(b.index) != digest])
        delta, _, _ = decode_span(target, views[at], min(target.a.begin, target.b.begin))
        return delta[start:end].contiguous().to(inputs.device), at + 1
    b_view, a_view = views[at], views[at + 1]
    row_bytes = target.b.row_bytes
    _check(expert_id, tensor, target.path, [
        b.index for b in blocks
        if block_hash(b_view[(b.row_start - start) * row_bytes : (b.row_end - start) * row_bytes], a_view)
        != recorded.get(b.index)])
    return decode_rows(target, b_view, a_view, end - start).to(inputs.device), at + 2


def _check(expert_id: str, tensor: str, path: Path, mismatched: list[int]) -> None:
    if mismatched:
        raise ModelChangedError(
            f"model '{expert_id}' changed on disk since it was analysed: block {mismatched[0]} of tensor '{tensor}' "
            f"in {path} no longer matches its recorded hash; nothing was published. Re-register it "
            "(`mergepipe register --force`), analyse it and plan again")
