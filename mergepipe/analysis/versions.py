"""Versions of a model over time: what changed between two, and which old ones can go.

A retrained expert is registered as a new version of its id
(``register --new-version``); a merged model published again is a new
version of its merged id. ``changes`` compares two versions from the catalog
alone: tensors whose layout differs, and blocks whose content hashes differ
(known once both versions are analysed or hashed). ``droppable`` lists the
versions ``gc --versions`` may remove: checkpoint versions that are not the
latest of their id and that no snapshot used.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mergepipe.catalog import Catalog
from mergepipe.catalog.records import ModelRecord


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
            return (f"{self.tensors_changed} of {self.tensors} tensors changed, "
                    f"{self.blocks_changed} of {self.blocks} blocks")
        unknown = "not known until `mergepipe analyze` hashes the blocks (not hashed yet)"
        if not self.tensors_changed:
            return f"which tensors changed is {unknown}"
        return (f"{self.tensors_changed} of {self.tensors} tensors added, removed or re-laid out; which others changed "
                f"is {unknown}")


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
        older=older.label, newer=newer.label, tensors_changed=len(changed_tensors), tensors=len(new_tensors),
        blocks_changed=changed_blocks if hashed else None, blocks=sum(len(v) for v in new_hashes.values()),
    )


def droppable(catalog: Catalog) -> list[ModelRecord]:
    """Versions of experts (checkpoints, delta checkpoints, LoRA adapters) that are not the latest of their
    id, that no snapshot has as a parent, that no delta checkpoint was taken against and that no merge in
    progress reads (the check `register --force` makes). Snapshots are outputs: they go with their
    snapshot (``snapshots gc``), never here."""
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
    """Remove ``records`` from the catalog (their rows and statistics), and the delta-store files
    MergePipe wrote for them; return the records dropped and the files removed. A record a merge began
    to read since ``droppable`` listed it is kept (checked again under the catalog's write lock). User
    checkpoints are never touched."""
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
