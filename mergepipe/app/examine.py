"""The snapshot reports: verify, explain, diff (and the HTML pages of the last two).

Each opens an existing catalog (``verify`` of a directory needs none), looks
things up and returns typed values for the caller to render; nothing here
writes but the pages asked for (never over a file without ``force``, never
inside a model: ``txn/outpath.py``). None of them loads torch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from mergepipe.app.session import Catalogish, open_catalog
from mergepipe.app.views import Node, label, parent_nodes
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import ModelRecord, SnapshotRecord
from mergepipe.analysis.opening import check_unchanged
from mergepipe.errors import CatalogError, ConfigError, ModelChangedError, PlanError, UnknownModelError, VerifyError
from mergepipe.manifest.manifest import MANIFEST_FILENAME, Manifest
from mergepipe.planner.diff import SnapshotDiff, diff_snapshots
from mergepipe.planner.explain import Explanation
from mergepipe.planner.explain import explain as explain_plan
from mergepipe.planner.html.diff_page import render_diff
from mergepipe.planner.html.explain_page import render_explain
from mergepipe.spec.plan import Plan
from mergepipe.storage.location import RemotePath, location
from mergepipe.txn.outpath import writable_file, write_report
from mergepipe.txn.verify import VerifyReport, verify_snapshot


def verify(target: str | Path, db: Catalogish | None = None) -> VerifyReport:
    """Recompute every file hash and the manifest hash of a snapshot: a directory, or (with ``db``) a
    snapshot id or merged model id, whose manifest hash must also be the catalog's."""
    path = Path(target)
    stored = None
    if not path.is_dir():
        if db is None:
            raise ConfigError(f"{target} is not a directory; give --db to verify a snapshot by id")
        with open_catalog(db) as catalog:
            record = _verified_record(catalog, str(target))
            path, stored = Path(record.out_path), record.manifest_hash
    report = verify_snapshot(path, published=stored is not None)
    if report.ok and stored is not None and report.manifest is not None and report.manifest.manifest_hash != stored:
        report.problems.append(
            f"manifest hash {report.manifest.manifest_hash[:16]} differs from the catalog's {stored[:16]}"
        )
    return report


def explain(db: Catalogish, target: str, *, tensor: str | None = None, html: str | Path | None = None,
            force: bool = False) -> Explanation:
    """Where the budget of ``target`` went (a snapshot id or prefix, a merged model id, or a plan id or
    prefix), per tensor and per expert; ``html``: also written there as one self-contained page."""
    with open_catalog(db) as catalog:
        page = None if html is None else writable_file(catalog, html, force, "--html")
        made, manifest = _explain_target(catalog, target)
        result = explain_plan(catalog, made, manifest, tensor)
        tree = None if page is None else _explained_lineage(catalog, made, manifest)
    if page is not None:
        write_report(page, render_explain(result, tree))
    return result


def diff(db: Catalogish, a: str, b: str, *, html: str | Path | None = None, top: int = 20,
         force: bool = False) -> SnapshotDiff:
    """What differs from snapshot ``a`` to snapshot ``b`` (ids or prefixes, merged model ids, ``name@N``):
    inputs, and every tensor's relative change; ``html``: also written there, charting the ``top`` ones."""
    with open_catalog(db) as catalog:
        page = None if html is None else writable_file(catalog, html, force, "--html")
        result = diff_snapshots(catalog, a, b)
    if page is not None:
        write_report(page, render_diff(result, top))
    return result


def _verified_record(catalog: Catalog, target: str) -> SnapshotRecord:
    """The snapshot ``target`` names (a snapshot id or prefix, or a merged model id); VerifyError
    saying "missing" (not "damaged") when its current directory was deleted."""
    record = catalog.snapshots.find(target)
    if record is None:
        model = _model_or_none(catalog, target)
        record = catalog.snapshots.of_model(model.id) if model is not None else None
    if record is None:
        record = catalog.snapshots.get(target)  # the unknown-snapshot error
    if record.status != "committed":
        return record
    locations = catalog.snapshots.locations(record.id or "")
    removed = next((loc.removed_at for loc in locations if loc.path == record.out_path and loc.removed_at), None)
    if removed is not None or not os.path.lexists(record.out_path):
        replaced = os.path.isfile(os.path.join(record.out_path, MANIFEST_FILENAME))  # another snapshot is there
        how = "replaced by another snapshot" if replaced else "removed with `mergepipe rm`"
        gone = f"was {how} ({removed})" if removed is not None else "no longer exists"
        copies = [loc.path for loc in locations if loc.removed_at is None and os.path.isdir(loc.path)]
        if copies:
            raise VerifyError(f"snapshot {record.id} (model '{snapshot_label(catalog, record)}') is missing at "
                              f"{record.out_path}, which {gone}; a copy is at {copies[0]}: verify that directory")
        raise VerifyError(f"snapshot {record.id} (model '{snapshot_label(catalog, record)}') is missing: "
                          f"{record.out_path} {gone}; {restore_advice(catalog, record)}")
    return record


def restore_advice(catalog: Catalog, record: SnapshotRecord) -> str:
    """How a snapshot whose directory is gone can come back: executing its plan again, when its inputs
    still are the files it was made from; otherwise why it cannot, and what can be done instead
    (``analysis/opening.what_now``). Local inputs are checked as a merge checks them (sizes and times);
    remote ones only when the plan is executed."""
    again = f"`mergepipe execute --db {catalog.path} --plan {record.plan_id[:12]} --out DIR`"
    plan = Plan.from_json(catalog.plans.get(record.plan_id))
    for ref in (plan.base, *plan.experts):
        model = catalog.models.find(ref.id)
        if model is None or _content_fingerprint(catalog, ref.id) != ref.fingerprint:
            return (f"it cannot be re-materialised: its input '{ref.id}' is no longer registered with the content "
                    "it was made from; merge again with the current inputs")
        if isinstance(location(model.uri), RemotePath):
            continue
        try:
            check_unchanged(catalog, ref.id)
        except ModelChangedError as exc:
            return f"{again} would re-materialise it from the exact inputs it records, but {exc}"
    return f"re-materialise it with {again}"


def _content_fingerprint(catalog: Catalog, model_id: str) -> str | None:
    try:
        return catalog.blocks.content_fingerprint(model_id)
    except CatalogError:  # not hashed: no plan was made from it
        return None


def snapshot_label(catalog: Catalog, record: SnapshotRecord) -> str:
    """A snapshot's model as lineage names it (``merged@2`` once the name has several versions)."""
    model = catalog.models.find(record.model_id)
    return record.model_id if model is None else label(catalog, model)


def _explain_target(catalog: Catalog, target: str) -> tuple[Plan, Manifest | None]:
    """The plan (and manifest, for a committed snapshot) that ``target`` names."""
    record = catalog.snapshots.find(target)  # an ambiguous prefix raises
    model = _model_or_none(catalog, target) if record is None else None
    if model is not None:
        record = catalog.snapshots.of_model(model.id)
        if record is None:
            raise ConfigError(
                f"model '{model.id}' is not a merged snapshot; explain takes a snapshot id, "
                "a merged model id or a plan id"
            )
    if record is not None:
        made = Plan.from_json(catalog.plans.get(record.plan_id))
        manifest = Manifest.from_json(json.loads(record.manifest)) if record.manifest else None
        return made, manifest
    plan_id = catalog.plans.find(target)  # an ambiguous prefix raises
    if plan_id is None:
        raise PlanError(
            f"'{target}' is not a snapshot, merged model or plan of {catalog.path}; "
            "list them with `mergepipe snapshots` and `mergepipe models`"
        )
    return Plan.from_json(catalog.plans.get(plan_id)), None


def _model_or_none(catalog: Catalog, ref: str) -> ModelRecord | None:
    """The model ``ref`` names (a name means its latest version), or None."""
    try:
        return catalog.models.resolve(ref)
    except UnknownModelError:
        return None


def _explained_lineage(catalog: Catalog, made: Plan, manifest: Manifest | None) -> Node:
    """Lineage nodes of what explain shows: the snapshot's model, or a plan and its inputs; the snapshot
    an incremental merge was built ``--from`` is one more parent. Ids here are stored ids, each one exact
    version: looked up as they are, never resolved to a latest version."""
    model = None if manifest is None else catalog.models.find(manifest.model_id)
    if model is not None:
        root: Node = {"id": model.id, "label": label(catalog, model), "role": None,
                      "parents": parent_nodes(catalog, model, seen={model.id})}
    else:
        inputs = [(made.base.id, "base"), *((e.id, "expert") for e in made.experts)]
        records = [(r, role) for r, role in ((catalog.models.find(i), role) for i, role in inputs) if r]
        root = {"id": made.digest, "label": f"plan {made.digest[:12]}", "role": None,
                "parents": [{"id": r.id, "label": label(catalog, r), "role": role,
                             "parents": parent_nodes(catalog, r, seen={r.id})} for r, role in records]}
    previous = None if made.reuse is None else catalog.models.find(made.reuse.snapshot)
    if previous is not None and previous.id != root["id"]:
        known = next((n for n in root["parents"] if n["id"] == previous.id), None)
        if known is not None:
            known["role"] = f"{known['role']} · built --from"
        else:
            root["parents"].append({"id": previous.id, "label": label(catalog, previous), "role": "built --from",
                                    "parents": parent_nodes(catalog, previous, seen={root["id"], previous.id})})
    return root
