"""Where a merge may write: never inside a registered model or a snapshot's directory."""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path

from mergepipe.catalog import Catalog
from mergepipe.errors import ConfigError


def refuse_inside_models(catalog: Catalog, out_path: Path, may_restore: Collection[str] | None = None) -> None:
    """ConfigError if ``out_path`` (resolved) is inside a registered model or a snapshot's directory:
    writing there would damage it.

    Exception: ``out_path`` may be exactly a location of a snapshot in ``may_restore`` (of any snapshot
    when None: the CLI checks before it has a plan, the engine again with it) that no longer exists,
    since re-materialising the snapshot puts back the bytes the catalog says are there."""
    snapshots = catalog.snapshots
    gone = {Path(loc.path) for loc in snapshots.location_intents("committed")
            if (may_restore is None or loc.snapshot_id in may_restore) and not os.path.lexists(loc.path)}
    owners = [(f"model '{m.id}'", Path(m.uri), m.kind == "snapshot") for m in catalog.models.list()]
    owners += [(f"the output of merge intent {s.intent_id}", Path(s.out_path), s.status == "committed")
               for s in snapshots.list() if s.status != "aborted"]
    owners += [(f"a location of snapshot {loc.snapshot_id}", Path(loc.path), loc.status == "committed")
               for loc in snapshots.location_intents() if loc.status != "aborted"]
    for owner, directory, committed in owners:
        if committed and out_path == directory and directory in gone:
            continue
        if committed and out_path == directory and not os.path.lexists(directory):  # a deleted snapshot
            raise ConfigError(
                f"output path {out_path} is where the catalog records {owner}, deleted since: only the same "
                "snapshot may be re-materialised there (by executing its plan again); choose another --out"
            )
        if out_path == directory or directory in out_path.parents:
            raise ConfigError(
                f"output path {out_path} is inside {owner} ({directory}); a merge must not write into a "
                "registered model or snapshot: choose an --out outside it"
            )
