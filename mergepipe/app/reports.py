"""What the reports show: a plan's or snapshot's explanation, two snapshots' difference, stored scores compared,
the text lines the CLI prints, and the HTML pages (``templates/``) of explain, diff, search and bisect."""

from __future__ import annotations

import html
import math
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from safetensors import safe_open

from mergepipe.analysis.experts import expert_block_bytes, expert_shared_bytes
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import EvaluationRecord, SearchRecord
from mergepipe.errors import ConfigError, visible
from mergepipe.manifest.manifest import Manifest
from mergepipe.planner.reuse import committed_snapshot
from mergepipe.sizes import format_bytes
from mergepipe.spec.copy_map import CopyMap
from mergepipe.spec.plan import Plan
from mergepipe.spec.settings import family, layer_index
from mergepipe.storage.checkpoint import open_checkpoint

#: How many characters of a data digest a report shows: enough to tell data sets apart by eye.
DIGEST_CHARS = 12


@dataclass(frozen=True)
class TensorExplanation:
    tensor: str
    layer: int | None
    blocks: int
    changed: dict[str, int]  # expert -> changed (non-identical) blocks
    read: dict[str, int]  # expert -> planned block reads
    planned_bytes: int
    retained_energy: float  # of the tensor's weighted delta energy, in [0, 1]; 1.0 when nothing changed
    store: dict[str, str]  # expert -> what is read from its delta store ("sketch 2", "exact"), if anything
    reused_blocks: int = 0  # output blocks copied from the previous snapshot
    reused_bytes: int = 0  # of planned_bytes, what that reuse saves (the rest is recomputed)
    updated_blocks: int = 0  # output blocks delta-updated from the previous snapshot
    energy: dict[str, float] = field(default_factory=dict)  # expert -> its weighted delta energy Σ (w‖Δ_b‖)²
    kept_energy: dict[str, float] = field(default_factory=dict)  # expert -> the part of it the plan reads


@dataclass(frozen=True)
class ExpertExplanation:
    expert: str
    planned_bytes: int
    realized_bytes: int | None
    full_bytes: int
    share: float  # of the planned expert bytes
    reused_bytes: int = 0  # of planned_bytes, what reuse of the previous snapshot saves


@dataclass(frozen=True)
class Explanation:
    plan_id: str
    snapshot_id: str | None
    operator: str
    policy: str
    budget_bytes: int
    planned_expert_bytes: int
    realized_expert_bytes: int | None
    full_expert_bytes: int
    error_bound: float
    error_bound_kind: str
    error_share: float
    retained_energy: float  # the whole plan's share of the weighted delta energy Σ (w‖Δ‖)² it reads
    tensors: tuple[TensorExplanation, ...]
    experts: tuple[ExpertExplanation, ...]
    reused_from: str | None = None  # the previous snapshot of an incremental merge (its model id)
    reused_snapshot: str | None = None  # its snapshot id (None: the catalog no longer holds that snapshot)
    reused_output_bytes: int = 0  # output bytes copied from it
    updated_output_bytes: int = 0  # output bytes delta-updated from it
    update_bound: float = 0.0  # how far those may be from a merge from scratch (Frobenius)
    estimate: float | None = None  # first-order deviation; None: a plan made before it existed
    seconds: dict[str, float] = field(default_factory=dict)  # a snapshot's realized seconds per phase
    output_bytes_by_method: dict[str, int] = field(default_factory=dict)  # an incremental snapshot's
    predicted: dict[str, float] = field(default_factory=dict)  # the seconds predicted, if any were
    tensor_filter: str | None = None  # ``tensors`` are those whose name contains it (all without one)
    tensor_count: int = 0  # the plan's tensors, shown or not
    shown_retained_energy: float = 1.0  # the tensors shown: the share of their weighted delta energy read
    shown_planned_bytes: int = 0  # the tensors shown: their planned expert bytes
    evaluations: tuple[EvaluationRecord, ...] = ()  # what the merge scored (stored under the plan's digest)
    searches: tuple[SearchRecord, ...] = ()  # the `mergepipe search` studies whose best trial this snapshot is

    def to_json(self) -> dict:
        data = asdict(self)
        return {
            **data,
            "tensors": list(data["tensors"]),
            "experts": list(data["experts"]),
            "evaluations": [r.model_dump() for r in self.evaluations],
            "searches": [r.model_dump() for r in self.searches],
        }


def explain(catalog: Catalog, plan: Plan, manifest: Manifest | None = None, tensor: str | None = None) -> Explanation:
    """Where the budget of ``plan`` went, per tensor and per expert; ``tensor`` filters the tensors shown."""
    realized = manifest.cost.realized if manifest is not None else None
    copies = plan.copies
    rows, experts = _copied(catalog, plan, copies, realized) if copies is not None else _merged(catalog, plan, realized)
    shown = [r for r in rows if tensor is None or tensor in r.tensor]
    if not shown and tensor is not None:
        raise ConfigError(
            f"no output tensor of this passthrough has {tensor!r} in its name"
            if copies is not None
            else f"no tensor of '{plan.base.id}' has {tensor!r} in its name; see `mergepipe show {plan.base.id}`"
        )

    def retained(rows: Sequence[TensorExplanation]) -> float:
        energy = sum(sum(r.energy.values()) for r in rows)
        return sum(sum(r.kept_energy.values()) for r in rows) / energy if energy else 1.0

    previous = catalog.snapshots.of_model(plan.reuse.snapshot) if plan.reuse else None  # as the engine finds it
    return Explanation(
        plan_id=plan.digest,
        snapshot_id=None if manifest is None else manifest.snapshot_id,
        operator=plan.operator,
        policy=plan.policy,
        budget_bytes=plan.budget_bytes,
        planned_expert_bytes=plan.cost.expert_bytes,
        realized_expert_bytes=None if realized is None else realized.expert_bytes,
        full_expert_bytes=plan.cost.full_expert_bytes,
        error_bound=plan.error_bound,
        error_bound_kind=plan.error_bound_kind,
        error_share=plan.error_share,
        estimate=plan.estimate,
        retained_energy=retained(rows),
        tensors=tuple(shown),
        experts=experts,
        seconds={} if realized is None else dict(realized.seconds),
        output_bytes_by_method={} if realized is None else dict(realized.output_bytes_by_method),
        predicted=dict(manifest.cost.estimated.seconds or {})
        if manifest is not None
        else ({} if plan.seconds is None else plan.seconds.flat()),
        tensor_filter=tensor,
        tensor_count=len(rows),
        shown_retained_energy=retained(shown),
        shown_planned_bytes=sum(row.planned_bytes for row in shown),
        evaluations=tuple(catalog.evaluations.for_subjects([plan.digest]).get(plan.digest, [])),
        searches=() if manifest is None else tuple(catalog.searches.of_snapshot(manifest.snapshot_id)),
        reused_from=plan.reuse.snapshot if plan.reuse else None,
        reused_output_bytes=plan.reuse.output_bytes if plan.reuse else 0,
        updated_output_bytes=plan.reuse.updated_bytes if plan.reuse else 0,
        update_bound=plan.reuse.bound if plan.reuse else 0.0,
        reused_snapshot=previous.id
        if plan.reuse and previous and previous.manifest_hash == plan.reuse.manifest_hash
        else None,
    )


def _merged(catalog: Catalog, plan: Plan, realized: Any) -> tuple[list[TensorExplanation], tuple]:
    """Every tensor's row of a merge, and every expert's."""
    base_id, ids = plan.base.id, [e.id for e in plan.experts]
    blocks = catalog.blocks.by_tensor(base_id)
    deltas = {e: catalog.stats.block_deltas(e, base_id) for e in ids}
    weights = {e: abs(plan.merge.scalar_weight(e)) for e in ids}
    stores = {e: (catalog.deltas.chunks(e, base_id), catalog.deltas.stages(e, base_id)) for e in plan.stores}
    own = {e: expert_block_bytes(catalog, e, base_id) for e in ids}  # None: the base's block sizes
    shared_by = {e: expert_shared_bytes(catalog, e) for e in ids}  # a LoRA's A: once per tensor read
    full = dict.fromkeys(ids, 0)
    rows = []
    for name in (t.name for t in catalog.models.tensors(base_id)):
        changed, read, store, energy, kept = {}, {}, {}, {}, {}
        sizes = {e: [b.nbytes for b in blocks[name]] if (mine := own[e]) is None else mine[name] for e in ids}
        shared = {e: shared_by[e].get(name, 0) for e in ids}
        planned = 0
        for e in ids:
            per_block = deltas[e].get(name, [])
            changed_blocks = [d.index for d in per_block if not d.identical]
            full[e] += sum(sizes[e][i] for i in changed_blocks) + (shared[e] if changed_blocks else 0)
            reads = set(plan.reads_of(name, e))
            changed[e], read[e] = len(changed_blocks), len(reads)
            planned += sum(sizes[e][i] for i in reads) + (shared[e] if reads else 0)
            stages, chunks = plan.stages_of(name, e), plan.chunks_of(name, e)
            energy[e] = kept[e] = 0.0
            if stages or chunks:  # read from its delta store
                store_chunks, store_stages = stores[e][0].get(name, []), stores[e][1].get(name, [])
                energy[e] = weights[e] ** 2 * sum(c.energy for c in store_chunks)
                left = weights[e] ** 2 * store_stages[stages - 1].residual if stages else 0.0
                planned += sum(p.nbytes for p in (store_stages[:stages] if stages else store_chunks[:chunks]))
                store[e], kept[e] = f"sketch {stages}" if stages else "exact", max(energy[e] - left, 0.0)
                continue
            for d in per_block:
                if not d.identical and d.l2 is not None:
                    part = (weights[e] * d.l2) ** 2
                    energy[e] += part
                    kept[e] += part if d.index in reads else 0.0
        total, retained = sum(energy.values()), sum(kept.values())
        reused = set(plan.reuse.blocks.get(name, ())) if plan.reuse else set()
        if reused and (store or name in plan.tensor_level):  # merged whole: reused whole
            saved = planned
        else:
            saved = sum(sizes[e][i] for e in ids for i in plan.reads_of(name, e) if i in reused)
            saved += sum(shared[e] for e in ids if plan.reads_of(name, e) and reused.issuperset(plan.reads_of(name, e)))
        rows.append(
            TensorExplanation(
                tensor=name,
                layer=layer_index(name),
                blocks=len(blocks[name]),
                changed=changed,
                read=read,
                planned_bytes=planned,
                retained_energy=retained / total if total else 1.0,
                store=store,
                reused_blocks=len(reused),
                reused_bytes=saved,
                updated_blocks=len(plan.reuse.updated.get(name, ())) if plan.reuse else 0,
                energy=energy,
                kept_energy=kept,
            )
        )
    by_model, planned_total = plan.cost.expert_bytes_by_model, plan.cost.expert_bytes
    experts = tuple(
        ExpertExplanation(
            expert=e,
            planned_bytes=by_model.get(e, 0),
            realized_bytes=None if realized is None else realized.expert_bytes_by_model.get(e, 0),
            full_bytes=full[e],
            share=by_model.get(e, 0) / planned_total if planned_total else 0.0,
            reused_bytes=plan.reuse.saved.get(e, 0) if plan.reuse else 0,
        )
        for e in ids
    )
    return rows, experts


def _copied(catalog: Catalog, plan: Plan, copies: CopyMap, realized: Any) -> tuple[list[TensorExplanation], tuple]:
    """A passthrough's rows: every source model a column, each output tensor read whole from its source."""
    sources = list(dict.fromkeys([plan.base.id, *copies.models]))
    blocks = {m: catalog.blocks.by_tensor(m) for m in sources}
    by_source = dict.fromkeys(sources, 0)
    rows = []
    for c in copies.copies:
        own, layer = blocks[c.model][c.tensor], layer_index(c.tensor)
        by_source[c.model] += sum(b.nbytes for b in own)
        rows.append(
            TensorExplanation(
                tensor=c.output,
                layer=layer_index(c.output),
                blocks=len(own),
                changed=dict.fromkeys(sources, 0),
                read={m: len(own) if m == c.model else 0 for m in sources},
                planned_bytes=sum(b.nbytes for b in own),
                retained_energy=1.0,
                store={m: ("copy" if layer is None else f"layer {layer}") if m == c.model else "-" for m in sources},
            )
        )
    read = None if realized is None else {plan.base.id: realized.base_bytes, **realized.expert_bytes_by_model}
    total = sum(by_source.values())
    experts = tuple(
        ExpertExplanation(m, n, None if read is None else read.get(m, 0), n, n / total if total else 0.0)
        for m, n in by_source.items()
    )
    return rows, experts


def output_text(by_method: Mapping[str, int], snapshot: str | None, previous: str | None) -> str | None:
    """How an incremental snapshot got its output bytes, in one line; None for any other."""
    if not by_method:
        return None
    source = f"snapshot {snapshot}" if snapshot else f"the previous snapshot of '{previous}'"
    linked = f"{format_bytes(by_method['linked'])} linked, " if by_method["linked"] else ""  # an earlier MergePipe's
    return (
        f"{format_bytes(sum(by_method.values()))}: {linked}{format_bytes(by_method['cloned'])} reflinked and "
        f"{format_bytes(by_method['copied'])} copied by the kernel from {source}, each checked against its "
        f"recorded hash, {format_bytes(by_method['written'])} written"
    )


def time_rows(seconds: Mapping[str, float], by_method: Mapping[str, int]) -> list[tuple[str, str]]:
    """A merge's realized seconds as (label, text) rows that add up to the millisecond shown."""
    ms = {key: round(value * 1000) for key, value in seconds.items()}
    total, hashing, publishing = ms.pop("total", None), ms.pop("hash", 0), ms.pop("publish", None)
    startup, writing = ms.pop("startup", None), ms.pop("write", None)
    phases = (("read_wait", "read wait"), ("compute", "compute"), ("write_wait", "write wait"))
    workers = [(label, ms.pop(key)) for key, label in phases if key in ms]
    busy = sum(value for _, value in workers)
    parts = " + ".join(f"{label} {_s(value)}" for label, value in workers) or "none recorded"
    copies = " (including any kernel copies of reused blocks)" if by_method.get("copied", 0) > 0 else ""
    alongside = "" if writing is None else f"; writing {_s(writing)}{copies} ran alongside, on the writer thread"
    rows = []
    if total is not None:
        streaming = total - hashing - (publishing or 0)
        if busy <= streaming:
            detail = f"{parts} + set-up {_s(streaming - busy)} (staging, opening the inputs, creating the files)"
        else:
            detail = f"{parts}: the workers' seconds, summed over work units that ran in parallel"
        rows += [
            (
                "time",
                f"total {_s(total)} = streaming {_s(streaming)} + hashing {_s(hashing)} + publishing "
                f"{_s(publishing or 0)}",
            ),
            ("  streaming", detail + alongside),
        ]
    elif workers or hashing:  # a manifest on disk is sealed before publishing: no total
        rows.append(
            (
                "time",
                f"streaming: {parts} by the workers{alongside}; then hashing {_s(hashing)} (the "
                "manifest is sealed before publishing, so it holds no total)",
            )
        )
    if ms:
        rows.append(("  also recorded", ", ".join(f"{k} {_s(v)}" for k, v in ms.items())))
    if startup is not None:
        rows.append(
            (
                "start-up",
                f"{_s(startup)} from process start to the first read (interpreter, imports, "
                "catalog, planning and the set-up): shown apart, since the merge's time starts "
                "inside it",
            )
        )
    return rows


def _s(milliseconds: int) -> str:
    return f"{milliseconds / 1000:.3f} s"


@dataclass(frozen=True)
class MetricChange:
    data_name: str
    data_digest: str
    metric: str
    a: float
    b: float
    delta: float


@dataclass(frozen=True)
class EvaluatedData:
    digest: str
    name: str

    def to_json(self) -> dict[str, str]:
        return {"data_digest": self.digest, "data_name": self.name}


def changes(a: Sequence[EvaluationRecord], b: Sequence[EvaluationRecord]) -> list[MetricChange]:
    """Every metric measured for both ``a`` and ``b`` on data both were evaluated on, by data name and metric."""
    before = {(r.data_digest, r.metric): r for r in a}
    out = []
    for r in sorted(b, key=lambda r: (r.data_name, r.data_digest, r.metric)):
        if (old := before.get((r.data_digest, r.metric))) is not None:
            out.append(MetricChange(r.data_name, r.data_digest, r.metric, old.value, r.value, r.value - old.value))
    return out


def most_shared_data(per_subject: Iterable[Sequence[EvaluationRecord]]) -> EvaluatedData | None:
    """The data evaluated for the most subjects, the most recently evaluated among ties; None when none was."""
    subjects: dict[str, set[str]] = {}
    latest: dict[str, EvaluationRecord] = {}
    for rows in per_subject:
        for r in rows:
            subjects.setdefault(r.data_digest, set()).add(r.subject)
            if r.data_digest not in latest or r.created_at > latest[r.data_digest].created_at:
                latest[r.data_digest] = r
    if not latest:
        return None
    digest = max(latest, key=lambda d: (len(subjects[d]), latest[d].created_at, d))
    return EvaluatedData(digest, latest[digest].data_name)


def value_text(value: float) -> str:
    """A score as reports print it: six significant digits (``nan`` for a diverged model)."""
    return f"{value:.6g}"


def delta_text(value: float) -> str:
    return f"{value:+.6g}"


def compact(rows: Sequence[EvaluationRecord], data: EvaluatedData) -> str:
    """``loss=2.5 perplexity=12.1825``: the metrics of ``rows`` on ``data``, by metric; empty if none."""
    mine = sorted((r for r in rows if r.data_digest == data.digest), key=lambda r: r.metric)
    return " ".join(f"{r.metric}={value_text(r.value)}" for r in mine)


def params_text(params: Mapping[str, Any], digits: int = 3) -> str:
    """A search trial's parameters in one line (``weight math=0.603, density=0.5``)."""
    return ", ".join(f"{k}={v:.{digits}g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


@dataclass(frozen=True)
class TensorChange:
    tensor: str
    relative_change: float  # ‖B − A‖ / ‖A‖ (inf when A is all zeros and B is not, or the shapes differ)
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
        return [t for t in self.tensors if t.relative_change != 0]

    @property
    def unchanged(self) -> int:
        return len(self.tensors) - len(self.changed)

    def to_json(self) -> dict:
        return {**asdict(self), "unchanged": self.unchanged}


def diff_snapshots(catalog: Catalog, a_ref: str, b_ref: str) -> SnapshotDiff:
    """The difference from snapshot ``a_ref`` to snapshot ``b_ref``: inputs, and every tensor's relative change."""
    a, b = (committed_snapshot(catalog, ref, "diff") for ref in (a_ref, b_ref))
    ma, mb = (Manifest.from_json(r.manifest_data()) for r in (a, b))
    sides = []
    for m, record in ((ma, a), (mb, b)):  # ``merged@1 (snap-…)``: the exact version, as `merged` names the latest
        model = catalog.models.find(m.model_id)
        sides.append(f"{m.model_id if model is None else model.label} ({record.id})")
    scores = catalog.evaluations.for_subjects([ma.plan_digest, mb.plan_digest])
    hashes = {e.id: catalog.blocks.hashes(e.id) for e in (*ma.experts, *mb.experts) if catalog.models.exists(e.id)}
    tensors = _tensor_changes(Path(a.out_path), Path(b.out_path), ma, mb, hashes)
    return SnapshotDiff(
        sides[0],
        sides[1],
        inputs=_input_changes(ma, mb),
        tensors=sorted(tensors, key=lambda t: (-t.relative_change, t.tensor)),
        evaluations=changes(scores.get(ma.plan_digest, []), scores.get(mb.plan_digest, [])),
    )


def _input_changes(a: Manifest, b: Manifest) -> list[str]:
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
    for key, before, after in (
        ("global parameters", a.operator.params.get("global"), b.operator.params.get("global")),
        ("seed", a.seed, b.seed),
        ("policy", a.extra.get("policy"), b.extra.get("policy")),
    ):
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
    """A manifest's budget as written and in bytes (``25% = 3.3 MiB``)."""
    if m.budget_bytes is None:
        return "none"
    written, size = m.extra.get("budget"), format_bytes(m.budget_bytes)
    return f"{written} = {size}" if isinstance(written, str) and written != size else size


def _tensor_changes(a_dir: Path, b_dir: Path, a: Manifest, b: Manifest, hashes: dict) -> list[TensorChange]:
    """Every tensor both snapshots have: its relative change, and the families whose planned blocks differ."""

    def planned(m: Manifest, tensor: str) -> dict[str, object]:
        out: dict[str, object] = {}
        for expert, ranges in m.reads.get(tensor, {}).items():
            blocks = [i for first, last in ranges for i in range(first, last + 1)]
            known = hashes.get(expert, {}).get(tensor)
            out[family(expert)] = [(i, known[i]) for i in blocks] if known is not None else (expert, blocks)
        return out

    ca, cb = open_checkpoint(a_dir), open_checkpoint(b_dir)
    out = []
    for _, entry in ca.iter_tensors():
        if entry.name not in cb.tensor_files:
            continue
        with (
            safe_open(str(ca.file_of(entry.name).path), "pt") as fa,
            safe_open(str(cb.file_of(entry.name).path), "pt") as fb,
        ):
            x, y = fa.get_tensor(entry.name).double(), fb.get_tensor(entry.name).double()
        if x.shape != y.shape:
            out.append(TensorChange(entry.name, math.inf, []))
            continue
        norm, delta = float(x.norm()), float((y - x).norm())
        old, new = planned(a, entry.name), planned(b, entry.name)
        experts = sorted(name for name in old.keys() | new.keys() if old.get(name) != new.get(name))
        out.append(TensorChange(entry.name, delta / norm if norm else (0.0 if delta == 0 else math.inf), experts))
    return out


# ------------------------------------------------------------------ HTML pages

CHAR_PX = 7.3  # advance of one monospace character at the charts' 12 px (DejaVu Sans Mono: 0.602 em), rounded up
PANEL_PX = 1082  # a panel's content on a wide window: main's 1160 px less its padding, the panel's and its border
LABEL_CHARS, VALUE_CHARS, NAME_CHARS = 48, 56, 32  # a row label, the text beside a bar, names side by side
MIN_BAR_PX = 260  # bars are shortened to this to fit long labels in a panel, no further: past it, the chart scales
EMPTY_FILL = "#e4e7eb"  # a heatmap cell with nothing to show
_VIRIDIS = ((0x44, 0x01, 0x54), (0x3B, 0x52, 0x8B), (0x21, 0x91, 0x8C), (0x5E, 0xC9, 0x62), (0xFD, 0xE7, 0x25))
_ROLE_COLOURS = {"base": "#52606d", "expert": "#2f6fba", "previous version": "#d9822b", "built --from": "#8e44ad"}


def text_width(text: str) -> float:
    """Width in pixels of ``text`` in the charts' monospace font (wide characters two cells)."""
    cells = (
        0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in visible(text)
    )
    return sum(cells) * CHAR_PX


def shorten(text: object, cap: int) -> str:
    """``text`` as shown, or past ``cap`` characters its start and end joined by an ellipsis."""
    full = visible(text)
    head = (cap - 1) // 2
    return full if len(full) <= cap else full[:head] + "…" + full[len(full) - (cap - 1 - head) :]


class Label(NamedTuple):
    full: str
    shown: str
    width: float


def _label(text: str, cap: int) -> Label:
    shown = shorten(text, cap)
    return Label(visible(text), shown, text_width(shown))


def percent(share: float) -> str:
    """A share in [0, 1] in whole percents, one decimal near 0% and 100%: "100%" and "0%" mean exactly that."""
    p = 100 * share
    if p in (0.0, 100.0) or 1 <= p <= 99:
        return f"{p:.0f}%"
    if p < 1:
        return f"{math.ceil(p * 10) / 10:.1f}%" if p >= 0.1 else "<0.1%"
    return f"{math.floor(p * 10) / 10:.1f}%" if p <= 99.9 else ">99.9%"


def scale_colour(value: float) -> str:
    """``#rrggbb`` of a share in [0, 1] (clamped) on the viridis scale: dark = 0, yellow = 1."""
    v = min(max(value, 0.0), 1.0) * (len(_VIRIDIS) - 1)
    i = min(int(v), len(_VIRIDIS) - 2)
    return "#" + "".join(f"{round(a + (b - a) * (v - i)):02x}" for a, b in zip(_VIRIDIS[i], _VIRIDIS[i + 1]))


def _ink(fill: str) -> str:
    r, g, b = (int(fill[i : i + 2], 16) for i in (1, 3, 5))
    return "#111111" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "#ffffff"


def render(page: str, **context: Any) -> str:
    """``templates/{page}.html`` with ``context``; every value shown escaped, hidden characters spelled out."""
    import jinja2  # here: the text views start without it
    from markupsafe import Markup

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("mergepipe.app"),
        autoescape=True,
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
        finalize=lambda v: v if isinstance(v, Markup) else Markup(html.escape(visible(v), quote=True)),
    )
    env.filters.update(
        bytes=format_bytes, percent=percent, score=value_text, params=params_text, visible=visible, short=shorten
    )
    env.filters.update(f1=lambda x: f"{x:.1f}", text_width=text_width)
    env.tests["finite"] = math.isfinite
    env.globals.update(scale_colour=scale_colour, ink=_ink, empty_fill=EMPTY_FILL, output_text=output_text)
    return env.get_template(f"{page}.html").render(**context)


def _heatmap(rows: Sequence[tuple[str, str]], columns: Sequence[str], cells: list) -> dict[str, Any]:
    """A heatmap's geometry (64 × 22 px cells), its column names slanted at 40° when they do not fit."""
    labels = [_label(label, LABEL_CHARS) for _, label in rows]
    heads = [_label(c, NAME_CHARS) for c in columns]
    left = max([label.width for label in labels] + [40]) + 12
    slant = any(h.width + 8 > 64 for h in heads)
    top, beyond = 24.0, 0.0
    if slant:
        sin, cos = math.sin(math.radians(40)), math.cos(math.radians(40))
        top = max(h.width for h in heads) * sin + 18
        reach = max(left + (j + 0.5) * 64 + h.width * cos for j, h in enumerate(heads))
        beyond = max(reach - (left + 64 * len(columns)), 0.0) + 4
    return {
        **{"columns": columns, "heads": heads, "left": left, "top": top, "slant": slant},
        "rows": [(key, label, row) for (key, _), label, row in zip(rows, labels, cells)],
        "width": math.ceil(left + 64 * len(columns) + 2 + beyond),
        "height": math.ceil(top + 22 * len(rows) + 2),
    }


def _bars(name: str, groups: Sequence[tuple[str, Sequence[tuple[str, float, str, str]]]]) -> dict[str, Any]:
    """Horizontal bars ``(label, [(series, value, text, colour)])`` that fit a panel beside their labels."""
    finite = [v for _, bars in groups for _, v, _, _ in bars if math.isfinite(v)]
    labels = [_label(label, LABEL_CHARS) for label, _ in groups]
    texts = [[_label(text, VALUE_CHARS) for _, _, text, _ in bars] for _, bars in groups]
    left = max([label.width for label in labels] + [40]) + 14
    room = max([t.width for row in texts for t in row] + [0]) + 16
    length = min(520, max(math.floor(PANEL_PX - left - room), MIN_BAR_PX))
    group_height = 14 * max([len(bars) for _, bars in groups] + [1]) + 10
    return {
        **{"name": name, "length": length, "left": left, "top": max(finite + [0.0]), "group_height": group_height},
        "groups": [
            (group, label, [(s, v, text, c) for (s, v, _, c), text in zip(bars, row)])
            for (group, bars), label, row in zip(groups, labels, texts)
        ],
        "hatch": len(finite) < sum(len(bars) for _, bars in groups),
        "width": math.ceil(left + length + room),
        "height": math.ceil(group_height * len(groups) + 4),
    }


def _lineage(root: Mapping) -> dict[str, Any]:
    """The lineage nodes as boxes and arrows: each model once, in the column of its longest path to the root."""
    labels: dict[str, Label] = {}
    depth: dict[str, int] = {}
    edges: list[tuple[str, str, str]] = []  # (parent, child, role)

    def collect(node: Mapping, path: tuple[str, ...]) -> None:
        ident = str(node["id"])
        labels.setdefault(ident, _label(str(node["label"]), NAME_CHARS))
        depth[ident] = max(depth.get(ident, 0), len(path))
        for parent in node["parents"]:
            edge = (str(parent["id"]), ident, str(parent["role"]))
            if edge[0] in path or edge[0] == ident:  # a cycle must not loop the drawing
                continue
            if edge not in edges:
                edges.append(edge)
            collect(parent, (*path, ident))

    collect(root, ())
    last = max(depth.values())
    columns: list[list[str]] = [[] for _ in range(last + 1)]
    for ident in labels:
        columns[last - depth[ident]].append(ident)
    tallest = max(len(column) for column in columns)
    boxes: dict[str, tuple[float, float, float]] = {}  # x, y, width
    lanes = []  # per column: x, width, the heights of the free lanes between its boxes
    x = 8.0
    for column in columns:
        width = max(labels[i].width + 24 for i in column)
        for k, ident in enumerate(column):
            boxes[ident] = (x, 8 + (tallest - len(column)) * 21 + k * 42, width)
        ys = sorted(boxes[i][1] for i in column)
        lanes.append((x, width, [ys[0] - 6, *(y + 36 for y in ys)]))
        x += width + 110
    ports: dict[tuple[int, tuple[str, str, str]], float] = {}
    for side, other in ((0, 1), (1, 0)):  # where each arrow leaves its parent (0) and enters its child (1)
        for ident in labels:
            mine = sorted((e for e in edges if e[side] == ident), key=lambda e: boxes[e[other]][1])
            step = min(6.0, 22 / max(len(mine) - 1, 1))
            ports.update(
                {(side, e): boxes[ident][1] + 15 + (k - (len(mine) - 1) / 2) * step for k, e in enumerate(mine)}
            )
    drawn = []
    for edge in edges:
        parent, child, role = edge
        sy, ey = ports[0, edge], ports[1, edge]
        here, end = (boxes[parent][0] + boxes[parent][2], sy), (boxes[child][0] - 7, ey)
        first, stop = last - depth[parent] + 1, last - depth[child]
        path = f"M {here[0]:.1f} {here[1]:.1f}"
        for k in range(first, stop):
            lx, lw, free = lanes[k]
            lane = min(free, key=lambda y: abs(y - (sy + (ey - sy) * (k - first + 1) / (stop - first + 1))))
            path += _curve(here, (lx - 8, lane)) + f" L {lx + lw + 8:.1f} {lane:.1f}"
            here = (lx + lw + 8, lane)
        ex = end[0] + 7
        colour = _ROLE_COLOURS["built --from"] if "built --from" in role else _ROLE_COLOURS.get(role, "#9aa5b1")
        drawn.append(
            {
                **{"parent": parent, "child": child, "role": role, "colour": colour},
                **{"parent_label": labels[parent].full, "child_label": labels[child].full},
                "path": path + _curve(here, end),
                "head": f"{ex:.1f},{ey:.1f} {ex - 7:.1f},{ey - 3.5:.1f} {ex - 7:.1f},{ey + 3.5:.1f}",
            }
        )
    return {
        "root": str(root["id"]),
        "edges": drawn,
        "boxes": [
            {
                **{"id": ident, "label": labels[ident], "x": x, "y": y, "width": w},
                "tooltip": ident if labels[ident].full == visible(ident) else f"{labels[ident].full} ({ident})",
            }
            for ident, (x, y, w) in ((i, boxes[i]) for i in labels)
        ],
        "legend": [
            (d["colour"], d["role"]) for d in sorted({e["role"]: e for e in drawn}.values(), key=lambda e: e["role"])
        ],
        "width": math.ceil(x - 110 + 8),
        "height": math.ceil(16 + tallest * 42 - 12),
    }


def _curve(a: tuple[float, float], b: tuple[float, float]) -> str:
    bend = max((b[0] - a[0]) / 2, 20)
    return f" C {a[0] + bend:.1f} {a[1]:.1f}, {b[0] - bend:.1f} {b[1]:.1f}, {b[0]:.1f} {b[1]:.1f}"


def render_explain(data: Mapping[str, Any], lineage: Mapping | None = None, top: int = 15) -> str:
    """The page of an explanation (``Explanation.to_json()``) and its lineage nodes, if any."""
    experts = [e["expert"] for e in data["experts"]]
    shares: dict[tuple[str, str], dict[str, Any]] = {}  # (layer, expert) -> its totals there
    for t in data["tensors"]:
        for e in experts:
            key = "other" if t["layer"] is None else str(t["layer"])
            s = shares.setdefault((key, e), {"changed": 0, "read": 0, "energy": 0.0, "kept": 0.0, "store": False})
            s["changed"] += t["changed"].get(e, 0)
            s["read"] += t["read"].get(e, 0)
            s["energy"] += t["energy"].get(e, 0.0)
            s["kept"] += t["kept_energy"].get(e, 0.0)
            s["store"] = s["store"] or e in t["store"]
    rows = [(str(n), f"layer {n}") for n in sorted({t["layer"] for t in data["tensors"] if t["layer"] is not None})]
    rows += [("other", "other")] if any(t["layer"] is None for t in data["tensors"]) else []
    series = [("changed", "full_bytes", "#bcccdc", "changed bytes (a full read)")]
    series += [
        ("planned", "planned_bytes", "#2f6fba", "planned"),
        ("realized", "realized_bytes", "#243b53", "realized (read)"),
    ]
    series = series if data["realized_expert_bytes"] is not None else series[:2]
    bars = [(e["expert"], [(s, float(e[k]), format_bytes(e[k]), c) for s, k, c, _ in series]) for e in data["experts"]]
    total = sum(sum(t["energy"].values()) for t in data["tensors"])
    left = [(sum(t["energy"].values()) - sum(t["kept_energy"].values()), t) for t in data["tensors"]]
    left = sorted([(o, t) for o, t in left if o > 0], key=lambda pair: (-pair[0], pair[1]["tensor"]))[:top]
    omitted = [
        [t["tensor"], "-" if t["layer"] is None else str(t["layer"]), percent(o / total), percent(t["retained_energy"])]
        + [format_bytes(t["planned_bytes"])]
        + [t["store"].get(e) or f"{t['read'].get(e, 0)}/{t['changed'].get(e, 0)}" for e in experts]
        for o, t in left
    ]
    if data["snapshot_id"] is not None:
        what = str(lineage["label"]) if lineage is not None else data["snapshot_id"]
        subtitle = f"snapshot {data['snapshot_id']} · plan {data['plan_id'][:16]}"
    else:
        what, subtitle = f"plan {data['plan_id'][:12]}", f"plan {data['plan_id']} (not executed)"
    return render(
        "explain",
        title=f"MergePipe explain: {what}",
        subtitle=f"{subtitle} · operator {data['operator']} · policy {data['policy']}",
        e=data,
        heatmap_shares=_heatmap(rows, experts, [[shares[key, e] for e in experts] for key, _ in rows]),
        bytes={**_bars("bytes", bars), "legend": [(c, text) for _, _, c, text in series]},
        graph=None if lineage is None else _lineage(lineage),
        omitted=omitted,
    )


def render_diff(data: Mapping[str, Any], top: int = 20) -> str:
    """The page of a diff (``SnapshotDiff.to_json()``), charting the ``top`` changed tensors."""
    changed = [t for t in data["tensors"] if t["relative_change"] != 0][:top]
    finite = [t["relative_change"] for t in data["tensors"] if math.isfinite(t["relative_change"])]
    bars = [
        (t["tensor"], [("relative change", t["relative_change"], _change(t), "#2f6fba" if t["experts"] else "#9fb3c8")])
        for t in changed
    ]
    return render(
        "diff",
        title="MergePipe diff",
        subtitle=f"{data['a']} → {data['b']}",
        d=data,
        largest=f"{max(finite):.3e}" if finite else "-",
        chart=_bars("relative-change", bars) if bars else None,
    )


def _change(t: Mapping[str, Any]) -> str:
    value = t["relative_change"]
    text = "∞ (A is zero or shapes differ)" if math.isinf(value) else f"{value:.3e}"
    return text + (f"  ({', '.join(t['experts'])})" if t["experts"] else "")
