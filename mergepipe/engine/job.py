"""Everything fixed for one execution of a plan, shared by all its work units.

Built once by the coordinator from the catalog (opened checkpoints, checked
against their registration; thresholds; layer count; the output's weight
files) and read by every unit. It holds no open files and no catalog: a unit
opens what it needs. A checkpoint may be remote (``s3://``, ``http(s)://``):
its files' paths are then ``RemotePath`` values, which the units' source reads
by ranged requests, and ``meter`` counts that traffic for the whole execution.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mergepipe.analysis.experts import (
    LORA,
    ExpertFormat,
    aligned_block,
    block_hash,
    block_ranges,
    expert_format,
    layer_count,
    open_lora,
    open_registered,
)
from mergepipe.analysis.provenance import BlockOutput
from mergepipe.catalog import Catalog
from mergepipe.catalog.statistics import DeltaChunk, DeltaStage
from mergepipe.errors import MergePipeError, ModelChangedError, PreviousChangedError, StalePlanError
from mergepipe.manifest.manifest import FileEntry, read_manifest
from mergepipe.spec.operators import BlockContext, OperatorDef, TrimThreshold, get_operator
from mergepipe.spec.plan import Plan
from mergepipe.storage.checkpoint import (
    TOKENIZER_CONFIG_FILE,
    Checkpoint,
    CheckpointFile,
    OutputFile,
    OutputLayout,
    mirror_layout,
    open_checkpoint,
    packed_layout,
)
from mergepipe.storage.format import DTYPE_SIZES, MERGEABLE_DTYPES, BlockSpec, TensorEntry, block_at, tensor_blocks
from mergepipe.storage.writer import open_inside
from mergepipe.storage.location import RemotePath
from mergepipe.storage.lora import LoraAdapter, LoraTarget, delta_rows
from mergepipe.storage.remote import TransferMeter
from mergepipe.storage.source import BlockCheck, ByteRange, WorkItem, block_digest
from mergepipe.storage.writer import raw_view, to_float32


@dataclass(frozen=True)
class PreviousSnapshot:
    """The opened previous snapshot, what it recorded of its every output block (hash, norm bound, drift; the
    plan's reused and updated blocks among them), its manifest's file entries, and, for delta updates, the
    replaced expert versions (opened, checked) with their hashes."""

    checkpoint: Checkpoint
    blocks: dict[tuple[str, int], BlockOutput]
    older: dict[str, Checkpoint] = field(default_factory=dict)  # expert id -> the version it replaced
    older_hashes: dict[str, dict[str, list[str | None]]] = field(default_factory=dict)
    files: dict[str, FileEntry] = field(default_factory=dict)  # name -> its hash and size, as published

    def open(self, name: str) -> int:
        """A read-only descriptor of the snapshot's file ``name``, reached through no symbolic link."""
        root = self.checkpoint.root
        assert isinstance(root, Path), f"snapshot {root} is not a local directory"
        return open_inside(root, name)


def load_previous(catalog: Catalog, plan: Plan) -> PreviousSnapshot | None:
    """The previous snapshot ``plan`` reuses blocks of (None when it reuses none); StalePlanError
    when the catalog moved on, PreviousChangedError when its files did."""
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
        files = _check_files(root, reuse.manifest_hash)
        checkpoint = open_checkpoint(root)
    except MergePipeError as exc:
        raise PreviousChangedError(
            f"the previous snapshot '{reuse.snapshot}' cannot be reused: {exc}; nothing was written. "
            "Merge without --from, or restore it",
            reason=str(exc),
        ) from None
    recorded = catalog.snapshots.outputs(reuse.snapshot)
    for tensor, indices in (*reuse.blocks.items(), *reuse.updated.items()):
        for index in indices:
            if (tensor, index) not in recorded:
                raise StalePlanError(
                    f"plan {plan.digest[:12]} is stale: snapshot '{reuse.snapshot}' has no "
                    f"recorded block {index} of '{tensor}'; run `mergepipe plan --from` again"
                )
    blocks = {key: BlockOutput(found.hash, found.l2, found.drift) for key, found in recorded.items()}
    older = {e: open_registered(catalog, old) for e, old in reuse.replaced.items()}  # checked like any input
    return PreviousSnapshot(
        checkpoint, blocks, older, {e: catalog.blocks.hashes(old) for e, old in reuse.replaced.items()}, files
    )


def _check_files(root: Path, manifest_hash: str) -> dict[str, FileEntry]:
    """The manifest's file entries by name; VerifyError / ModelChangedError unless ``root`` holds the
    manifest with ``manifest_hash`` and every file it lists, a plain file at its listed size."""
    manifest, stored = read_manifest(root)
    if stored != manifest_hash or manifest.manifest_hash != manifest_hash:
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
    return {entry.name: entry for entry in manifest.files}


#: Tag of base reads in the source's counters (experts are tagged with their ids).
BASE_TAG = "base"
#: Tag of reads of reused blocks from the previous snapshot (``merge --from``).
REUSE_TAG = "previous snapshot"


@dataclass(frozen=True)
class StoreInput:
    """An expert's delta store as the plan reads it: the file, each tensor's chunks and sketch stages."""

    path: Path
    chunks: Mapping[str, Sequence[DeltaChunk]]
    stages: Mapping[str, Sequence[DeltaStage]]


@dataclass(frozen=True)
class Job:
    """The plan with its operator, the opened checkpoints and per-tensor thresholds."""

    plan: Plan
    definition: OperatorDef
    base: Checkpoint
    experts: Mapping[str, Checkpoint]
    thresholds: Mapping[str, Sequence[Mapping[float, TrimThreshold] | None]]
    num_layers: int
    device: torch.device
    # model id -> tensor -> block index -> recorded content hash: every block
    # of the base, the planned blocks of each expert
    hashes: Mapping[str, Mapping[str, Mapping[int, str]]]
    # the output's weight files and the tensors each holds (the base's, or shards of plan.out_shard_bytes)
    layout: OutputLayout
    # expert id -> its delta store, for the experts the plan reads entries of
    stores: Mapping[str, StoreInput] = field(default_factory=dict)
    # the snapshot reused blocks are copied from (incremental merges only)
    previous: PreviousSnapshot | None = None
    # expert id -> its format (analysis/expert_format.py): full weights unless listed
    formats: Mapping[str, ExpertFormat] = field(default_factory=dict)
    # expert id -> its opened adapter, for the LoRA experts (not in ``experts``)
    loras: Mapping[str, LoraAdapter] = field(default_factory=dict)
    # the execution's remote traffic (bytes, requests) when the base or an expert is remote, else None: units
    # then coalesce their planned reads, and the progress bar shows the remote rate (storage/remote_source.py)
    meter: TransferMeter | None = None

    @property
    def expert_ids(self) -> tuple[str, ...]:
        return self.plan.merge.expert_ids

    def expert_format(self, expert_id: str) -> ExpertFormat:
        """How an expert's bytes become Δ: full weights (minus the base) or a delta checkpoint."""
        return self.formats.get(expert_id) or expert_format("checkpoint")

    def expert_dtype(self, expert_id: str, tensor: str) -> str:
        """The dtype an expert stores ``tensor`` in (a delta checkpoint's may differ from the base's)."""
        return self.experts[expert_id].tensor(tensor).dtype

    @property
    def measures_drift(self) -> bool:
        """Whether output blocks record their drift (``planner/delta_update.py``): for the operators a later
        merge can delta-update."""
        return self.definition.delta_updatable

    def output_dtype(self, entry: TensorEntry) -> str:
        """The dtype a tensor is written in: ``out_dtype`` for merged dtypes, else the base's."""
        return output_dtype(self.plan, entry)

    def output_row_bytes(self, entry: TensorEntry) -> int:
        """Bytes of one row of a tensor as written (in its output dtype)."""
        return entry.row_numel * DTYPE_SIZES[self.output_dtype(entry)]

    def output_entries(self, file: OutputFile) -> list[tuple[str, str, tuple[int, ...]]]:
        """An output file's tensors, in its order, with their output dtypes and the base's shapes."""
        entries = [self.base.tensor(name) for name in file.tensors]
        return [(e.name, self.output_dtype(e), e.shape) for e in entries]


def output_dtype(plan: Plan, entry: TensorEntry) -> str:
    """The dtype ``plan`` writes a base tensor in: ``out_dtype`` for merged dtypes, else the base's."""
    if plan.out_dtype is not None and entry.dtype in MERGEABLE_DTYPES:
        return plan.out_dtype
    return entry.dtype


def output_layout(base: Checkpoint, plan: Plan) -> OutputLayout:
    """The output's weight files: the base's (names, tensors, header metadata), or with
    ``plan.out_shard_bytes`` shards of at most that many bytes of output tensors, in the base's tensor
    order. Every shard carries the first base file's header metadata: Hugging Face writes the same
    (``{"format": "pt"}``) into each of its files."""
    if plan.out_shard_bytes is None:
        return mirror_layout(base)
    sizes = [(e.name, e.numel * DTYPE_SIZES[output_dtype(plan, e)]) for _, e in base.iter_tensors()]
    return packed_layout(sizes, plan.out_shard_bytes, base.files[0].header.metadata)


def load_job(catalog: Catalog, plan: Plan, device: torch.device) -> Job:
    """Open the plan's checkpoints (checked against their registration) and
    fetch the thresholds its tensors need."""
    base = open_registered(catalog, plan.base.id, sides=True)  # the output gets its side files
    if plan.chat_template is not None and TOKENIZER_CONFIG_FILE not in base.aux_files:
        raise ModelChangedError(
            f"plan {plan.digest[:12]} sets a chat template in {TOKENIZER_CONFIG_FILE}, but the base '{plan.base.id}' "
            f"at {base.root} no longer has that file; nothing was published. Restore it, or plan without a chat "
            "template"
        )
    formats = {e.id: expert_format(catalog.models.get(e.id).kind) for e in plan.experts}
    loras = {e.id: open_lora(catalog, e.id) for e in plan.experts if formats[e.id].kind == LORA}
    experts = {e.id: open_registered(catalog, e.id) for e in plan.experts if e.id not in loras}
    stats = [catalog.stats.tensor_stats(e.id, plan.base.id) for e in plan.experts]
    thresholds = {}
    for _, entry in base.iter_tensors():
        if entry.dtype in MERGEABLE_DTYPES:
            thresholds[entry.name] = [s[entry.name].thresholds if entry.name in s else None for s in stats]
    num_layers = layer_count(catalog, plan.base.id)
    hashes = {plan.base.id: _recorded(catalog, plan.base.id, None)}
    for e in plan.experts:
        hashes[e.id] = _recorded(catalog, e.id, {t: per.get(e.id, ()) for t, per in plan.reads.items()})
    return Job(
        plan=plan,
        definition=get_operator(plan.operator),
        base=base,
        experts=experts,
        thresholds=thresholds,
        num_layers=num_layers,
        device=device,
        hashes=hashes,
        layout=output_layout(base, plan),
        stores={e: load_store(catalog, plan, e) for e in plan.stores},
        previous=load_previous(catalog, plan),
        formats=formats,
        loras=loras,
        meter=TransferMeter() if any(isinstance(c.root, RemotePath) for c in (base, *experts.values())) else None,
    )


def load_store(catalog: Catalog, plan: Plan, expert_id: str) -> StoreInput:
    """The delta store the plan was made on; StalePlanError / ModelChangedError if it moved on."""
    record = catalog.deltas.find(expert_id, plan.base.id)
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
            f"`mergepipe analyze --base {plan.base.id} --store-deltas DIR {expert_id}`"
        )
    base_id = plan.base.id
    return StoreInput(path, catalog.deltas.chunks(expert_id, base_id), catalog.deltas.stages(expert_id, base_id))


def _recorded(catalog: Catalog, model_id: str, wanted: Mapping[str, Sequence[int]] | None) -> dict[str, dict[int, str]]:
    """The recorded block hashes of a model: all, or only the ``wanted`` blocks."""
    out: dict[str, dict[int, str]] = {}
    for tensor, digests in catalog.blocks.hashes(model_id).items():
        indices = range(len(digests)) if wanted is None else wanted.get(tensor, ())
        out[tensor] = {i: digest for i in indices if (digest := digests[i]) is not None}
    return out


#: Target bytes of base data per unit: large enough that per-unit start-up
#: (opening files, a read-ahead pipeline) is negligible, small enough that
#: several workers get balanced shares of a 1 GB shard.
DEFAULT_UNIT_BYTES = 256 * 1024 * 1024
#: A target no file reaches: one unit per output file (a single worker gains nothing from smaller units).
WHOLE_FILES = sys.maxsize
#: Units per worker when a merge is shared by several: run largest first, the last units to finish are
#: small, so the workers finish within about a unit of each other instead of one worker finishing alone.
UNITS_PER_WORKER = 4


@dataclass(frozen=True)
class WorkUnit:
    """Tensors ``tensors`` (in file order) of output file ``shard``."""

    index: int
    shard: str
    tensors: tuple[str, ...]
    nbytes: int


def balanced_target(total_bytes: int, workers: int) -> int:
    """The unit size for ``workers`` sharing a merge of ``total_bytes`` of base data: whole files for one
    worker; else about ``UNITS_PER_WORKER`` units each, at most ``DEFAULT_UNIT_BYTES`` (a large model
    then gets many more units, and the balance only improves)."""
    if workers <= 1:
        return WHOLE_FILES
    return max(1, min(DEFAULT_UNIT_BYTES, -(-total_bytes // (UNITS_PER_WORKER * workers))))


def cut_units(
    base: Checkpoint, target_bytes: int = DEFAULT_UNIT_BYTES, files: Sequence[OutputFile] | None = None
) -> list[WorkUnit]:
    """The units of a merge of ``base`` into the output ``files`` (by default the base's own), in output
    order; a unit's size counts the base bytes of its tensors."""
    if target_bytes <= 0:
        raise ValueError(f"target_bytes must be positive, got {target_bytes}")
    units: list[WorkUnit] = []
    for file in mirror_layout(base).files if files is None else files:
        names: list[str] = []
        size = 0
        for entry in (base.tensor(name) for name in file.tensors):
            if names and entry.nbytes >= target_bytes:  # a big tensor is a unit of its own
                units.append(WorkUnit(len(units), file.name, tuple(names), size))
                names, size = [], 0
            names.append(entry.name)
            size += entry.nbytes
            if size >= target_bytes:
                units.append(WorkUnit(len(units), file.name, tuple(names), size))
                names, size = [], 0
        if names or not file.tensors:
            units.append(WorkUnit(len(units), file.name, tuple(names), size))
    return units


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


def lora_reads(
    inputs: Job, expert_id: str, tensor: str, first: BlockSpec, last: BlockSpec, shared: SharedFactors
) -> list[ByteRange]:
    """The reads of blocks ``first..last`` (the base's geometry) of an adapter's tensor: B's rows, and A
    with the tensor's first run; or the rows of a replacement."""
    adapter = inputs.loras[expert_id]
    if tensor in adapter.saved:
        entry = adapter.saved[tensor].entry
        recorded = inputs.hashes[expert_id][tensor]
        checks = tuple(
            BlockCheck(
                b.index,
                entry.begin + b.row_start * entry.row_bytes,
                entry.begin + b.row_end * entry.row_bytes,
                recorded[b.index],
            )
            for b in _run(inputs, tensor, first, last)
        )
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


def replacement_delta(
    inputs: Job, expert_id: str, tensor: str, view: memoryview, shape: tuple[int, ...], base: torch.Tensor
) -> torch.Tensor:
    """Δ = fp32(saved) − fp32(base) of a replaced tensor's rows (``base``: the base's values, on the device)."""
    dtype = inputs.loras[expert_id].saved[tensor].entry.dtype
    return raw_view(view, dtype, shape).to(torch.float32, copy=True).to(base.device).sub_(base)


def lora_delta(
    inputs: Job,
    expert_id: str,
    tensor: str,
    blocks: list[BlockSpec],
    views: Iterator[memoryview],
    shared: SharedFactors,
) -> torch.Tensor:
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
    _check(
        expert_id,
        tensor,
        target.path,
        [
            b.index
            for b in blocks
            if block_hash(b_view[(b.row_start - start) * row_bytes : (b.row_end - start) * row_bytes], kept.raw)
            != recorded.get(b.index)
        ],
    )
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
            "(`mergepipe register --force`), analyse it and plan again"
        )


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


def _read(
    inputs: Job, model_id: str, tag: str, file: CheckpointFile, tensor: str, blocks: list[BlockSpec]
) -> ByteRange:
    """One read of consecutive ``blocks`` of a tensor, with the check of each block."""
    recorded = inputs.hashes[model_id][tensor]
    checks = tuple(BlockCheck(b.index, b.begin, b.end, recorded[b.index]) for b in blocks)
    return ByteRange(file.path, blocks[0].begin, blocks[-1].end, tag, tensor, checks)


def _base_read(inputs: Job, file: CheckpointFile, entry: TensorEntry, first: BlockSpec, last: BlockSpec) -> ByteRange:
    blocks = (
        [first]
        if first.index == last.index
        else [block_at(entry, inputs.plan.block_bytes, i) for i in range(first.index, last.index + 1)]
    )
    return _read(inputs, inputs.plan.base.id, BASE_TAG, file, entry.name, blocks)


def _expert_reads(
    inputs: Job, expert_id: str, tensor: str, first: int, last: int, factors: SharedFactors
) -> list[ByteRange]:
    """The reads of blocks ``first..last`` (the base's block indices) of an expert's tensor: one, or those
    of a LoRA adapter (``factors``: what the tensor's LoRA reads share)."""
    if expert_id in inputs.loras:
        base_entry = inputs.base.tensor(tensor)
        return lora_reads(
            inputs,
            expert_id,
            tensor,
            block_at(base_entry, inputs.plan.block_bytes, first),
            block_at(base_entry, inputs.plan.block_bytes, last),
            factors,
        )
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


def tensor_items(inputs: Job, file: CheckpointFile, entry: TensorEntry, read_reused: bool = True) -> Iterator[WorkItem]:
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
        yield _reuse_item(inputs, entry, [b for b in tensor_blocks(entry, plan.block_bytes) if b.nbytes], read_reused)
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
                run = [b for b in blocks[block.index :] if b.index in reused]
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
    for kind, parts, counts, got in (
        ("chunk", "chunks", plan.entry_reads, item.stored),
        ("sketch stage", "stages", plan.sketch_reads, item.sketched),
    ):
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
            copied = mode == "copy" or (
                mode == "blocks"
                and copies_unread
                and block.index not in updated
                and not any(block.index in ix for ix in planned)
            )
            recorded = previous.blocks.get(key)
            if not copied or recorded is None or recorded.hash != base_hashes[name].get(block.index):
                return None
            outputs[key] = BlockOutput(recorded.hash, None, 0.0 if inputs.measures_drift else None)  # as stream.py
    return WholeFile(outputs, reused_bytes)


def _update_item(
    inputs: Job, entry: TensorEntry, block: BlockSpec, swapped: list[int], ctx: BlockContext, factors: SharedFactors
) -> WorkItem:
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
        reads.append(
            ByteRange(older.file_of(entry.name).path, old_block.begin, old_block.end, tag, entry.name, (check,))
        )
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
        raise PreviousChangedError(
            f"the previous snapshot at {changed}; nothing was written. Merge without --from", reason=changed
        )
    checks = tuple(
        BlockCheck(
            b.index,
            old.begin + b.row_start * old.row_bytes,
            old.begin + b.row_end * old.row_bytes,
            previous.blocks[(entry.name, b.index)].hash,
        )
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
    return BlockContext(
        inputs.definition,
        entry.name,
        entry.shape,
        spec.expert_ids,
        params,
        seed=spec.seed,
        thresholds=inputs.thresholds.get(entry.name),
        owns_deltas=True,
    )
