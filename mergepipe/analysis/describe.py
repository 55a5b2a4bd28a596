"""A checkpoint's catalog rows, from its headers and side files (no SQL).

Registration and snapshot commits both describe an opened checkpoint this
way: its files (size, mtime, header hash; a remote file's ETag), tensors with their byte ranges,
block geometry at the catalog's block size, the layout fingerprint, and the
sha256 of each side file (config, tokenizer: what a merge copies from its
base, so part of what the model is; the one read of data). A
delta checkpoint's blocks take the base's row ranges instead
(``expert_format.aligned_records``): plans address blocks by index.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from mergepipe.analysis.expert_format import aligned_records
from mergepipe.catalog.records import BlockRecord, FileRecord, ModelContent, ModelRecord, TensorRecord
from mergepipe.spec.canonical import canonical_json
from mergepipe.storage.geometry import tensor_blocks
from mergepipe.storage.checkpoint import Checkpoint, side_files
from mergepipe.storage.location import RemotePath


def layout_fingerprint(files: Sequence[FileRecord]) -> str:
    """sha256 over the sorted (name, header sha256, size) of the weight files.

    A header fixes every tensor's name, dtype, shape and offsets, so this is
    a cheap identity of the layout; data changes are caught by size/mtime at
    use time and by block hashes after analysis.
    """
    items = sorted([f.name, f.header_sha256, f.size] for f in files)
    return hashlib.sha256(json.dumps(items, separators=(",", ":")).encode()).hexdigest()


def checkpoint_files(checkpoint: Checkpoint) -> tuple[FileRecord, ...]:
    """The weight files as registration records them; a remote file's ETag with them (``etag`` stays
    ``None`` for local files, so their records are what they always were)."""
    return tuple(
        FileRecord(name=f.name, size=f.size, mtime_ns=f.mtime_ns, header_sha256=f.header.header_sha256, etag=f.etag)
        for f in checkpoint.files
    )


def checkpoint_uri(checkpoint: Checkpoint) -> str:
    """The ``uri`` a model is recorded under: a local directory resolved (symlinks, ``..``), a remote one
    as its normalised URI. Never credentials: those stay in the environment and fsspec's config."""
    root = checkpoint.root
    return str(root) if isinstance(root, RemotePath) else str(Path(root).resolve())


def describe_checkpoint(
    checkpoint: Checkpoint,
    model_id: str,
    kind: str,
    block_bytes: int,
    created_at: str,
    geometry: Mapping[str, Sequence[BlockRecord]] | None = None,
    delta_base: str | None = None,
) -> ModelContent:
    """The catalog rows of an opened checkpoint; with ``geometry`` (a base's blocks by tensor, for a
    delta of kind ``delta`` against ``delta_base``) its blocks cover the base's row ranges."""
    files = checkpoint_files(checkpoint)
    tensors: list[TensorRecord] = []
    blocks: list[BlockRecord] = []
    for ordinal, (file, entry) in enumerate(checkpoint.iter_tensors()):
        tensors.append(
            TensorRecord(
                name=entry.name, file=file.name, dtype=entry.dtype, shape=tuple(entry.shape),
                begin=entry.begin, end=entry.end, ordinal=ordinal,
            )
        )
        if geometry is not None:
            blocks.extend(aligned_records(entry, geometry[entry.name]))
            continue
        blocks.extend(
            BlockRecord(entry.name, b.index, b.row_start, b.row_end, b.begin, b.end, None)
            for b in tensor_blocks(entry, block_bytes)
        )
    architecture, num_layers = _architecture(checkpoint.config)
    record = ModelRecord(
        id=model_id,
        uri=checkpoint_uri(checkpoint),
        kind=kind,
        fingerprint=layout_fingerprint(files),
        architecture=architecture,
        num_layers=num_layers,
        total_bytes=checkpoint.total_bytes,
        n_tensors=len(tensors),
        n_blocks=len(blocks),
        created_at=created_at,
        delta_base=delta_base,
        side_files=canonical_json([FileRecord(name, stat.size, stat.mtime_ns, sha256, stat.etag).to_json()
                                   for name, (stat, sha256) in side_files(checkpoint).items()]).decode("utf-8"),
    )
    return ModelContent(record=record, files=files, tensors=tuple(tensors), blocks=tuple(blocks))


def side_changes(recorded: Mapping[str, str], found: Mapping[str, str]) -> str:
    """How side files ``found`` differ from the ``recorded`` ones, in words ("tokenizer.json added")."""
    words = [f"{n} {'added' if n not in recorded else 'removed' if n not in found else 'changed'}"
             for n in sorted(recorded.keys() | found.keys()) if recorded.get(n) != found.get(n)]
    return ", ".join(words)


def _architecture(config: dict[str, Any] | None) -> tuple[str | None, int | None]:
    """(architecture, layer count) from config.json; ``None`` where it does not say."""
    if not config:
        return None, None
    architecture = None
    archs = config.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        architecture = archs[0]
    elif isinstance(config.get("model_type"), str):
        architecture = config["model_type"]
    # Multimodal configs keep the language model's depth in text_config.
    for source in (config, config.get("text_config") or {}):
        if not isinstance(source, dict):
            continue
        for key in ("num_hidden_layers", "n_layer", "num_layers"):
            value = source.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return architecture, value
    return architecture, None
