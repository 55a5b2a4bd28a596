"""Run one work unit: base blocks + planned expert blocks -> kernel -> output bytes.

For every tensor of the unit, in file order:

* a tensor that is not merged (integer dtypes) or whose blocks no expert
  read changes is copied from the base, block by block, when the output
  dtype is the base's;
* a streaming tensor is merged block by block: the base block and the planned
  expert blocks are read (positional reads, counted per model), converted to
  fp32 on the device, ``Δi = Ei − B``, the kernel merges, the result is cast
  and written at its fixed offset;
* a tensor-level tensor (SLERP, model stock, or trim thresholds missing from
  the catalog) is read whole: base in one read, each expert's planned blocks
  coalesced into runs; unread expert blocks contribute Δ = 0;
* a tensor the plan reads delta stores for (policy ``entries``) is read
  whole too: the base, experts' block runs, and per store expert one read
  of its planned chunk prefix or sketch stages. A chunk holds positions and
  the expert's exact element bytes, so ``Δ = E - B`` there is the full
  read's delta (entries not read: Δ = 0); sketch stages give
  ``Δ ≈ Σ_s q_s * scale_s`` for every entry (``analysis/sketch.py``).

An expert block that is not planned is never read; ``None`` stands for its
delta. A block for which no expert is read equals the base: every operator
returns the base for all-zero deltas, so it is copied instead of merged.

Every byte read is checked before it is used: each block must hash to what
the catalog recorded when the model was analysed (the read-ahead thread
hashes it as it arrives). A file changed behind the catalog's back — even
with its size and mtime restored — aborts the merge with a
``ModelChangedError`` naming the file, tensor and block. Copied base bytes
go through the same reads and checks, so the base is checked in full;
expert blocks recorded identical to the base are never read, and are
covered by the base's check.

A unit opens its own source and writer and returns a small ``UnitRecord``
(bytes read per model, bytes written, seconds per phase): it needs nothing
from the coordinator but the shared, read-only ``UnitJob``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from mergepipe.catalog.deltas import DeltaChunk, DeltaStage
from mergepipe.engine.inputs import BASE_TAG, MergeInputs
from mergepipe.engine.operators.context import BlockContext
from mergepipe.engine.operators.registry import merge
from mergepipe.engine.workunits import WorkUnit
from mergepipe.errors import EngineError, ModelChangedError
from mergepipe.progress import Advance
from mergepipe.storage.blocks import BlockSpec, block_at, tensor_blocks
from mergepipe.storage.checkpoint import CheckpointFile
from mergepipe.storage.convert import MERGEABLE_DTYPES, raw_view, to_bytes
from mergepipe.storage.entries import decode_chunk, decode_stage
from mergepipe.storage.format import DTYPE_SIZES, TensorEntry
from mergepipe.storage.hashing import block_digest
from mergepipe.storage.readahead import (
    BlockCheck,
    ByteRange,
    Fetched,
    ReadAhead,
    WorkItem,
)
from mergepipe.storage.source import LocalFileSource
from mergepipe.storage.writer import ShardLayout, ShardWriter


@dataclass(frozen=True)
class UnitJob:
    """What every unit of one execution shares (read-only)."""

    inputs: MergeInputs
    layouts: Mapping[str, ShardLayout]
    window_bytes: int
    io_threads: int


@dataclass
class UnitRecord:
    """What one unit did: bytes read per model tag, data bytes written, and
    seconds per phase."""

    index: int
    bytes_by_tag: dict[str, int] = field(default_factory=dict)
    bytes_written: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: {"read_wait": 0.0, "compute": 0.0, "write": 0.0})

    def add_time(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds


@dataclass
class _Copy:
    """A base block written as it is."""

    entry: TensorEntry
    block: BlockSpec


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
    stored: list[tuple[int, Sequence[DeltaChunk]]] = field(default_factory=list)  # (expert position, chunks read)
    sketched: list[tuple[int, Sequence[DeltaStage]]] = field(default_factory=list)  # (expert position, stages read)


def run_unit(unit: WorkUnit, job: UnitJob, advance: Advance) -> UnitRecord:
    """Merge and write every tensor of ``unit``; its record."""
    inputs = job.inputs
    file = inputs.base.file(unit.shard)
    record = UnitRecord(unit.index)
    with LocalFileSource() as source, ShardWriter(job.layouts[unit.shard], unit.tensors) as writer:
        for checkpoint in inputs.experts.values():
            for expert_file in checkpoint.files:
                source.advise_random(expert_file.path)
        readahead = ReadAhead(source, job.io_threads, job.window_bytes, on_read=_verifier(inputs))
        items = (item for name in unit.tensors for item in _tensor_items(inputs, file, file.header.tensors[name]))
        for fetched in _timed(readahead.run(items), record):
            _merge_and_write(inputs, fetched, writer, record, advance)
        writer.finish()
        record.bytes_by_tag = source.bytes_by_tag()
        record.bytes_written = writer.bytes_written
    return record


def _merge_and_write(
    inputs: MergeInputs, fetched: Fetched, writer: ShardWriter, record: UnitRecord, advance: Advance
) -> None:
    payload = fetched.item.payload
    if isinstance(payload, _Copy):
        started = time.perf_counter()
        writer.write(payload.entry.name, payload.block.begin - payload.entry.begin, fetched.views[0])
        fetched.release()
        record.add_time("write", time.perf_counter() - started)
        advance(payload.block.nbytes, payload.entry.name)
        return
    started = time.perf_counter()
    if isinstance(payload, _Block):
        out = _merge_block(inputs, payload, fetched.views)
        offset = payload.block.row_start * payload.entry.row_numel * DTYPE_SIZES[inputs.output_dtype(payload.entry)]
    else:
        out = _merge_whole(inputs, payload, fetched.views)
        offset = 0
    fetched.release()
    data = to_bytes(out, inputs.output_dtype(payload.entry))
    record.add_time("compute", time.perf_counter() - started)
    started = time.perf_counter()
    writer.write(payload.entry.name, offset, data)
    record.add_time("write", time.perf_counter() - started)
    advance(len(data), payload.entry.name)


def _timed(fetches: Iterator[Fetched], record: UnitRecord) -> Iterator[Fetched]:
    """Count the time spent waiting for reads as its own phase."""
    while True:
        started = time.perf_counter()
        fetched = next(fetches, None)
        record.add_time("read_wait", time.perf_counter() - started)
        if fetched is None:
            return
        yield fetched


# ------------------------------------------------------------------ checks


def _verifier(inputs: MergeInputs) -> Callable[[WorkItem, list[memoryview]], None]:
    """The read-ahead's ``on_read``: every checked block must hash to its record."""

    def verify(item: WorkItem, views: list[memoryview]) -> None:
        for read, view in zip(item.reads, views):
            for check in read.checks:
                if block_digest(view[check.begin - read.begin : check.end - read.begin]) != check.digest:
                    model_id = inputs.plan.base.id if read.tag == BASE_TAG else read.tag
                    if read.kind != "block":
                        raise ModelChangedError(
                            f"the delta store of '{model_id}' changed on disk since it was built: {read.kind} "
                            f"{check.index} of tensor '{read.tensor}' in {read.path} no longer matches its recorded "
                            "hash; nothing was published. Rebuild it with `mergepipe analyze --store-deltas`"
                        )
                    raise ModelChangedError(
                        f"model '{model_id}' changed on disk since it was analysed: block {check.index} of "
                        f"tensor '{read.tensor}' in {read.path} no longer matches its recorded hash; nothing was "
                        "published. Re-register it (`mergepipe register --force`), analyse it and plan again"
                    )

    return verify


def _read(inputs: MergeInputs, model_id: str, tag: str, file: CheckpointFile, entry: TensorEntry,
          first: BlockSpec, last: BlockSpec) -> ByteRange:
    """A read of blocks ``first..last`` of a tensor, with the check of each block."""
    recorded = inputs.hashes[model_id][entry.name]
    checks = tuple(
        BlockCheck(b.index, b.begin, b.end, recorded[b.index])
        for b in (block_at(entry, inputs.plan.block_bytes, i) for i in range(first.index, last.index + 1))
    )
    return ByteRange(file.path, first.begin, last.end, tag, entry.name, checks)


def _base_read(inputs: MergeInputs, file: CheckpointFile, entry: TensorEntry,
               first: BlockSpec, last: BlockSpec) -> ByteRange:
    return _read(inputs, inputs.plan.base.id, BASE_TAG, file, entry, first, last)


def _expert_read(inputs: MergeInputs, expert_id: str, tensor: str, first: int, last: int) -> ByteRange:
    checkpoint = inputs.experts[expert_id]
    entry = checkpoint.tensor(tensor)
    b0 = block_at(entry, inputs.plan.block_bytes, first)
    b1 = b0 if last == first else block_at(entry, inputs.plan.block_bytes, last)
    return _read(inputs, expert_id, expert_id, checkpoint.file_of(tensor), entry, b0, b1)


# ------------------------------------------------------------------ items


def _tensor_items(inputs: MergeInputs, file: CheckpointFile, entry: TensorEntry) -> Iterator[WorkItem]:
    plan = inputs.plan
    planned = plan.reads.get(entry.name, {})
    stored = {**plan.entry_reads.get(entry.name, {}), **plan.sketch_reads.get(entry.name, {})}
    same_dtype = inputs.output_dtype(entry) == entry.dtype
    merged = entry.dtype in MERGEABLE_DTYPES and (any(planned.values()) or bool(stored))
    if not merged and same_dtype:
        for block in tensor_blocks(entry, plan.block_bytes):
            if block.nbytes:  # an empty tensor needs no bytes written
                yield _copy_item(inputs, file, entry, block)
        return
    ctx = _context(inputs, entry)
    ids = inputs.expert_ids
    if entry.name in plan.tensor_level or not merged or stored:
        yield _whole_item(inputs, file, entry, ctx, planned)
        return
    read_sets = [set(planned.get(e, ())) for e in ids]
    for block in tensor_blocks(entry, plan.block_bytes):
        experts = [i for i in range(len(ids)) if block.index in read_sets[i]]
        if not experts and same_dtype:
            yield _copy_item(inputs, file, entry, block)
            continue
        reads = [_base_read(inputs, file, entry, block, block)]
        reads += [_expert_read(inputs, ids[i], entry.name, block.index, block.index) for i in experts]
        yield WorkItem(_Block(entry, block, experts, ctx.for_rows(block.row_start)), reads)


def _copy_item(inputs: MergeInputs, file: CheckpointFile, entry: TensorEntry, block: BlockSpec) -> WorkItem:
    return WorkItem(_Copy(entry, block), [_base_read(inputs, file, entry, block, block)])


def _whole_item(inputs: MergeInputs, file, entry, ctx, planned) -> WorkItem:
    block_bytes = inputs.plan.block_bytes
    blocks = tensor_blocks(entry, block_bytes)
    reads = [_base_read(inputs, file, entry, blocks[0], blocks[-1])]
    runs = []
    for i, expert_id in enumerate(inputs.expert_ids):
        for first, last in _runs(sorted(planned.get(expert_id, ()))):
            runs.append((i, block_at(entry, block_bytes, first), block_at(entry, block_bytes, last)))
            reads.append(_expert_read(inputs, expert_id, entry.name, first, last))
    item = _Whole(entry, runs, ctx)
    plan = inputs.plan
    for kind, parts, counts, got in (("chunk", "chunks", plan.entry_reads, item.stored),
                                     ("sketch stage", "stages", plan.sketch_reads, item.sketched)):
        for i, expert_id in enumerate(inputs.expert_ids):
            n = counts.get(entry.name, {}).get(expert_id, 0)
            if n:
                store = inputs.stores[expert_id]
                read = tuple(getattr(store, parts)[entry.name][:n])
                got.append((i, read))
                checks = tuple(BlockCheck(getattr(p, "stage", None) or p.index, p.begin, p.end, p.hash) for p in read)
                reads.append(ByteRange(store.path, read[0].begin, read[-1].end, expert_id, entry.name, checks, kind))
    return WorkItem(item, reads)


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
    spec = inputs.plan.merge
    params = inputs.definition.resolve(spec, entry.name, inputs.num_layers)
    return BlockContext.create(
        inputs.definition, entry.name, entry.shape, spec.expert_ids, params,
        seed=spec.seed, thresholds=inputs.thresholds.get(entry.name),
    )


def to_device_float32(buf: memoryview, dtype: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The values in ``buf`` as a new fp32 tensor on ``device`` (never aliasing ``buf``).

    On a GPU the raw (often half-size) bytes are copied first and widened
    there; on the CPU the widening is the copy.
    """
    raw = raw_view(buf, dtype, shape)
    if device.type == "cpu":
        return raw.to(torch.float32, copy=True)
    return raw.to(device).to(torch.float32)


def _block_shape(entry: TensorEntry, rows: int) -> tuple[int, ...]:
    if len(entry.shape) <= 1:
        return entry.shape
    return (rows, *entry.shape[1:])


def _merge_block(inputs: MergeInputs, item: _Block, views: list[memoryview]) -> torch.Tensor:
    entry, block = item.entry, item.block
    shape = _block_shape(entry, block.row_end - block.row_start)
    base = to_device_float32(views[0], entry.dtype, shape, inputs.device)
    deltas: list[torch.Tensor | None] = [None] * len(inputs.expert_ids)
    for i, view in zip(item.experts, views[1:]):
        deltas[i] = to_device_float32(view, entry.dtype, shape, inputs.device).sub_(base)
    return merge(base, deltas, item.ctx)


def _merge_whole(inputs: MergeInputs, item: _Whole, views: list[memoryview]) -> torch.Tensor:
    entry = item.entry
    base = to_device_float32(views[0], entry.dtype, entry.shape, inputs.device)
    flat_base = base.view(-1)
    deltas: list[torch.Tensor | None] = [None] * len(inputs.expert_ids)
    for (i, first, last), view in zip(item.runs, views[1:]):
        if deltas[i] is None:
            deltas[i] = torch.zeros_like(base)
        start, end = first.flat_start, last.flat_end
        values = to_device_float32(view, entry.dtype, (end - start,), inputs.device)
        deltas[i].view(-1)[start:end] = values.sub_(flat_base[start:end])
    store_views = views[1 + len(item.runs):]
    for (i, chunks), view in zip(item.stored, store_views):
        if deltas[i] is None:
            deltas[i] = torch.zeros_like(base)
        _scatter_entries(deltas[i].view(-1), flat_base, chunks, view, entry, inputs.device)
    for (i, stages), view in zip(item.sketched, store_views[len(item.stored):]):
        deltas[i] = _sketch(stages, view, entry, inputs.device)
    if all(d is None for d in deltas):
        return base
    return merge(base, deltas, item.ctx)


def _scatter_entries(flat_delta: torch.Tensor, flat_base: torch.Tensor, chunks: Sequence[DeltaChunk],
                     view: memoryview, entry: TensorEntry, device: torch.device) -> None:
    """``Δ = E - B`` at the positions of each chunk (checked against its hash already)."""
    start = chunks[0].begin
    for c in chunks:
        positions, raw = decode_chunk(view[c.begin - start : c.end - start], c.entries, c.gap_bytes, entry.itemsize)
        if positions.size and not (0 <= positions[0] and positions[-1] < entry.numel):
            raise EngineError(f"internal error: chunk {c.index} of '{entry.name}' has positions outside the tensor")
        index = torch.from_numpy(positions).to(device)
        values = to_device_float32(memoryview(raw), entry.dtype, (c.entries,), device)
        flat_delta[index] = values.sub_(flat_base[index])


def _sketch(stages: Sequence[DeltaStage], view: memoryview, entry: TensorEntry, device: torch.device) -> torch.Tensor:
    """``Σ_s q_s * scale_s`` over the stages read, added in stage order in fp32 (as the store was built)."""
    start = stages[0].begin
    total = torch.zeros((stages[0].rows, entry.numel // stages[0].rows), dtype=torch.float32, device=device)
    for stage in stages:
        q, scales = decode_stage(view[stage.begin - start : stage.end - start], stage.rows, entry.numel)
        rows = torch.from_numpy(q).to(device).view(stage.rows, -1).to(torch.float32)
        total = total + rows * torch.from_numpy(scales.copy()).to(device)[:, None]
    return total.reshape(entry.shape)
