"""Run one work unit: read what its items need, merge, write each output piece at its offset.

The items (``items.py``) say, per tensor, which bytes each output piece needs
— copied base blocks, merged blocks, whole tensors — and the merge of each
is ``compute.py``. An expert block that is not planned is never read;
``None`` stands for its delta. A block for which no expert is read is
copied from the base where the operator returns the base for all-zero
deltas (``OperatorDef.keeps_base``), else merged from the base alone.

Every byte read is checked before it is used: each block must hash to what
the catalog recorded when the model was analysed (the read-ahead thread
hashes it as it arrives). A file changed behind the catalog's back — even
with its size and mtime restored — aborts the merge with a
``ModelChangedError`` naming the file, tensor and block. Copied base bytes
go through the same reads and checks, so the base is checked in full;
expert blocks recorded identical to the base are never read, and are
covered by the base's check. Every output block's hash is recorded too
(``UnitRecord.outputs``), so a later merge can reuse it.

Output bytes are queued to a write-behind thread (``storage/writebehind.py``)
that copies them into the staged file, feeds the file's streamed hash and
starts their write-back, while this worker merges the next block; a copied
block's read buffer goes back to the read-ahead only once it is written.

Reused runs of an incremental merge (``UnitJob.copy_reused``: units that run
beside the staged files) are not read into this process and written out
again: the kernel copies each block from the previous snapshot's file
(``ShardWriter.copy_from``), on the write-behind thread in the order of the
writes around it, and the one read back that the file's hash needs anyway
checks it against its recorded hash. Elsewhere (Ray workers) they are read,
checked and written like any other bytes.

A unit opens its own source and writer and returns a small ``UnitRecord``
(bytes read per model, bytes written, output block hashes, seconds per
phase): it needs nothing from the coordinator but the shared, read-only
``UnitJob``.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch

from mergepipe.analysis.provenance import BlockOutput
from mergepipe.catalog.statistics import DeltaChunk, DeltaStage
from mergepipe.engine.job import (
    BASE_TAG,
    Block,
    Copy,
    Job,
    Reuse,
    SharedFactors,
    Update,
    Whole,
    WorkUnit,
    lora_delta,
    replacement_delta,
    tensor_items,
)
from mergepipe.errors import EngineError, ModelChangedError, PreviousChangedError
from mergepipe.runtime import Advance
from mergepipe.spec.operators.kernels import merge
from mergepipe.spec.operators.linear import LinearDef
from mergepipe.storage.format import decode_chunk, decode_stage_span, span_trits
from mergepipe.storage.format import DTYPE_SIZES, BlockSpec, TensorEntry, block_at, tensor_blocks
from mergepipe.storage.writer import OpenFiles
from mergepipe.storage.source import (
    BlockCheck,
    ByteRange,
    CheckpointSource,
    Fetched,
    FileHash,
    ReadAhead,
    WorkItem,
    block_digest,
)
from mergepipe.storage.writer import ShardLayout, ShardWriter, WriteBehind, raw_view, to_bytes, torch_dtype

#: On a CPU a block is merged in pieces of at most this many elements (whole rows), each piece's raw
#: bytes widened just before its kernel runs: the base, the K deltas and the result of a piece then stay
#: in the CPU caches across the kernel's passes, where a whole 1 MiB block streams K multi-MB tensors
#: through memory once per pass (TIES, K = 8: ~6 ms per block in pieces against ~10 ms whole;
#: BENCHMARKS.md). Streaming operators give the same bits whatever the split (``operators/context.py``).
CPU_PIECE_ELEMENTS = 1 << 17

#: Recorded block norms are upper bounds of the norm of the written values: ×(1 + 2⁻⁷) covers rounding to
#: BF16/F16 (at most 2⁻⁸ of each value) and the fp32 reductions.
NORM_MARGIN = 1.0 + 2.0**-7


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


@dataclass(frozen=True)
class MergedBlock:
    """A merged block: fp32 values and ``norm`` None, or (merged on a CPU in pieces) the values already in
    the output dtype, ``norm`` the upper bound on their norm (``NORM_MARGIN``) and, where ``drift`` was asked
    for, a bound on the distance of the narrowed values to the fp32 ones (``rounding_drift``)."""

    values: torch.Tensor
    norm: float | None = None
    drift: float | None = None


def rounding_drift(written: torch.Tensor, values: torch.Tensor) -> float:
    """A bound on ``‖written − values‖`` (Frobenius): the fp32 ``values`` against what was written of them,
    ``written`` (in the output dtype). Both are in fp32 once widened, the difference of a value and its
    rounding is exact there, and ``NORM_MARGIN`` covers the reduction."""
    if values.numel() == 0:
        return 0.0
    if written.dtype == torch.float32:
        return 0.0 if written is values else float(torch.linalg.vector_norm(written - values)) * NORM_MARGIN
    return float(torch.linalg.vector_norm(written.to(torch.float32).sub_(values))) * NORM_MARGIN


def merge_block(inputs: Job, item: Block, views: list[memoryview], drift: bool = False) -> MergedBlock:
    """The merged block; on a CPU in pieces of whole rows (``CPU_PIECE_ELEMENTS``), each piece narrowed
    into the output dtype as soon as it is merged and its norm (and with ``drift`` its rounding's) taken
    then, while it is in the CPU caches: no fp32 copy of the whole block is assembled, narrowed and reduced
    afterwards (three passes less over memory)."""
    rows = item.block.row_end - item.block.row_start
    step = _piece_rows(inputs, item.entry, item.experts, rows)
    if step >= rows:
        return MergedBlock(_merge_rows(inputs, item, views, 0, rows))
    out = torch.empty(_block_shape(item.entry, rows), dtype=torch_dtype(inputs.output_dtype(item.entry)))
    squares = rounding = 0.0  # Σ of the pieces' squared norms (and their roundings'), in float64
    for start in range(0, rows, step):
        end = min(rows, start + step)
        piece = _merge_rows(inputs, item, _rows_of(inputs, item, views, start, end), start, end)
        out[start:end].copy_(piece)  # rounds to nearest even, as ``to_bytes`` does
        squares += float(torch.linalg.vector_norm(piece)) ** 2
        if drift:
            rounding += rounding_drift(out[start:end], piece) ** 2
    return MergedBlock(
        out, math.sqrt(squares) * NORM_MARGIN if out.numel() else None, math.sqrt(rounding) if drift else None
    )


def _piece_rows(inputs: Job, entry: TensorEntry, experts: Iterable[int], rows: int) -> int:
    """Rows per piece of ``rows`` read for ``experts``: all of them on a GPU, with a LoRA adapter (its reads are
    factors, not rows) or for a 1-D tensor (one row)."""
    if (
        inputs.device.type != "cpu"
        or len(entry.shape) < 2
        or any(inputs.expert_ids[i] in inputs.loras for i in experts)
    ):
        return rows
    return max(1, CPU_PIECE_ELEMENTS // entry.row_numel)


def _rows_of(inputs: Job, item: Block, views: list[memoryview], start: int, end: int) -> list[memoryview]:
    """The base's and each read expert's bytes of rows ``start:end`` of the block (each in its own dtype)."""
    entry = item.entry
    dtypes = [entry.dtype] + [inputs.expert_dtype(inputs.expert_ids[i], entry.name) for i in item.experts]
    return [
        view[start * entry.row_numel * DTYPE_SIZES[d] : end * entry.row_numel * DTYPE_SIZES[d]]
        for view, d in zip(views, dtypes)
    ]


def _merge_rows(inputs: Job, item: Block, views: list[memoryview], start: int, end: int) -> torch.Tensor:
    """Rows ``start:end`` of the block merged, from ``views`` holding exactly those rows."""
    entry, block = item.entry, item.block
    shape = _block_shape(entry, end - start)
    base = to_device_float32(views[0], entry.dtype, shape, inputs.device)
    deltas: list[torch.Tensor | None] = [None] * len(inputs.expert_ids)
    reads = iter(views[1:])
    for i in item.experts:
        deltas[i] = _run_delta(inputs, i, entry, [block], reads, shape, base, item.factors)
    return merge(base, deltas, item.ctx if start == 0 else item.ctx.for_rows(item.ctx.row_start + start))


def _run_delta(
    inputs: Job,
    i: int,
    entry: TensorEntry,
    blocks: list[BlockSpec],
    views: Iterator[memoryview],
    shape: tuple[int, ...],
    base: torch.Tensor,
    factors: SharedFactors,
) -> torch.Tensor:
    """Δ of expert ``i`` over consecutive ``blocks`` from its views, the next of ``views`` (a LoRA
    adapter's: B's rows, and A the first time, ``lora_reads.py``; one otherwise)."""
    expert_id = inputs.expert_ids[i]
    if expert_id in inputs.loras and entry.name in inputs.loras[expert_id].saved:
        return replacement_delta(inputs, expert_id, entry.name, next(views), shape, base)
    if expert_id in inputs.loras:
        return lora_delta(inputs, expert_id, entry.name, blocks, views, factors).reshape(shape)
    return _expert_delta(inputs, i, entry, next(views), shape, base)


def _expert_delta(
    inputs: Job, i: int, entry: TensorEntry, view: memoryview, shape: tuple[int, ...], base: torch.Tensor
) -> torch.Tensor:
    """Δ of expert ``i`` over the base values ``base`` (of ``shape``) from its bytes: ``fp32(E) − fp32(B)``
    for full weights, ``fp32(Δ)`` for a delta checkpoint (the same bits when that delta is F32)."""
    expert_id = inputs.expert_ids[i]
    values = to_device_float32(view, inputs.expert_dtype(expert_id, entry.name), shape, inputs.device)
    return values.sub_(base) if inputs.expert_format(expert_id).needs_base else values


def merge_update(inputs: Job, item: Update, views: list[memoryview]) -> torch.Tensor:
    """``old + Σ c·(E_new − E_old)`` in fp32, experts in id order (``planner/delta_update.py``)."""
    entry, block = item.entry, item.block
    shape = _block_shape(entry, block.row_end - block.row_start)
    out = to_device_float32(views[0], inputs.output_dtype(entry), shape, inputs.device)
    definition = inputs.definition
    assert isinstance(definition, LinearDef)  # updates are planned for delta_updatable operators: linear's family
    coefficients = definition.coefficients(item.ctx.params, entry.name)
    pairs = {i: (views[1 + 2 * k], views[2 + 2 * k]) for k, i in enumerate(item.experts)}
    if any(not inputs.expert_format(inputs.expert_ids[i]).needs_base for i in pairs):
        raise EngineError("internal error: a delta update of a delta checkpoint was planned; please report it")
    for i in sorted(pairs, key=lambda i: inputs.expert_ids[i]):
        new, old = (to_device_float32(v, entry.dtype, shape, inputs.device) for v in pairs[i])
        out.add_(new.sub_(old).mul_(coefficients[i]))
    return out


@dataclass(frozen=True)
class MergedTensor:
    """A tensor merged whole: fp32 ``values`` and ``blocks`` None, or (merged on a CPU in pieces) the values
    already in the output dtype and, per block of the tensor, its norm bound and drift as ``MergedBlock``
    gives them."""

    values: torch.Tensor
    blocks: list[tuple[float | None, float | None]] | None = None


def merge_whole(inputs: Job, item: Whole, views: list[memoryview], drift: bool = False) -> MergedTensor:
    """The merged tensor: on a CPU, for a streaming operator, block by block in pieces of whole rows as
    ``merge_block`` merges (each expert's delta made for a piece at a time from its block runs, store chunks
    or sketch stages: no tensor-sized fp32 copy of any of them); else all of it at once."""
    entry = item.entry
    # in pieces: a tensor merged whole only because it is read through delta stores (the plan's tensor_level
    # lists those whose operator needs the whole tensor)
    step = (
        entry.rows
        if entry.name in inputs.plan.tensor_level or not (item.stored or item.sketched)
        else _piece_rows(inputs, entry, (i for i, _, _ in item.runs), entry.rows)
    )
    if step >= entry.rows:
        return MergedTensor(_merge_at_once(inputs, item, views))
    reads = _PieceReads(inputs, item, views)
    out = torch.empty(entry.shape, dtype=torch_dtype(inputs.output_dtype(entry)))
    blocks: list[tuple[float | None, float | None]] = []
    for block in tensor_blocks(entry, inputs.plan.block_bytes):
        squares = rounding = 0.0  # as in ``merge_block``
        for start in range(block.row_start, block.row_end, step):
            end = min(block.row_end, start + step)
            base, deltas = reads.rows(start, end)
            piece = merge(base, deltas, item.ctx.for_rows(start))
            out[start:end].copy_(piece)
            squares += float(torch.linalg.vector_norm(piece)) ** 2
            if drift:
                rounding += rounding_drift(out[start:end], piece) ** 2
        blocks.append(
            (math.sqrt(squares) * NORM_MARGIN if block.nbytes else None, math.sqrt(rounding) if drift else None)
        )
    return MergedTensor(out, blocks)


class _PieceReads:
    """The base and each expert's Δ over any rows of a ``Whole`` item's tensor, from its reads (all in memory:
    ``views``): block runs (Δ = 0 outside them), store chunks (exact entries at their positions, Δ = 0
    elsewhere; decoded once) and sketch stages (decoded a piece at a time).

    Why a class: what is decoded once per tensor (the chunks' entries) is kept between the pieces."""

    def __init__(self, inputs: Job, item: Whole, views: list[memoryview]) -> None:
        self.inputs, self.entry = inputs, item.entry
        self.base = views[0]
        reads = iter(views[1:])
        self.runs = [(i, first.flat_start, last.flat_end, next(reads)) for i, first, last in item.runs]
        store_views = list(reads)
        self.stored = [
            (i, _chunk_values(chunks, view, item.entry)) for (i, chunks), view in zip(item.stored, store_views)
        ]
        self.sketched = [
            (i, _stage_payloads(stages, view))
            for (i, stages), view in zip(item.sketched, store_views[len(item.stored) :])
        ]

    def rows(self, start: int, end: int) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """fp32 base and deltas of rows ``start:end`` (each made for this call: the kernel may overwrite them)."""
        entry, inputs = self.entry, self.inputs
        cols = entry.row_numel
        first, last = start * cols, end * cols
        shape = (end - start, *entry.shape[1:])
        base = to_device_float32(
            self.base[first * entry.itemsize : last * entry.itemsize], entry.dtype, shape, inputs.device
        )
        flat_base = base.view(-1)
        deltas = _Deltas(base, len(inputs.expert_ids))
        for i, run_start, run_end, view in self.runs:
            lo, hi = max(first, run_start), min(last, run_end)
            if lo < hi:
                itemsize = DTYPE_SIZES[inputs.expert_dtype(inputs.expert_ids[i], entry.name)]
                part = view[(lo - run_start) * itemsize : (hi - run_start) * itemsize]
                deltas.flat(i)[lo - first : hi - first] = _expert_delta(
                    inputs, i, entry, part, (hi - lo,), flat_base[lo - first : hi - first]
                )
        for i, chunks in self.stored:
            for positions, values in chunks:
                lo, hi = np.searchsorted(positions, (first, last))
                if lo < hi:
                    index = torch.from_numpy(positions[lo:hi] - first)
                    deltas.flat(i).index_copy_(0, index, values[lo:hi].sub(flat_base.index_select(0, index)))
        for i, stages in self.sketched:
            deltas.values[i] = _sketch_span(stages, entry, first, last, inputs.device).view(shape)
        return base, deltas.values


class _Deltas:
    """Each expert's Δ over ``base``'s elements: None until a read gives some of it, then zero but where
    reads fill it (``flat``), or a whole value of its own (``values[i] = ...``)."""

    def __init__(self, base: torch.Tensor, experts: int) -> None:
        self.base = base
        self.values: list[torch.Tensor | None] = [None] * experts

    def flat(self, i: int) -> torch.Tensor:
        """Expert ``i``'s Δ, flat, made zero on first use."""
        delta = self.values[i]
        if delta is None:
            delta = self.values[i] = torch.zeros_like(self.base)
        return delta.view(-1)


def _chunk_values(
    chunks: Sequence[DeltaChunk], view: memoryview, entry: TensorEntry
) -> list[tuple[np.ndarray, torch.Tensor]]:
    """Each chunk's positions (ascending: a chunk stores its entries by position) and the expert's fp32
    values there. A piece finds its entries in each chunk by bisection: no sort of all the chunks' entries."""
    start = chunks[0].begin
    out = []
    for c in chunks:
        positions, raw = decode_chunk(view[c.begin - start : c.end - start], c.entries, c.gap_bytes, entry.itemsize)
        if positions.size and not (0 <= positions[0] and positions[-1] < entry.numel):
            raise EngineError(f"internal error: chunk {c.index} of '{entry.name}' has positions outside the tensor")
        out.append((positions, raw_view(raw, entry.dtype, (len(positions),)).to(torch.float32)))
    return out


def _stage_payloads(stages: Sequence[DeltaStage], view: memoryview) -> list[tuple[DeltaStage, memoryview]]:
    """Each stage read with its bytes, from ``view`` holding them all (one read)."""
    return [(stage, view[stage.begin - stages[0].begin : stage.end - stages[0].begin]) for stage in stages]


def _sketch(stages: Sequence[DeltaStage], view: memoryview, entry: TensorEntry, device: torch.device) -> torch.Tensor:
    """``Σ_s q_s * scale_s`` over the stages read, the whole tensor (``_sketch_span``)."""
    return _sketch_span(_stage_payloads(stages, view), entry, 0, entry.numel, device).reshape(entry.shape)


def _sketch_span(
    stages: Sequence[tuple[DeltaStage, memoryview]], entry: TensorEntry, first: int, last: int, device: torch.device
) -> torch.Tensor:
    """Elements ``first:last`` (whole rows) of ``Σ_s q_s * scale_s`` over the stages read, as rows, added in
    stage order in fp32 (as the store was built): each stage's trits decoded by a table gather into an fp32
    buffer, the first one scaled in place (on a CPU the result is that buffer: no other allocation of its size
    for a one-stage read), the next ones added in place. ``q * scale`` is exact, so ``total + q * scale``
    rounds as the build's sum did (``_positive_zeros`` for the first stage)."""
    cols = entry.row_numel
    rows = slice(first // cols, last // cols)
    total: torch.Tensor | None = None
    trits = np.empty(span_trits(first, last), dtype=np.float32)
    for stage, payload in stages:
        q, scales = decode_stage_span(payload, stage.rows, entry.numel, first, last, trits)
        values = torch.from_numpy(q).to(device).view(-1, cols)
        scale = torch.from_numpy(scales[rows].copy()).to(device)[:, None]
        if total is not None:
            total.addcmul_(values, scale)
            continue
        total = values.mul_(scale)
        _positive_zeros(total, scales[rows])
        if len(stages) > 1 and device.type == "cpu":  # ``total`` is ``trits`` itself
            trits = np.empty_like(trits)
    assert total is not None  # a sketch read has a stage
    return total


def _positive_zeros(total: torch.Tensor, scales: np.ndarray) -> None:
    """The first stage's ``q * scale`` (rows of ``total``, scaled by ``scales``) made ``0 + q * scale``, as the
    build's sum from zeros is: +0 where the product is -0 (a row whose scale is 0, or negative where q is 0).
    Other values are the same either way. The rows are found in numpy: there are few, and usually none."""
    zero, negative = scales == 0, scales < 0
    if zero.any():
        total[torch.from_numpy(zero).to(total.device)] = 0.0
    if negative.any():
        total[torch.from_numpy(negative).to(total.device)] += 0.0  # -0 + +0 is +0


def _merge_at_once(inputs: Job, item: Whole, views: list[memoryview]) -> torch.Tensor:
    """The merged tensor in fp32, every expert's delta made for the whole tensor."""
    entry = item.entry
    base = to_device_float32(views[0], entry.dtype, entry.shape, inputs.device)
    flat_base = base.view(-1)
    deltas = _Deltas(base, len(inputs.expert_ids))
    reads = iter(views[1:])
    for i, first, last in item.runs:
        flat = deltas.flat(i)
        start, end = first.flat_start, last.flat_end
        blocks = [block_at(entry, inputs.plan.block_bytes, j) for j in range(first.index, last.index + 1)]
        flat[start:end] = _run_delta(
            inputs, i, entry, blocks, reads, (end - start,), flat_base[start:end], item.factors
        )
    store_views = list(reads)  # then the delta stores' reads
    for (i, chunks), view in zip(item.stored, store_views):
        _scatter_entries(deltas.flat(i), flat_base, chunks, view, entry, inputs.device)
    for (i, stages), view in zip(item.sketched, store_views[len(item.stored) :]):
        deltas.values[i] = _sketch(stages, view, entry, inputs.device)
    if all(d is None for d in deltas.values) and item.ctx.definition.keeps_base(item.ctx.params):
        return base
    return merge(base, deltas.values, item.ctx)


def _scatter_entries(
    flat_delta: torch.Tensor,
    flat_base: torch.Tensor,
    chunks: Sequence[DeltaChunk],
    view: memoryview,
    entry: TensorEntry,
    device: torch.device,
) -> None:
    """``Δ = E - B`` at the positions of the chunks (checked against their hashes already): one gather of the
    base and one scatter (a tensor's chunks hold disjoint positions, so the order of the writes does not
    matter)."""
    decoded = _chunk_values(chunks, view, entry)
    index = torch.from_numpy(np.concatenate([positions for positions, _ in decoded])).to(device)
    delta = torch.cat([values for _, values in decoded]).to(device)
    flat_delta.index_copy_(0, index, delta.sub_(flat_base.index_select(0, index)))


#: ``put(tensor, offset, data, done)``: queue ``data`` for writing at ``offset`` of the tensor, then ``done()``.
Put = Callable[[str, int, bytes | memoryview, Callable[[], None] | None], None]


@dataclass(frozen=True)
class UnitJob:
    """What every unit of one execution shares (read-only)."""

    inputs: Job
    layouts: Mapping[str, ShardLayout]
    window_bytes: int
    io_threads: int
    # output file -> its hash (blake3), fed as bytes are written (units in this process only; else empty)
    hashers: Mapping[str, FileHash] = field(default_factory=dict)
    # reused runs copied from the previous snapshot by the kernel (units in this process, writing files)
    copy_reused: bool = False


@dataclass
class UnitRecord:
    """What one unit did: bytes read per model tag, data bytes written, and
    seconds per phase."""

    index: int
    bytes_by_tag: dict[str, int] = field(default_factory=dict)
    # remote requests per model tag (each try; none for local inputs), for the manifest
    requests_by_tag: dict[str, int] = field(default_factory=dict)
    bytes_written: int = 0
    # bytes of reused blocks the kernel copied from the previous snapshot (not read: not in bytes_by_tag)
    copied_bytes: int = 0
    # (tensor, block) -> what was measured of the output block (base block geometry, output dtype): recorded
    # with the snapshot so a later merge can reuse the block after checking it, or update it
    # (analysis/provenance.py)
    outputs: dict[tuple[str, int], BlockOutput] = field(default_factory=dict)
    # read_wait and write_wait: this worker waiting for reads, for room to queue writes; write: the writer
    # thread copying bytes into the file (or having the kernel copy reused ones, read back and checked) and
    # hashing them, overlapped with compute
    seconds: dict[str, float] = field(
        default_factory=lambda: {"read_wait": 0.0, "compute": 0.0, "write": 0.0, "write_wait": 0.0}
    )

    def add_time(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds


def run_unit(unit: WorkUnit, job: UnitJob, advance: Advance) -> UnitRecord:
    """Merge and write every tensor of ``unit``; its record."""
    inputs = job.inputs
    base = inputs.base
    record = UnitRecord(unit.index)
    writer = ShardWriter(job.layouts[unit.shard], unit.tensors, hasher=job.hashers.get(unit.shard))
    # local files as ever; remote ones by ranged requests; the previous snapshot's files copied from
    with CheckpointSource(inputs.meter) as source, writer, OpenFiles() as previous:
        for checkpoint in inputs.experts.values():
            for expert_file in checkpoint.files:
                source.advise_random(expert_file.path)
        for adapter in inputs.loras.values():
            source.advise_random(adapter.weights)
        readahead = ReadAhead(source, job.io_threads, job.window_bytes, on_read=_verifier(inputs))
        # each tensor's base bytes come from the base file that holds it (the output may be sharded otherwise)
        items = (
            item
            for name in unit.tensors
            for item in tensor_items(inputs, base.file_of(name), base.tensor(name), not job.copy_reused)
        )
        with WriteBehind() as behind:  # written (and hashed) on its own thread while the next block is merged
            put = partial(behind.write, writer)
            for fetched in _timed(readahead.run(items), record):
                payload = fetched.item.payload
                if isinstance(payload, Reuse) and not fetched.item.reads:
                    behind.call(_copy_reused(inputs, payload, writer, previous, record, advance))
                else:
                    _merge_and_write(inputs, fetched, put, record, advance)
        record.add_time("write", behind.write_seconds)
        record.add_time("write_wait", behind.wait_seconds)
        writer.finish()
        record.bytes_by_tag = source.bytes_by_tag()
        record.requests_by_tag = source.requests_by_tag()
        record.bytes_written = writer.bytes_written
    return record


def _merge_and_write(inputs: Job, fetched: Fetched, put: Put, record: UnitRecord, advance: Advance) -> None:
    """Make one item's output bytes and queue them for writing."""
    payload = fetched.item.payload
    if isinstance(payload, Reuse):
        _write_reused(inputs, payload, fetched, put, record, advance)
        return
    if isinstance(payload, Copy):
        # the bytes are the base block's, checked against its recorded hash as they were read
        (check,) = fetched.item.reads[0].checks
        # every operator computes the base for a block with no delta: its fp32 values are these bytes' own
        drift = 0.0 if inputs.measures_drift else None
        record.outputs[(payload.entry.name, payload.block.index)] = BlockOutput(check.digest, None, drift)
        put(payload.entry.name, payload.block.begin - payload.entry.begin, fetched.views[0], fetched.release)
        advance(payload.block.nbytes, payload.entry.name)
        return
    started = time.perf_counter()
    merged: MergedBlock | MergedTensor | None = None  # merged in pieces: norms and drifts are known already
    if isinstance(payload, Block):
        merged = merge_block(inputs, payload, fetched.views, drift=inputs.measures_drift)
        out = merged.values
    elif isinstance(payload, Update):
        out = merge_update(inputs, payload, fetched.views)
    else:
        merged = merge_whole(inputs, payload, fetched.views, drift=inputs.measures_drift)
        out = merged.values
    offset = 0 if isinstance(payload, Whole) else payload.block.row_start * inputs.output_row_bytes(payload.entry)
    fetched.release()
    data = to_bytes(out, inputs.output_dtype(payload.entry))  # no copy when already narrowed
    _hash_outputs(inputs, payload, data, out, record, merged)
    record.add_time("compute", time.perf_counter() - started)
    put(payload.entry.name, offset, data, None)
    advance(len(data), payload.entry.name)


def _write_reused(
    inputs: Job, payload: Reuse, fetched: Fetched, put: Put, record: UnitRecord, advance: Advance
) -> None:
    """Blocks of the previous snapshot, already checked against their recorded hashes: written as they are."""
    entry, first = payload.entry, payload.blocks[0]
    row_bytes = inputs.output_row_bytes(entry)
    previous = inputs.previous
    assert previous is not None
    for block in payload.blocks:
        record.outputs[(entry.name, block.index)] = previous.blocks[(entry.name, block.index)]
    put(entry.name, first.row_start * row_bytes, fetched.views[0], fetched.release)
    advance((payload.blocks[-1].row_end - first.row_start) * row_bytes, entry.name)


def _copy_reused(
    inputs: Job, payload: Reuse, writer: ShardWriter, previous_files: OpenFiles, record: UnitRecord, advance: Advance
) -> Callable[[], None]:
    """A run of the previous snapshot's blocks recorded as this unit's output, and the copy of their bytes,
    to run on the write-behind thread: by the kernel, block by block, each read back once, checked against
    its recorded hash (a snapshot edited since it was published is never copied on) and hashed."""
    entry, source = payload.entry, payload.source
    previous = inputs.previous
    assert previous is not None
    assert isinstance(source.path, Path), "a snapshot is a local directory"
    fd = previous_files.fd(source.path)
    offset = payload.blocks[0].row_start * inputs.output_row_bytes(entry)  # where the run starts in the tensor
    for block in payload.blocks:
        record.outputs[(entry.name, block.index)] = previous.blocks[(entry.name, block.index)]
    record.copied_bytes += source.nbytes
    advance(source.nbytes, entry.name)

    def copy() -> None:
        for check in source.checks:
            writer.copy_from(
                entry.name,
                offset + check.begin - source.begin,
                fd,
                check.begin,
                check.end - check.begin,
                partial(_check_reused, check, source),
            )

    return copy


def _check_reused(check: BlockCheck, source: ByteRange, data: memoryview) -> None:
    """PreviousChangedError unless a reused block's bytes hash to what was recorded at publish time."""
    if block_digest(data) != check.digest:
        raise _previous_changed(check, source)


def _previous_changed(check: BlockCheck, read: ByteRange) -> PreviousChangedError:
    changed = f"block {check.index} of tensor '{read.tensor}' in {read.path} no longer matches its recorded hash"
    return PreviousChangedError(
        f"the previous snapshot changed after it was published: {changed}; nothing was published. Merge "
        "without --from, or restore the snapshot",
        reason=changed,
    )


def _hash_outputs(
    inputs: Job,
    payload: Block | Update | Whole,
    data: bytes | memoryview,
    out: torch.Tensor,
    record: UnitRecord,
    merged: MergedBlock | MergedTensor | None = None,
) -> None:
    """The output blocks' hashes, norms and drifts (``merged``: a block or tensor merged in pieces: its
    values are narrowed already and its norms and drifts known): one block, or every block of a tensor
    merged whole."""
    entry = payload.entry
    dtype = inputs.output_dtype(entry)
    measure = inputs.measures_drift
    if isinstance(payload, Update):
        record.outputs[(entry.name, payload.block.index)] = _updated(inputs, payload, data, out)
    elif isinstance(payload, Block):
        norm, drift = (
            (merged.norm, merged.drift)
            if isinstance(merged, MergedBlock) and merged.norm is not None
            else (_norm(out), _drift(data, out, dtype) if measure else None)
        )
        record.outputs[(entry.name, payload.block.index)] = BlockOutput(block_digest(data), norm, drift)
        return
    else:
        itemsize = DTYPE_SIZES[dtype]
        view, flat = memoryview(data), out.reshape(-1)
        known = merged.blocks if isinstance(merged, MergedTensor) else None
        for block in tensor_blocks(entry, inputs.plan.block_bytes):
            piece = view[block.flat_start * itemsize : block.flat_end * itemsize]
            if known is not None:
                norm, drift = known[block.index]
            else:
                values = flat[block.flat_start : block.flat_end]
                norm, drift = _norm(values), (_drift(piece, values, dtype) if measure else None)
            record.outputs[(entry.name, block.index)] = BlockOutput(block_digest(piece), norm, drift)


def _drift(data: bytes | memoryview, values: torch.Tensor, dtype: str) -> float:
    """``rounding_drift`` of fp32 ``values`` written as ``data`` in ``dtype``."""
    if dtype == "F32" or values.numel() == 0:
        return 0.0
    written = raw_view(memoryview(data), dtype, tuple(values.shape))
    return rounding_drift(written.to(values.device), values)


def _updated(inputs: Job, payload: Update, data: bytes | memoryview, y: torch.Tensor) -> BlockOutput:
    """A delta-updated block's record: its drift and its a-posteriori bound where the previous block's drift
    is known (``planner/delta_update.py``), the plan's bound otherwise."""
    entry, index = payload.entry.name, payload.block.index
    previous, reuse = inputs.previous, inputs.plan.reuse
    assert previous is not None and reuse is not None  # an update is planned from a previous snapshot
    old, slack = previous.blocks[(entry, index)], reuse.slack.get(entry, {}).get(index)
    digest, norm = block_digest(data), _norm(y)
    if old.drift is None or slack is None:  # a snapshot or a plan made before drifts were recorded
        return BlockOutput(digest, norm)
    drift = _drift(data, y, inputs.output_dtype(payload.entry)) + old.drift + slack
    return BlockOutput(digest, norm, drift, min(reuse.errors[entry][index], 2 * drift))


def _norm(values: torch.Tensor) -> float | None:
    """An upper bound on the norm of ``values`` as written: rounding to a 16-bit float moves each value
    by at most 2⁻⁸ of it, and the fp32 reduction is well inside the rest of the margin."""
    if values.numel() == 0:
        return None
    return float(torch.linalg.vector_norm(values)) * NORM_MARGIN


def requests_by_model(records: list[UnitRecord], base_id: str) -> dict[str, int]:
    """Remote requests per model id over the units (the base's reads are tagged ``base``); empty when
    every input was local."""
    out: dict[str, int] = {}
    for record in records:
        for tag, n in record.requests_by_tag.items():
            model = base_id if tag == BASE_TAG else tag
            out[model] = out.get(model, 0) + n
    return out


def _timed(fetches: Iterator[Fetched], record: UnitRecord) -> Iterator[Fetched]:
    """Count the time spent waiting for reads as its own phase."""
    while True:
        started = time.perf_counter()
        fetched = next(fetches, None)
        record.add_time("read_wait", time.perf_counter() - started)
        if fetched is None:
            return
        yield fetched


# ------------------------------------------------------------------ the output files' hashes and timing


def file_hashers(layouts: Mapping[str, ShardLayout]) -> dict[str, FileHash]:
    """A streamed hash per created shard, its header (already in the file) added: units feed the rest."""
    hashers = {}
    for name, layout in layouts.items():
        hashers[name] = FileHash(layout.path, layout.file_size)
        hashers[name].add(0, length=layout.data_start)
    return hashers


def file_digests(hashers: Mapping[str, FileHash]) -> dict[str, str]:
    """Each file's hash, once every unit has written its bytes."""
    try:
        return {name: hasher.hexdigest() for name, hasher in hashers.items()}
    except ValueError as exc:  # every unit finished, so every byte was written: a bug, never a user error
        raise EngineError(f"internal error: {exc}; please report it") from None


def process_seconds() -> float | None:
    """Seconds since this process started (Linux: ``/proc``, to the clock tick), or None elsewhere: an
    execution's start-up is this at its first read (interpreter, imports, catalog, planning), which the
    manifest shows beside the engine's own seconds."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        now = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux
        return None
    return max(0.0, now - ticks / os.sysconf("SC_CLK_TCK"))


# ------------------------------------------------------------------ checks


def _verifier(inputs: Job) -> Callable[[WorkItem, list[memoryview]], None]:
    """The read-ahead's ``on_read``: every checked block must hash to its record."""

    def verify(item: WorkItem, views: list[memoryview]) -> None:
        for read, view in zip(item.reads, views):
            for check in read.checks:
                if block_digest(view[check.begin - read.begin : check.end - read.begin]) != check.digest:
                    model_id = inputs.plan.base.id if read.tag == BASE_TAG else read.tag
                    if read.kind == "output":
                        raise _previous_changed(check, read)
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
