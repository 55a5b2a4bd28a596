"""The merge of one work item: raw bytes to fp32 on the device, deltas, the kernel.

``Update``: the previous output block plus ``c·(E_new − E_old)`` per replaced
expert (a delta update). ``Block``: the base block and the read experts' blocks, ``Δi = Ei - B``
(a delta checkpoint's block is ``Δi`` itself, in its own dtype: ``analysis/expert_format.py``; a LoRA
adapter's is ΔW = s·B·A from its rows of B and the tensor's A, ``lora_reads.py``),
``None`` for experts not read. ``Whole``: the base tensor, the experts'
block runs (unread blocks Δ = 0), delta-store chunks (exact entries at their
positions) and sketch stages (``Σ_s q_s * scale_s``, ``analysis/sketch.py``); on a CPU, for a streaming
operator, merged block by block in pieces of rows as a ``Block`` is (a tensor read through delta stores is
merged whole only because its sketches cover every row, not because the operator needs all of it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mergepipe.catalog.deltas import DeltaChunk, DeltaStage
from mergepipe.engine.job import Job
from mergepipe.engine.items import Block, Update, Whole
from mergepipe.engine.lora_reads import SharedFactors, lora_delta, replacement_delta
from mergepipe.engine.operators.registry import merge
from mergepipe.errors import EngineError
from mergepipe.spec.operators import LinearDef
from mergepipe.storage.geometry import BlockSpec, block_at, tensor_blocks
from mergepipe.storage.convert import raw_view, torch_dtype
from mergepipe.storage.delta_encoding import decode_chunk, decode_stage_span, span_trits
from mergepipe.storage.format import DTYPE_SIZES, TensorEntry

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
    return MergedBlock(out, math.sqrt(squares) * NORM_MARGIN if out.numel() else None,
                       math.sqrt(rounding) if drift else None)


def _piece_rows(inputs: Job, entry: TensorEntry, experts: Iterable[int], rows: int) -> int:
    """Rows per piece of ``rows`` read for ``experts``: all of them on a GPU, with a LoRA adapter (its reads are
    factors, not rows) or for a 1-D tensor (one row)."""
    if inputs.device.type != "cpu" or len(entry.shape) < 2 or any(inputs.expert_ids[i] in inputs.loras
                                                                   for i in experts):
        return rows
    return max(1, CPU_PIECE_ELEMENTS // entry.row_numel)


def _rows_of(inputs: Job, item: Block, views: list[memoryview], start: int, end: int) -> list[memoryview]:
    """The base's and each read expert's bytes of rows ``start:end`` of the block (each in its own dtype)."""
    entry = item.entry
    dtypes = [entry.dtype] + [inputs.expert_dtype(inputs.expert_ids[i], entry.name) for i in item.experts]
    return [view[start * entry.row_numel * DTYPE_SIZES[d] : end * entry.row_numel * DTYPE_SIZES[d]]
            for view, d in zip(views, dtypes)]


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


def _run_delta(inputs: Job, i: int, entry: TensorEntry, blocks: list[BlockSpec], views: Iterator[memoryview],
               shape: tuple[int, ...], base: torch.Tensor, factors: SharedFactors) -> torch.Tensor:
    """Δ of expert ``i`` over consecutive ``blocks`` from its views, the next of ``views`` (a LoRA
    adapter's: B's rows, and A the first time, ``lora_reads.py``; one otherwise)."""
    expert_id = inputs.expert_ids[i]
    if expert_id in inputs.loras and entry.name in inputs.loras[expert_id].saved:
        return replacement_delta(inputs, expert_id, entry.name, next(views), shape, base)
    if expert_id in inputs.loras:
        return lora_delta(inputs, expert_id, entry.name, blocks, views, factors).reshape(shape)
    return _expert_delta(inputs, i, entry, next(views), shape, base)


def _expert_delta(inputs: Job, i: int, entry: TensorEntry, view: memoryview, shape: tuple[int, ...],
                  base: torch.Tensor) -> torch.Tensor:
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
    step = entry.rows if entry.name in inputs.plan.tensor_level or not (item.stored or item.sketched) else \
        _piece_rows(inputs, entry, (i for i, _, _ in item.runs), entry.rows)
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
        blocks.append((math.sqrt(squares) * NORM_MARGIN if block.nbytes else None,
                       math.sqrt(rounding) if drift else None))
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
        self.stored = [(i, _chunk_values(chunks, view, item.entry))
                       for (i, chunks), view in zip(item.stored, store_views)]
        self.sketched = [(i, _stage_payloads(stages, view))
                         for (i, stages), view in zip(item.sketched, store_views[len(item.stored):])]

    def rows(self, start: int, end: int) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """fp32 base and deltas of rows ``start:end`` (each made for this call: the kernel may overwrite them)."""
        entry, inputs = self.entry, self.inputs
        cols = entry.row_numel
        first, last = start * cols, end * cols
        shape = (end - start, *entry.shape[1:])
        base = to_device_float32(self.base[first * entry.itemsize : last * entry.itemsize], entry.dtype, shape,
                                 inputs.device)
        flat_base = base.view(-1)
        deltas = _Deltas(base, len(inputs.expert_ids))
        for i, run_start, run_end, view in self.runs:
            lo, hi = max(first, run_start), min(last, run_end)
            if lo < hi:
                itemsize = DTYPE_SIZES[inputs.expert_dtype(inputs.expert_ids[i], entry.name)]
                part = view[(lo - run_start) * itemsize : (hi - run_start) * itemsize]
                deltas.flat(i)[lo - first : hi - first] = _expert_delta(inputs, i, entry, part, (hi - lo,),
                                                                        flat_base[lo - first : hi - first])
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


def _chunk_values(chunks: Sequence[DeltaChunk], view: memoryview, entry: TensorEntry
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


def _sketch_span(stages: Sequence[tuple[DeltaStage, memoryview]], entry: TensorEntry, first: int, last: int,
                 device: torch.device) -> torch.Tensor:
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
        flat[start:end] = _run_delta(inputs, i, entry, blocks, reads, (end - start,), flat_base[start:end],
                                     item.factors)
    store_views = list(reads)  # then the delta stores' reads
    for (i, chunks), view in zip(item.stored, store_views):
        _scatter_entries(deltas.flat(i), flat_base, chunks, view, entry, inputs.device)
    for (i, stages), view in zip(item.sketched, store_views[len(item.stored):]):
        deltas.values[i] = _sketch(stages, view, entry, inputs.device)
    if all(d is None for d in deltas.values) and item.ctx.definition.keeps_base(item.ctx.params):
        return base
    return merge(base, deltas.values, item.ctx)


def _scatter_entries(flat_delta: torch.Tensor, flat_base: torch.Tensor, chunks: Sequence[DeltaChunk],
                     view: memoryview, entry: TensorEntry, device: torch.device) -> None:
    """``Δ = E - B`` at the positions of the chunks (checked against their hashes already): one gather of the
    base and one scatter (a tensor's chunks hold disjoint positions, so the order of the writes does not
    matter)."""
    decoded = _chunk_values(chunks, view, entry)
    index = torch.from_numpy(np.concatenate([positions for positions, _ in decoded])).to(device)
    delta = torch.cat([values for _, values in decoded]).to(device)
    flat_delta.index_copy_(0, index, delta.sub_(flat_base.index_select(0, index)))
