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

import re
from pathlib import Path

from mergepipe.analysis.describe import describe_checkpoint
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import ModelContent, ModelRecord
from mergepipe.errors import CatalogError, ConfigError
from mergepipe.storage.checkpoint import open_checkpoint

# Hugging Face style ids ("org/name-v2", "llama3:8b@rev") but nothing that
# breaks a shell, a table or a file name.
_MODEL_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$")


def check_model_id(model_id: str) -> str:
    """Return ``model_id`` if usable as an id, else raise ``ConfigError``."""
    if not isinstance(model_id, str) or not _MODEL_ID_RE.match(model_id):
        raise ConfigError(
            f"invalid model id {model_id!r}: use 1-200 letters, digits and . _ - : / @ +, "
            "starting with a letter or digit"
        )
    return model_id


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
        existing = catalog.models.find(model_id)
        if existing is not None:
            same_place = existing.uri == content.record.uri
            same_files = tuple(catalog.models.files(model_id)) == content.files
            if same_place and same_files:
                return existing
            if not force:
                raise CatalogError(_conflict_message(existing, content, same_place))
            users = catalog.snapshots.pending_inputs().get(model_id)
            if users:
                raise CatalogError(
                    f"model '{model_id}' is an input of a merge in progress (into '{users[0].model_id}', intent "
                    f"{users[0].intent_id}); wait for it to finish, or run `mergepipe recover` if it stopped, "
                    "then re-register"
                )
            catalog.models.delete(model_id)
        catalog.models.add(content)
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
