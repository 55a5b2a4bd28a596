"""Delta checkpoints: an expert stored as Δ = E − B against one base (model kind ``delta``).

The format (``mergepipe export-delta`` writes it, ``register --kind delta``
reads it):

* weight files as any checkpoint has them (``model.safetensors``, or shards
  with ``model.safetensors.index.json``), holding tensors with the base's
  names and shapes, each F32, F16 or BF16 (the base's dtype or not);
* a base tensor the delta leaves out has Δ = 0: it costs nothing and is never
  read. A tensor the base does not have, another shape, a non-float dtype,
  or a delta of a tensor the base never merges (integer, F64, FP8 dtypes) is
  refused by name, and nothing is registered;
* ``mergepipe_delta.json`` beside them (or the same object as JSON text under
  the key ``mergepipe_delta`` of the first weight file's safetensors
  metadata) names the base it was taken against::

    {"format": "dense", "version": 1,
     "base_fingerprint": "<sha256>", "block_bytes": 1048576,
     "base_id": "base", "expert_id": "math", "dtype": "F32", "density": null}

  ``format`` "dense": every tensor is a plain dense tensor (a trimmed export
  keeps zeros where it trimmed). ``base_fingerprint`` is the base's content
  fingerprint (its layout and the blake3 of every block) at ``block_bytes``:
  the weights, not only their layout. ``base_id``, ``expert_id``, ``dtype``
  and ``density`` describe where it came from (not checked: another catalog
  may call the base otherwise).

Registering checks ``base_fingerprint`` against the base named by
``--base``. A base not hashed yet, or a fingerprint taken at another
``block_bytes`` than the catalog's, is checked by reading the base's files
once; at the catalog's block size those hashes are recorded with the delta
(every analysis needs them), and a refusal writes nothing.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from mergepipe.analysis.describe import describe_checkpoint
from mergepipe.analysis.opening import open_registered
from mergepipe.analysis.layout import summarise
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import ModelContent, ModelRecord, TensorRecord
from mergepipe.errors import CatalogError, CheckpointError, ConfigError, LayoutMismatchError
from mergepipe.storage.geometry import tensor_blocks
from mergepipe.storage.checkpoint import Checkpoint
from mergepipe.storage.format import MERGEABLE_DTYPES
from mergepipe.storage.hashing import block_digest
from mergepipe.storage.remote_source import CheckpointSource

#: The file that names a delta's base, beside its weights.
DELTA_FILE = "mergepipe_delta.json"
#: The safetensors metadata key that may hold the same object (as JSON text) instead.
DELTA_METADATA_KEY = "mergepipe_delta"
#: The only storage of Δ this version reads and writes: dense tensors (zeros where trimmed).
DENSE = "dense"
FORMAT_VERSION = 1


def is_delta_dir(root: Path) -> bool:
    """Whether ``root`` holds a delta checkpoint's description file."""
    return (Path(root) / DELTA_FILE).is_file()


def delta_info(checkpoint: Checkpoint) -> dict[str, Any]:
    """The delta's description (module docstring), validated; CheckpointError naming what is wrong."""
    if not isinstance(checkpoint.root, Path):
        raise CheckpointError(f"{checkpoint.root}: delta checkpoints are read from a local directory; download it "
                              "and use the copy")
    path = checkpoint.root / DELTA_FILE
    if path.is_file():
        where = str(path)
        try:
            info = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"cannot read {where}: {exc}; export the delta again") from None
    else:
        metadata = checkpoint.files[0].header.metadata or {}
        where = f"the '{DELTA_METADATA_KEY}' metadata of {checkpoint.files[0].path}"
        if DELTA_METADATA_KEY not in metadata:
            raise CheckpointError(
                f"{checkpoint.root} has no {DELTA_FILE} (nor '{DELTA_METADATA_KEY}' safetensors metadata) naming the "
                "base it was taken against; write one (see docs) or export it with `mergepipe export-delta`"
            )
        try:
            info = json.loads(metadata[DELTA_METADATA_KEY])
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{where} is not valid JSON ({exc.msg}); export the delta again") from None
    if not isinstance(info, dict):
        raise CheckpointError(f"{where} is not a JSON object; export the delta again")
    if info.get("format") != DENSE:
        raise CheckpointError(f"{where}: format {info.get('format')!r} is not supported (MergePipe reads "
                              f"{DENSE!r}: dense tensors, zeros where trimmed)")
    fingerprint, block_bytes = info.get("base_fingerprint"), info.get("block_bytes")
    if not isinstance(fingerprint, str) or not fingerprint:
        raise CheckpointError(f"{where} has no base_fingerprint naming the base it was taken against")
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0:
        raise CheckpointError(f"{where}: block_bytes must be the positive block size its base_fingerprint was "
                              f"computed at, got {block_bytes!r}")
    return info


def check_delta_tensors(name: str, checkpoint: Checkpoint, base: ModelRecord,
                        base_tensors: Sequence[TensorRecord]) -> None:
    """LayoutMismatchError naming the first problems unless every tensor of the delta is a float delta of
    a merged base tensor of the same shape."""
    theirs = {t.name: t for t in base_tensors}
    problems = []
    for _, entry in checkpoint.iter_tensors():
        b = theirs.get(entry.name)
        if b is None:
            problems.append(f"extra tensor '{entry.name}' (not in the base)")
        elif tuple(entry.shape) != b.shape:
            problems.append(f"'{entry.name}' has shape {list(entry.shape)}, base {list(b.shape)}")
        elif entry.dtype not in MERGEABLE_DTYPES:
            problems.append(f"'{entry.name}' is {entry.dtype}, not a float delta (F32, F16 or BF16)")
        elif b.dtype not in MERGEABLE_DTYPES:
            problems.append(f"'{entry.name}' is {b.dtype} in the base, which is never merged: leave it out")
    if problems:
        raise LayoutMismatchError(
            f"delta '{name}' does not fit base '{base.id}' ({summarise(problems, 'problem')}); nothing was "
            "registered. Export the delta against this base"
        )


@dataclass(frozen=True)
class DeltaRegistration:
    """What registering a delta writes: its rows, and the base's block hashes computed on the way
    ((tensor, block, blake3) at the catalog's block size; empty when they were known)."""

    content: ModelContent
    base_hashes: list[tuple[str, int, str]]


def base_fingerprint(catalog: Catalog, base: ModelRecord, block_bytes: int) -> tuple[str, list[tuple[str, int, str]]]:
    """The content fingerprint of ``base`` at ``block_bytes``, as ``catalog.blocks.content_fingerprint``
    computes it at the catalog's block size, and the block hashes read for it (module docstring)."""
    if block_bytes == catalog.block_bytes and catalog.blocks.hashed_count(base.id) == base.n_blocks:
        return catalog.blocks.content_fingerprint(base.id), []
    checkpoint = open_registered(catalog, base.id)
    hashes = []
    with CheckpointSource() as source:  # the base may be remote (storage/remote_source.py)
        for _, entry in sorted(checkpoint.iter_tensors(), key=lambda pair: pair[1].name):
            path = checkpoint.file_of(entry.name).path
            for b in tensor_blocks(entry, block_bytes):
                hashes.append((entry.name, b.index, block_digest(source.read(path, b.begin, b.end))))
    digest = hashlib.sha256(base.fingerprint.encode())
    digest.update("".join(f"{tensor}\0{index}\0{h}\n" for tensor, index, h in hashes).encode())
    return digest.hexdigest(), hashes if block_bytes == catalog.block_bytes else []


def describe_delta(catalog: Catalog, name: str, checkpoint: Checkpoint, base_ref: str | None) -> DeltaRegistration:
    """The catalog rows of delta checkpoint ``checkpoint`` against ``base_ref``, after every check (module
    docstring); nothing is written."""
    if base_ref is None:
        raise ConfigError("a delta checkpoint is registered against its base: give --base BASE")
    base = catalog.models.resolve(base_ref)
    if base.kind == "delta":
        raise ConfigError(f"'{base.id}' is a delta checkpoint, not a base; give the model the delta was taken against")
    info = delta_info(checkpoint)
    base_tensors = catalog.models.tensors(base.id)
    check_delta_tensors(name, checkpoint, base, base_tensors)
    fingerprint, base_hashes = base_fingerprint(catalog, base, info["block_bytes"])
    if fingerprint != info["base_fingerprint"]:
        raise CatalogError(
            f"delta '{name}' was taken against another base than '{base.id}' (its {DELTA_FILE} names base "
            f"fingerprint {info['base_fingerprint'][:12]}…, '{base.id}' has another); nothing was registered. "
            "Give the base it was exported from"
        )
    content = describe_checkpoint(checkpoint, name, kind="delta", block_bytes=catalog.block_bytes,
                                  created_at=catalog.now(), geometry=catalog.blocks.by_tensor(base.id),
                                  delta_base=base.id)
    return DeltaRegistration(content, base_hashes)
