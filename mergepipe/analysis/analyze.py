"""Analyse registered models: block content hashes and (expert, base) delta statistics.

Analysis is paid once per expert and reused by every later plan, so it must
be cheap: it reads every needed byte exactly once per call and does all work
on that one buffer.

* Every model gets a blake3 hash per block (block geometry from the catalog).
* Every expert analysed against a base gets, per block, statistics of
  Δ = E − B in fp32 (‖Δ‖₂, max|Δ|, non-zeros, identical-to-base), and per
  mergeable tensor exact trim thresholds at every density of ``DENSITY_GRID``
  (complements for breadcrumbs, e.g. the top γ to drop, are grid values too;
  an off-grid density falls back to a whole-tensor computation in the engine).

How it stays fast: tensors are processed base-major (base tensor read once,
then that tensor of every expert), each tensor in one read; the shared
read-ahead (``storage/readahead.py``) reads and hashes the next tensor on
its thread while this one computes statistics (``stats.py``) of the current
one; buffers are pooled. Blocks known to be identical (equal hashes) are
never converted, and tensors whose hashes are already known to be equal are
not even read.

Non-mergeable tensors (integer, F64, FP8 dtypes) are carried through from the
base by the engine and never merged, so only their identical flags are
recorded (statistics ``None``, no thresholds).

A delta checkpoint (``expert_format.py``) holds Δ itself: its tensors are read
without the base's, a block is unchanged when its bytes are all zero, and a
tensor it leaves out is unchanged everywhere without a read. A LoRA adapter
(``lora_expert.py``) is read a tensor's two factors at once: ΔW of that one
tensor is decoded in fp32, a block is unchanged when its rows of B are zero;
a tensor it stores whole (``modules_to_save``) is read like a full expert's.

Each (expert, base) result and each model's new hashes are written in one
transaction after all reads finish, so an interruption records nothing
half-done, and a re-run skips what is recorded (reading nothing for it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mergepipe.analysis.expert_format import ExpertFormat, expert_format
from mergepipe.analysis.incremental import Inheritance, inheritance, inherited, previous_versions
from mergepipe.analysis.inputs import open_registered
from mergepipe.analysis.layout import check_delta_base, check_layout
from mergepipe.analysis.lora_expert import LORA, adapter_part, open_lora, replaces, span_hashes, span_result
from mergepipe.analysis.report import AnalyzeReport
from mergepipe.analysis.stats import DeltaWorkspace, TensorResult, from_delta, from_hashes
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import BlockDelta, BlockRecord, ModelRecord, TensorRecord, TensorStats
from mergepipe.errors import CatalogError
from mergepipe.progress import byte_progress
from mergepipe.storage.convert import MERGEABLE_DTYPES, raw_view, to_float32
from mergepipe.storage.hashing import block_digest
from mergepipe.storage.lora import LoraAdapter, LoraTarget, SavedTensor
from mergepipe.storage.readahead import ByteRange, Fetched, ReadAhead, WorkItem
from mergepipe.storage.source import LocalFileSource
from mergepipe.threads import compute_threads

#: How many tensors the reading thread may run ahead of the computing one:
#: enough to overlap I/O and hashing with compute, little enough to bound memory.
_TENSORS_AHEAD = 2


@dataclass(frozen=True)
class _Read:
    """One whole-tensor read of one model (the payload of a read-ahead item)."""

    model_id: str
    role: str  # "base", "expert" or "hash"
    tensor: TensorRecord
    blocks: list[BlockRecord]
    needs_hash: bool
    lora: LoraTarget | SavedTensor | None = None  # an adapter's factors (the read is their span) or replacement


@dataclass
class _Job:
    """Everything one analyze call knows before it reads, and what it computes."""

    base_id: str | None
    records: dict[str, ModelRecord]
    tensors: dict[str, list[TensorRecord]]
    blocks: dict[str, dict[str, list[BlockRecord]]]
    experts: list[str]  # to analyse against base_id
    skipped: list[str]
    formats: dict[str, ExpertFormat] = field(default_factory=dict)  # expert -> how its bytes give Δ
    loras: dict[str, LoraAdapter] = field(default_factory=dict)  # the LoRA adapters among the models
    schedule: list[WorkItem] = field(default_factory=list)
    new_hashes: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    deltas: dict[str, list[BlockDelta]] = field(default_factory=dict)
    stats: dict[str, list[TensorStats]] = field(default_factory=dict)
    inherit: dict[str, Inheritance] = field(default_factory=dict)  # expert -> its previous version's rows
    inherited: dict[str, int] = field(default_factory=dict)  # expert -> tensors taken over unchanged

    def hashes(self, model_id: str, tensor: str) -> list[str | None]:
        computed = self.new_hashes.get(model_id, {}).get(tensor)
        if computed is not None:
            return list(computed)
        return [b.hash for b in self.blocks[model_id][tensor]]

    def add(self, expert: str, result: TensorResult) -> None:
        deltas, stats = result
        self.deltas[expert].extend(deltas)
        self.stats[expert].append(stats)


def analyze(
    catalog: Catalog,
    model_ids: Sequence[str] | None = None,
    base_id: str | None = None,
    progress: bool = True,
) -> AnalyzeReport:
    """Hash ``model_ids`` and, with ``base_id``, analyse each against the base.

    ``model_ids=None`` means the latest version of every registered
    checkpoint (not snapshots) other than the base when a base is given, and
    of every model otherwise. Ids are names (their latest version), ``name@N``
    or stored ids; the report names exact versions.
    """
    start = time.perf_counter()
    if base_id is not None:
        base_id = catalog.models.resolve(base_id).id
    if model_ids is not None:
        model_ids = [catalog.models.resolve(m).id for m in model_ids]
    first = _hash_new_versions(catalog, model_ids, base_id, progress)
    job = _prepare(catalog, model_ids, base_id, incremental=True)
    with LocalFileSource() as source, compute_threads():
        _run(job, source, progress)
        by_model = source.bytes_by_tag()
    _record(catalog, job)
    for model_id, n in (first.bytes_by_model if first else {}).items():
        by_model[model_id] = by_model.get(model_id, 0) + n
    hashed = tuple(m for m in job.records if m in job.new_hashes) + (first.hashed if first else ())
    return AnalyzeReport(
        base_id=base_id,
        hashed=hashed,
        analyzed=tuple(job.experts),
        skipped=tuple(job.skipped),
        bytes_read=sum(by_model.values()),
        bytes_by_model=by_model,
        seconds=time.perf_counter() - start,
        inherited={e: (job.inherited.get(e, 0), len(job.tensors[e])) for e in job.inherit},
    )


def _hash_new_versions(catalog: Catalog, model_ids: Sequence[str] | None, base_id: str | None,
                       progress: bool) -> AnalyzeReport | None:
    """Hash the experts that are new versions of an analysed one first, so that the analysis proper
    knows which of their tensors are unchanged (``incremental.py``)."""
    if base_id is None:
        return None
    experts = _prepare(catalog, model_ids, base_id).experts
    unhashed = [e for e in _previous_versions(catalog, experts, base_id)
                if catalog.blocks.hashed_count(e) < catalog.models.get(e).n_blocks]
    if not unhashed:
        return None
    return analyze(catalog, [catalog.models.exact_ref(catalog.models.get(e)) for e in unhashed], progress=progress)


# --------------------------------------------------------------------------- planning


def _prepare(catalog: Catalog, model_ids: Sequence[str] | None, base_id: str | None,
             incremental: bool = False) -> _Job:
    if base_id is not None:
        catalog.models.get(base_id)
    if model_ids is None:
        models = [m for m in catalog.models.list() if catalog.models.latest(m.name) == m]
        if base_id is not None:  # checkpoints, and the deltas taken against this base
            models = [m for m in models if m.id != base_id and (m.kind == "checkpoint" or m.delta_base == base_id)]
        ids = [m.id for m in models]
    else:
        ids = list(dict.fromkeys(model_ids))
    records = {m: catalog.models.get(m) for m in ([base_id] if base_id else []) + ids}

    experts: list[str] = []
    skipped: list[str] = []
    if base_id is not None:
        for m in ids:
            if m == base_id:
                continue
            (skipped if catalog.stats.is_analyzed(m, base_id) else experts).append(m)

    tensors = {m: catalog.models.tensors(m) for m in records}
    for expert in experts:
        if records[expert].kind in ("delta", LORA):  # its tensors were checked against its base when registered
            check_delta_base(records[expert], records[base_id])  # type: ignore[index]
        else:
            check_layout(expert, tensors[expert], base_id, tensors[base_id])  # type: ignore[arg-type]
    loras = {m: open_lora(catalog, m) for m, r in records.items() if r.kind == LORA}
    for m in records:
        _ = loras.get(m) or open_registered(catalog, m)  # refuses a model changed on disk since registration
    job = _Job(
        base_id=base_id,
        records=records,
        tensors=tensors,
        blocks={m: catalog.blocks.by_tensor(m) for m in records},
        experts=experts,
        skipped=skipped,
        formats={e: expert_format(records[e].kind) for e in experts},
        loras=loras,
    )
    if incremental and base_id is not None:
        job.inherit = {e: inheritance(catalog, e, previous, base_id)
                       for e, previous in _previous_versions(catalog, experts, base_id).items()}
    _schedule(job)
    return job


def _previous_versions(catalog: Catalog, experts: Sequence[str], base_id: str) -> dict[str, str]:
    """``previous_versions`` of the same kind: equal bytes mean equal Δ only within one format (and not for
    adapters, whose config scales the same factors)."""
    kind = {m: catalog.models.get(m).kind for m in experts}
    return {e: p for e, p in previous_versions(catalog, experts, base_id).items()
            if catalog.models.get(p).kind == kind[e] != LORA}


def _all_known(hashes: list[str | None]) -> bool:
    return all(h is not None for h in hashes)


def _schedule(job: _Job) -> None:
    """Decide which tensors of which models to read, in read order.

    (expert, tensor) pairs whose result follows from known hashes alone are
    recorded right here, without a read.
    """
    roots = {m: Path(r.uri) for m, r in job.records.items()}

    def read(model_id: str, role: str, t: TensorRecord) -> WorkItem:
        blocks = job.blocks[model_id][t.name]
        needs_hash = not _all_known([b.hash for b in blocks])
        payload = _Read(model_id, role, t, blocks, needs_hash, adapter_part(job.loras.get(model_id), t.name))
        return WorkItem(payload, [ByteRange(roots[model_id] / t.file, t.begin, t.end, model_id)])

    base = job.base_id
    if base is not None:
        expert_tensors = {e: {t.name: t for t in job.tensors[e]} for e in job.experts}
        for e in job.experts:
            job.deltas[e], job.stats[e] = [], []
        for bt in job.tensors[base]:
            base_hashes = [b.hash for b in job.blocks[base][bt.name]]
            mergeable = bt.dtype in MERGEABLE_DTYPES
            expert_reads = []
            need_base = not _all_known(base_hashes)
            for e in job.experts:
                et = expert_tensors[e].get(bt.name)
                if et is None:  # a delta that leaves the tensor out: Δ = 0, nothing to read
                    job.add(e, from_hashes(bt, job.blocks[base][bt.name], [True] * len(base_hashes)))
                    continue
                e_blocks = job.blocks[e][bt.name]
                e_hashes = [b.hash for b in e_blocks]
                taken = inherited(job.inherit.get(e), bt.name, e_hashes)
                if taken is not None:  # byte-identical to the previous version's tensor: its rows hold
                    job.add(e, taken)
                    job.inherited[e] = job.inherited.get(e, 0) + 1
                    continue
                fmt = job.formats[e]
                known = _all_known(e_hashes) and (_all_known(base_hashes) or not fmt.needs_base)
                flags = fmt.unchanged_flags(e_hashes, base_hashes, e_blocks)
                if known and (not mergeable or all(flags)):
                    job.add(e, from_hashes(bt, e_blocks, flags))
                    continue
                expert_reads.append(read(e, "expert", et))
                need_base = need_base or (mergeable and (fmt.needs_base or replaces(expert_reads[-1].payload.lora)))
            if need_base:
                job.schedule.append(read(base, "base", bt))
            job.schedule.extend(expert_reads)
    for m in job.records:
        if m == base or m in job.experts:
            continue
        job.schedule.extend(
            read(m, "hash", t) for t in job.tensors[m] if not _all_known([b.hash for b in job.blocks[m][t.name]])
        )


# ---------------------------------------------------------------------------- run


def _hash_blocks(item: WorkItem, views: list[memoryview]) -> list[str] | None:
    """Block hashes of a freshly read tensor, computed on the reading thread
    (the second core is better spent on torch than on blake3)."""
    read: _Read = item.payload
    if not read.needs_hash:
        return None
    (view,) = views
    t = read.tensor
    if isinstance(read.lora, LoraTarget):  # each block: its rows of B, then A
        return span_hashes(read.lora, view, t.begin, read.blocks)
    return [block_digest(view[b.begin - t.begin : b.end - t.begin]) for b in read.blocks]


def _run(job: _Job, source: LocalFileSource, progress: bool) -> None:
    total = sum(item.nbytes for item in job.schedule)
    window = _TENSORS_AHEAD * max((item.nbytes for item in job.schedule), default=1)
    readahead = ReadAhead(source, threads=1, window_bytes=window, on_read=_hash_blocks)
    workspace = DeltaWorkspace()
    base: Fetched | None = None
    base32: torch.Tensor | None = None
    stream = readahead.run(job.schedule)
    with byte_progress("analyze", total, progress and bool(job.schedule)) as advance, closing(stream):
        for fetched in stream:
            read: _Read = fetched.item.payload
            t = read.tensor
            if fetched.result is not None:
                job.new_hashes.setdefault(read.model_id, {})[t.name] = fetched.result
            if read.role == "base":
                if base is not None:
                    base.release()
                base, base32 = fetched, None
            else:
                if read.role == "expert":
                    if base32 is None and _needs_delta(job, read) and base is not None:
                        base32 = to_float32(base.views[0], t.dtype, t.shape)
                    _analyse(job, read, fetched.views[0], base, base32, workspace)
                fetched.release()
            advance(t.nbytes, f"{read.model_id}: {t.name}")
    if base is not None:
        base.release()


def _needs_delta(job: _Job, read: _Read) -> bool:
    """Whether this expert tensor's Δ needs the base tensor's values."""
    flags = _flags(job, read)
    needs_base = job.formats[read.model_id].needs_base or replaces(read.lora)
    return not all(flags) and read.tensor.dtype in MERGEABLE_DTYPES and needs_base


def _flags(job: _Job, read: _Read) -> list[bool]:
    name = read.tensor.name
    base_hashes = job.hashes(job.base_id, name)  # type: ignore[arg-type]
    return job.formats[read.model_id].unchanged_flags(job.hashes(read.model_id, name), base_hashes, read.blocks)


def _analyse(
    job: _Job, read: _Read, view: memoryview, base: Fetched | None, base32: torch.Tensor | None,
    workspace: DeltaWorkspace,
) -> None:
    """Record one expert tensor, from hashes alone or from its delta to the base."""
    t = read.tensor
    flags = _flags(job, read)
    blocks = job.blocks[read.model_id][t.name]
    if all(flags) or t.dtype not in MERGEABLE_DTYPES:
        job.add(read.model_id, from_hashes(t, blocks, flags))
        return
    who = f"'{read.model_id}' against '{job.base_id}'"
    if isinstance(read.lora, LoraTarget):  # ΔW of this tensor from its factors
        job.add(read.model_id, span_result(read.lora, view, t, blocks, who))
        return
    if not (job.formats[read.model_id].needs_base or replaces(read.lora)):  # a delta checkpoint: the bytes are Δ
        abs_delta = workspace.abs_values(raw_view(view, t.dtype, t.shape))
    elif base is None or base.item.payload.tensor.name != t.name or base32 is None:
        raise AssertionError(f"base tensor {t.name} was not read before the expert's")
    else:
        abs_delta = workspace.abs_delta(raw_view(view, t.dtype, t.shape), base32)
    job.add(read.model_id, from_delta(t, blocks, flags, abs_delta, who))


# ---------------------------------------------------------------------------- record


def _record(catalog: Catalog, job: _Job) -> None:
    """Write new hashes and analyses: one transaction per model / per expert."""

    def check_same(model_id: str) -> None:
        if catalog.models.find(model_id) != job.records[model_id]:
            raise CatalogError(
                f"model '{model_id}' was re-registered while analyze ran; run `mergepipe analyze` again"
            )

    def flat(model_id: str) -> list[tuple[str, int, str]]:
        return [
            (tensor, i, h) for tensor, hashes in job.new_hashes.get(model_id, {}).items() for i, h in enumerate(hashes)
        ]

    for model_id in job.records:
        if model_id in job.experts or model_id not in job.new_hashes:
            continue
        with catalog.transaction():
            check_same(model_id)
            catalog.blocks.set_hashes(model_id, flat(model_id))
    for expert in job.experts:
        with catalog.transaction():
            check_same(expert)
            check_same(job.base_id)  # type: ignore[arg-type]
            catalog.blocks.set_hashes(expert, flat(expert))
            if not catalog.stats.is_analyzed(expert, job.base_id):  # type: ignore[arg-type]
                catalog.stats.record(expert, job.base_id, job.deltas[expert], job.stats[expert])  # type: ignore[arg-type]
