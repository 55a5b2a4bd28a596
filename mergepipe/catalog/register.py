"""Register a checkpoint directory as a model of the catalog.

Registration is cheap on purpose: it reads only safetensors headers (and
config.json), never tensor data. It records the files with their size and
mtime (so a later change on disk is noticed), every tensor with its byte
range, and the block geometry at the catalog's ``block_bytes``. Content
hashes and delta statistics come later, from ``analyze``.

The directory is opened and validated before the catalog is touched, so a
missing or corrupt checkpoint leaves the catalog exactly as it was.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mergepipe.catalog.records import BlockRecord, FileRecord, ModelRecord, TensorRecord
from mergepipe.errors import CatalogError, ConfigError
from mergepipe.storage.blocks import tensor_blocks
from mergepipe.storage.checkpoint import Checkpoint, open_checkpoint

if TYPE_CHECKING:
    from mergepipe.catalog.db import Catalog

# Hugging Face style ids ("org/name-v2", "llama3:8b@rev") but nothing that
# breaks a shell, a table or a file name.
_MODEL_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$")


@dataclass(frozen=True)
class ModelContent:
    """Everything registration writes for one model, built from its headers."""

    record: ModelRecord
    files: tuple[FileRecord, ...]
    tensors: tuple[TensorRecord, ...]
    blocks: tuple[BlockRecord, ...]


def check_model_id(model_id: str) -> str:
    """Return ``model_id`` if usable as an id, else raise ``ConfigError``."""
    if not isinstance(model_id, str) or not _MODEL_ID_RE.match(model_id):
        raise ConfigError(
            f"invalid model id {model_id!r}: use 1-200 letters, digits and . _ - : / @ +, "
            "starting with a letter or digit"
        )
    return model_id


def fingerprint(files: tuple[FileRecord, ...] | list[FileRecord]) -> str:
    """sha256 over the sorted (name, header sha256, size) of the weight files.

    A header fixes every tensor's name, dtype, shape and offsets, so this is
    a cheap identity of the layout; data changes are caught by size/mtime at
    use time and by block hashes after analysis.
    """
    items = sorted([f.name, f.header_sha256, f.size] for f in files)
    return hashlib.sha256(json.dumps(items, separators=(",", ":")).encode()).hexdigest()


def content_fingerprint(catalog: Catalog, model_id: str) -> str:
    """The layout fingerprint combined with every block's content hash.

    Experts fine-tuned from one base share a layout (so a layout
    fingerprint), but not their bytes: plans record this one, so a plan made
    before a model was re-registered with new weights is seen to be stale.
    Needs the model's blocks hashed (``analyze``); CatalogError otherwise.
    """
    record = catalog.get_model(model_id)
    digest = hashlib.sha256(record.fingerprint.encode())
    for tensor, blocks in sorted(catalog.blocks(model_id).items()):
        for block in blocks:
            if block.hash is None:
                raise CatalogError(f"model '{model_id}' is not analysed yet; run `mergepipe analyze --db ... {model_id}`")
            digest.update(f"{tensor}\0{block.index}\0{block.hash}\n".encode())
    return digest.hexdigest()


def checkpoint_files(checkpoint: Checkpoint) -> tuple[FileRecord, ...]:
    return tuple(
        FileRecord(name=f.name, size=f.size, mtime_ns=f.mtime_ns, header_sha256=f.header.header_sha256)
        for f in checkpoint.files
    )


def describe_checkpoint(
    checkpoint: Checkpoint,
    model_id: str,
    kind: str,
    block_bytes: int,
    created_at: str,
) -> ModelContent:
    """The catalog rows of an opened checkpoint (pure: no I/O, no SQL)."""
    files = checkpoint_files(checkpoint)
    tensors: list[TensorRecord] = []
    blocks: list[BlockRecord] = []
    for ordinal, (file, entry) in enumerate(checkpoint.iter_tensors()):
        tensors.append(
            TensorRecord(
                name=entry.name,
                file=file.name,
                dtype=entry.dtype,
                shape=tuple(entry.shape),
                begin=entry.begin,
                end=entry.end,
                ordinal=ordinal,
            )
        )
        blocks.extend(
            BlockRecord(entry.name, b.index, b.row_start, b.row_end, b.begin, b.end, None)
            for b in tensor_blocks(entry, block_bytes)
        )
    architecture, num_layers = _architecture(checkpoint.config)
    record = ModelRecord(
        id=model_id,
        uri=str(Path(checkpoint.root).resolve()),
        kind=kind,
        fingerprint=fingerprint(files),
        architecture=architecture,
        num_layers=num_layers,
        total_bytes=checkpoint.total_bytes,
        n_tensors=len(tensors),
        n_blocks=len(blocks),
        created_at=created_at,
    )
    return ModelContent(record=record, files=files, tensors=tuple(tensors), blocks=tuple(blocks))


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


def register_model(catalog: Catalog, model_id: str, uri: str | Path, force: bool = False) -> ModelRecord:
    """Record the checkpoint at ``uri`` as model ``model_id``; return its record.

    Registering the same id again is a no-op when nothing changed (same
    location, same headers, same file sizes and mtimes). Anything else is
    refused unless ``force``, which replaces the model and drops its hashes
    and delta statistics (a model that is a parent of a snapshot, or is a
    snapshot, is never replaced: lineage must stay true).
    """
    check_model_id(model_id)
    checkpoint = open_checkpoint(Path(uri).expanduser())  # validates before any write
    content = describe_checkpoint(
        checkpoint, model_id, kind="checkpoint", block_bytes=catalog.block_bytes, created_at=catalog.now()
    )
    with catalog.transaction():
        existing = catalog.find_model(model_id)
        if existing is not None:
            same_place = existing.uri == content.record.uri
            same_files = tuple(catalog.files(model_id)) == content.files
            if same_place and same_files:
                return existing
            if not force:
                raise CatalogError(_conflict_message(existing, content, same_place))
            catalog.delete_model(model_id)
        catalog.add_model(content)
    return content.record


def _conflict_message(existing: ModelRecord, content: ModelContent, same_place: bool) -> str:
    model_id = existing.id
    if existing.fingerprint != content.record.fingerprint:
        return (
            f"model '{model_id}' is already registered with different content; "
            "use a new id or --force"
        )
    if not same_place:
        return (
            f"model '{model_id}' is already registered from {existing.uri}; "
            "use a new id, or --force to point it at the new location"
        )
    return (
        f"model '{model_id}' changed on disk since registration (file sizes or times differ); "
        "re-register it with `mergepipe register --force`"
    )
