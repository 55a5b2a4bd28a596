"""Register a checkpoint directory (local, ``s3://``, ``http(s)://`` or a Hub commit) as a model version,
every input refused before any write; versions (what changed, which old ones ``gc --versions`` drops).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from mergepipe.analysis.experts import (
    DELTA_FILE,
    LORA,
    describe_checkpoint,
    describe_delta,
    describe_lora,
    is_delta_dir,
    is_lora_dir,
    remote_matches,
    side_changes,
    what_now,
)
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import ModelContent, ModelRecord
from mergepipe.errors import CatalogError, CheckpointError, ConfigError
from mergepipe.storage import hub
from mergepipe.storage.checkpoint import INDEX_FILE, SINGLE_FILE, open_checkpoint, remote_files
from mergepipe.storage.location import Location, RemotePath, is_remote, location, model_location
from mergepipe.storage.lora import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from mergepipe.storage.remote import RemoteClient

# Hugging Face style ids ("org/name-v2", "llama3:8b@rev") but nothing that breaks a shell, a table or a file name.
_MODEL_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$")
#: ``@<number>`` at the end of an id names a version (``math@2``): not allowed in a new name.
_VERSION_SUFFIX = re.compile(r"@[0-9]+$")
#: What ``register`` accepts as ``kind``: full weights, Δ against a base, or a LoRA adapter of a base.
REGISTER_KINDS = ("checkpoint", "delta", LORA)


def check_model_id(model_id: str) -> str:
    """Return ``model_id`` if usable as an id, else raise ``ConfigError``."""
    if not isinstance(model_id, str) or not _MODEL_ID_RE.match(model_id):
        raise ConfigError(
            f"invalid model id {model_id!r}: use 1-200 letters, digits and . _ - : / @ +, "
            "starting with a letter or digit"
        )
    return model_id


#: ``register``'s status for a version an earlier release registered without side files, registered again
#: with the same weight files: its side files are recorded into it.
SIDE_FILES_RECORDED = "side files recorded"


@dataclass(frozen=True)
class Registration:
    """What ``register`` did."""

    record: ModelRecord
    status: str


def register_model(
    catalog: Catalog,
    model_id: str,
    uri: str | Path | RemotePath,
    force: bool = False,
    new_version: bool = False,
    kind: str = "checkpoint",
    base: str | None = None,
    side_versions: bool = False,
) -> ModelRecord:
    """Record the checkpoint at ``uri`` as model ``model_id``; return its record (see ``register``)."""
    return register(
        catalog, model_id, uri, force=force, new_version=new_version, kind=kind, base=base, side_versions=side_versions
    ).record


def register(
    catalog: Catalog,
    name: str,
    uri: str | Path | RemotePath,
    force: bool = False,
    new_version: bool = False,
    kind: str = "checkpoint",
    base: str | None = None,
    side_versions: bool = False,
) -> Registration:
    """Record the checkpoint at ``uri`` under the model name ``name``."""
    check_model_id(name)
    if _VERSION_SUFFIX.search(name):
        raise ConfigError(f"model id {name!r} ends in @<number>, which names a version; choose another id")
    typed = root = _root(uri)
    client = None
    if isinstance(typed, RemotePath):
        client = RemoteClient()
        bare = uri if isinstance(uri, str) and not is_remote(uri) else None  # ORG/NAME, read as a Hub id
        root = client.pin(typed, bare)  # a Hub revision resolved once: its commit is what is compared and recorded
        same = _unchanged_remote(catalog, name, root, client) if (kind, base) == ("checkpoint", None) else None
        if same is not None:
            return Registration(same, "unchanged")
    content, base_hashes = _describe(catalog, name, root, kind, base, client)  # before any write
    with catalog.transaction():
        if base_hashes:  # read to check a delta's base: recorded with it (only unknown hashes are filled)
            catalog.blocks.set_hashes(str(content.record.delta_base), base_hashes)
        latest = catalog.models.latest(name)
        if latest is None:
            catalog.models.add(content)
            return Registration(content.record, "registered")
        same_place = latest.uri == content.record.uri
        same_kind = (latest.kind, latest.delta_base) == (content.record.kind, content.record.delta_base)
        same_weights = same_place and same_kind and tuple(catalog.models.files(latest.id)) == content.files
        if same_weights and latest.side_digests == content.record.side_digests:
            return Registration(latest, "unchanged")
        if same_weights and latest.side_files is None and content.record.side_files is not None:
            catalog.models.record_side_files(latest.id, content.record.side_files)
            return Registration(
                latest.model_copy(update={"side_files": content.record.side_files}), SIDE_FILES_RECORDED
            )
        if new_version or (side_versions and same_weights and latest.kind == "checkpoint"):
            if latest.kind == "snapshot":
                raise CatalogError(
                    f"model '{name}' is a merged model: its versions are published by `mergepipe merge`, "
                    "not registered; choose another id"
                )
            version = latest.version + 1
            record = content.record.model_copy(update={"id": f"{name}@{version}", "name": name, "version": version})
            catalog.models.add(replace(content, record=record))
            return Registration(record, "new version")
        in_use = bool(catalog.models.children(latest.id) or catalog.models.deltas_of(latest.id))
        on_disk = "file sizes or times differ"
        if same_weights and latest.side_digests is not None:
            on_disk = f"side files: {side_changes(latest.side_digests, content.record.side_digests or {})}"
        if not force:
            raise CatalogError(_conflict_message(latest, content, same_place, not in_use, typed, on_disk))
        if in_use and same_place and same_kind:  # retrained in place: its old files are what its users need
            raise CatalogError(
                f"model '{name}' ({latest.label}) changed on disk since registration ({on_disk}); "
                f"{what_now(catalog, latest.id)}"
            )
        users = catalog.snapshots.pending_inputs().get(latest.id)
        if users:
            raise CatalogError(
                f"model '{latest.id}' is an input of a merge in progress (into '{users[0].model_id}', intent "
                f"{users[0].intent_id}); wait for it to finish, or run `mergepipe recover` if it stopped, "
                "then re-register"
            )
        catalog.models.delete(latest.id)
        record = content.record.model_copy(update={"id": latest.id, "name": name, "version": latest.version})
        catalog.models.add(replace(content, record=record))
        return Registration(record, "replaced")


def _root(uri: str | Path | RemotePath) -> Location:
    if isinstance(uri, str):
        return model_location(uri)
    root = location(uri)
    return root.expanduser() if isinstance(root, Path) else root


def _unchanged_remote(catalog: Catalog, name: str, root: RemotePath, client: RemoteClient) -> ModelRecord | None:
    """The latest version of ``name`` when it is the full checkpoint at ``root`` and metadata alone tell that
    nothing changed (the recorded Hub commit; S3 or HTTP files with the recorded sizes and ETags), else None:
    the checkpoint is then described from its headers and compared as any other."""
    latest = catalog.models.latest(name)
    if latest is None or latest.uri != root.uri or (latest.kind, latest.delta_base) != ("checkpoint", None):
        return None
    if latest.side_files is None:
        return None
    if root.hub is not None:
        return latest
    recorded = catalog.models.files(latest.id)
    if any(f.etag is None for f in recorded):
        return None
    weights, sides = remote_files(root, client)
    if [(file, stat.size, stat.etag) for file, stat in weights.items()] != [(f.name, f.size, f.etag) for f in recorded]:
        return None
    records = {f.name: f for f in latest.side_records or ()}
    same_sides = sides.keys() == records.keys() and all(remote_matches(records[n], stat) for n, stat in sides.items())
    return latest if same_sides else None


def _describe(
    catalog: Catalog, name: str, root: Location, kind: str, base: str | None, client: RemoteClient | None = None
) -> tuple[ModelContent, list[tuple[str, int, str]]]:
    """The rows of the checkpoint at ``root`` registered as ``kind``."""
    if kind not in REGISTER_KINDS:
        raise ConfigError(f"--kind must be one of {', '.join(REGISTER_KINDS)}, got {kind!r}")
    if isinstance(root, RemotePath):
        client = client or RemoteClient()
        root = client.pin(root)
        adapter = hub_adapter(root, client) if kind != "delta" and (kind == LORA or base is not None) else None
        if adapter is None:
            return _describe_remote(catalog, name, root, kind, base, client), []
        root = adapter  # a Hub adapter, downloaded: registered from the cache's folder
    if kind == "checkpoint" and is_lora_dir(root):
        if base is None:
            raise ConfigError(f"{root} is a LoRA adapter (adapter_config.json): register it with --base BASE")
        kind = LORA
    if kind == LORA:
        return describe_lora(catalog, name, root, base), []
    if kind != "delta" and base is not None:
        raise ConfigError("--base is for delta checkpoints and LoRA adapters: a full checkpoint needs no base")
    checkpoint = open_checkpoint(root)
    if kind == "delta":
        return describe_delta(catalog, name, checkpoint, base)
    if is_delta_dir(root):
        raise ConfigError(f"{root} is a delta checkpoint ({DELTA_FILE}): register it with --kind delta --base BASE")
    return describe_checkpoint(
        checkpoint, name, kind="checkpoint", block_bytes=catalog.block_bytes, created_at=catalog.now()
    ), []


def _describe_remote(
    catalog: Catalog, name: str, root: RemotePath, kind: str, base: str | None, client: RemoteClient
) -> ModelContent:
    """A remote full checkpoint's rows, from its metadata, JSON files and headers only (delta checkpoints, and
    adapters elsewhere than on the Hub, are registered from local directories)."""
    local_only = (
        f"{root}: delta checkpoints and LoRA adapters are registered from a local directory; download it "
        "and register the copy"
    )
    if root.hub is not None and kind == LORA:
        raise ConfigError(f"{root} is no LoRA adapter: it has no {ADAPTER_CONFIG_FILE}")
    if kind != "checkpoint" or base is not None:
        raise ConfigError(local_only)
    checkpoint = open_checkpoint(root, client)
    if root.hub is not None and ADAPTER_CONFIG_FILE in checkpoint.aux_files:
        raise ConfigError(f"{root} is a LoRA adapter ({ADAPTER_CONFIG_FILE}): register it with --base BASE")
    if {DELTA_FILE, ADAPTER_CONFIG_FILE} & set(checkpoint.aux_files):
        raise ConfigError(local_only)
    return describe_checkpoint(
        checkpoint, name, kind="checkpoint", block_bytes=catalog.block_bytes, created_at=catalog.now()
    )


def hub_adapter(root: RemotePath, client: RemoteClient) -> Path | None:
    """The local folder of the LoRA adapter at the Hub commit ``root``."""
    if root.hub is None:
        return None
    if hub.cached_file(root / ADAPTER_CONFIG_FILE) is None and (
        hub.cached_folder(root, (INDEX_FILE, SINGLE_FILE)) is not None  # the cache has its weights: no request
        or client.stat(root / ADAPTER_CONFIG_FILE) is None
    ):
        return None
    if client.stat(root / ADAPTER_WEIGHTS_FILE) is None:
        raise CheckpointError(
            f"{root} is a LoRA adapter without {ADAPTER_WEIGHTS_FILE} (a pickled adapter_model.bin "
            "is not read); convert it to safetensors, or give a revision that has it"
        )
    return hub.download(root, (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE))


def _conflict_message(
    existing: ModelRecord, content: ModelContent, same_place: bool, replaceable: bool, typed: Location, on_disk: str
) -> str:
    """Why other content under a registered name is refused, and what can be done."""
    new = f"register it as version {existing.version + 1} with --new-version"
    if not replaceable:
        new += f" ({existing.label} cannot be replaced: snapshots or deltas were made from it)"
    moved = _moved_commit(existing.uri, content.record.uri, typed)
    if moved is not None:
        why, force = moved, "--force to point it at the new commit"
    elif (existing.kind, existing.delta_base) != (content.record.kind, content.record.delta_base):
        against = f" against '{existing.delta_base}'" if existing.delta_base is not None else ""
        why, force = f"is registered as a {existing.kind}{against}", "replace it with --force"
    elif existing.fingerprint != content.record.fingerprint:
        why, force = "is already registered with different content", "replace it with --force"
    elif not same_place:
        why, force = f"is already registered from {existing.uri}", "--force to point it at the new location"
    else:
        why, force = f"changed on disk since registration ({on_disk})", "re-register it with --force"
    return f"model '{existing.name}' ({existing.label}) {why}; {new}" + (f", or {force}" if replaceable else "")


def _moved_commit(registered: str, found: str, typed: Location) -> str | None:
    """How the Hub commit ``found`` differs from the ``registered`` one of the same repository, in words."""
    was, now = location(registered), location(found)
    was_hub = was.hub if isinstance(was, RemotePath) else None
    now_hub = now.hub if isinstance(now, RemotePath) else None
    if was_hub is None or now_hub is None or (was_hub.repo_id, was_hub.path) != (now_hub.repo_id, now_hub.path):
        return None
    hub_typed = typed.hub if isinstance(typed, RemotePath) else None
    revision = hub_typed.revision if hub_typed is not None and hub_typed.revision is not None else "main"
    return (
        f"is commit {was_hub.commit} of {was_hub.repo_id}, and {was_hub.repo_id}@{revision} is now commit "
        f"{now_hub.commit}"
    )


@dataclass(frozen=True)
class VersionChanges:
    """What ``newer`` changed relative to ``older``."""

    older: str
    newer: str
    tensors_changed: int  # tensors added, removed, re-laid out, or with a changed block (unhashed: the first three)
    tensors: int  # tensors of the newer version
    blocks_changed: int | None  # None until both versions' blocks are hashed
    blocks: int

    def describe(self) -> str:
        """What changed, in words; until both versions are hashed, which values changed is unknown, never 0."""
        if self.blocks_changed is not None:
            return (
                f"{self.tensors_changed} of {self.tensors} tensors changed, "
                f"{self.blocks_changed} of {self.blocks} blocks"
            )
        unknown = "not known until `mergepipe analyze` hashes the blocks (not hashed yet)"
        if not self.tensors_changed:
            return f"which tensors changed is {unknown}"
        return (
            f"{self.tensors_changed} of {self.tensors} tensors added, removed or re-laid out; which others changed "
            f"is {unknown}"
        )


def changes(catalog: Catalog, older: ModelRecord, newer: ModelRecord) -> VersionChanges:
    """The differences between two versions, from their tensors and block hashes."""
    old_tensors = {t.name: (t.dtype, t.shape) for t in catalog.models.tensors(older.id)}
    new_tensors = {t.name: (t.dtype, t.shape) for t in catalog.models.tensors(newer.id)}
    old_hashes, new_hashes = catalog.blocks.hashes(older.id), catalog.blocks.hashes(newer.id)
    hashed = all(h is not None for per in (*old_hashes.values(), *new_hashes.values()) for h in per)
    changed_tensors = set(old_tensors) ^ set(new_tensors)
    changed_blocks = 0
    for name, layout in new_tensors.items():
        if name not in old_tensors:
            changed_blocks += len(new_hashes.get(name, ()))
            continue
        if old_tensors[name] != layout:
            changed_tensors.add(name)
            changed_blocks += len(new_hashes.get(name, ()))
            continue
        differing = sum(1 for a, b in zip(old_hashes.get(name, ()), new_hashes.get(name, ())) if a != b)
        if hashed and differing:
            changed_tensors.add(name)
            changed_blocks += differing
    return VersionChanges(
        older=older.label,
        newer=newer.label,
        tensors_changed=len(changed_tensors),
        tensors=len(new_tensors),
        blocks_changed=changed_blocks if hashed else None,
        blocks=sum(len(v) for v in new_hashes.values()),
    )


def droppable(catalog: Catalog) -> list[ModelRecord]:
    """Versions of experts that are not the latest of their name and that nothing uses."""
    busy = catalog.snapshots.pending_inputs()
    out = []
    for record in catalog.models.list():
        if record.kind == "snapshot" or catalog.models.latest(record.name) == record:
            continue
        if catalog.models.children(record.id) or catalog.models.deltas_of(record.id) or record.id in busy:
            continue  # in use: kept
        out.append(record)
    return out


def drop(catalog: Catalog, records: list[ModelRecord]) -> tuple[list[ModelRecord], list[Path]]:
    """Remove ``records`` from the catalog (rows, statistics) and the delta-store files MergePipe wrote for them."""
    removed: list[Path] = []
    with catalog.transaction():
        busy = catalog.snapshots.pending_inputs()
        records = [r for r in records if r.id not in busy]
        for record in records:
            for analysis in catalog.stats.analyses(record.id):  # as the expert or as the base
                store = catalog.deltas.find(analysis.expert_id, analysis.base_id)
                if store is not None:
                    removed.append(Path(store.path))
            catalog.models.delete(record.id)
    for path in removed:
        path.unlink(missing_ok=True)
    return records, removed
