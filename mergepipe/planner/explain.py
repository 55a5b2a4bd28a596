"""Explain a plan (or the snapshot it produced): where the budget went.

Per tensor: how many changed blocks each expert has, how many the plan
reads (or which level of the expert's delta store: ``sketch N``, ``exact``),
and the share of the weighted delta energy ``Σ (w_i ||Δi_b||)²`` those reads
retain (a sketch retains its tensor's energy minus the residual it leaves).
Per expert: planned bytes, realized bytes (from the manifest, when a
snapshot is explained) and their share of the total. For an incremental
merge (``plan.reuse``), per tensor and per expert: the planned bytes that
reuse of the previous snapshot saves (the rest is recomputed), and the
output blocks copied from it; for its snapshot, how the output's bytes got
there as the manifest records them (``output_text``: reflinked or
kernel-copied from the previous snapshot and checked, hard-linked by an
earlier MergePipe, or written). Each tensor row also
carries every expert's weighted delta energy and the part of it the plan
keeps, so a report can aggregate by layer and expert; a snapshot's
explanation carries the seconds per phase its merge took (``time_rows``: as
rows that add up; writing includes the kernel's copies), and both
carry what the merge scored where it was evaluated (stored under the plan's
digest: a plan evaluated in memory and its snapshot share them).

The summary is the whole plan's; with a tensor filter the explanation also
totals the tensors shown, apart, so a header never describes rows it does
not sum.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from safetensors import safe_open

from mergepipe.analysis.experts import expert_block_bytes, expert_shared_bytes
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import BlockDelta, EvaluationRecord, SearchRecord
from mergepipe.errors import ConfigError
from mergepipe.manifest.manifest import Manifest
from mergepipe.manifest.manifest import RealizedCost
from mergepipe.planner.reuse import committed_snapshot
from mergepipe.sizes import format_bytes
from mergepipe.spec.plan import Plan
from mergepipe.spec.settings import family, layer_index
from mergepipe.storage.checkpoint import open_checkpoint


@dataclass(frozen=True)
class TensorExplanation:
    tensor: str
    layer: int | None
    blocks: int
    changed: dict[str, int]  # expert -> changed (non-identical) blocks
    read: dict[str, int]  # expert -> planned block reads
    planned_bytes: int
    retained_energy: float  # fraction in [0, 1]; 1.0 when nothing changed
    store: dict[str, str]  # expert -> what is read from its delta store ("sketch 2", "exact"), if anything
    reused_blocks: int = 0  # output blocks copied from the previous snapshot
    reused_bytes: int = 0  # of planned_bytes, what that reuse saves (the rest is recomputed)
    updated_blocks: int = 0  # output blocks delta-updated from the previous snapshot
    energy: dict[str, float] = field(default_factory=dict)  # expert -> its weighted delta energy Σ (w‖Δ_b‖)²
    kept_energy: dict[str, float] = field(default_factory=dict)  # expert -> the part of it the plan reads

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ExpertExplanation:
    expert: str
    planned_bytes: int
    realized_bytes: int | None
    full_bytes: int
    share: float  # of the planned expert bytes
    reused_bytes: int = 0  # of planned_bytes, what reuse of the previous snapshot saves

    def to_json(self) -> dict:
        return asdict(self)


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
    estimate: float | None = None  # first-order deviation (planner/bound.py); None: a plan made before it existed
    seconds: dict[str, float] = field(default_factory=dict)  # a snapshot's realized seconds per phase
    # an incremental merge's snapshot: its output bytes by how they got there (manifest/parts.OUTPUT_METHODS,
    # adding up to the output's bytes); empty for any other snapshot, and for a plan
    output_bytes_by_method: dict[str, int] = field(default_factory=dict)
    # the seconds predicted (spec/seconds.Prediction.flat): the plan's, or what the snapshot's merge predicted;
    # empty when none were
    predicted: dict[str, float] = field(default_factory=dict)
    tensor_filter: str | None = None  # ``tensors`` are those whose name contains it (all without one)
    tensor_count: int = 0  # the plan's tensors, shown or not
    shown_retained_energy: float = 1.0  # the tensors shown: the share of their weighted delta energy read
    shown_planned_bytes: int = 0  # the tensors shown: their planned expert bytes
    evaluations: tuple[EvaluationRecord, ...] = ()  # what the merge scored, by data and metric (none: never evaluated)
    searches: tuple[SearchRecord, ...] = ()  # the `mergepipe search` studies whose best trial this snapshot is

    def to_json(self) -> dict:
        data = asdict(self)
        data["tensors"] = [t.to_json() for t in self.tensors]
        data["experts"] = [e.to_json() for e in self.experts]
        data["evaluations"] = [r.model_dump() for r in self.evaluations]
        data["searches"] = [r.model_dump() for r in self.searches]
        return data


def explain(catalog: Catalog, plan: Plan, manifest: Manifest | None = None, tensor: str | None = None) -> Explanation:
    """Build the explanation of ``plan`` from the catalog's statistics.

    ``tensor`` keeps only tensors whose name contains it (ConfigError if none does).
    """
    if plan.copies is not None:
        return _copied(catalog, plan, manifest, tensor)
    base_id = plan.base.id
    expert_ids = [e.id for e in plan.experts]
    blocks = catalog.blocks.by_tensor(base_id)
    deltas = {e: catalog.stats.block_deltas(e, base_id) for e in expert_ids}
    weights = {e: abs(plan.merge.scalar_weight(e)) for e in expert_ids}
    stores = {e: (catalog.deltas.chunks(e, base_id), catalog.deltas.stages(e, base_id)) for e in plan.stores}
    own = {e: expert_block_bytes(catalog, e, base_id) for e in expert_ids}  # None: the base's block sizes
    shared = {e: expert_shared_bytes(catalog, e) for e in expert_ids}  # a LoRA's A: once per tensor read
    rows = []
    full_by_expert = {e: 0 for e in expert_ids}
    total_energy = kept_energy = shown_energy = shown_kept = 0.0
    names = [record.name for record in catalog.models.tensors(base_id)]
    for name in names:
        sizes = {e: [b.nbytes for b in blocks[name]] if (mine := own[e]) is None else mine[name] for e in expert_ids}
        for e in expert_ids:
            changed = [d.index for d in deltas[e].get(name, []) if not d.identical]
            full_by_expert[e] += sum(sizes[e][i] for i in changed) + (shared[e].get(name, 0) if changed else 0)
        costs = (sizes, {e: shared[e].get(name, 0) for e in expert_ids})
        row, energy, kept = _tensor_row(
            plan, name, costs, {e: deltas[e].get(name, []) for e in expert_ids}, weights, stores
        )
        total_energy += energy
        kept_energy += kept
        if tensor is None or tensor in name:
            rows.append(row)
            shown_energy += energy
            shown_kept += kept
    if tensor is not None and not rows:
        raise ConfigError(f"no tensor of '{base_id}' has {tensor!r} in its name; see `mergepipe show {base_id}`")
    realized = manifest.cost.realized if manifest is not None else None
    planned_total = plan.cost.expert_bytes
    experts = _experts(plan, full_by_expert, realized)
    return Explanation(
        plan_id=plan.digest,
        snapshot_id=None if manifest is None else manifest.snapshot_id,
        operator=plan.operator,
        policy=plan.policy,
        budget_bytes=plan.budget_bytes,
        planned_expert_bytes=planned_total,
        realized_expert_bytes=None if realized is None else realized.expert_bytes,
        full_expert_bytes=plan.cost.full_expert_bytes,
        error_bound=plan.error_bound,
        error_bound_kind=plan.error_bound_kind,
        error_share=plan.error_share,
        estimate=plan.estimate,
        retained_energy=kept_energy / total_energy if total_energy else 1.0,
        tensors=tuple(rows),
        experts=experts,
        seconds={} if realized is None else dict(realized.seconds),
        output_bytes_by_method={} if realized is None else dict(realized.output_bytes_by_method),
        predicted=_predicted(plan, manifest),
        tensor_filter=tensor,
        tensor_count=len(names),
        shown_retained_energy=shown_kept / shown_energy if shown_energy else 1.0,
        shown_planned_bytes=sum(row.planned_bytes for row in rows),
        evaluations=_evaluations(catalog, plan),
        searches=() if manifest is None else tuple(catalog.searches.of_snapshot(manifest.snapshot_id)),
        **_incremental(catalog, plan),
    )


def _copied(catalog: Catalog, plan: Plan, manifest: Manifest | None, tensor: str | None) -> Explanation:
    """The explanation of a passthrough (``plan.copies``): every source model is a column (the base too,
    when a slice takes its layers), with the bytes the map reads of it; each output tensor's row names
    its source, in that source's column: ``layer N`` (the source's layer it is) or ``copy`` outside the
    layers. Nothing is left out: no error, every byte read."""
    copies = plan.copies
    assert copies is not None
    sources = list(dict.fromkeys([plan.base.id, *copies.models]))
    blocks = {m: catalog.blocks.by_tensor(m) for m in sources}
    by_source = dict.fromkeys(sources, 0)
    rows = []
    for c in copies.copies:
        own = blocks[c.model][c.tensor]
        nbytes = sum(b.nbytes for b in own)
        by_source[c.model] += nbytes
        if tensor is not None and tensor not in c.output:
            continue
        source_layer = layer_index(c.tensor)
        rows.append(
            TensorExplanation(
                tensor=c.output,
                layer=layer_index(c.output),
                blocks=len(own),
                changed=dict.fromkeys(sources, 0),
                read={m: len(own) if m == c.model else 0 for m in sources},
                planned_bytes=nbytes,
                retained_energy=1.0,
                store={
                    m: ("copy" if source_layer is None else f"layer {source_layer}") if m == c.model else "-"
                    for m in sources
                },
            )
        )
    if tensor is not None and not rows:
        raise ConfigError(f"no output tensor of this passthrough has {tensor!r} in its name")
    realized = manifest.cost.realized if manifest is not None else None
    read = None if realized is None else {plan.base.id: realized.base_bytes, **realized.expert_bytes_by_model}
    total = sum(by_source.values())
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
        retained_energy=1.0,
        tensors=tuple(rows),
        experts=tuple(
            ExpertExplanation(m, n, None if read is None else read.get(m, 0), n, n / total if total else 0.0)
            for m, n in by_source.items()
        ),
        seconds={} if realized is None else dict(realized.seconds),
        output_bytes_by_method={} if realized is None else dict(realized.output_bytes_by_method),
        predicted=_predicted(plan, manifest),
        tensor_filter=tensor,
        tensor_count=len(copies.copies),
        shown_planned_bytes=sum(row.planned_bytes for row in rows),
        evaluations=_evaluations(catalog, plan),
        searches=() if manifest is None else tuple(catalog.searches.of_snapshot(manifest.snapshot_id)),
    )


#: The seconds each work unit records, summed over units: its worker waiting for reads, merging, waiting for
#: room to queue writes. Writing (``write``) runs on a writer thread beside them.
_WORKER_PHASES = (("read_wait", "read wait"), ("compute", "compute"), ("write_wait", "write wait"))


def output_text(result: Explanation) -> str | None:
    """How an incremental merge's snapshot got its output bytes, in one line (None for any other): files
    reflinked from the previous snapshot (nothing written; hard-linked by an earlier MergePipe), files and
    runs of it copied by the kernel, all read back and checked, the rest written; the parts add up to the
    output's bytes."""
    by_method = result.output_bytes_by_method
    if not by_method:
        return None
    # the snapshot id names that exact version; the model id alone may now name a later one
    previous = (
        f"snapshot {result.reused_snapshot}"
        if result.reused_snapshot
        else f"the previous snapshot of '{result.reused_from}'"
    )
    linked = f"{format_bytes(by_method['linked'])} linked, " if by_method["linked"] else ""  # an earlier MergePipe's
    return (
        f"{format_bytes(sum(by_method.values()))}: {linked}{format_bytes(by_method['cloned'])} reflinked and "
        f"{format_bytes(by_method['copied'])} copied by the kernel from {previous}, each checked against its "
        f"recorded hash, {format_bytes(by_method['written'])} written"
    )


def copies_in_write(output_bytes_by_method: Mapping[str, int]) -> bool:
    """Whether a snapshot's ``write`` seconds may include the kernel copying reused runs of the previous
    snapshot (its output bytes by method, as the manifest records them): the writer threads have it do that
    copy, timed as writing, and the manifest records the copied bytes but not their seconds apart (nor which
    copies were of whole files, done before the writers start)."""
    return output_bytes_by_method.get("copied", 0) > 0


def time_rows(seconds: Mapping[str, float], kernel_copies: bool = False) -> list[tuple[str, str]]:
    """A merge's realized seconds as (label, text) rows that add up, to the millisecond shown.

    ``total`` is the engine's wall clock, staging to commit: streaming (its workers' phases, and the set-up
    before them: staging, opening the inputs, creating the files), then hashing and publishing. A manifest
    is sealed before it is published, so the one on disk has no ``total`` (nor ``publish``): its phases are
    shown without a sum. ``startup`` is the process's age at the first read (interpreter, imports, catalog,
    planning and that set-up), so total starts inside it: it is shown apart, never added in.
    ``kernel_copies``: the writer thread also had the kernel copy reused runs of a previous snapshot, which
    the engine counts as writing (``copies_in_write``).
    """
    ms = {key: round(value * 1000) for key, value in seconds.items()}
    total, hashing, publishing = ms.pop("total", None), ms.pop("hash", 0), ms.pop("publish", None)
    startup, writing = ms.pop("startup", None), ms.pop("write", None)
    workers = [(label, ms.pop(key)) for key, label in _WORKER_PHASES if key in ms]
    busy = sum(value for _, value in workers)
    parts = " + ".join(f"{label} {_s(value)}" for label, value in workers) or "none recorded"
    copies = " (including any kernel copies of reused blocks)" if kernel_copies else ""
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
    elif workers or hashing:
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


def _experts(
    plan: Plan, full_by_expert: dict[str, int], realized: RealizedCost | None
) -> tuple[ExpertExplanation, ...]:
    """Each expert's row: planned, realized and full bytes, its share of the plan, what reuse saves."""
    planned_total = plan.cost.expert_bytes
    return tuple(
        ExpertExplanation(
            expert=e,
            planned_bytes=plan.cost.expert_bytes_by_model.get(e, 0),
            realized_bytes=None if realized is None else realized.expert_bytes_by_model.get(e, 0),
            full_bytes=full_by_expert[e],
            share=plan.cost.expert_bytes_by_model.get(e, 0) / planned_total if planned_total else 0.0,
            reused_bytes=plan.reuse.saved.get(e, 0) if plan.reuse else 0,
        )
        for e in full_by_expert
    )


def _predicted(plan: Plan, manifest: Manifest | None) -> dict[str, float]:
    """The predicted seconds a snapshot's manifest records, or a plan's own."""
    if manifest is not None:
        return dict(manifest.cost.estimated.seconds or {})
    return {} if plan.seconds is None else plan.seconds.flat()


def _evaluations(catalog: Catalog, plan: Plan) -> tuple[EvaluationRecord, ...]:
    """What the merge ``plan`` makes scored: its rows are under the plan's digest, for the plan and its snapshot."""
    return tuple(catalog.evaluations.for_subjects([plan.digest]).get(plan.digest, []))


def _incremental(catalog: Catalog, plan: Plan) -> dict:
    """The ``Explanation`` fields of an incremental merge (their defaults for any other)."""
    if plan.reuse is None:
        return {}
    reuse = plan.reuse
    # the snapshot it was planned against, as the engine finds it: the model's, with the manifest hash planned
    previous = catalog.snapshots.of_model(reuse.snapshot)
    return {
        "reused_from": reuse.snapshot,
        "reused_output_bytes": reuse.output_bytes,
        "updated_output_bytes": reuse.updated_bytes,
        "update_bound": reuse.bound,
        "reused_snapshot": previous.id if previous and previous.manifest_hash == reuse.manifest_hash else None,
    }


def _tensor_row(
    plan: Plan,
    name: str,
    costs: tuple[dict[str, list[int]], dict[str, int]],
    deltas: dict[str, list[BlockDelta]],
    weights: dict[str, float],
    stores: dict[str, tuple[dict, dict]],
) -> tuple[TensorExplanation, float, float]:
    """One tensor's row, with its weighted delta energy and the part the plan keeps (``costs``: what each
    expert's blocks cost to read, and what its reads of this tensor share)."""
    sizes, shared = costs
    changed, read, store, energy, kept = {}, {}, {}, {}, {}
    planned = 0
    for e, per_block in deltas.items():
        changed[e] = sum(1 for d in per_block if not d.identical)
        read[e] = len(plan.reads_of(name, e))
        nbytes, level, energy[e], kept[e] = _expert_part(plan, name, e, sizes[e], per_block, weights[e], stores.get(e))
        nbytes += shared[e] if read[e] else 0
        planned += nbytes
        if level is not None:
            store[e] = level
    total, retained = sum(energy.values()), sum(kept.values())
    reused = set(plan.reuse.blocks.get(name, ())) if plan.reuse else set()
    if reused and (any(store) or name in plan.tensor_level):  # merged whole: reused whole
        saved = planned
    else:
        saved = sum(sizes[e][i] for e in deltas for i in plan.reads_of(name, e) if i in reused)
        saved += sum(shared[e] for e in deltas if plan.reads_of(name, e) and reused.issuperset(plan.reads_of(name, e)))
    row = TensorExplanation(
        tensor=name,
        layer=layer_index(name),
        blocks=len(next(iter(sizes.values()), [])),
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
    return row, total, retained


def _expert_part(
    plan: Plan,
    name: str,
    expert: str,
    sizes: list[int],
    per_block: list[BlockDelta],
    weight: float,
    store: tuple[dict, dict] | None,
) -> tuple[int, str | None, float, float]:
    """What the plan reads of one expert's tensor: (planned bytes, the delta-store level read or None,
    the expert's weighted delta energy, the part of it kept)."""
    reads = set(plan.reads_of(name, expert))
    planned = sum(sizes[i] for i in reads)
    levels = (plan.stages_of(name, expert), plan.chunks_of(name, expert))
    if any(levels):
        assert store is not None  # a plan reads delta-store levels only of the experts in plan.stores
        chunks, stages = (parts.get(name, []) for parts in store)
        total = weight**2 * sum(c.energy for c in chunks)
        left = weight**2 * stages[levels[0] - 1].residual if levels[0] else 0.0
        planned += sum(p.nbytes for p in (stages[: levels[0]] if levels[0] else chunks[: levels[1]]))
        return planned, f"sketch {levels[0]}" if levels[0] else "exact", total, max(total - left, 0.0)
    energy = kept = 0.0
    for d in per_block:
        if d.identical or d.l2 is None:
            continue
        part = (weight * d.l2) ** 2
        energy += part
        if d.index in reads:
            kept += part
    return planned, None, energy, kept


#: How many characters of a data digest a report shows: enough to tell data sets apart by eye.
DIGEST_CHARS = 12


@dataclass(frozen=True)
class MetricChange:
    """One metric of two subjects on the same data: ``a``, ``b`` and ``delta`` = b − a."""

    data_name: str
    data_digest: str
    metric: str
    a: float
    b: float

    @property
    def delta(self) -> float:
        return self.b - self.a

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "delta": self.delta}


@dataclass(frozen=True)
class EvaluatedData:
    """A data set as rows name it: its digest, and what people call it."""

    digest: str
    name: str

    def to_json(self) -> dict[str, str]:
        return {"data_digest": self.digest, "data_name": self.name}


def changes(a: Sequence[EvaluationRecord], b: Sequence[EvaluationRecord]) -> list[MetricChange]:
    """Every metric measured for both ``a`` and ``b`` on data both were evaluated on, by data name and metric."""
    before = {(r.data_digest, r.metric): r for r in a}
    out = []
    for r in sorted(b, key=lambda r: (r.data_name, r.data_digest, r.metric)):
        old = before.get((r.data_digest, r.metric))
        if old is not None:
            out.append(MetricChange(r.data_name, r.data_digest, r.metric, old.value, r.value))
    return out


def most_shared_data(per_subject: Iterable[Sequence[EvaluationRecord]]) -> EvaluatedData | None:
    """The data that compares the most subjects: evaluated for the most of them, the most recently evaluated
    among ties; None when none was evaluated."""
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
    """A difference of scores, always signed."""
    return f"{value:+.6g}"


def compact(rows: Sequence[EvaluationRecord], data: EvaluatedData) -> str:
    """``loss=2.5 perplexity=12.1825``: the metrics of ``rows`` on ``data``, by metric; empty if none."""
    return " ".join(
        f"{r.metric}={value_text(r.value)}"
        for r in sorted(rows, key=lambda r: r.metric)
        if r.data_digest == data.digest
    )


def params_text(params: Mapping[str, Any], digits: int = 3) -> str:
    """A search trial's parameters in one line (``weight math=0.603, density=0.5``), floats to ``digits``
    significant digits."""
    return ", ".join(f"{k}={v:.{digits}g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


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
        return {
            "a": self.a,
            "b": self.b,
            "inputs": self.inputs,
            "tensors": [asdict(t) for t in self.tensors],
            "unchanged": self.unchanged,
            "evaluations": [c.to_json() for c in self.evaluations],
        }


def diff_snapshots(catalog: Catalog, a_ref: str, b_ref: str) -> SnapshotDiff:
    """The difference from snapshot ``a_ref`` to snapshot ``b_ref``."""
    a, b = (committed_snapshot(catalog, ref, "diff") for ref in (a_ref, b_ref))
    ma, mb = (Manifest.from_json(r.manifest_data()) for r in (a, b))
    out = SnapshotDiff(_side(catalog, ma.model_id, a.id), _side(catalog, mb.model_id, b.id), inputs=_inputs(ma, mb))
    scores = catalog.evaluations.for_subjects([ma.plan_digest, mb.plan_digest])
    out.evaluations = changes(scores.get(ma.plan_digest, []), scores.get(mb.plan_digest, []))
    hashes = {e.id: catalog.blocks.hashes(e.id) for e in (*ma.experts, *mb.experts) if catalog.models.exists(e.id)}
    out.tensors = sorted(
        _tensors(Path(a.out_path), Path(b.out_path), ma, mb, hashes), key=lambda t: (-t.relative_change, t.tensor)
    )
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
        with (
            safe_open(str(ca.file_of(entry.name).path), "pt") as fa,
            safe_open(str(cb.file_of(entry.name).path), "pt") as fb,
        ):
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
