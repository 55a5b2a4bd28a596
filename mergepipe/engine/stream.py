"""Run one work unit (``run_unit``): its items' reads, each block checked against its recorded hash as it
arrives; the merge of each block or tensor in fp32 on the device (on a CPU in pieces of rows); the output
bytes written at fixed offsets behind the compute, every output block's hash recorded. And where units run:
the ``Executor`` interface and ``LocalExecutor`` (threads of this process; Ray: ``ray_executor.py``)."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Protocol, cast

import numpy as np
import torch

from mergepipe.analysis.experts import block_hash
from mergepipe.analysis.provenance import BlockOutput
from mergepipe.catalog.statistics import DeltaChunk, DeltaStage
from mergepipe.engine.job import BASE_TAG, Copy, Job, Merge, Reuse, SharedFactors, Update, WorkUnit, tensor_items
from mergepipe.spec.operators.kernels import merge
from mergepipe.errors import EngineError, ModelChangedError, PreviousChangedError
from mergepipe.runtime import Advance
from mergepipe.spec.operators.linear import LinearDef
from mergepipe.storage.format import (
    DTYPE_SIZES,
    BlockSpec,
    TensorEntry,
    block_at,
    decode_chunk,
    decode_stage_span,
    span_trits,
)
from mergepipe.storage.writer import OpenFiles
from mergepipe.storage.lora import delta_rows
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
from mergepipe.storage.writer import ShardLayout, ShardWriter, WriteBehind, raw_view, to_bytes, to_float32, torch_dtype

#: On a CPU a block is merged in pieces of at most this many elements (whole rows), so a piece's base, K
#: deltas and result stay in the CPU caches across the kernel's passes (BENCHMARKS.md).
CPU_PIECE_ELEMENTS = 1 << 17
#: Recorded block norms bound the written values' norm: ×(1 + 2⁻⁷) covers rounding to BF16/F16 (2⁻⁸ of
#: each value) and the fp32 reductions.
NORM_MARGIN = 1.0 + 2.0**-7
#: Reads in flight at once per unit: enough to keep one disk busy while the cores compute.
READ_THREADS = 2


def to_device_float32(buf: memoryview, dtype: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A new fp32 tensor on ``device`` of ``buf``'s values: on a GPU the raw (often half-size) bytes are moved,
    then widened there; on the CPU the widening is the copy."""
    raw = raw_view(buf, dtype, shape)
    if device.type == "cpu":
        return raw.to(torch.float32, copy=True)
    return raw.to(device).to(torch.float32)


def _shape(entry: TensorEntry, rows: int) -> tuple[int, ...]:
    return entry.shape if len(entry.shape) <= 1 else (rows, *entry.shape[1:])


def _rows(t: torch.Tensor, start: int, end: int, first: int) -> torch.Tensor:
    """Rows ``start:end`` of ``t``, whose first row is row ``first`` (a tensor of one row: all of it)."""
    return t if t.dim() < 2 else t[start - first : end - first]


def rounding_drift(written: torch.Tensor, values: torch.Tensor) -> float:
    """A bound on ``‖written − values‖``: fp32 ``values`` against what was written of them."""
    if written.dtype == torch.float32 or values.numel() == 0:
        return 0.0
    return float(torch.linalg.vector_norm(written.to(torch.float32).sub_(values))) * NORM_MARGIN


def _lora_delta(
    inputs: Job, expert_id: str, tensor: str, blocks: list[BlockSpec], views: Iterator[memoryview], kept: SharedFactors
) -> torch.Tensor:
    """fp32 ΔW (flat) of ``blocks`` from an adapter's next reads, each block checked against its hash."""
    target, recorded = inputs.loras[expert_id].targets[tensor], inputs.hashes[expert_id][tensor]
    start, end = blocks[0].row_start, blocks[-1].row_end
    if target.transposed:  # both factors in one read, whose digest is every block's hash
        if expert_id not in kept.kept:
            view, begin = next(views), min(target.a.begin, target.b.begin)
            a, b = (
                to_float32(view[f.begin - begin : f.end - begin], f.dtype, tuple(f.shape)) for f in (target.a, target.b)
            )
            kept.kept[expert_id] = (a, b, block_digest(view))
        a, b, digest = kept.kept[expert_id]
        bad = [block.index for block in blocks if recorded.get(block.index) != digest]
        delta = delta_rows(b, a[:, start:end], target.scale, True)
    else:  # B's rows, and A with the tensor's first read: a block's hash covers its B rows and A
        b_view = next(views)
        if expert_id not in kept.kept:
            raw = bytes(next(views))
            kept.kept[expert_id] = (to_float32(raw, target.a.dtype, tuple(target.a.shape)), raw)
        a, raw = kept.kept[expert_id]
        row = target.b.row_bytes
        rows = {
            block.index: b_view[(block.row_start - start) * row : (block.row_end - start) * row] for block in blocks
        }
        bad = [i for i, part in rows.items() if block_hash(part, raw) != recorded.get(i)]
        delta = delta_rows(to_float32(b_view, target.b.dtype, (end - start, target.rank)), a, target.scale, False)
    if bad:
        raise ModelChangedError(_changed(expert_id, f"block {bad[0]} of tensor '{tensor}' in {target.path}"))
    return delta.to(inputs.device).reshape(-1)


def _changed(model_id: str, what: str) -> str:
    return (
        f"model '{model_id}' changed on disk since it was analysed: {what} no longer matches its recorded hash; "
        "nothing was published. Re-register it (`mergepipe register --force`), analyse it and plan again"
    )


class _Rows:
    """The base and each expert's Δ over any rows of a ``Merge`` item, from its reads: block runs, store
    chunks (exact entries) and sketch stages; Δ = 0 where none reaches."""

    def __init__(self, inputs: Job, item: Merge, views: list[memoryview]) -> None:
        self.inputs, self.entry, self.item = inputs, item.entry, item
        self.first, self.base = item.blocks[0].row_start, views[0]
        reads = iter(views[1:])
        self.runs: list[tuple[int, int, int, memoryview | torch.Tensor]] = []
        for i, first, last in item.runs:
            expert, data = inputs.expert_ids[i], None
            adapter = inputs.loras.get(expert)
            if adapter is not None and item.entry.name in adapter.saved:  # a replaced tensor: Δ = saved − base
                base = self.base_values(first.row_start, last.row_end).view(-1)
                dtype = adapter.saved[item.entry.name].entry.dtype
                data = to_device_float32(next(reads), dtype, base.shape, inputs.device).sub_(base)
            elif adapter is not None:
                blocks = [block_at(self.entry, inputs.plan.block_bytes, j) for j in range(first.index, last.index + 1)]
                data = _lora_delta(inputs, expert, self.entry.name, blocks, reads, item.factors)
            self.runs.append((i, first.flat_start, last.flat_end, next(reads) if data is None else data))
        store_views = list(reads)
        self.stored = [(i, _chunk_values(c, view, self.entry)) for (i, c), view in zip(item.stored, store_views)]
        self.sketched = [
            (i, [(s, view[s.begin - stages[0].begin : s.end - stages[0].begin]) for s in stages])
            for (i, stages), view in zip(item.sketched, store_views[len(item.stored) :])
        ]

    def base_values(self, start: int, end: int) -> torch.Tensor:
        row = self.entry.row_bytes
        view = self.base[(start - self.first) * row : (end - self.first) * row]
        return to_device_float32(view, self.entry.dtype, _shape(self.entry, end - start), self.inputs.device)

    def merged(self, start: int, end: int) -> torch.Tensor:
        """Rows ``start:end`` merged in fp32 (the base where every Δ is 0 and the operator keeps it)."""
        entry, inputs = self.entry, self.inputs
        cols, device = entry.row_numel, inputs.device
        first, last = start * cols, end * cols
        base = self.base_values(start, end)
        flat_base = base.view(-1)
        deltas: list[torch.Tensor | None] = [None] * len(inputs.expert_ids)

        def flat(i: int) -> torch.Tensor:  # expert i's Δ, zero until reads fill it
            if deltas[i] is None:
                deltas[i] = torch.zeros_like(base)
            return deltas[i].view(-1)  # type: ignore[union-attr]

        for i, run_start, run_end, data in self.runs:
            lo, hi = max(first, run_start), min(last, run_end)
            if lo >= hi:
                continue
            if isinstance(data, torch.Tensor):
                delta = data[lo - run_start : hi - run_start]
            else:
                expert = inputs.expert_ids[i]
                dtype = inputs.experts[expert].tensor(entry.name).dtype
                part = data[(lo - run_start) * DTYPE_SIZES[dtype] : (hi - run_start) * DTYPE_SIZES[dtype]]
                delta = to_device_float32(part, dtype, (hi - lo,), device)
                if inputs.formats[expert].needs_base:  # full weights: E − B (a delta checkpoint holds Δ)
                    delta.sub_(flat_base[lo - first : hi - first])
            if (lo, hi) == (first, last):  # the whole piece: no zeros to fill
                deltas[i] = delta.view(base.shape)
            else:
                flat(i)[lo - first : hi - first] = delta
        for i, chunks in self.stored:
            for positions, values in chunks:
                lo, hi = np.searchsorted(positions, (first, last))
                if lo < hi:
                    index = torch.from_numpy(positions[lo:hi] - first).to(device)
                    flat(i).index_copy_(0, index, values[lo:hi].to(device).sub(flat_base.index_select(0, index)))
        for i, stages in self.sketched:
            deltas[i] = _sketch_span(stages, entry, first, last, device).view(base.shape)
        ctx = self.item.ctx
        if all(d is None for d in deltas) and ctx.definition.keeps_base(ctx.params):
            return base
        return merge(base, deltas, ctx.for_rows(start))


def _chunk_values(
    chunks: Sequence[DeltaChunk], view: memoryview, entry: TensorEntry
) -> list[tuple[np.ndarray, torch.Tensor]]:
    out = []
    for c in chunks:
        part = view[c.begin - chunks[0].begin : c.end - chunks[0].begin]
        positions, raw = decode_chunk(part, c.entries, c.gap_bytes, entry.itemsize)
        if positions.size and not (0 <= positions[0] and positions[-1] < entry.numel):
            raise EngineError(f"internal error: chunk {c.index} of '{entry.name}' has positions outside the tensor")
        out.append((positions, raw_view(raw, entry.dtype, (len(positions),)).to(torch.float32)))
    return out


def _sketch_span(
    stages: Sequence[tuple[DeltaStage, memoryview]], entry: TensorEntry, first: int, last: int, device: torch.device
) -> torch.Tensor:
    """Elements ``first:last`` (whole rows) of ``Σ_s q_s · scale_s`` over the stages read, as rows, summed in
    stage order in fp32 as the store was built (one buffer: the first stage scaled, the next added in place)."""
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
        # the build's sum starts from zeros: +0 where the product is -0 (a zero or negative scale)
        if (zero := scales[rows] == 0).any():
            total[torch.from_numpy(zero).to(device)] = 0.0
        if (negative := scales[rows] < 0).any():
            total[torch.from_numpy(negative).to(device)] += 0.0  # -0 + +0 is +0
        if len(stages) > 1 and device.type == "cpu":  # ``total`` is ``trits`` itself
            trits = np.empty_like(trits)
    if total is None:
        raise EngineError(f"internal error: a sketch read of '{entry.name}' without stages; please report it")
    return total


def _merged(
    inputs: Job, item: Merge, views: list[memoryview]
) -> tuple[torch.Tensor, list[tuple[float | None, float | None]]]:
    """The item's blocks merged and written into one tensor of the output dtype, with each block's norm bound
    and drift: on a CPU block by block in pieces of whole rows, each narrowed as soon as it is merged, while
    in the caches; a tensor-level operator's tensor, a LoRA expert's reads and any GPU merge at once."""
    rows, entry = _Rows(inputs, item, views), item.entry
    first, last = item.blocks[0].row_start, item.blocks[-1].row_end
    step = max(1, CPU_PIECE_ELEMENTS // max(1, entry.row_numel))
    lora = any(inputs.expert_ids[i] in inputs.loras for i, _, _ in item.runs)
    if inputs.device.type != "cpu" or lora or entry.name in inputs.plan.tensor_level or step >= last - first:
        values = rows.merged(first, last)
        pieces = ((b, b.row_start, b.row_end, _rows(values, b.row_start, b.row_end, first)) for b in item.blocks)
    else:
        spans = [(b, s, min(b.row_end, s + step)) for b in item.blocks for s in range(b.row_start, b.row_end, step)]
        pieces = ((b, s, e, rows.merged(s, e)) for b, s, e in spans)
    return _narrowed(inputs, entry, item.blocks, pieces, inputs.measures_drift)


def _updated_block(
    inputs: Job, item: Update, views: list[memoryview]
) -> tuple[torch.Tensor, list[tuple[float | None, float | None]]]:
    """``old + Σ c·(E_new − E_old)`` in fp32, experts in id order (``planner/delta_update.py``), narrowed."""
    entry, device, block = item.entry, inputs.device, item.block
    shape = _shape(entry, block.num_rows)
    out = to_device_float32(views[0], inputs.output_dtype(entry), shape, device)
    definition = inputs.definition
    pairs = {i: (views[1 + 2 * k], views[2 + 2 * k]) for k, i in enumerate(item.experts)}
    if not isinstance(definition, LinearDef) or any(not inputs.formats[inputs.expert_ids[i]].needs_base for i in pairs):
        raise EngineError("internal error: a delta update was planned where none applies; please report it")
    coefficients = definition.coefficients(item.ctx.params, entry.name)
    for i in sorted(pairs, key=lambda i: inputs.expert_ids[i]):
        new, old = (to_device_float32(v, entry.dtype, shape, device) for v in pairs[i])
        out.add_(new.sub_(old).mul_(coefficients[i]))
    return _narrowed(inputs, entry, [block], iter([(block, block.row_start, block.row_end, out)]), True)


def _narrowed(
    inputs: Job,
    entry: TensorEntry,
    blocks: list[BlockSpec],
    pieces: Iterator[tuple[BlockSpec, int, int, torch.Tensor]],
    drift: bool,
) -> tuple[torch.Tensor, list[tuple[float | None, float | None]]]:
    """The fp32 pieces narrowed into one tensor as they come; per block a norm bound and (``drift``) its drift."""
    first = blocks[0].row_start
    dtype = torch_dtype(inputs.output_dtype(entry))
    out = torch.empty(_shape(entry, blocks[-1].row_end - first), dtype=dtype, device=inputs.device)
    norms: dict[int, list[float]] = {b.index: [] for b in blocks}
    roundings: dict[int, list[float]] = {b.index: [] for b in blocks}
    for block, start, end, values in pieces:
        written = _rows(out, start, end, first)
        written.copy_(values)
        norms[block.index].append(float(torch.linalg.vector_norm(values)))
        if drift:
            roundings[block.index].append(rounding_drift(written, values))
    stats = [
        (math.hypot(*norms[b.index]) * NORM_MARGIN if b.nbytes else None, math.hypot(*roundings[b.index]))
        for b in blocks
    ]
    return out, [(norm, rounding if drift else None) for norm, rounding in stats]


# ------------------------------------------------------------------ one unit


@dataclass(frozen=True)
class UnitJob:
    inputs: Job
    layouts: Mapping[str, ShardLayout]
    window_bytes: int
    hashers: Mapping[str, FileHash] = field(default_factory=dict)
    copy_reused: bool = False


@dataclass
class UnitRecord:
    """What one unit read, wrote (every output block's record) and copied, and its seconds per phase."""

    index: int
    bytes_by_tag: dict[str, int] = field(default_factory=dict)
    requests_by_tag: dict[str, int] = field(default_factory=dict)
    bytes_written: int = 0
    copied_bytes: int = 0
    outputs: dict[tuple[str, int], BlockOutput] = field(default_factory=dict)
    seconds: dict[str, float] = field(
        default_factory=lambda: {"read_wait": 0.0, "compute": 0.0, "write": 0.0, "write_wait": 0.0}
    )


def run_unit(unit: WorkUnit, job: UnitJob, advance: Advance) -> UnitRecord:
    inputs, record = job.inputs, UnitRecord(unit.index)
    writer = ShardWriter(job.layouts[unit.shard], unit.tensors, hasher=job.hashers.get(unit.shard))
    with CheckpointSource(inputs.meter) as source, writer, OpenFiles() as files, WriteBehind() as behind:
        if not inputs.copies:  # planned reads skip around the experts' files
            for path in [f.path for c in inputs.experts.values() for f in c.files]:
                source.advise_random(path)
            for adapter in inputs.loras.values():
                source.advise_random(adapter.weights)
        readahead = ReadAhead(source, READ_THREADS, job.window_bytes, partial(_verify, inputs))
        items = (item for name in unit.tensors for item in tensor_items(inputs, name, not job.copy_reused))
        fetches = readahead.run(items)
        while True:
            started = time.perf_counter()
            fetched = next(fetches, None)
            record.seconds["read_wait"] += time.perf_counter() - started
            if fetched is None:
                break
            _write_item(inputs, fetched, writer, behind, files, record, advance)
        behind.close()  # every write done (and hashed) on its own thread, behind the compute
        record.seconds["write"] += behind.write_seconds
        record.seconds["write_wait"] += behind.wait_seconds
        writer.finish()
        record.bytes_by_tag, record.requests_by_tag = source.bytes_by_tag(), source.requests_by_tag()
        record.bytes_written = writer.bytes_written
    return record


def _write_item(
    inputs: Job,
    fetched: Fetched,
    writer: ShardWriter,
    behind: WriteBehind,
    files: OpenFiles,
    record: UnitRecord,
    advance: Advance,
) -> None:
    payload, views = fetched.item.payload, fetched.views
    entry = payload.entry
    if isinstance(payload, Reuse):  # checked against their records: as read, or copied by the kernel, read back
        source, offset = payload.source, payload.blocks[0].row_start * inputs.output_row_bytes(entry)
        for block in payload.blocks:
            record.outputs[(entry.name, block.index)] = inputs.reused.blocks[(entry.name, block.index)]
        advance(source.nbytes, entry.name)
        if fetched.item.reads:
            behind.write(writer, entry.name, offset, views[0], fetched.release)
            return
        record.copied_bytes += source.nbytes
        fd = files.fd(cast(Path, source.path))  # a snapshot is a local directory
        behind.call(partial(_copy_reused, writer, entry.name, offset, fd, source))
        return
    started = time.perf_counter()
    dtype = inputs.output_dtype(entry)
    if isinstance(payload, Copy):
        name, offset = payload.output, payload.block.row_start * inputs.output_row_bytes(entry)
        if dtype == entry.dtype:  # the input's bytes, checked as they were read
            # every operator computes the base for a block with no delta: its fp32 values are these bytes' own
            digest, drift = fetched.item.reads[0].checks[0].digest, 0.0 if inputs.measures_drift else None
            record.outputs[(name, payload.block.index)] = BlockOutput(digest, None, drift)
            behind.write(writer, name, offset, views[0], fetched.release)
            advance(payload.block.nbytes, name)
            return
        data = to_bytes(to_float32(views[0], entry.dtype, _shape(entry, payload.block.num_rows)), dtype)
        fetched.release()  # a passthrough's tensor cast to the plan's out_dtype
        record.seconds["compute"] += time.perf_counter() - started
        behind.write(writer, name, offset, data)
        advance(len(data), name)
        return
    update = isinstance(payload, Update)
    blocks = [payload.block] if update else payload.blocks
    out, stats = _updated_block(inputs, payload, views) if update else _merged(inputs, payload, views)
    fetched.release()
    data = to_bytes(out, dtype)  # no copy on a CPU
    row_bytes, first = inputs.output_row_bytes(entry), blocks[0].row_start
    for block, (norm, drift) in zip(blocks, stats):
        digest = block_digest(data[(block.row_start - first) * row_bytes : (block.row_end - first) * row_bytes])
        record.outputs[(entry.name, block.index)] = (
            _updated(inputs, payload, digest, norm, drift)
            if isinstance(payload, Update)
            else BlockOutput(digest, norm, drift)
        )
    record.seconds["compute"] += time.perf_counter() - started
    behind.write(writer, entry.name, first * row_bytes, data)
    advance(len(data), entry.name)


def _updated(inputs: Job, item: Update, digest: str, norm: float | None, drift: float | None) -> BlockOutput:
    """An updated block's record, with an a-posteriori bound when the previous block's drift is known."""
    key, reuse = (item.entry.name, item.block.index), inputs.plan.reuse
    old = inputs.reused.blocks[key]
    slack = reuse.slack.get(key[0], {}).get(key[1]) if reuse else None
    if reuse is None or old.drift is None or slack is None or drift is None:  # recorded before drifts were
        return BlockOutput(digest, norm)
    drift += old.drift + slack
    return BlockOutput(digest, norm, drift, min(reuse.errors[key[0]][key[1]], 2 * drift))


def _copy_reused(writer: ShardWriter, tensor: str, offset: int, fd: int, source: ByteRange) -> None:
    """The kernel's copy of a reused run, each block read back once and checked against its record."""
    for check in source.checks:

        def verify(data: memoryview, check: BlockCheck = check) -> None:
            if block_digest(data) != check.digest:
                raise _previous_changed(check, source)

        writer.copy_from(tensor, offset + check.begin - source.begin, fd, check.begin, check.end - check.begin, verify)


def _previous_changed(check: BlockCheck, read: ByteRange) -> PreviousChangedError:
    changed = f"block {check.index} of tensor '{read.tensor}' in {read.path} no longer matches its recorded hash"
    return PreviousChangedError(
        f"the previous snapshot changed after it was published: {changed}; nothing was published. Merge "
        "without --from, or restore the snapshot",
        reason=changed,
    )


def _verify(inputs: Job, item: WorkItem, views: list[memoryview]) -> None:
    for read, view in zip(item.reads, views):
        for check in read.checks:
            if block_digest(view[check.begin - read.begin : check.end - read.begin]) == check.digest:
                continue
            model_id = inputs.plan.base.id if read.tag == BASE_TAG else read.tag
            if read.kind == "output":
                raise _previous_changed(check, read)
            if read.kind != "block":
                raise ModelChangedError(
                    f"the delta store of '{model_id}' changed on disk since it was built: {read.kind} "
                    f"{check.index} of tensor '{read.tensor}' in {read.path} no longer matches its recorded "
                    "hash; nothing was published. Rebuild it with `mergepipe analyze --store-deltas`"
                )
            raise ModelChangedError(_changed(model_id, f"block {check.index} of tensor '{read.tensor}' in {read.path}"))


def process_seconds() -> float | None:
    """Seconds since this process started (Linux ``/proc``), or None elsewhere."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        now = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux
        return None
    return max(0.0, now - ticks / os.sysconf("SC_CLK_TCK"))


# ------------------------------------------------------------------ executors


def no_progress(nbytes: int, description: str) -> None:
    """The ``advance`` of a unit run away from the progress bar (its executor reports its bytes)."""


@dataclass(frozen=True)
class UnitTask:
    """What an executor runs per unit: ``run(unit, job, advance)`` with one execution's shared job."""

    job: UnitJob
    advance: Advance = no_progress
    run: Callable[[WorkUnit, UnitJob, Advance], UnitRecord] = run_unit

    def __call__(self, unit: WorkUnit) -> UnitRecord:
        return self.run(unit, self.job, self.advance)


class Executor(Protocol):
    """Runs every unit with ``task``; the records in unit order, or the first error."""

    workers: int  # units at once (they share the engine's memory bound)
    in_process: bool  # units feed the streamed file hashes; False: the files are hashed after

    def run(self, units: Sequence[WorkUnit], task: UnitTask) -> list[UnitRecord]: ...

    def status(self) -> str: ...


class LocalExecutor:
    """Units on ``workers`` threads here; the first failure cancels those not started and is raised."""

    in_process = True

    def __init__(self, workers: int = 1) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.workers = workers

    def status(self) -> str:
        return ""  # the bar's own speed is this process's

    def run(self, units: Sequence[WorkUnit], task: Callable[[WorkUnit], UnitRecord]) -> list[UnitRecord]:
        if self.workers == 1:
            return [task(unit) for unit in units]
        with ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="mergepipe-unit") as pool:
            futures = [pool.submit(task, unit) for unit in units]
            wait(futures, return_when=FIRST_EXCEPTION)
            for future in futures:
                future.cancel()
            return [f.result() for f in futures]
