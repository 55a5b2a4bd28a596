"""The previous snapshot of an incremental merge, opened and checked before anything is written.

A plan that reuses blocks (``plan.reuse``) names the snapshot and the
manifest hash the catalog recorded when it was published. Before the merge
starts, the snapshot must still be that one: committed in the catalog with
that manifest hash, its manifest intact, every file the size the manifest
says. Every reused block of an output file that is made anew is then checked
as it is copied (against the hash recorded at publish time), so a snapshot
edited after publishing is refused — one line, nothing written — without a
full re-hash of the files the merge does not reuse.

An output file that is wholly the previous snapshot's file of the same name
(``items.whole_file``: the same header, every block reused) is placed as a
file of its own (``storage/linking.py``: a reflink, else a copy by the
kernel), read back once and checked against the hash the previous manifest
records before it is sealed (``engine.place_reused``). No file is ever read
through a symbolic link: a snapshot whose file became one is refused.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from pathlib import Path

from mergepipe.analysis.opening import open_registered
from mergepipe.analysis.provenance import BlockOutput
from mergepipe.catalog import Catalog
from mergepipe.errors import MergePipeError, ModelChangedError, PreviousChangedError, StalePlanError
from mergepipe.manifest.manifest import FileEntry, read_manifest
from mergepipe.spec.plan import Plan
from mergepipe.storage.checkpoint import Checkpoint, open_checkpoint
from mergepipe.storage.linking import open_inside


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
            "Merge without --from, or restore it", reason=str(exc)
        ) from None
    recorded = catalog.snapshots.outputs(reuse.snapshot)
    for tensor, indices in (*reuse.blocks.items(), *reuse.updated.items()):
        for index in indices:
            if (tensor, index) not in recorded:
                raise StalePlanError(f"plan {plan.digest[:12]} is stale: snapshot '{reuse.snapshot}' has no "
                                     f"recorded block {index} of '{tensor}'; run `mergepipe plan --from` again")
    blocks = {key: BlockOutput(found.hash, found.l2, found.drift) for key, found in recorded.items()}
    older = {e: open_registered(catalog, old) for e, old in reuse.replaced.items()}  # checked like any input
    return PreviousSnapshot(checkpoint, blocks, older,
                            {e: catalog.blocks.hashes(old) for e, old in reuse.replaced.items()}, files)


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
