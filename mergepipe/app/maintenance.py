"""`gc` and `recover`: clearing what interrupted work left, never a committed snapshot or a user file.

``recover`` finishes or rolls back interrupted publishes (every writing call
runs it first anyway). ``gc`` recovers, then removes aborted staging
directories (only those provably MergePipe's: ``txn/staging.py``) and the
staging files of delta-store builds that were killed; it keeps plans saved
with ``plan --save`` unless asked (``plans``); with ``versions`` it lists,
and with ``drop`` also drops, old expert versions that no snapshot used and
no running merge reads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from mergepipe.analysis.deltastore import sweep_abandoned
from mergepipe.analysis.versions import drop as drop_versions
from mergepipe.analysis.versions import droppable
from mergepipe.app.session import Catalogish, open_catalog
from mergepipe.catalog.records import ModelRecord
from mergepipe.errors import ConfigError
from mergepipe.txn.recover import RecoverReport
from mergepipe.txn.recover import recover as recover_publishes
from mergepipe.txn.staging import remove_staging


@dataclass
class Collected:
    """What ``gc`` did."""

    removed_dirs: list[Path] = field(default_factory=list)  # aborted staging directories
    swept: list[Path] = field(default_factory=list)  # killed delta-store builds' staging files
    saved_plans: int = 0  # plans no merge ran: deleted with ``plans``, else kept
    plans_deleted: bool = False
    old_versions: list[ModelRecord] = field(default_factory=list)  # listed (``versions``)
    dropped: list[ModelRecord] = field(default_factory=list)  # and dropped (``drop``)
    store_files: list[Path] = field(default_factory=list)  # delta-store files of dropped versions
    problems: list[str] = field(default_factory=list)


def recover(db: Catalogish) -> RecoverReport:
    """Finish or roll back interrupted publishes (idempotent)."""
    with open_catalog(db) as catalog:
        return recover_publishes(catalog)


def gc(db: Catalogish, *, versions: bool = False, drop: bool = False, plans: bool = False) -> Collected:
    """Collect what interrupted work left (see the module docstring)."""
    if drop and not versions:
        raise ConfigError("--yes only confirms --versions; nothing else gc does needs confirming")
    done = Collected()
    with open_catalog(db) as catalog:
        report = recover_publishes(catalog)  # first: a merge that died no longer holds its inputs
        done.removed_dirs, done.problems = list(report.removed), list(report.problems)
        if versions:
            done.old_versions = droppable(catalog)
            if drop and done.old_versions:
                done.dropped, done.store_files = drop_versions(catalog, done.old_versions)
        for record in catalog.snapshots.list():
            staging = Path(record.staging_path)
            if record.status != "aborted" or not os.path.lexists(staging):
                continue
            problem = remove_staging(staging, record.intent_id, Path(record.out_path))
            if problem is None:
                done.removed_dirs.append(staging)
            else:
                done.problems.append(problem)
        done.plans_deleted = plans
        done.saved_plans = catalog.plans.delete_unreferenced() if plans else catalog.plans.count_unreferenced()
        store_dirs = sorted({Path(path).parent for path in catalog.deltas.paths()})
    for directory in store_dirs:  # where this catalog's delta stores live: a killed build's staging files
        done.swept.extend(sweep_abandoned(directory) if directory.is_dir() else ())
    return done
