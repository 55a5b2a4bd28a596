"""What one execution of a plan shares (``Job``: its inputs opened and checked against the catalog, their
recorded block hashes, the output's files), the units it is cut into, and per output tensor the work items
with their checked reads. Plain data: a unit may run in another process."""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from mergepipe.analysis.experts import (
    LORA,
    ExpertFormat,
    aligned_block,
    block_ranges,
    expert_format,
    layer_count,
    open_lora,
    open_registered,
)
from mergepipe.analysis.provenance import BlockOutput
from mergepipe.catalog import Catalog
from mergepipe.catalog.statistics import DeltaChunk, DeltaStage
from mergepipe.errors import EngineError, MergePipeError, ModelChangedError, PreviousChangedError, StalePlanError
from mergepipe.manifest.manifest import FileEntry, read_manifest
from mergepipe.spec.copy_map import TensorCopy
from mergepipe.spec.operators import BlockContext, OperatorDef, TrimThreshold, get_operator
from mergepipe.spec.plan import Plan
from mergepipe.storage.checkpoint import (
    TOKENIZER_CONFIG_FILE,
    Checkpoint,
    OutputFile,
    OutputLayout,
    mirror_layout,
    open_checkpoint,
    packed_layout,
)
from mergepipe.storage.format import DTYPE_SIZES, MERGEABLE_DTYPES, BlockSpec, TensorEntry, block_at, tensor_blocks
from mergepipe.storage.writer import open_inside
from mergepipe.storage.location import Location, RemotePath
from mergepipe.storage.lora import LoraAdapter
from mergepipe.storage.remote import TransferMeter
from mergepipe.storage.source import BlockCheck, ByteRange, WorkItem

#: Tags of reads in the source's counters: the base's, the previous snapshot's (experts: their ids).
BASE_TAG = "base"
REUSE_TAG = "previous snapshot"
#: The largest output shard when the plan packs shards and sets no size: mergekit's and transformers' (5 GB).
DEFAULT_SHARD_BYTES = 5 * 10**9


@dataclass(frozen=True)
class PreviousSnapshot:
    """The snapshot an incremental merge takes blocks from: opened, its output blocks' records, its files."""

    checkpoint: Checkpoint
    root: Path
    blocks: dict[tuple[str, int], BlockOutput]
    files: dict[str, FileEntry]


@dataclass(frozen=True)
class StoreInput:
    path: Path
    chunks: Mapping[str, Sequence[DeltaChunk]]
    stages: Mapping[str, Sequence[DeltaStage]]


@dataclass(frozen=True)
class Job:
    """The plan, its operator (None for a passthrough), its opened inputs (``experts``: also a passthrough's
    sources and versions delta updates replace) and every block read's hash (model -> tensor -> block)."""

    plan: Plan
    definition: OperatorDef | None
    base: Checkpoint
    experts: Mapping[str, Checkpoint]
    thresholds: Mapping[str, Sequence[Mapping[float, TrimThreshold] | None]]
    num_layers: int
    device: torch.device
    hashes: Mapping[str, Mapping[str, Mapping[int, str]]]
    layout: OutputLayout
    copies: Mapping[str, TensorCopy] = field(default_factory=dict)  # a passthrough's output tensor -> source
    stores: Mapping[str, StoreInput] = field(default_factory=dict)
    previous: PreviousSnapshot | None = None
    formats: Mapping[str, ExpertFormat] = field(default_factory=dict)
    loras: Mapping[str, LoraAdapter] = field(default_factory=dict)
    meter: TransferMeter | None = None

    @property
    def expert_ids(self) -> tuple[str, ...]:
        return self.plan.merge.expert_ids

    @property
    def reused(self) -> PreviousSnapshot:
        """The previous snapshot, which a plan that reuses or updates blocks always has."""
        if self.previous is None:
            raise EngineError("internal error: reused blocks without their previous snapshot; please report it")
        return self.previous

    @property
    def measures_drift(self) -> bool:
        """Whether output blocks record their drift: for the operators a later merge can delta-update."""
        return self.definition is not None and self.definition.delta_updatable

    def checkpoint(self, model_id: str) -> Checkpoint:
        return self.base if model_id == self.plan.base.id else self.experts[model_id]

    def tensor(self, name: str) -> TensorEntry:
        """The input tensor output tensor ``name`` is made from: the base's, or a passthrough's source."""
        copy = self.copies.get(name)
        return self.base.tensor(name) if copy is None else self.checkpoint(copy.model).tensor(copy.tensor)

    def output_dtype(self, entry: TensorEntry) -> str:
        """``out_dtype`` for merged dtypes, else the tensor's own."""
        return self.plan.out_dtype if self.plan.out_dtype and entry.dtype in MERGEABLE_DTYPES else entry.dtype

    def output_row_bytes(self, entry: TensorEntry) -> int:
        return entry.row_numel * DTYPE_SIZES[self.output_dtype(entry)]

    def output_entries(self, file: OutputFile) -> list[tuple[str, str, tuple[int, ...]]]:
        return [(name, self.output_dtype(e), e.shape) for name in file.tensors for e in (self.tensor(name),)]


def load_job(catalog: Catalog, plan: Plan, device: torch.device) -> Job:
    """Open the plan's inputs (each checked against its registration) and fetch what its units need."""
    base_id, reuse = plan.base.id, plan.reuse
    base = open_registered(catalog, base_id, sides=True)  # the output gets its side files
    if plan.chat_template is not None and TOKENIZER_CONFIG_FILE not in base.aux_files:
        raise ModelChangedError(
            f"plan {plan.digest[:12]} sets a chat template in {TOKENIZER_CONFIG_FILE}, but the base '{base_id}' "
            f"at {base.root} no longer has that file; nothing was published. Restore it, or plan without a chat "
            "template"
        )
    formats = {e.id: expert_format(catalog.models.get(e.id).kind) for e in plan.experts}
    loras = {e: open_lora(catalog, e) for e, f in formats.items() if f.kind == LORA}
    experts = {e: open_registered(catalog, e) for e in formats if e not in loras}
    copies = {c.output: c for c in plan.copies.copies} if plan.copies is not None else {}
    definition, thresholds, num_layers = None, {}, 0
    if copies:  # a passthrough reads every block of its sources
        hashes = {m: _recorded(catalog, m, None) for m in (base_id, *experts)}
    else:
        definition, num_layers = get_operator(plan.operator), layer_count(catalog, base_id)
        stats = [catalog.stats.tensor_stats(e.id, base_id) for e in plan.experts]
        for _, entry in base.iter_tensors():
            if entry.dtype in MERGEABLE_DTYPES:
                thresholds[entry.name] = [s[entry.name].thresholds if entry.name in s else None for s in stats]
        hashes = {base_id: _recorded(catalog, base_id, None)}
        for e in plan.experts:
            hashes[e.id] = _recorded(catalog, e.id, {t: per.get(e.id, ()) for t, per in plan.reads.items()})
        for old in set(reuse.replaced.values()) - {base_id} if reuse else ():  # read by delta updates
            experts[old], hashes[old] = open_registered(catalog, old), _recorded(catalog, old, None)
    job = Job(
        plan=plan,
        definition=definition,
        base=base,
        experts=experts,
        thresholds=thresholds,
        num_layers=num_layers,
        device=device,
        hashes=hashes,
        layout=mirror_layout(base),
        copies=copies,
        stores={e: load_store(catalog, plan, e) for e in plan.stores},
        previous=_previous(catalog, plan),
        formats=formats,
        loras=loras,
        meter=TransferMeter() if any(isinstance(c.root, RemotePath) for c in (base, *experts.values())) else None,
    )
    if plan.out_shard_bytes is None and not copies:
        return job
    # shards of the output tensors in order, each with the first base file's header metadata (as Hugging Face)
    names = list(copies) or [entry.name for _, entry in base.iter_tensors()]
    sizes = [(n, e.numel * DTYPE_SIZES[job.output_dtype(e)]) for n in names for e in (job.tensor(n),)]
    layout = packed_layout(sizes, plan.out_shard_bytes or DEFAULT_SHARD_BYTES, base.files[0].header.metadata)
    return replace(job, layout=layout)


def _previous(catalog: Catalog, plan: Plan) -> PreviousSnapshot | None:
    """The previous snapshot ``plan`` reuses, checked: record, manifest, every file plain and at its size."""
    reuse = plan.reuse
    if reuse is None or not (reuse.blocks or reuse.updated):
        return None
    record = catalog.snapshots.of_model(reuse.snapshot)
    if record is None or record.manifest_hash != reuse.manifest_hash:
        raise StalePlanError(
            f"plan {plan.digest[:12]} is stale: the snapshot '{reuse.snapshot}' it reuses blocks of is no longer "
            "the one it was planned against; run `mergepipe plan --from` again"
        )
    root = Path(record.out_path)
    try:
        manifest, stored = read_manifest(root)
        if stored != reuse.manifest_hash or manifest.manifest_hash != reuse.manifest_hash:
            raise ModelChangedError(f"{root}/manifest.json is not the manifest recorded at publish time")
        for entry in manifest.files:
            try:
                fd = open_inside(root, entry.name)
            except OSError as exc:
                found = "is missing" if exc.errno == errno.ENOENT else "is a symbolic link or not a plain file"
                raise ModelChangedError(f"{root / entry.name} {found}") from None
            size = os.fstat(fd).st_size
            os.close(fd)
            if size != entry.size:
                raise ModelChangedError(f"{root / entry.name} holds {size} bytes, the manifest says {entry.size}")
        checkpoint = open_checkpoint(root)
    except MergePipeError as exc:
        raise PreviousChangedError(
            f"the previous snapshot '{reuse.snapshot}' cannot be reused: {exc}; nothing was written. "
            "Merge without --from, or restore it",
            reason=str(exc),
        ) from None
    recorded = catalog.snapshots.outputs(reuse.snapshot)
    planned = [(tensor, i) for tensor, ix in (*reuse.blocks.items(), *reuse.updated.items()) for i in ix]
    for tensor, index in (key for key in planned if key not in recorded):
        raise StalePlanError(
            f"plan {plan.digest[:12]} is stale: snapshot '{reuse.snapshot}' has no "
            f"recorded block {index} of '{tensor}'; run `mergepipe plan --from` again"
        )
    blocks = {key: BlockOutput(found.hash, found.l2, found.drift) for key, found in recorded.items()}
    return PreviousSnapshot(checkpoint, root, blocks, {entry.name: entry for entry in manifest.files})


def load_store(catalog: Catalog, plan: Plan, expert_id: str) -> StoreInput:
    """The delta store the plan was made on; StalePlanError / ModelChangedError if it moved on."""
    base_id = plan.base.id
    record = catalog.deltas.find(expert_id, base_id)
    if record is None or record.digest != plan.stores[expert_id]:
        raise StalePlanError(
            f"plan {plan.digest[:12]} is stale: the delta store of '{expert_id}' was rebuilt or dropped since it "
            "was planned; run `mergepipe plan` again"
        )
    path = Path(record.path)
    size = path.stat().st_size if path.is_file() else None
    if size != record.file_size:
        found = "is missing" if size is None else f"holds {size} bytes, {record.file_size} were recorded"
        raise ModelChangedError(
            f"the delta store of '{expert_id}' at {path} {found}; rebuild it with "
            f"`mergepipe analyze --base {base_id} --store-deltas DIR {expert_id}`"
        )
    return StoreInput(path, catalog.deltas.chunks(expert_id, base_id), catalog.deltas.stages(expert_id, base_id))


def _recorded(catalog: Catalog, model_id: str, wanted: Mapping[str, Sequence[int]] | None) -> dict[str, dict[int, str]]:
    """The recorded block hashes of a model: all, or only the ``wanted`` blocks."""
    out: dict[str, dict[int, str]] = {}
    for tensor, digests in catalog.blocks.hashes(model_id).items():
        indices = range(len(digests)) if wanted is None else wanted.get(tensor, ())
        out[tensor] = {i: digest for i in indices if (digest := digests[i]) is not None}
    return out


# ------------------------------------------------------------------ work units

#: Target bytes of input data per unit: start-up per unit is negligible, several workers share a 1 GB shard.
DEFAULT_UNIT_BYTES = 256 * 1024 * 1024
#: A target no file reaches: one unit per output file (a single worker gains nothing from smaller units).
WHOLE_FILES = sys.maxsize
#: Units per worker when several share a merge (run largest first, they finish within about a unit).
UNITS_PER_WORKER = 4


@dataclass(frozen=True)
class WorkUnit:
    """Tensors ``tensors`` (in file order) of output file ``shard``; ``nbytes`` of input data."""

    index: int
    shard: str
    tensors: tuple[str, ...]
    nbytes: int


def balanced_target(total_bytes: int, workers: int) -> int:
    """Whole files for one worker, else about ``UNITS_PER_WORKER`` units each, at most ``DEFAULT_UNIT_BYTES``."""
    if workers <= 1:
        return WHOLE_FILES
    return max(1, min(DEFAULT_UNIT_BYTES, -(-total_bytes // (UNITS_PER_WORKER * workers))))


def cut_units(
    inputs: Checkpoint | Job, target_bytes: int = DEFAULT_UNIT_BYTES, files: Sequence[OutputFile] | None = None
) -> list[WorkUnit]:
    """The output ``files``' units in order, sized by their input tensors' bytes (a big tensor alone)."""
    if target_bytes <= 0:
        raise ValueError(f"target_bytes must be positive, got {target_bytes}")
    if files is None:
        files = mirror_layout(inputs).files if isinstance(inputs, Checkpoint) else inputs.layout.files
    units: list[WorkUnit] = []
    for file in files:
        names: list[str] = []
        size = 0
        for name in file.tensors:
            nbytes = inputs.tensor(name).nbytes
            if names and nbytes >= target_bytes:
                units.append(WorkUnit(len(units), file.name, tuple(names), size))
                names, size = [], 0
            names.append(name)
            size += nbytes
            if size >= target_bytes:
                units.append(WorkUnit(len(units), file.name, tuple(names), size))
                names, size = [], 0
        if names or not file.tensors:
            units.append(WorkUnit(len(units), file.name, tuple(names), size))
    return units


# ------------------------------------------------------------------ work items


@dataclass
class SharedFactors:
    """A tensor's LoRA reads across its items: adapters whose first read (with A) is made, and what it brought."""

    requested: set[str] = field(default_factory=set)
    kept: dict[str, Any] = field(default_factory=dict)


@dataclass
class Copy:
    """An input block written as it is (cast where the output dtype differs) into tensor ``output``."""

    output: str
    entry: TensorEntry
    block: BlockSpec


@dataclass
class Merge:
    """Blocks of a tensor merged (one, or all of it) from the base, expert runs and delta-store parts."""

    entry: TensorEntry
    blocks: list[BlockSpec]
    runs: list[tuple[int, BlockSpec, BlockSpec]]
    ctx: BlockContext
    stored: list[tuple[int, Sequence[DeltaChunk]]] = field(default_factory=list)
    sketched: list[tuple[int, Sequence[DeltaStage]]] = field(default_factory=list)
    factors: SharedFactors = field(default_factory=SharedFactors)


@dataclass
class Update:
    """A block updated from the previous output: ``old + Σ c·(E_new − E_old)`` over ``experts``."""

    entry: TensorEntry
    block: BlockSpec
    experts: list[int]
    ctx: BlockContext


@dataclass
class Reuse:
    """A run of the previous snapshot's blocks in ``source``: read with the item, or copied by the kernel."""

    entry: TensorEntry
    blocks: list[BlockSpec]
    source: ByteRange


def tensor_items(inputs: Job, name: str, read_reused: bool = True) -> Iterator[WorkItem]:
    """Output tensor ``name``'s work items as ``Plan.merge_mode`` says (``read_reused`` False: for the kernel)."""
    plan, entry = inputs.plan, inputs.tensor(name)
    blocks = tensor_blocks(entry, plan.block_bytes)
    copy = inputs.copies.get(name)
    mode, copies_unread = "copy", True
    if copy is None:
        same_dtype, keeps = inputs.output_dtype(entry) == entry.dtype, plan.keeps_base(name, inputs.num_layers)
        mode = plan.merge_mode(name, entry.dtype in MERGEABLE_DTYPES, same_dtype, keeps)
        copies_unread = same_dtype and keeps  # a block no expert is read for is then the base's bytes
    if mode == "copy":
        source = plan.base.id if copy is None else copy.model
        for block in blocks:
            if block.nbytes:  # an empty tensor needs no bytes
                yield WorkItem(Copy(name, entry, block), [_read(inputs, source, entry.name, [block])])
        return
    reuse = plan.reuse
    reused = set(reuse.blocks.get(name, ())) if reuse else set()
    if mode == "whole" and reused:
        yield _reuse_item(inputs, entry, [b for b in blocks if b.nbytes], read_reused)
        return
    ctx, factors = context(inputs, entry), SharedFactors()
    planned = [set(plan.reads.get(name, {}).get(e, ())) for e in inputs.expert_ids]
    if mode == "whole":
        runs = [(i, *run) for i, read in enumerate(planned) for run in _runs(entry, read, plan.block_bytes)]
        yield _merge_item(inputs, Merge(entry, blocks, runs, ctx, factors=factors))
        return
    updated = set(reuse.updated.get(name, ())) if reuse else set()
    reuse_runs = {first.index: last.index for first, last in _runs(entry, reused, plan.block_bytes)}
    for block in blocks:
        experts = [i for i, read in enumerate(planned) if block.index in read]
        if block.index in updated and reuse is not None:
            swapped = [i for i in experts if inputs.expert_ids[i] in reuse.replaced]
            yield _update_item(inputs, entry, block, swapped, ctx, factors)
        elif block.index in reused:
            if block.index in reuse_runs:  # a run's first block: one read for the run
                yield _reuse_item(inputs, entry, blocks[block.index : reuse_runs[block.index] + 1], read_reused)
        elif experts or not copies_unread:
            yield _merge_item(inputs, Merge(entry, [block], [(i, block, block) for i in experts], ctx, factors=factors))
        else:
            yield WorkItem(Copy(name, entry, block), [_read(inputs, plan.base.id, name, [block])])


def _runs(entry: TensorEntry, indices: set[int], block_bytes: int) -> Iterator[tuple[BlockSpec, BlockSpec]]:
    """Block indices as runs of neighbours (first and last block): one read per run."""
    run: list[int] = []
    for index in [*sorted(indices), -1]:
        if run and index != run[-1] + 1:
            yield block_at(entry, block_bytes, run[0]), block_at(entry, block_bytes, run[-1])
            run = []
        run.append(index)


def _merge_item(inputs: Job, item: Merge) -> WorkItem:
    plan, entry = inputs.plan, item.entry
    reads = [_read(inputs, plan.base.id, entry.name, item.blocks)]
    for i, first, last in item.runs:
        reads += _expert_reads(inputs, inputs.expert_ids[i], entry.name, first, last, item.factors)
    for kind, parts, counts, got in (
        ("chunk", "chunks", plan.entry_reads, item.stored),
        ("sketch stage", "stages", plan.sketch_reads, item.sketched),
    ):
        for i, expert_id in enumerate(inputs.expert_ids):
            if n := counts.get(entry.name, {}).get(expert_id, 0):
                store = inputs.stores[expert_id]
                read = tuple(getattr(store, parts)[entry.name][:n])
                got.append((i, read))
                checks = tuple(BlockCheck(getattr(p, "stage", None) or p.index, p.begin, p.end, p.hash) for p in read)
                reads.append(ByteRange(store.path, read[0].begin, read[-1].end, expert_id, entry.name, checks, kind))
    return WorkItem(item, reads)


def _read(inputs: Job, model_id: str, tensor: str, blocks: Sequence[BlockSpec], tag: str | None = None) -> ByteRange:
    """One read of consecutive ``blocks`` of a model's tensor, each block checked against its hash."""
    recorded, path = inputs.hashes[model_id][tensor], inputs.checkpoint(model_id).file_of(tensor).path
    tag = tag or (BASE_TAG if model_id == inputs.plan.base.id else model_id)
    return _checked(path, blocks, [recorded[b.index] for b in blocks], tag, tensor)


def _checked(
    path: Location, blocks: Sequence[BlockSpec], digests: Sequence[str], tag: str, tensor: str, kind: str = "block"
) -> ByteRange:
    checks = tuple(BlockCheck(b.index, b.begin, b.end, digest) for b, digest in zip(blocks, digests))
    return ByteRange(path, blocks[0].begin, blocks[-1].end, tag, tensor, checks, kind)


def _expert_reads(
    inputs: Job, expert_id: str, tensor: str, first: BlockSpec, last: BlockSpec, shared: SharedFactors
) -> list[ByteRange]:
    """The reads of base blocks ``first..last`` of an expert's tensor (an adapter's: B's rows, A once)."""
    base_entry, block_bytes = inputs.base.tensor(tensor), inputs.plan.block_bytes
    blocks = [first, *(block_at(base_entry, block_bytes, i) for i in range(first.index + 1, last.index + 1))]
    adapter = inputs.loras.get(expert_id)
    if adapter is None:
        entry = inputs.experts[expert_id].tensor(tensor)
        return [_read(inputs, expert_id, tensor, [aligned_block(entry, b) for b in blocks])]
    if tensor in adapter.saved:  # a replaced tensor's rows
        entry, recorded = adapter.saved[tensor].entry, inputs.hashes[expert_id][tensor]
        rows = [aligned_block(entry, b) for b in blocks]
        return [_checked(adapter.weights, rows, [recorded[b.index] for b in blocks], expert_id, tensor)]
    target = adapter.targets[tensor]
    first_read = expert_id not in shared.requested
    shared.requested.add(expert_id)
    if target.transposed:  # both factors, once: ΔW's rows need all of them
        span = (min(target.a.begin, target.b.begin), max(target.a.end, target.b.end))
        return [ByteRange(target.path, *span, expert_id, tensor)] if first_read else []
    (b_begin, b_end), (a_begin, a_end) = block_ranges(target, first.row_start, last.row_end)
    reads = [ByteRange(target.path, b_begin, b_end, expert_id, tensor)]
    return reads + [ByteRange(target.path, a_begin, a_end, expert_id, tensor)] if first_read else reads


def _reuse_item(inputs: Job, entry: TensorEntry, blocks: list[BlockSpec], read: bool) -> WorkItem:
    previous = inputs.reused
    old = previous.checkpoint.tensor(entry.name) if entry.name in previous.checkpoint.tensor_files else None
    if old is None or old.dtype != inputs.output_dtype(entry) or old.shape != entry.shape:
        changed = f"{previous.checkpoint.root} no longer holds tensor '{entry.name}' as it was published"
        raise PreviousChangedError(
            f"the previous snapshot at {changed}; nothing was written. Merge without --from", reason=changed
        )
    path, rows = previous.checkpoint.file_of(entry.name).path, [aligned_block(old, b) for b in blocks]
    digests = [previous.blocks[(entry.name, b.index)].hash for b in blocks]
    source = _checked(path, rows, digests, REUSE_TAG, entry.name, "output")
    return WorkItem(Reuse(entry, blocks, source), [source] if read else [])


def _update_item(
    inputs: Job, entry: TensorEntry, block: BlockSpec, swapped: list[int], ctx: BlockContext, shared: SharedFactors
) -> WorkItem:
    """The previous output block, then per replaced expert its new and its earlier version's block."""
    reuse = inputs.plan.reuse
    reads = _reuse_item(inputs, entry, [block], True).reads
    for i in swapped:
        expert = inputs.expert_ids[i]
        reads += _expert_reads(inputs, expert, entry.name, block, block, shared)
        old = reuse.replaced[expert] if reuse else expert
        old_block = block_at(inputs.checkpoint(old).tensor(entry.name), inputs.plan.block_bytes, block.index)
        # counted under the expert (an added expert's earlier version is the base: base bytes)
        reads.append(_read(inputs, old, entry.name, [old_block], BASE_TAG if old == inputs.plan.base.id else expert))
    return WorkItem(Update(entry, block, swapped, ctx), reads)


def whole_file(inputs: Job, file: OutputFile) -> tuple[dict[tuple[str, int], BlockOutput], int] | None:
    """When every block of ``file`` is the previous snapshot's: their records, and the bytes reused."""
    previous = inputs.previous
    if inputs.plan.reuse is None or previous is None:
        return None
    outputs: dict[tuple[str, int], BlockOutput] = {}
    reused = 0
    for name in file.tensors:
        for item in tensor_items(inputs, name, read_reused=False):
            payload = item.payload
            if isinstance(payload, Reuse):
                outputs.update({(name, b.index): previous.blocks[(name, b.index)] for b in payload.blocks})
                reused += payload.source.nbytes
                continue
            recorded = previous.blocks.get((name, payload.block.index)) if isinstance(payload, Copy) else None
            if recorded is None or recorded.hash != item.reads[0].checks[0].digest:
                return None  # a block made here
            outputs[(name, payload.block.index)] = BlockOutput(
                recorded.hash, None, 0.0 if inputs.measures_drift else None
            )
    return outputs, reused


def context(inputs: Job, entry: TensorEntry) -> BlockContext:
    """The kernel's context of a tensor: the operator with its resolved parameters, thresholds and seed."""
    spec, definition = inputs.plan.merge, inputs.definition
    if definition is None:
        raise EngineError("internal error: a passthrough has no operator to merge with; please report it")
    params, thr = definition.resolve(spec, entry.name, inputs.num_layers), inputs.thresholds.get(entry.name)
    return BlockContext(
        definition, entry.name, entry.shape, spec.expert_ids, params, seed=spec.seed, thresholds=thr, owns_deltas=True
    )
