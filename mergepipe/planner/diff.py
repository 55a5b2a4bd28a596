"""What differs between two snapshots: to trace a regression from one merged version to the next.

Inputs come from the two manifests (experts added, removed or at another
version, operator parameters, seed, budget, policy); outputs from the two
published files, tensor by tensor (relative change ``‖B − A‖ / ‖A‖`` in
fp64, one tensor in memory at a time), with the experts whose planned block
reads differ for that tensor. Experts are matched by family (``math`` and
``math@2`` are the same expert at two versions). Each side is named by its
exact version (``merged@1``), never by a name that may since mean another.
Where both were evaluated on the same data, their scores side by side
(stored under each manifest's plan digest).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from safetensors import safe_open

from mergepipe.catalog import Catalog
from mergepipe.manifest.manifest import Manifest
from mergepipe.planner.evaluations import MetricChange, changes
from mergepipe.planner.reuse import committed_snapshot
from mergepipe.sizes import format_bytes
from mergepipe.spec.refs import family
from mergepipe.storage.checkpoint import open_checkpoint


@dataclass(frozen=True)
class TensorChange:
    tensor: str
    relative_change: float  # ‖B − A‖ / ‖A‖ (inf when A is all zeros and B is not)
    experts: list[str]  # families whose planned block reads of this tensor differ


@dataclass
class SnapshotDiff:
    a: str  # "merged@1 (snap-…)": the model at its exact version, and the snapshot id
    b: str
    inputs: list[str] = field(default_factory=list)  # one line per input difference
    tensors: list[TensorChange] = field(default_factory=list)  # every tensor both have, largest change first
    evaluations: list[MetricChange] = field(default_factory=list)  # scores on data both were evaluated on

    @property
    def changed(self) -> list[TensorChange]:
        """The tensors whose values differ (largest change first)."""
        return [t for t in self.tensors if t.relative_change != 0]

    @property
    def unchanged(self) -> int:
        """How many tensors hold the same values in both."""
        return len(self.tensors) - len(self.changed)

    def to_json(self) -> dict:
        return {"a": self.a, "b": self.b, "inputs": self.inputs, "tensors": [asdict(t) for t in self.tensors],
                "unchanged": self.unchanged, "evaluations": [c.to_json() for c in self.evaluations]}


def diff_snapshots(catalog: Catalog, a_ref: str, b_ref: str) -> SnapshotDiff:
    """The difference from snapshot ``a_ref`` to snapshot ``b_ref``."""
    a, b = (committed_snapshot(catalog, ref, "diff") for ref in (a_ref, b_ref))
    ma, mb = (Manifest.from_json(r.manifest_data()) for r in (a, b))
    out = SnapshotDiff(_side(catalog, ma.model_id, a.id), _side(catalog, mb.model_id, b.id), inputs=_inputs(ma, mb))
    scores = catalog.evaluations.for_subjects([ma.plan_digest, mb.plan_digest])
    out.evaluations = changes(scores.get(ma.plan_digest, []), scores.get(mb.plan_digest, []))
    hashes = {e.id: catalog.blocks.hashes(e.id) for e in (*ma.experts, *mb.experts) if catalog.models.exists(e.id)}
    out.tensors = sorted(_tensors(Path(a.out_path), Path(b.out_path), ma, mb, hashes),
                         key=lambda t: (-t.relative_change, t.tensor))
    return out


def _side(catalog: Catalog, model_id: str, snapshot_id: str | None) -> str:
    """``merged@1 (snap-…)``: the exact version, as ``merged`` alone names the latest."""
    model = catalog.models.find(model_id)
    return f"{model_id if model is None else model.label} ({snapshot_id})"


def _inputs(a: Manifest, b: Manifest) -> list[str]:
    lines = []
    if a.base.id != b.base.id or a.base.fingerprint != b.base.fingerprint:
        lines.append(f"base: {a.base.id} -> {b.base.id}")
    old, new = ({family(e.id): e for e in m.experts} for m in (a, b))
    for name in sorted(old.keys() | new.keys()):
        if name not in new:
            lines.append(f"expert removed: {old[name].id}")
        elif name not in old:
            lines.append(f"expert added: {new[name].id}")
        elif old[name].fingerprint != new[name].fingerprint or old[name].id != new[name].id:
            lines.append(f"expert changed: {old[name].id} -> {new[name].id}")
    if a.operator.name != b.operator.name:
        lines.append(f"operator: {a.operator.name} -> {b.operator.name}")
    for key, before, after in (("global parameters", a.operator.params.get("global"), b.operator.params.get("global")),
                               ("seed", a.seed, b.seed), ("policy", a.extra.get("policy"), b.extra.get("policy"))):
        if before != after:
            lines.append(f"{key}: {before} -> {after}")
    if a.budget_bytes != b.budget_bytes:
        lines.append(f"budget: {_budget(a)} -> {_budget(b)}")
    old_p, new_p = ({family(e): p for e, p in m.operator.params.get("experts", {}).items()} for m in (a, b))
    for name in sorted(old_p.keys() & new_p.keys()):
        if old_p[name] != new_p[name]:
            lines.append(f"parameters of {name}: {old_p[name]} -> {new_p[name]}")
    return lines


def _budget(m: Manifest) -> str:
    """A manifest's expert-I/O budget as people wrote it and in bytes (``25% = 3.3 MiB``)."""
    written = m.extra.get("budget")
    if m.budget_bytes is None:
        return "none"
    size = format_bytes(m.budget_bytes)
    return f"{written} = {size}" if isinstance(written, str) and written != size else size


def _tensors(a_dir: Path, b_dir: Path, a: Manifest, b: Manifest, hashes: dict) -> list[TensorChange]:
    ca, cb = open_checkpoint(a_dir), open_checkpoint(b_dir)
    changes = []
    for _, entry in ca.iter_tensors():
        if entry.name not in cb.tensor_files:
            continue
        with safe_open(str(ca.file_of(entry.name).path), "pt") as fa, \
                safe_open(str(cb.file_of(entry.name).path), "pt") as fb:
            x, y = fa.get_tensor(entry.name).double(), fb.get_tensor(entry.name).double()
        if x.shape != y.shape:
            changes.append(TensorChange(entry.name, math.inf, []))
            continue
        norm, delta = float(x.norm()), float((y - x).norm())
        relative = delta / norm if norm else (0.0 if delta == 0 else math.inf)
        changes.append(TensorChange(entry.name, relative, _read_changes(entry.name, a, b, hashes)))
    return changes


def _read_changes(tensor: str, a: Manifest, b: Manifest, hashes: dict) -> list[str]:
    """Families whose planned blocks of ``tensor`` differ between the two snapshots: other blocks read,
    or other content in them (from the catalog's block hashes, when both versions are still registered)."""
    def planned(m: Manifest) -> dict[str, object]:
        out: dict[str, object] = {}
        for expert, ranges in m.reads.get(tensor, {}).items():
            blocks = [i for first, last in ranges for i in range(first, last + 1)]
            known = hashes.get(expert, {}).get(tensor)
            out[family(expert)] = [(i, known[i]) for i in blocks] if known is not None else (expert, blocks)
        return out

    old, new = planned(a), planned(b)
    return sorted(name for name in old.keys() | new.keys() if old.get(name) != new.get(name))
