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

import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from mergepipe.analysis.provenance import BlockOutput
from mergepipe.engine.compute import (
    NORM_MARGIN,
    MergedBlock,
    MergedTensor,
    merge_block,
    merge_update,
    merge_whole,
    rounding_drift,
)
from mergepipe.engine.job import BASE_TAG, Job
from mergepipe.engine.items import Block, Copy, Reuse, Update, Whole, tensor_items
from mergepipe.engine.workunits import WorkUnit
from mergepipe.errors import EngineError, ModelChangedError, PreviousChangedError
from mergepipe.progress import Advance
from mergepipe.storage.geometry import tensor_blocks
from mergepipe.storage.convert import raw_view, to_bytes
from mergepipe.storage.format import DTYPE_SIZES
from mergepipe.storage.hashing import FileHash, block_digest
from mergepipe.storage.linking import OpenFiles
from mergepipe.storage.readahead import (
    BlockCheck,
    ByteRange,
    Fetched,
    ReadAhead,
    WorkItem,
)
from mergepipe.storage.remote_source import CheckpointSource
from mergepipe.storage.writebehind import WriteBehind
from mergepipe.storage.writer import ShardLayout, ShardWriter

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
    seconds: dict[str, float] = field(default_factory=lambda: {"read_wait": 0.0, "compute": 0.0, "write": 0.0,
                                                               "write_wait": 0.0})

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
        readahead = ReadAhead(source, source.read_threads(job.io_threads), job.window_bytes, on_read=_verifier(inputs))
        # each tensor's base bytes come from the base file that holds it (the output may be sharded otherwise)
        items = source.planned(  # remote inputs: adjacent planned ranges of a file coalesced into one request
            item for name in unit.tensors
            for item in tensor_items(inputs, base.file_of(name), base.tensor(name), not job.copy_reused))
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


def _write_reused(inputs: Job, payload: Reuse, fetched: Fetched, put: Put, record: UnitRecord,
                  advance: Advance) -> None:
    """Blocks of the previous snapshot, already checked against their recorded hashes: written as they are."""
    entry, first = payload.entry, payload.blocks[0]
    row_bytes = inputs.output_row_bytes(entry)
    previous = inputs.previous
    assert previous is not None
    for block in payload.blocks:
        record.outputs[(entry.name, block.index)] = previous.blocks[(entry.name, block.index)]
    put(entry.name, first.row_start * row_bytes, fetched.views[0], fetched.release)
    advance((payload.blocks[-1].row_end - first.row_start) * row_bytes, entry.name)


def _copy_reused(inputs: Job, payload: Reuse, writer: ShardWriter, previous_files: OpenFiles,
                 record: UnitRecord, advance: Advance) -> Callable[[], None]:
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
            writer.copy_from(entry.name, offset + check.begin - source.begin, fd, check.begin,
                             check.end - check.begin, partial(_check_reused, check, source))

    return copy


def _check_reused(check: BlockCheck, source: ByteRange, data: memoryview) -> None:
    """PreviousChangedError unless a reused block's bytes hash to what was recorded at publish time."""
    if block_digest(data) != check.digest:
        raise _previous_changed(check, source)


def _previous_changed(check: BlockCheck, read: ByteRange) -> PreviousChangedError:
    changed = (f"block {check.index} of tensor '{read.tensor}' in {read.path} no longer matches its recorded "
               "hash")
    return PreviousChangedError(
        f"the previous snapshot changed after it was published: {changed}; nothing was published. Merge "
        "without --from, or restore the snapshot", reason=changed
    )


def _hash_outputs(inputs: Job, payload: Block | Update | Whole, data: bytes | memoryview, out: torch.Tensor,
                  record: UnitRecord, merged: MergedBlock | MergedTensor | None = None) -> None:
    """The output blocks' hashes, norms and drifts (``merged``: a block or tensor merged in pieces: its
    values are narrowed already and its norms and drifts known): one block, or every block of a tensor
    merged whole."""
    entry = payload.entry
    dtype = inputs.output_dtype(entry)
    measure = inputs.measures_drift
    if isinstance(payload, Update):
        record.outputs[(entry.name, payload.block.index)] = _updated(inputs, payload, data, out)
    elif isinstance(payload, Block):
        norm, drift = (merged.norm, merged.drift) if isinstance(merged, MergedBlock) and merged.norm is not None \
            else (_norm(out), _drift(data, out, dtype) if measure else None)
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


