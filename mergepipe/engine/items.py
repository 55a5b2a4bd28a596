"""Work items of a unit: which bytes each output piece needs, and how it is made.

For every tensor of a unit the plan's ``merge_mode`` decides:

* ``copy``: the base's bytes, block by block (``Copy``);
* ``blocks``: merged block by block (``Block``: the base block and the
  planned expert blocks); a block no expert is read for is copied where
  the operator keeps the base at Δ = 0 (else the kernel runs on the base
  alone: linear without normalisation scales it);
* ``whole``: read and merged whole (``Whole``: the base tensor, each
  expert's planned blocks coalesced into runs, and delta-store parts).

Blocks an incremental merge reuses (``plan.reuse``) are neither: each run of
them is one range of the previous snapshot's output (``Reuse``), checked
against the hashes recorded when it was published and written as it is —
copied by the kernel and read back for the check where the unit runs beside
the staged files, else read and written. A delta-updated block (``Update``)
reads the previous output block and, per replaced expert, its new and its
earlier version's block. An output file none of whose blocks is made
(``whole_file``: each reused, or a base copy the previous snapshot holds the
same bytes of) needs no work item at all: the engine places the previous
snapshot's file instead, when its header is the same too.

Every read carries the checks of its bytes: each block's recorded content
hash (the read-ahead thread verifies them before anything is merged).
An expert's blocks are the base's rows at the expert's own byte offsets
(``analysis/expert_format.py``): a delta checkpoint in another dtype than
the base reads other byte counts for the same block, and a LoRA adapter's
run of blocks reads its rows of B, and A with the tensor's first run only
(``lora_reads.py``: the tensor's items share what that read brought).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from mergepipe.analysis.expert_format import aligned_block
from mergepipe.analysis.provenance import BlockOutput
from mergepipe.catalog.deltas import DeltaChunk, DeltaStage
from mergepipe.engine.job import BASE_TAG, REUSE_TAG, Job
from mergepipe.engine.lora_reads import SharedFactors, lora_reads
from mergepipe.engine.operators.context import BlockContext
from mergepipe.errors import PreviousChangedError
from mergepipe.storage.geometry import BlockSpec, block_at, tensor_blocks
from mergepipe.storage.checkpoint import CheckpointFile
from mergepipe.storage.format import MERGEABLE_DTYPES, TensorEntry
from mergepipe.storage.readahead import BlockCheck, ByteRange, WorkItem
from mergepipe.storage.sharding import OutputFile


@dataclass
class Copy:
    """A base block written as it is."""

    entry: TensorEntry
    block: BlockSpec


@dataclass
class Block:
    """A block-level work item: which block, which experts are read."""

    entry: TensorEntry
    block: BlockSpec
    experts: list[int]  # positions in spec order of the experts read
    ctx: BlockContext
    factors: SharedFactors = field(default_factory=SharedFactors)  # the tensor's, shared by its items


@dataclass
class Whole:
    """A tensor-level work item: reads of the base tensor and expert runs."""

    entry: TensorEntry
    runs: list[tuple[int, BlockSpec, BlockSpec]]  # (expert position, first block, last block)
    ctx: BlockContext
    stored: list[tuple[int, Sequence[DeltaChunk]]] = field(default_factory=list)  # (expert position, chunks read)
    sketched: list[tuple[int, Sequence[DeltaStage]]] = field(default_factory=list)  # (expert position, stages read)
    factors: SharedFactors = field(default_factory=SharedFactors)


@dataclass
class Reuse:
    """A run of output blocks copied from the previous snapshot (base block geometry): ``source``, the range
    of its file and each block's check (read by the read-ahead, or copied by the kernel when the item has no
    reads)."""

    entry: TensorEntry
    blocks: list[BlockSpec]
    source: ByteRange


@dataclass(frozen=True)
class WholeFile:
    """An output file every block of which is the previous snapshot's: its blocks' records (hash, norm
    bound, drift), as a unit would make them, and the bytes of those the plan reuses (the rest are base copies)."""

    outputs: dict[tuple[str, int], BlockOutput]
    reused_bytes: int


@dataclass
class Update:
    """A block updated from the previous output: ``old + Σ c·(E_new − E_old)`` over ``experts``."""

    entry: TensorEntry
    block: BlockSpec
    experts: list[int]  # positions in spec order of the replaced experts read
    ctx: BlockContext


def _read(inputs: Job, model_id: str, tag: str, file: CheckpointFile, tensor: str,
          blocks: list[BlockSpec]) -> ByteRange:
    """One read of consecutive ``blocks`` of a tensor, with the check of each block."""
    recorded = inputs.hashes[model_id][tensor]
    checks = tuple(BlockCheck(b.index, b.begin, b.end, recorded[b.index]) for b in blocks)
    return ByteRange(file.path, blocks[0].begin, blocks[-1].end, tag, tensor, checks)


def _base_read(inputs: Job, file: CheckpointFile, entry: TensorEntry,
               first: BlockSpec, last: BlockSpec) -> ByteRange:
    blocks = [first] if first.index == last.index else [
        block_at(entry, inputs.plan.block_bytes, i) for i in range(first.index, last.index + 1)]
    return _read(inputs, inputs.plan.base.id, BASE_TAG, file, entry.name, blocks)


def _expert_reads(inputs: Job, expert_id: str, tensor: str, first: int, last: int,
                  factors: SharedFactors) -> list[ByteRange]:
    """The reads of blocks ``first..last`` (the base's block indices) of an expert's tensor: one, or those
    of a LoRA adapter (``factors``: what the tensor's LoRA reads share)."""
    if expert_id in inputs.loras:
        base_entry = inputs.base.tensor(tensor)
        return lora_reads(inputs, expert_id, tensor, block_at(base_entry, inputs.plan.block_bytes, first),
                          block_at(base_entry, inputs.plan.block_bytes, last), factors)
    checkpoint = inputs.experts[expert_id]
    entry, base_entry = checkpoint.tensor(tensor), inputs.base.tensor(tensor)
    blocks = [aligned_block(entry, block_at(base_entry, inputs.plan.block_bytes, i)) for i in range(first, last + 1)]
    return [_read(inputs, expert_id, expert_id, checkpoint.file_of(tensor), tensor, blocks)]


def _mode(inputs: Job, entry: TensorEntry) -> tuple[str, bool]:
    """The plan's merge mode of a tensor (``Plan.merge_mode``), and whether a block of it no expert is read for
    is the base's bytes (its own dtype, and an operator that keeps the base where every Δ is 0)."""
    plan = inputs.plan
    same_dtype = inputs.output_dtype(entry) == entry.dtype
    keeps = plan.keeps_base(entry.name, inputs.num_layers)
    return plan.merge_mode(entry.name, entry.dtype in MERGEABLE_DTYPES, same_dtype, keeps), same_dtype and keeps


def tensor_items(inputs: Job, file: CheckpointFile, entry: TensorEntry, read_reused: bool = True
                 ) -> Iterator[WorkItem]:
    """The work items of one tensor, in order; ``read_reused`` False: reused runs come without reads (the
    unit copies them in the kernel)."""
    plan = inputs.plan
    planned = plan.reads.get(entry.name, {})
    mode, copies_unread = _mode(inputs, entry)
    if mode == "copy":
        for block in tensor_blocks(entry, plan.block_bytes):
            if block.nbytes:  # an empty tensor needs no bytes written
                yield _copy_item(inputs, file, entry, block)
        return
    reused = set(plan.reuse.blocks.get(entry.name, ())) if plan.reuse else set()
    if mode == "whole" and reused:
        yield _reuse_item(inputs, entry, [b for b in tensor_blocks(entry, plan.block_bytes) if b.nbytes],
                          read_reused)
        return
    ctx = context(inputs, entry)
    ids = inputs.expert_ids
    if mode == "whole":
        yield _whole_item(inputs, file, entry, ctx, planned)
        return
    read_sets = [set(planned.get(e, ())) for e in ids]
    blocks = tensor_blocks(entry, plan.block_bytes)
    factors = SharedFactors()
    updated = set(plan.reuse.updated.get(entry.name, ())) if plan.reuse else set()
    replaced = plan.reuse.replaced if plan.reuse else {}
    for block in blocks:
        if block.index in updated:
            swapped = [i for i in range(len(ids)) if ids[i] in replaced and block.index in read_sets[i]]
            yield _update_item(inputs, entry, block, swapped, ctx.for_rows(block.row_start), factors)
            continue
        if block.index in reused:
            if block.index - 1 not in reused:  # the first block of a run: one read for the run
                run = [b for b in blocks[block.index:] if b.index in reused]
                yield _reuse_item(inputs, entry, _leading_run(run), read_reused)
            continue
        experts = [i for i in range(len(ids)) if block.index in read_sets[i]]
        if not experts and copies_unread:
            yield _copy_item(inputs, file, entry, block)
            continue
        reads = [_base_read(inputs, file, entry, block, block)]
        for i in experts:
            reads += _expert_reads(inputs, ids[i], entry.name, block.index, block.index, factors)
        yield WorkItem(Block(entry, block, experts, ctx.for_rows(block.row_start), factors), reads)


def _copy_item(inputs: Job, file: CheckpointFile, entry: TensorEntry, block: BlockSpec) -> WorkItem:
    return WorkItem(Copy(entry, block), [_base_read(inputs, file, entry, block, block)])


def _whole_item(inputs: Job, file, entry, ctx, planned) -> WorkItem:
    block_bytes = inputs.plan.block_bytes
    blocks = tensor_blocks(entry, block_bytes)
    reads = [_base_read(inputs, file, entry, blocks[0], blocks[-1])]
    runs = []
    factors = SharedFactors()
    for i, expert_id in enumerate(inputs.expert_ids):
        for first, last in _runs(sorted(planned.get(expert_id, ()))):
            runs.append((i, block_at(entry, block_bytes, first), block_at(entry, block_bytes, last)))
            reads += _expert_reads(inputs, expert_id, entry.name, first, last, factors)
    item = Whole(entry, runs, ctx, factors=factors)
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


def _leading_run(blocks: list[BlockSpec]) -> list[BlockSpec]:
    """The first run of consecutive blocks of ``blocks`` (sorted by index)."""
    end = 1
    while end < len(blocks) and blocks[end].index == blocks[end - 1].index + 1:
        end += 1
    return blocks[:end]


def _reuse_item(inputs: Job, entry: TensorEntry, blocks: list[BlockSpec], read: bool) -> WorkItem:
    """A run of reused blocks: one range of the previous snapshot, each block checked; read by the
    read-ahead, or (``read`` False) left for the unit to copy."""
    source = _previous_read(inputs, entry, blocks)
    return WorkItem(Reuse(entry, blocks, source), [source] if read else [])


def whole_file(inputs: Job, file: OutputFile) -> WholeFile | None:
    """``file``'s blocks when every one is the previous snapshot's: reused by the plan, or copied from the
    base (as ``tensor_items`` decides) where the previous snapshot recorded the base block's hash for it, so
    its bytes there are the base's. None when some block is made (merged, updated, or a copy the previous
    snapshot holds other bytes for), or when the plan reuses nothing."""
    plan, previous = inputs.plan, inputs.previous
    if plan.reuse is None or previous is None:
        return None
    base_hashes = inputs.hashes[plan.base.id]
    outputs: dict[tuple[str, int], BlockOutput] = {}
    reused_bytes = 0
    for name in file.tensors:
        entry = inputs.base.tensor(name)
        mode, copies_unread = _mode(inputs, entry)
        reused = set(plan.reuse.blocks.get(name, ())) if mode != "copy" else set()
        updated = set(plan.reuse.updated.get(name, ()))
        planned = plan.reads.get(name, {}).values()
        for block in tensor_blocks(entry, plan.block_bytes):
            if not block.nbytes:  # nothing is written for it
                continue
            key = (name, block.index)
            if block.index in reused:
                outputs[key] = previous.blocks[key]
                reused_bytes += (block.row_end - block.row_start) * inputs.output_row_bytes(entry)
                continue
            copied = mode == "copy" or (mode == "blocks" and copies_unread and block.index not in updated
                                        and not any(block.index in ix for ix in planned))
            recorded = previous.blocks.get(key)
            if not copied or recorded is None or recorded.hash != base_hashes[name].get(block.index):
                return None
            outputs[key] = BlockOutput(recorded.hash, None, 0.0 if inputs.measures_drift else None)  # as stream.py
    return WholeFile(outputs, reused_bytes)


def _update_item(inputs: Job, entry: TensorEntry, block: BlockSpec, swapped: list[int],
                 ctx: BlockContext, factors: SharedFactors) -> WorkItem:
    """The previous output block, then per replaced expert its new and its earlier version's block."""
    previous = inputs.previous
    assert previous is not None, "a plan that updates blocks always loads its previous snapshot"
    reads = [_previous_read(inputs, entry, [block])]
    for i in swapped:
        expert = inputs.expert_ids[i]
        reads += _expert_reads(inputs, expert, entry.name, block.index, block.index, factors)
        older = previous.older[expert]
        old_entry = older.tensor(entry.name)
        old_block = block_at(old_entry, inputs.plan.block_bytes, block.index)
        recorded = previous.older_hashes[expert][entry.name][block.index]
        assert recorded is not None  # the version an update replaces was analysed (planner/delta_update.py)
        check = BlockCheck(block.index, old_block.begin, old_block.end, recorded)
        # an added expert's earlier version is the base: those are base bytes, not the expert's
        tag = BASE_TAG if inputs.plan.reuse and inputs.plan.reuse.replaced[expert] == inputs.plan.base.id else expert
        reads.append(ByteRange(older.file_of(entry.name).path, old_block.begin, old_block.end, tag, entry.name,
                               (check,)))
    return WorkItem(Update(entry, block, swapped, ctx), reads)


def _previous_read(inputs: Job, entry: TensorEntry, blocks: list[BlockSpec]) -> ByteRange:
    """A read of consecutive output blocks of the previous snapshot, each checked against its record."""
    previous = inputs.previous
    assert previous is not None, "a plan that reuses blocks always loads its previous snapshot"
    try:
        old = previous.checkpoint.tensor(entry.name)
    except KeyError:
        old = None
    if old is None or old.dtype != inputs.output_dtype(entry) or old.shape != entry.shape:
        changed = f"{previous.checkpoint.root} no longer holds tensor '{entry.name}' as it was published"
        raise PreviousChangedError(f"the previous snapshot at {changed}; nothing was written. Merge without --from",
                                   reason=changed)
    checks = tuple(
        BlockCheck(b.index, old.begin + b.row_start * old.row_bytes, old.begin + b.row_end * old.row_bytes,
                   previous.blocks[(entry.name, b.index)].hash)
        for b in blocks
    )
    path = previous.checkpoint.file_of(entry.name).path
    return ByteRange(path, checks[0].begin, checks[-1].end, REUSE_TAG, entry.name, checks, "output")


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Sorted indices as inclusive runs of neighbours: one read per run."""
    runs: list[tuple[int, int]] = []
    for index in indices:
        if runs and index == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], index)
        else:
            runs.append((index, index))
    return runs


def context(inputs: Job, entry: TensorEntry) -> BlockContext:
    spec = inputs.plan.merge
    params = inputs.definition.resolve(spec, entry.name, inputs.num_layers)
    return BlockContext.create(
        inputs.definition, entry.name, entry.shape, spec.expert_ids, params,
        seed=spec.seed, thresholds=inputs.thresholds.get(entry.name), owns_deltas=True,
    )
