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
from dataclasses import dataclass, replace
from pathlib import Path

from mergepipe.analysis.describe import describe_checkpoint
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import ModelContent, ModelRecord
from mergepipe.errors import CatalogError, ConfigError
from mergepipe.storage.checkpoint import open_checkpoint

# Hugging Face style ids ("org/name-v2", "llama3:8b@rev") but nothing that
# breaks a shell, a table or a file name.
_MODEL_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$")
#: ``@<number>`` at the end of an id names a version (``math@2``): not allowed in a new name.
_VERSION_SUFFIX = re.compile(r"@[0-9]+$")


def check_model_id(model_id: str) -> str:
    """Return ``model_id`` if usable as an id, else raise ``ConfigError``."""
    if not isinstance(model_id, str) or not _MODEL_ID_RE.match(model_id):
        raise ConfigError(
            f"invalid model id {model_id!r}: use 1-200 letters, digits and . _ - : / @ +, "
            "starting with a letter or digit"
        )
    return model_id


@dataclass(frozen=True)
class Registration:
    """What ``register`` did: ``status`` is "registered", "new version", "replaced" or "unchanged"."""

    record: ModelRecord
    status: str


def register_model(catalog: Catalog, model_id: str, uri: str | Path, force: bool = False,
                   new_version: bool = False) -> ModelRecord:
    """Record the checkpoint at ``uri`` as model ``model_id``; return its record (see ``register``)."""
    return register(catalog, model_id, uri, force=force, new_version=new_version).record


def register(catalog: Catalog, name: str, uri: str | Path, force: bool = False,
             new_version: bool = False) -> Registration:
    """Record the checkpoint at ``uri`` under the model name ``name``.

    A new name is version 1. For a registered name, the latest version is
    compared: the same location with the same files is a no-op
    ("unchanged"); other content is refused unless ``new_version`` (it is
    recorded as the next version, ``name@N``, the earlier ones stay) or
    ``force`` (it replaces the latest version and drops its hashes and
    delta statistics; a model that is a parent of a snapshot, or is a
    snapshot, is never replaced: lineage must stay true).
    """
    check_model_id(name)
    if _VERSION_SUFFIX.search(name):
        raise ConfigError(f"model id {name!r} ends in @<number>, which names a version; choose another id")
    checkpoint = open_checkpoint(Path(uri).expanduser())  # validates before any write
    content = describe_checkpoint(
        checkpoint, name, kind="checkpoint", block_bytes=catalog.block_bytes, created_at=catalog.now()
    )
    with catalog.transaction():
        latest = catalog.models.latest(name)
        if latest is None:
            catalog.models.add(content)
            return Registration(content.record, "registered")
        same_place = latest.uri == content.record.uri
        if same_place and tuple(catalog.models.files(latest.id)) == content.files:
            return Registration(latest, "unchanged")
        if new_version:
            if latest.kind == "snapshot":
                raise CatalogError(
                    f"model '{name}' is a merged model: its versions are published by `mergepipe merge`, "
                    "not registered; choose another id"
                )
            version = latest.version + 1
            record = replace(content.record, id=f"{name}@{version}", name=name, version=version)
            catalog.models.add(_with_record(content, record))
            return Registration(record, "new version")
        if not force:
            raise CatalogError(_conflict_message(latest, content, same_place))
        users = catalog.snapshots.pending_inputs().get(latest.id)
        if users:
            raise CatalogError(
                f"model '{latest.id}' is an input of a merge in progress (into '{users[0].model_id}', intent "
                f"{users[0].intent_id}); wait for it to finish, or run `mergepipe recover` if it stopped, "
                "then re-register"
            )
        catalog.models.delete(latest.id)
        record = replace(content.record, id=latest.id, name=name, version=latest.version)
        catalog.models.add(_with_record(content, record))
        return Registration(record, "replaced")


def _with_record(content: ModelContent, record: ModelRecord) -> ModelContent:
    return replace(content, record=record)


def _conflict_message(existing: ModelRecord, content: ModelContent, same_place: bool) -> str:
    label = existing.label
    new = f"register it as version {existing.version + 1} with --new-version"
    if existing.fingerprint != content.record.fingerprint:
        return f"model '{existing.name}' ({label}) is already registered with different content; {new}, or replace it with --force"
    if not same_place:
        return (
            f"model '{existing.name}' ({label}) is already registered from {existing.uri}; {new}, "
            "or --force to point it at the new location"
        )
    return (
        f"model '{existing.name}' ({label}) changed on disk since registration (file sizes or times differ); "
        f"{new}, or re-register it with --force"
    )
