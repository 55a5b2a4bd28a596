"""The catalog views: models, show, snapshots, lineage (the snapshot reports are ``examine.py``).

Each opens an existing catalog, looks things up and returns typed values for
the caller to render; nothing here writes. Light: they import the catalog
and little else, so these commands start fast.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from mergepipe.analysis.versions import VersionChanges, changes
from mergepipe.app.session import Catalogish, open_catalog
from mergepipe.catalog import Catalog
from mergepipe.errors import CatalogError
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
from mergepipe.planner.evaluations import most_shared_data

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
    """A publish attempt, with every directory it was published to, its re-materialisation attempts and the
    Hugging Face Hub commits it was pushed to."""

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
            record=record, status=catalog.model_status(record.id), files=catalog.models.files(record.id),
            tensors=catalog.models.tensors(record.id),
            blocks={name: len(b) for name, b in catalog.blocks.by_tensor(record.id).items()},
            parents=catalog.models.parents(record.id), analyses=catalog.stats.analyses(record.id),
            history=[(v, None if i == 0 else changes(catalog, family[i - 1], v)) for i, v in enumerate(family)],
            content_fingerprint=_content_fingerprint(catalog, record.id),
        )


def _content_fingerprint(catalog: Catalog, model_id: str) -> str | None:
    """The model's content fingerprint, or None while its blocks are not all hashed (``analyze``)."""
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
    """The tree of a model's parents (with their versions), recursively; a merged model's earlier
    versions too; for a snapshot pushed to the Hub, its commits there (``hub_locations``: only then);
    what each model scored, where any was evaluated (``_add_scores``: only then)."""
    with open_catalog(db) as catalog:
        record = catalog.models.resolve(ref)
        root: Node = {"id": record.id, "label": label(catalog, record), "role": None,
                      "parents": parent_nodes(catalog, record, seen={record.id})}
        snapshot = catalog.snapshots.of_model(record.id) if record.kind == "snapshot" else None
        pushed = [] if snapshot is None else catalog.snapshots.hub_locations(str(snapshot.id))
        if pushed:
            root["hub_locations"] = [hub.to_json() for hub in pushed]
        _add_scores(catalog, root)
        _add_searches(catalog, root)
        return root


# ---------------------------------------------------------------------- lineage


def label(catalog: Catalog, record: ModelRecord) -> str:
    """A model as lineage shows it: ``name@N`` once its id has several versions, else the id."""
    return record.label if len(catalog.models.versions(record.name)) > 1 else record.id


def parent_nodes(catalog: Catalog, record: ModelRecord, seen: set[str]) -> list[Node]:
    """A model's parents as nodes (id, label, role, their own parents), and its previous version for a
    merged model; a model already on the path is listed without its parents (no cycles)."""
    nodes = []
    for parent_id, role in catalog.models.parents(record.id):
        parent = catalog.models.get(parent_id)
        deeper = parent_nodes(catalog, parent, seen | {parent.id}) if parent.id not in seen else []
        nodes.append({"id": parent.id, "label": label(catalog, parent), "role": role, "parents": deeper})
    if record.kind == "snapshot" and record.version > 1:  # the deployable model's history
        previous = next((v for v in catalog.models.versions(record.name) if v.version == record.version - 1), None)
        if previous is not None and previous.id not in seen:
            nodes.append({"id": previous.id, "label": previous.label, "role": "previous version",
                          "parents": parent_nodes(catalog, previous, seen | {previous.id})})
    return nodes


def _add_scores(catalog: Catalog, root: Node) -> None:
    """Each evaluated model's rows on its node (``evaluations``: a merged model's under its plan digest, any
    other's under its content fingerprint), and on the root the data that compares the most of them
    (``evaluated_on``: the one evaluated for the most, the most recent among ties). Nothing when none was."""
    nodes = _tree(root)
    subjects = {node["id"]: catalog.evaluations.subject_of(catalog.models.get(node["id"])) for node in nodes}
    rows = catalog.evaluations.for_subjects([s.id for s in subjects.values() if s is not None])
    scored = {model_id: rows[s.id] for model_id, s in subjects.items() if s is not None and s.id in rows}
    for node in nodes:
        if node["id"] in scored:
            node["evaluations"] = [r.to_json() for r in scored[node["id"]]]
    data = most_shared_data(scored.values())
    if data is not None:
        root["evaluated_on"] = data.to_json()


def _add_searches(catalog: Catalog, root: Node) -> None:
    """On each node of a snapshot published as the best of a `mergepipe search` study: ``searches`` (study,
    trial, trials, objective)."""
    for node in _tree(root):
        record = catalog.models.get(node["id"])
        snapshot = catalog.snapshots.of_model(record.id) if record.kind == "snapshot" else None
        found = catalog.searches.of_snapshot(snapshot.id) if snapshot is not None and snapshot.id else []
        if found:
            node["searches"] = [{"study": r.study, "trial": r.trial, "trials": r.trials, "objective": r.objective}
                                for r in found]


def _tree(node: Node) -> list[Node]:
    """``node`` and every node under it."""
    return [node, *(below for parent in node["parents"] for below in _tree(parent))]


def _snapshot_view(record: SnapshotRecord, rows: list[LocationRecord], hub: list[HubPush]) -> SnapshotView:
    """A snapshot's committed locations, its other re-materialisation attempts (pending or aborted) and its
    Hub commits."""
    locations = [{"path": r.path, "created_at": r.created_at, "committed_at": r.committed_at,
                  "exists": r.removed_at is None and os.path.isdir(r.path), "removed_at": r.removed_at,
                  "current": r.path == record.out_path}
                 for r in rows if r.status == "committed"]
    attempts = [{"intent_id": r.intent_id, "path": r.path, "status": r.status, "created_at": r.created_at}
                for r in rows if r.status != "committed"]
    return SnapshotView(record, locations, attempts, hub)
