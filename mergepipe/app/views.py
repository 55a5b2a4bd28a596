"""The read-only calls: ``models``, ``show``, ``snapshots``, ``lineage``, ``verify``, ``explain``, ``diff`` (and
their pages); the catalog and little else (no torch), so these commands start fast."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mergepipe.analysis.experts import check_unchanged
from mergepipe.analysis.register import VersionChanges, changes
from mergepipe.app.reports import Explanation, SnapshotDiff, diff_snapshots, most_shared_data, render_diff
from mergepipe.app.reports import explain as explain_plan
from mergepipe.app.reports import render_explain
from mergepipe.app.session import Catalogish, open_catalog
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import (
    AnalysisRecord,
    FileRecord,
    HubPush,
    LocationRecord,
    ModelRecord,
    ModelStatus,
    SnapshotRecord,
    TensorRecord,
)
from mergepipe.errors import CatalogError, ConfigError, ModelChangedError, PlanError, UnknownModelError, VerifyError
from mergepipe.manifest.manifest import MANIFEST_FILENAME, Manifest
from mergepipe.spec.plan import Plan
from mergepipe.storage.location import RemotePath, location
from mergepipe.txn.outpath import writable_file, write_report
from mergepipe.txn.verify import VerifyReport, verify_snapshot

#: A lineage node: ``{"id", "label", "role", "parents": [nodes]}`` (``lineage --format json``); only where there are
#: any, ``evaluations`` (its model's scores), and on the root ``hub_locations`` and ``evaluated_on``.
Node = dict[str, Any]


@dataclass(frozen=True)
class ModelView:
    """One model as ``show`` lists it: its rows, analyses and the history of its versions."""

    record: ModelRecord
    status: ModelStatus
    files: list[FileRecord]
    tensors: list[TensorRecord]
    blocks: dict[str, int]  # tensor -> number of blocks
    parents: list[tuple[str, str]]
    analyses: list[AnalysisRecord]
    history: list[tuple[ModelRecord, VersionChanges | None]]  # each version, with what changed from the one before
    # layout + every block hash: what plans and manifests record as the model's fingerprint (None: not hashed yet)
    content_fingerprint: str | None = None


@dataclass(frozen=True)
class SnapshotView:
    """A publish attempt, with its directories, its re-materialisation attempts and its Hub commits."""

    record: SnapshotRecord
    # committed: path, times, whether it exists now, when `mergepipe rm` removed it (or None), whether it is current
    locations: list[dict[str, Any]]
    attempts: list[dict[str, Any]]  # pending or aborted re-materialisations
    hub: list[HubPush] = field(default_factory=list)


def models(db: Catalogish) -> list[tuple[ModelRecord, ModelStatus]]:
    """Every registered model with its analysis state."""
    with open_catalog(db) as catalog:
        return [(m, catalog.model_status(m.id)) for m in catalog.models.list()]


def show(db: Catalogish, ref: str) -> ModelView:
    """The model ``ref`` names (a name: its latest version)."""
    with open_catalog(db) as catalog:
        record = catalog.models.resolve(ref)
        family = catalog.models.versions(record.name)
        return ModelView(
            record=record,
            status=catalog.model_status(record.id),
            files=catalog.models.files(record.id),
            tensors=catalog.models.tensors(record.id),
            blocks={name: len(b) for name, b in catalog.blocks.by_tensor(record.id).items()},
            parents=catalog.models.parents(record.id),
            analyses=catalog.stats.analyses(record.id),
            history=[(v, None if i == 0 else changes(catalog, family[i - 1], v)) for i, v in enumerate(family)],
            content_fingerprint=_content_fingerprint(catalog, record.id),
        )


def _content_fingerprint(catalog: Catalog, model_id: str) -> str | None:
    try:
        return catalog.blocks.content_fingerprint(model_id)
    except CatalogError:
        return None


def snapshots(db: Catalogish) -> list[SnapshotView]:
    """Every publish attempt: committed snapshots with their locations, pending and aborted intents."""
    with open_catalog(db) as catalog:
        records = catalog.snapshots.list()
        by_snapshot: dict[str, list[LocationRecord]] = {}
        for row in catalog.snapshots.location_intents():
            by_snapshot.setdefault(row.snapshot_id, []).append(row)
        pushed: dict[str, list[HubPush]] = {}
        for hub in catalog.snapshots.hub_locations():
            pushed.setdefault(hub.snapshot_id, []).append(hub)
    return [_snapshot_view(r, by_snapshot.get(r.id or "", []), pushed.get(r.id or "", [])) for r in records]


def lineage(db: Catalogish, ref: str) -> Node:
    """The tree of a model's parents and earlier versions, with Hub commits, scores and searches where any."""
    with open_catalog(db) as catalog:
        record = catalog.models.resolve(ref)
        root = node(catalog, record, None)
        snapshot = catalog.snapshots.of_model(record.id) if record.kind == "snapshot" else None
        pushed = [] if snapshot is None else catalog.snapshots.hub_locations(str(snapshot.id))
        if pushed:
            root["hub_locations"] = [hub.model_dump() for hub in pushed]
        _add_scores(catalog, root)
        _add_searches(catalog, root)
        return root


def label(catalog: Catalog, record: ModelRecord) -> str:
    """A model as lineage shows it: ``name@N`` once its id has several versions, else the id."""
    return record.label if len(catalog.models.versions(record.name)) > 1 else record.id


def node(catalog: Catalog, record: ModelRecord, role: str | None, seen: frozenset[str] = frozenset()) -> Node:
    """A lineage node: ``record`` and, unless on the path already (``seen``), its parents and previous version."""
    nodes, here = [], seen | {record.id}
    for parent_id, parent_role in [] if record.id in seen else catalog.models.parents(record.id):
        nodes.append(node(catalog, catalog.models.get(parent_id), parent_role, here))
    if record.kind == "snapshot" and record.version > 1 and record.id not in seen:  # the deployable model's history
        previous = next((v for v in catalog.models.versions(record.name) if v.version == record.version - 1), None)
        if previous is not None and previous.id not in here:
            nodes.append(node(catalog, previous, "previous version", here))
    return {"id": record.id, "label": label(catalog, record), "role": role, "parents": nodes}


def _add_scores(catalog: Catalog, root: Node) -> None:
    """Each evaluated model's rows on its node, and on the root the data that compares the most of them."""
    nodes = _tree(root)
    subjects = {node["id"]: catalog.evaluations.subject_of(catalog.models.get(node["id"])) for node in nodes}
    rows = catalog.evaluations.for_subjects([s.id for s in subjects.values() if s is not None])
    scored = {model_id: rows[s.id] for model_id, s in subjects.items() if s is not None and s.id in rows}
    for node in nodes:
        if node["id"] in scored:
            node["evaluations"] = [r.model_dump() for r in scored[node["id"]]]
    data = most_shared_data(scored.values())
    if data is not None:
        root["evaluated_on"] = data.to_json()


def _add_searches(catalog: Catalog, root: Node) -> None:
    for node in _tree(root):
        record = catalog.models.get(node["id"])
        snapshot = catalog.snapshots.of_model(record.id) if record.kind == "snapshot" else None
        found = catalog.searches.of_snapshot(snapshot.id) if snapshot is not None and snapshot.id else []
        if found:
            node["searches"] = [r.model_dump(include={"study", "trial", "trials", "objective"}) for r in found]


def _tree(node: Node) -> list[Node]:
    return [node, *(below for parent in node["parents"] for below in _tree(parent))]


def _snapshot_view(record: SnapshotRecord, rows: list[LocationRecord], hub: list[HubPush]) -> SnapshotView:
    shown = {"path", "created_at", "committed_at", "removed_at"}
    locations = [
        {
            **r.model_dump(include=shown),
            "exists": not r.removed_at and os.path.isdir(r.path),
            "current": r.path == record.out_path,
        }
        for r in rows
        if r.status == "committed"
    ]
    attempts = [
        r.model_dump(include={"intent_id", "path", "status", "created_at"}) for r in rows if r.status != "committed"
    ]
    return SnapshotView(record, locations, attempts, hub)


def verify(target: str | Path, db: Catalogish | None = None) -> VerifyReport:
    """Recompute a snapshot's file hashes and manifest hash (a directory, or with ``db`` an id)."""
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


def explain(
    db: Catalogish, target: str, *, tensor: str | None = None, html: str | Path | None = None, force: bool = False
) -> Explanation:
    """Where the budget of ``target`` went (a snapshot, merged model or plan); ``html``: also as a page."""
    with open_catalog(db) as catalog:
        page = None if html is None else writable_file(catalog, html, force, "--html")
        made, manifest = _explain_target(catalog, target)
        result = explain_plan(catalog, made, manifest, tensor)
        tree = None if page is None else _explained_lineage(catalog, made, manifest)
    if page is not None:
        write_report(page, render_explain(result.to_json(), tree))
    return result


def diff(
    db: Catalogish, a: str, b: str, *, html: str | Path | None = None, top: int = 20, force: bool = False
) -> SnapshotDiff:
    """What differs from snapshot ``a`` to snapshot ``b``; ``html``: also as a page charting the ``top`` ones."""
    with open_catalog(db) as catalog:
        page = None if html is None else writable_file(catalog, html, force, "--html")
        result = diff_snapshots(catalog, a, b)
    if page is not None:
        write_report(page, render_diff(result.to_json(), top))
    return result


def find_snapshot(catalog: Catalog, target: str) -> tuple[SnapshotRecord | None, ModelRecord | None]:
    """The snapshot ``target`` names (an id or prefix, else a model's own snapshot), and the model it names."""
    record = catalog.snapshots.find(target)  # an ambiguous prefix raises
    if record is not None:
        return record, None
    try:
        model = catalog.models.resolve(target)
    except UnknownModelError:
        return None, None
    return catalog.snapshots.of_model(model.id), model


def _verified_record(catalog: Catalog, target: str) -> SnapshotRecord:
    """The snapshot ``target`` names; VerifyError saying "missing" when its directory is gone."""
    record = find_snapshot(catalog, target)[0] or catalog.snapshots.get(target)  # get: the unknown-snapshot error
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
            raise VerifyError(
                f"snapshot {record.id} (model '{snapshot_label(catalog, record)}') is missing at "
                f"{record.out_path}, which {gone}; a copy is at {copies[0]}: verify that directory"
            )
        raise VerifyError(
            f"snapshot {record.id} (model '{snapshot_label(catalog, record)}') is missing: "
            f"{record.out_path} {gone}; {restore_advice(catalog, record)}"
        )
    return record


def restore_advice(catalog: Catalog, record: SnapshotRecord) -> str:
    """How a snapshot whose directory is gone can come back, or why it cannot."""
    again = f"`mergepipe execute --db {catalog.path} --plan {record.plan_id[:12]} --out DIR`"
    plan = Plan.from_json(catalog.plans.get(record.plan_id))
    for ref in (plan.base, *plan.experts):
        model = catalog.models.find(ref.id)
        if model is None or _content_fingerprint(catalog, ref.id) != ref.fingerprint:
            return (
                f"it cannot be re-materialised: its input '{ref.id}' is no longer registered with the content "
                "it was made from; merge again with the current inputs"
            )
        if isinstance(location(model.uri), RemotePath):
            continue
        try:
            check_unchanged(catalog, ref.id)
        except ModelChangedError as exc:
            return f"{again} would re-materialise it from the exact inputs it records, but {exc}"
    return f"re-materialise it with {again}"


def snapshot_label(catalog: Catalog, record: SnapshotRecord) -> str:
    model = catalog.models.find(record.model_id)
    return record.model_id if model is None else label(catalog, model)


def _explain_target(catalog: Catalog, target: str) -> tuple[Plan, Manifest | None]:
    """The plan (and manifest, for a committed snapshot) that ``target`` names."""
    record, model = find_snapshot(catalog, target)
    if model is not None and record is None:
        raise ConfigError(
            f"model '{model.id}' is not a merged snapshot; explain takes a snapshot id, a merged model id or a plan id"
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


def _explained_lineage(catalog: Catalog, made: Plan, manifest: Manifest | None) -> Node:
    """Lineage nodes of what explain shows, with the snapshot an incremental merge was built ``--from``."""
    model = None if manifest is None else catalog.models.find(manifest.model_id)
    if model is not None:
        root = node(catalog, model, None)
    else:
        inputs = [(made.base.id, "base"), *((e.id, "expert") for e in made.experts)]
        records = [(r, role) for r, role in ((catalog.models.find(i), role) for i, role in inputs) if r]
        parents = [node(catalog, r, role) for r, role in records]
        root = {"id": made.digest, "label": f"plan {made.digest[:12]}", "role": None, "parents": parents}
    previous = None if made.reuse is None else catalog.models.find(made.reuse.snapshot)
    if previous is not None and previous.id != root["id"]:
        known = next((n for n in root["parents"] if n["id"] == previous.id), None)
        if known is not None:
            known["role"] = f"{known['role']} · built --from"
        else:
            root["parents"].append(node(catalog, previous, "built --from", frozenset({root["id"]})))
    return root
