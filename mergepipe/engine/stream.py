"""Stream one output shard: base blocks + planned expert blocks -> operator -> writer.

For every tensor of a base shard, in file order:

* a tensor that is not merged (integer dtypes) or whose blocks no expert
  read changes is copied from the base file to the output file with
  ``copy_file_range`` (no Python buffers), when the output dtype is the base's;
* a streaming tensor is merged block by block: the base block and the planned
  expert blocks are read (positional reads, counted per model), converted to
  fp32, ``Δi = Ei − B``, the operator merges, the result is cast and written at
  its offset;
* a tensor-level tensor (SLERP, model stock, or trim thresholds missing from
  the catalog) is read whole: base in one read, each expert's planned blocks
  coalesced into runs; unread expert blocks contribute Δ = 0.

An expert block that is not planned is never read; ``None`` stands for its
delta. A block for which no expert is read equals the base: every operator
returns the base for all-zero deltas, so the engine copies it instead of
running the operator.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from mergepipe.catalog.thresholds import TrimThreshold
from mergepipe.engine.operators.base import BlockContext, Operator
from mergepipe.engine.params import MergeSpec, layer_index, resolve_for_tensor
from mergepipe.engine.prefetch import ByteRange, Prefetcher, WorkItem
from mergepipe.storage.blocks import BlockSpec, block_at, tensor_blocks
from mergepipe.storage.checkpoint import Checkpoint, CheckpointFile
from mergepipe.storage.convert import MERGEABLE_DTYPES, to_bytes, to_float32
from mergepipe.storage.format import DTYPE_SIZES, TensorEntry
from mergepipe.storage.writer import StreamingSafetensorsWriter

BASE_TAG = "base"


@dataclass
class StreamStats:
    """What one execution moved and where its time went."""

    copied_base_bytes: int = 0
    merged_blocks: int = 0
    copied_blocks: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: {"read_wait": 0.0, "compute": 0.0, "write": 0.0})

    def add_time(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds


@dataclass(frozen=True)
class MergeInputs:
    """Everything fixed for one execution, shared by every shard."""

    spec: MergeSpec
    op: Operator
    base: Checkpoint
    experts: Mapping[str, Checkpoint]
    reads: Mapping[str, Mapping[str, tuple[int, ...]]]
    tensor_level: frozenset[str]
    thresholds: Mapping[str, Sequence[Mapping[float, TrimThreshold] | None]]
    block_bytes: int
    num_layers: int
    out_dtype: str | None
    device: torch.device

    def output_dtype(self, entry: TensorEntry) -> str:
        if self.out_dtype is not None and entry.dtype in MERGEABLE_DTYPES:
            return self.out_dtype
        return entry.dtype


@dataclass
class _Block:
    """A block-level work item: which block, which experts are read."""

    entry: TensorEntry
    block: BlockSpec
    experts: list[int]  # positions in spec order of the experts read
    ctx: BlockContext


@dataclass
class _Whole:
    """A tensor-level work item: reads of the base tensor and expert runs."""

    entry: TensorEntry
    runs: list[tuple[int, BlockSpec, BlockSpec]]  # (expert position, first block, last block)
    ctx: BlockContext


def output_entries(inputs: MergeInputs, file: CheckpointFile) -> list[tuple[str, str, tuple[int, ...]]]:
    """The output shard's tensors: the base shard's, in its order, in output dtypes."""
    return [(e.name, inputs.output_dtype(e), e.shape) for e in file.header.tensors.values()]


def stream_shard(
    inputs: MergeInputs,
    file: CheckpointFile,
    writer: StreamingSafetensorsWriter,
    prefetcher: Prefetcher,
    copy_fd: int,
    stats: StreamStats,
    on_bytes: Callable[[int, str], None],
) -> None:
    """Write every tensor of the base shard ``file`` through ``writer``;
    ``copy_fd`` is the base shard opened for reading, the source of copies."""

    def items():
        for entry in file.header.tensors.values():
            yield from _tensor_items(inputs, file, entry, writer, copy_fd, stats, on_bytes)

    for item, buffers in _timed(prefetcher.run(items()), stats):
        started = time.perf_counter()
        payload = item.payload
        if isinstance(payload, _Block):
            out = _merge_block(inputs, payload, buffers)
            offset = payload.block.row_start * _row_out_bytes(inputs, payload.entry)
        else:
            out = _merge_whole(inputs, payload, buffers)
            offset = 0
        data = to_bytes(out, inputs.output_dtype(payload.entry))
        stats.add_time("compute", time.perf_counter() - started)
        started = time.perf_counter()
        writer.write(payload.entry.name, offset, data)
        stats.add_time("write", time.perf_counter() - started)
        stats.merged_blocks += 1
        on_bytes(len(data), payload.entry.name)


def _timed(iterator, stats: StreamStats):
    """Count the time spent waiting for reads as its own phase."""
    while True:
        started = time.perf_counter()
        item = next(iterator, None)
        stats.add_time("read_wait", time.perf_counter() - started)
        if item is None:
            return
        yield item


def _row_out_bytes(inputs: MergeInputs, entry: TensorEntry) -> int:
    return entry.row_numel * DTYPE_SIZES[inputs.output_dtype(entry)]


def _tensor_items(inputs, file, entry, writer, copy_fd, stats, on_bytes):
    """Work items for one tensor; copies are done right here, in order."""
    planned = inputs.reads.get(entry.name, {})
    same_dtype = inputs.output_dtype(entry) == entry.dtype
    merged = entry.dtype in MERGEABLE_DTYPES and any(planned.values())
    if not merged and same_dtype:
        _copy(writer, entry, 0, entry.begin, entry.nbytes, copy_fd, stats, on_bytes)
        return
    ctx = _context(inputs, entry)
    ids = inputs.spec.expert_ids
    if entry.name in inputs.tensor_level or not merged:
        yield _whole_item(inputs, file, entry, ctx, planned)
        return
    read_sets = [set(planned.get(e, ())) for e in ids]
    for block in tensor_blocks(entry, inputs.block_bytes):
        experts = [i for i in range(len(ids)) if block.index in read_sets[i]]
        if not experts and same_dtype:
            stats.copied_blocks += 1
            _copy(writer, entry, block.begin - entry.begin, block.begin, block.nbytes, copy_fd, stats, on_bytes)
            continue
        reads = [ByteRange(file.path, block.begin, block.end, BASE_TAG)]
        for i in experts:
            ckpt = inputs.experts[ids[i]]
            e_entry = ckpt.tensor(entry.name)
            e_block = block_at(e_entry, inputs.block_bytes, block.index)
            reads.append(ByteRange(ckpt.file_of(entry.name).path, e_block.begin, e_block.end, ids[i]))
        yield WorkItem(_Block(entry, block, experts, ctx.for_rows(block.row_start)), reads)


def _copy(writer, entry, tensor_offset, src_begin, nbytes, copy_fd, stats, on_bytes) -> None:
    if nbytes == 0:
        return
    started = time.perf_counter()
    writer.copy_range(entry.name, tensor_offset, copy_fd, src_begin, nbytes)
    stats.add_time("write", time.perf_counter() - started)
    stats.copied_base_bytes += nbytes
    on_bytes(nbytes, entry.name)


def _whole_item(inputs, file, entry, ctx, planned) -> WorkItem:
    ids = inputs.spec.expert_ids
    reads = [ByteRange(file.path, entry.begin, entry.end, BASE_TAG)]
    runs = []
    for i, expert_id in enumerate(ids):
        indices = sorted(planned.get(expert_id, ()))
        if not indices:
            continue
        ckpt = inputs.experts[expert_id]
        e_entry = ckpt.tensor(entry.name)
        path = ckpt.file_of(entry.name).path
        for first, last in _runs(indices):
            b0 = block_at(e_entry, inputs.block_bytes, first)
            b1 = block_at(e_entry, inputs.block_bytes, last)
            runs.append((i, b0, b1))
            reads.append(ByteRange(path, b0.begin, b1.end, expert_id))
    return WorkItem(_Whole(entry, runs, ctx), reads)


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Sorted indices as inclusive runs of neighbours: one read per run."""
    runs: list[tuple[int, int]] = []
    for index in indices:
        if runs and index == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], index)
        else:
            runs.append((index, index))
    return runs


def _context(inputs: MergeInputs, entry: TensorEntry) -> BlockContext:
    spec = inputs.spec
    per_expert, global_ = resolve_for_tensor(spec, entry.name, layer_index(entry.name), inputs.num_layers)
    return BlockContext.create(
        entry.name,
        entry.shape,
        spec.expert_ids,
        per_expert,
        global_,
        seed=spec.seed,
        thresholds=inputs.thresholds.get(entry.name),
    )


def _block_shape(entry: TensorEntry, rows: int) -> tuple[int, ...]:
    if len(entry.shape) <= 1:
        return entry.shape
    return (rows, *entry.shape[1:])


def _merge_block(inputs: MergeInputs, item: _Block, buffers: list[memoryview]) -> torch.Tensor:
    entry, block = item.entry, item.block
    shape = _block_shape(entry, block.row_end - block.row_start)
    base = to_float32(buffers[0], entry.dtype, shape).to(inputs.device)
    deltas: list[torch.Tensor | None] = [None] * len(inputs.spec.expert_ids)
    for i, buf in zip(item.experts, buffers[1:]):
        deltas[i] = to_float32(buf, entry.dtype, shape).to(inputs.device).sub_(base)
    return inputs.op.merge(base, deltas, item.ctx).cpu()


def _merge_whole(inputs: MergeInputs, item: _Whole, buffers: list[memoryview]) -> torch.Tensor:
    entry = item.entry
    base = to_float32(buffers[0], entry.dtype, entry.shape).to(inputs.device)
    flat_base = base.view(-1)
    deltas: list[torch.Tensor | None] = [None] * len(inputs.spec.expert_ids)
    for (i, first, last), buf in zip(item.runs, buffers[1:]):
        if deltas[i] is None:
            deltas[i] = torch.zeros_like(base)
        start, end = first.flat_start, last.flat_end
        values = to_float32(buf, entry.dtype, (end - start,)).to(inputs.device)
        deltas[i].view(-1)[start:end] = values.sub_(flat_base[start:end])
    if all(d is None for d in deltas):
        return base.cpu()
    return inputs.op.merge(base, deltas, item.ctx).cpu()
