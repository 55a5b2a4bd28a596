"""PEFT LoRA adapters as experts (model kind ``lora``): ΔW = s·B·A meets the expert-format contract.

``storage/lora.py`` opens and checks the adapter (headers only) against its
base's tensors; this module gives it the catalog rows every expert has
(``expert_format.py``), with one byte range per block as for every model:

* **files**: ``adapter_model.safetensors`` (its header sha256) and
  ``adapter_config.json`` (the sha256 of its bytes: r, lora_alpha and the
  patterns decide ΔW), so the fingerprint changes with either, and a file
  changed on disk since registration is refused like any model's;
* **tensors**: one per base tensor the adapter puts LoRA on, with the base's
  name and shape and factor B's dtype; its byte range is the span of its two
  factors, which peft writes next to each other (A, then B): an adapter
  whose factors lie apart is refused;
* **blocks**: the base's rows (same index, rows); ``(begin, end)`` are the
  rows of B that block needs. A, which every block needs whole, is the
  tensor's span less its blocks (``a_nbytes``);
* **hash** of a block: blake3 of its B rows followed by all of A, exactly
  the bytes a read of the block uses (the engine checks them);
* **cost** of a block: its B rows; A is the tensor's *shared* cost, read
  once with the first block the engine reads of the tensor and kept for the
  others (``expert_format.py``, ``engine/lora_reads.py``): realized =
  planned, and a 100% budget reads every factor byte once;
* **unchanged**: a block whose B rows are all zero (ΔW rows are then exactly
  0). Hashes cannot tell (A is in every hash), so analysis decides it from
  the values; tensors the adapter does not touch have Δ = 0 and no rows.

A tensor the adapter stores whole (``modules_to_save``) replaces the base's:
its tensor record is that tensor, its blocks its rows (as a full expert's),
and Δ = fp32(saved) − fp32(base), so analysis and the engine read the base
for it (``replaces``).

A transposed ΔW = s·(B·A)ᵀ (``fan_in_fan_out``, GPT-2's ``Conv1D``): a row
block needs strided columns of A and all of B, which one byte range cannot
say, so every block is recorded as the whole span: the span is the
tensor's shared cost (its blocks cost 0), read once, its hash is every
block's, and a block is unchanged when its columns of A are zero.

LoRA on an embedding (``lora_embedding_*``) is a transposed ΔW too. PEFT
saves a copy of the embedding beside its factors (``base_layer``, by
default), which its loader copies over the base: registration reads that
copy once and compares it byte for byte with the base's tensor. Equal (the
usual case: the vocabulary was not resized), the copy adds nothing to Δ and
is left out (``merged_parts``: never read again); different (a resized or
retrained embedding), the adapter is refused by name, nothing written.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Sequence

from mergepipe.analysis.describe import layout_fingerprint
from mergepipe.analysis.expert_format import LORA
from mergepipe.analysis.opening import changed, check_unchanged, open_registered
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import BlockRecord, FileRecord, ModelContent, ModelRecord, TensorRecord
from mergepipe.errors import CheckpointError, ConfigError
from mergepipe.storage.checkpoint import Checkpoint
from mergepipe.storage.hashing import block_digest
from mergepipe.storage.lora import BaseTensors, LoraAdapter, LoraTarget, SavedTensor, open_lora_adapter
from mergepipe.storage.lora_config import ADAPTER_CONFIG_FILE, MERGE_FIRST
from mergepipe.storage.remote_source import CheckpointSource

#: Bytes compared at a time when checking an embedding copy against the base.
_COMPARE_CHUNK = 16 << 20


def is_lora_dir(root: Path) -> bool:
    """Whether ``root`` holds a PEFT adapter (its ``adapter_config.json``)."""
    return (Path(root) / ADAPTER_CONFIG_FILE).is_file()


def base_tensors(catalog: Catalog, base_id: str) -> BaseTensors:
    """The base's tensors as ``storage/lora.py`` checks an adapter against them, in the base's order."""
    return {t.name: (t.dtype, t.shape) for t in catalog.models.tensors(base_id)}


def adapter_files(adapter: LoraAdapter) -> tuple[FileRecord, ...]:
    """The files that decide ΔW: the weights (header hash) and the config (hash of its bytes)."""
    out = []
    for path, digest in ((adapter.weights, adapter.header.header_sha256), (adapter.config.path, adapter.config.sha256)):
        st = path.stat()
        out.append(FileRecord(name=path.name, size=st.st_size, mtime_ns=st.st_mtime_ns, header_sha256=digest))
    return tuple(out)


def _check_supported(name: str, adapter: LoraAdapter, base: Checkpoint) -> None:
    """CheckpointError naming the first part of the adapter this version does not merge (module docstring)."""
    for target in adapter.targets.values():
        copy = adapter.saved.get(target.tensor)
        if copy is not None and not _same_bytes(copy, base):
            raise CheckpointError(
                f"adapter '{name}': the copy of {target.tensor!r} it saves (peft's save_embedding_layers) differs "
                f"from the base's (a resized or retrained embedding), which MergePipe does not merge from an "
                f"adapter; nothing was registered. {MERGE_FIRST}")
        if target.b.end != target.a.begin and target.a.end != target.b.begin:
            raise CheckpointError(
                f"adapter '{name}': the factors of {target.module!r} are not next to each other in "
                f"{target.path.name}; nothing was registered. Re-save it with peft's save_pretrained")


def _same_bytes(copy: SavedTensor, base: Checkpoint) -> bool:
    """Whether an adapter's saved copy of a base tensor holds the base's exact bytes (read in chunks)."""
    entry = base.tensor(copy.tensor)
    if (copy.entry.dtype, copy.entry.shape) != (entry.dtype, entry.shape):
        return False
    with CheckpointSource() as source:  # the base may be remote (storage/remote_source.py)
        for at in range(0, entry.nbytes, _COMPARE_CHUNK):
            n = min(entry.nbytes - at, _COMPARE_CHUNK)
            mine = source.read(copy.path, copy.entry.begin + at, copy.entry.begin + at + n)
            if mine != source.read(base.file_of(copy.tensor).path, entry.begin + at, entry.begin + at + n):
                return False
    return True


def merged_parts(adapter: LoraAdapter) -> LoraAdapter:
    """``adapter`` less the saved copies of its LoRA targets (registration found them equal to the base's:
    they add nothing to Δ, module docstring)."""
    saved = {name: s for name, s in adapter.saved.items() if name not in adapter.targets}
    return adapter if saved == adapter.saved else dataclasses.replace(adapter, saved=saved)


def describe_lora(catalog: Catalog, name: str, root: Path, base_ref: str | None) -> ModelContent:
    """The catalog rows of the adapter at ``root`` against ``base_ref``, after every check; nothing is written."""
    if base_ref is None:
        raise ConfigError("a LoRA adapter is registered against its base: give --base BASE")
    base = catalog.models.resolve(base_ref)
    if base.kind in ("delta", LORA):
        raise ConfigError(f"'{base.id}' is a {base.kind} expert, not a base; give the model the adapter was trained on")
    adapter = open_lora_adapter(root, base_tensors(catalog, base.id))
    _check_supported(name, adapter, open_registered(catalog, base.id))
    adapter = merged_parts(adapter)
    tensors, blocks = _rows(adapter, catalog.blocks.by_tensor(base.id))
    files = adapter_files(adapter)
    record = ModelRecord(
        id=name, uri=str(Path(root).resolve()), kind=LORA, fingerprint=layout_fingerprint(files),
        architecture=base.architecture, num_layers=base.num_layers, n_tensors=len(tensors), n_blocks=len(blocks),
        total_bytes=adapter.factor_bytes + adapter.saved_bytes, created_at=catalog.now(), delta_base=base.id,
    )
    return ModelContent(record=record, files=files, tensors=tuple(tensors), blocks=tuple(blocks))


def _rows(adapter: LoraAdapter, geometry: dict[str, list[BlockRecord]]) -> tuple[list[TensorRecord], list[BlockRecord]]:
    """Tensor and block rows (module docstring), in the base's tensor order."""
    order = {name: i for i, name in enumerate(geometry)}
    tensors: list[TensorRecord] = []
    blocks: list[BlockRecord] = []
    for ordinal, name in enumerate(sorted([*adapter.targets, *adapter.saved], key=order.__getitem__)):
        if name in adapter.saved:  # a replacement: its own rows, like a full expert's tensor
            entry, first = adapter.saved[name].entry, adapter.saved[name].entry.begin
            tensors.append(TensorRecord(name, adapter.weights.name, entry.dtype, tuple(entry.shape), entry.begin,
                                        entry.end, ordinal))
        else:
            target = adapter.targets[name]
            entry, first = target.b, target.b.begin
            span = (min(target.a.begin, first), max(target.a.end, entry.end))
            tensors.append(TensorRecord(name, target.path.name, entry.dtype, tuple(target.shape), *span, ordinal))
            if target.transposed:  # every block reads the whole span
                blocks.extend(BlockRecord(name, b.index, b.row_start, b.row_end, *span, None) for b in geometry[name])
                continue
        row = entry.row_bytes
        blocks.extend(BlockRecord(name, b.index, b.row_start, b.row_end, first + b.row_start * row,
                                  first + b.row_end * row, None) for b in geometry[name])
    return tensors, blocks


def replaces(part: LoraTarget | SavedTensor | None) -> bool:
    """Whether an adapter's tensor is a full replacement, whose Δ needs the base's values."""
    return isinstance(part, SavedTensor)


def adapter_part(adapter: LoraAdapter | None, tensor: str) -> LoraTarget | SavedTensor | None:
    """What an adapter holds for a base tensor: LoRA factors, a replacement, or nothing."""
    if adapter is None:
        return None
    return adapter.targets.get(tensor) or adapter.saved.get(tensor)


def open_lora(catalog: Catalog, model_id: str) -> LoraAdapter:
    """The registered adapter ``model_id``, opened against its base and checked against its registration."""
    check_unchanged(catalog, model_id)
    record = catalog.models.get(model_id)
    adapter = open_lora_adapter(record.uri, base_tensors(catalog, str(record.delta_base)))
    if layout_fingerprint(adapter_files(adapter)) != record.fingerprint:
        raise changed(catalog, model_id, f"headers or config in {record.uri}")
    return merged_parts(adapter)


def adapter_summary(catalog: Catalog, model_id: str) -> dict[str, Any]:
    """What a manifest records of a LoRA expert: its config's sha256, its rank and scale (the config's
    r and s; per-module values from rank_pattern / alpha_pattern are listed where they differ)."""
    adapter = open_lora(catalog, model_id)
    config = adapter.config
    ranks = sorted({t.rank for t in adapter.targets.values()})
    scales = sorted({t.scale for t in adapter.targets.values()})
    scale = config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)
    summary: dict[str, Any] = {"config_sha256": config.sha256, "rank": config.r, "scale": scale,
                               "targets": len(adapter.targets)}
    if ranks != [config.r] or len(scales) > 1:
        summary["ranks"], summary["scales"] = ranks, scales
    return summary


def block_ranges(target: LoraTarget, row_start: int, row_end: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The byte ranges a run of rows reads: (B's rows, all of A), absolute in the adapter file."""
    row = target.b.row_bytes
    return (target.b.begin + row_start * row, target.b.begin + row_end * row), (target.a.begin, target.a.end)


def block_hash(b_rows: bytes | memoryview, a: bytes | memoryview) -> str:
    """A LoRA block's content hash: blake3 of its B rows followed by A (the bytes it reads)."""
    return block_digest(bytes(b_rows) + bytes(a))


def span_hashes(target: LoraTarget, view: memoryview, span_begin: int, blocks: Sequence[BlockRecord]) -> list[str]:
    """Every block's hash from the factors' span as read whole (analysis reads a tensor at once)."""
    if target.transposed:  # each block reads the whole span
        return [block_digest(view)] * len(blocks)
    a = view[target.a.begin - span_begin : target.a.end - span_begin]
    return [block_hash(view[b.begin - span_begin : b.end - span_begin], a) for b in blocks]
