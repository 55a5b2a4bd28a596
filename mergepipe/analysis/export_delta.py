"""``export-delta``: an expert written as a delta checkpoint, ``fp32(E) − fp32(B)`` from checked bytes,
optionally trimmed per tensor, cast, and sharded like the base.
"""

from __future__ import annotations

import json
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mergepipe.analysis.analyze import analyze
from mergepipe.analysis.experts import (
    DELTA_FILE,
    DELTA_METADATA_KEY,
    DENSE,
    FORMAT_VERSION,
    check_blocks,
    open_registered,
    read_ahead,
)
from mergepipe.analysis.stats import trim_thresholds
from mergepipe.spec.operators.kernels import keep_mask
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import BlockRecord, ModelRecord
from mergepipe.errors import ConfigError
from mergepipe.runtime import Advance, byte_progress
from mergepipe.storage.checkpoint import CONFIG_FILE, INDEX_FILE, Checkpoint
from mergepipe.storage.format import DTYPE_SIZES, MERGEABLE_DTYPES, TensorEntry
from mergepipe.storage.remote import copy_file
from mergepipe.storage.source import BlockCheck, ByteRange, CheckpointSource, WorkItem
from mergepipe.storage.writer import ShardWriter, create_shard, to_bytes, to_float32


@dataclass(frozen=True)
class ExportReport:
    """What ``export_delta`` wrote, and how big it is next to the expert and the base."""

    expert_id: str
    base_id: str
    dtype: str
    density: float | None
    files: tuple[str, ...]  # every file written
    tensors: int  # tensors written
    total_bytes: int  # bytes of every file written (headers included)
    expert_bytes: int  # tensor data of the full expert checkpoint
    base_bytes: int
    analysed: bool  # the expert was analysed against the base first
    unmerged_changes: tuple[str, ...] = field(default_factory=tuple)  # changed tensors no merge uses


def resolve_pair(catalog: Catalog, model: str, base: str | None) -> tuple[ModelRecord, ModelRecord]:
    """The expert to export and its base: ``base``, else the one base it is analysed against."""
    expert = catalog.models.resolve(model)
    if expert.kind == "delta":
        raise ConfigError(f"'{expert.id}' is a delta checkpoint already (against '{expert.delta_base}')")
    if expert.kind == "lora":
        raise ConfigError(
            f"'{expert.id}' is a LoRA adapter (of '{expert.delta_base}'): merge it, or merge it into its "
            "base with peft and register that"
        )
    if base is not None:
        return expert, catalog.models.resolve(base)
    bases = sorted({a.base_id for a in catalog.stats.analyses(expert.id) if a.expert_id == expert.id})
    if len(bases) != 1:
        found = f"it is analysed against {', '.join(bases)}" if bases else "it is not analysed against any"
        raise ConfigError(f"which base is '{expert.id}' a delta of? {found}; give --base BASE")
    return expert, catalog.models.get(bases[0])


def export_delta(
    catalog: Catalog,
    model: str,
    directory: str | Path,
    base: str | None = None,
    dtype: str = "F32",
    density: float | None = None,
    progress: bool = False,
) -> ExportReport:
    """Write the delta of expert ``model`` against ``base`` (analysed first if need be) into ``directory``."""
    if dtype not in MERGEABLE_DTYPES:
        raise ConfigError(f"a delta is exported as F32, F16 or BF16, not {dtype!r}")
    if density is not None and not 0.0 < density <= 1.0:
        raise ConfigError(f"--density must be in (0, 1], got {density}")
    expert, base_record = resolve_pair(catalog, model, base)
    analysed = not catalog.stats.is_analyzed(expert.id, base_record.id)
    if analysed:
        analyze(
            catalog,
            [catalog.models.exact_ref(expert)],
            base_id=catalog.models.exact_ref(base_record),
            progress=progress,
        )
    base_ckpt, expert_ckpt = open_registered(catalog, base_record.id), open_registered(catalog, expert.id)
    stats = catalog.stats.tensor_stats(expert.id, base_record.id)
    info = {
        "format": DENSE,
        "version": FORMAT_VERSION,
        "base_id": base_record.id,
        "base_fingerprint": catalog.blocks.content_fingerprint(base_record.id),
        "block_bytes": catalog.block_bytes,
        "expert_id": expert.id,
        "expert_fingerprint": catalog.blocks.content_fingerprint(expert.id),
        "dtype": dtype,
        "density": density,
    }
    changed = [e for _, e in base_ckpt.iter_tensors() if e.dtype in MERGEABLE_DTYPES and not stats[e.name].identical]
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    with byte_progress("export-delta", sum(2 * e.nbytes for e in changed), progress) as advance:
        files = _write_files(catalog, (base_record, expert), (base_ckpt, expert_ckpt), changed, root, info, advance)
    with open(root / DELTA_FILE, "x", encoding="utf-8") as fh:
        fh.write(json.dumps(info, indent=2) + "\n")
    files.append(DELTA_FILE)
    if CONFIG_FILE in base_ckpt.aux_files:
        copy_file(base_ckpt.root / CONFIG_FILE, root / CONFIG_FILE)  # a download for a remote base
        files.append(CONFIG_FILE)
    unmerged = tuple(
        e.name for _, e in base_ckpt.iter_tensors() if e.dtype not in MERGEABLE_DTYPES and not stats[e.name].identical
    )
    return ExportReport(
        expert_id=expert.id,
        base_id=base_record.id,
        dtype=dtype,
        density=density,
        files=tuple(files),
        tensors=len(changed),
        total_bytes=sum((root / name).stat().st_size for name in files),
        expert_bytes=expert.total_bytes,
        base_bytes=base_record.total_bytes,
        analysed=analysed,
        unmerged_changes=unmerged,
    )


def _write_files(
    catalog: Catalog,
    records: tuple[ModelRecord, ModelRecord],
    checkpoints: tuple[Checkpoint, Checkpoint],
    changed: list[TensorEntry],
    root: Path,
    info: dict,
    advance: Advance,
) -> list[str]:
    """One file per base weight file that holds a changed tensor (same name, same tensor order)."""
    base = checkpoints[0]
    names = {e.name for e in changed}
    files = [(f, [e for e in f.header.tensors.values() if e.name in names]) for f in base.files]
    files = [(f, entries) for f, entries in files if entries]
    blocks = {r.id: catalog.blocks.by_tensor(r.id) for r in records}
    items = [
        WorkItem(e, [_read(blocks[r.id][e.name], r.id, c, e.name) for r, c in zip(records, checkpoints)])
        for _, es in files
        for e in es
    ]
    dtype = info["dtype"]
    metadata = {**(base.files[0].header.metadata or {}), DELTA_METADATA_KEY: json.dumps(info, sort_keys=True)}
    weight_map = {}
    with CheckpointSource() as source, closing(read_ahead(source, items, check_blocks).run(items)) as stream:
        for file, entries in files:
            layout = create_shard(root / file.name, [(e.name, dtype, e.shape) for e in entries], metadata)
            with ShardWriter(layout) as writer:
                for entry, fetched in zip(entries, stream):
                    base32, expert32 = (to_float32(v, entry.dtype, entry.shape) for v in fetched.views)
                    fetched.release()
                    delta = _trimmed(expert32.sub_(base32), info["density"])  # what engine/compute.py computes
                    writer.write(entry.name, 0, to_bytes(delta, dtype))
                    weight_map[entry.name] = file.name
                    advance(2 * entry.nbytes, entry.name)
                writer.finish()
    written = [f.name for f, _ in files]
    if base.index is not None:
        total = sum(e.numel * DTYPE_SIZES[dtype] for e in changed)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(root / INDEX_FILE, "x", encoding="utf-8") as fh:
            fh.write(json.dumps(index, indent=2) + "\n")
        written.append(INDEX_FILE)
    return written


def _read(blocks: list[BlockRecord], model_id: str, checkpoint: Checkpoint, name: str) -> ByteRange:
    """The read of one model's tensor, every block checked against the hash analysis recorded."""
    entry = checkpoint.tensor(name)
    checks = tuple(BlockCheck(b.index, b.begin, b.end, str(b.hash)) for b in blocks)
    return ByteRange(checkpoint.file_of(name).path, entry.begin, entry.end, model_id, name, checks)


def _trimmed(delta: torch.Tensor, density: float | None) -> torch.Tensor:
    """``delta`` with each entry past its top ``density`` by |Δ| (ties by position) set to +0.0."""
    if density is None:
        return delta
    flat = delta.view(-1)
    (threshold,) = trim_thresholds(flat.abs(), [density])
    kept = keep_mask(flat.abs(), 0, threshold)
    return torch.where(kept, flat, torch.zeros((), dtype=flat.dtype)).view(delta.shape)
