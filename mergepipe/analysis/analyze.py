"""Analyse registered models: block content hashes and (expert, base) delta statistics.

Analysis is paid once per expert and reused by every later plan, so it must
be cheap and small: it reads every needed byte once per call, a window at a
time, and does all its work while that window is in memory (the thresholds
then look again at a few pieces per tensor, ``windows.py``).

* Every model gets a blake3 hash per block (block geometry from the catalog).
* Every expert analysed against a base gets, per block, statistics of
  Δ = E − B in fp32 (‖Δ‖₂, max|Δ|, non-zeros, identical-to-base), and per
  mergeable tensor exact trim thresholds at every density of ``DENSITY_GRID``
  (complements for breadcrumbs, e.g. the top γ to drop, are grid values too;
  an off-grid density falls back to a whole-tensor computation in the engine).

How it stays fast and small: tensors are processed base-major (a window of
the base tensor read once, then that window of every expert), a window of
whole blocks at a time (``windows.py``: memory never grows with tensor
size); the shared read-ahead (``storage/readahead.py``) reads and hashes the
next windows on its thread while this one computes, in one pass over each
window's |Δ|, the block statistics and the counts of the threshold selector
(``stats.py``, ``topk.py``), which then looks again at only a few pieces per
tensor. Buffers are pooled. Blocks known to be identical (equal hashes) are
never converted, and tensors whose hashes are already known to be equal are
not even read. ``analyze_job.py`` runs the schedule this module plans.

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
What the reading thread read, and in how many seconds of its own, is
recorded as this host's read rate (``catalog/timings.py``): the time model's
prior for merges here (``spec/time_model.py``). Remote inputs are left out: a
link's rate says nothing of this machine's disk.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from mergepipe.analysis.analyze_job import AnalyzeJob, run
from mergepipe.analysis.expert_format import expert_format
from mergepipe.analysis.incremental import VersionHasher, inheritance, inherited, previous_versions
from mergepipe.analysis.opening import open_registered
from mergepipe.analysis.layout import check_delta_base, check_layout
from mergepipe.analysis.lora_expert import LORA, adapter_part, open_lora, replaces
from mergepipe.analysis.report import AnalyzeReport
from mergepipe.analysis.stats import from_hashes
from mergepipe.analysis.windows import REREAD, WINDOW_ELEMENTS, Read, block_entries, block_windows, tensor_reads
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import TensorRecord
from mergepipe.catalog.timings import host_key
from mergepipe.errors import CatalogError
from mergepipe.storage.format import MERGEABLE_DTYPES
from mergepipe.storage import hub
from mergepipe.storage.checkpoint import INDEX_FILE, open_checkpoint
from mergepipe.storage.location import RemotePath, location
from mergepipe.storage.remote import TransferMeter
from mergepipe.storage.readahead import WorkItem
from mergepipe.storage.remote_source import CheckpointSource
from mergepipe.threads import compute_threads


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
    fresh = _new_versions(catalog, model_ids, base_id)
    hashed_beside = [e for e in fresh if _hashed_beside(catalog, e)]
    first = _hash_first(catalog, [e for e in fresh if e not in hashed_beside], progress)
    job = _prepare(catalog, model_ids, base_id, incremental=True, deferred=hashed_beside)
    _download_hub_models(job)
    remote = any(isinstance(job.root(m), RemotePath) for m in job.records)
    with CheckpointSource(TransferMeter() if remote else None) as source, compute_threads(), \
            VersionHasher(_hash_work(job, hashed_beside)) as hasher:
        if hashed_beside:
            job.schedule, job.expected = _scheduled(job, hasher), _expected(job)
        read_bytes, read_seconds = run(job, source, progress)
        by_model = source.bytes_by_tag()
        for model_id, n in hasher.source.bytes_by_tag().items():
            by_model[model_id] = by_model.get(model_id, 0) + n
        read_bytes, read_seconds = read_bytes + hasher.read_bytes, read_seconds + hasher.read_seconds
    reread = by_model.pop(REREAD, 0) + (first.reread_bytes if first else 0)
    _record(catalog, job)
    if read_bytes and read_seconds > 0 and not remote:
        catalog.timings.add_read(host_key(), read_bytes, read_seconds)
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
        reread_bytes=reread,
    )


def _new_versions(catalog: Catalog, model_ids: Sequence[str] | None, base_id: str | None) -> list[str]:
    """The experts to analyse that are new versions of an analysed one, not hashed yet."""
    if base_id is None:
        return []
    experts = _prepare(catalog, model_ids, base_id, schedule=False).experts
    return [e for e in _previous_versions(catalog, experts, base_id)
            if catalog.blocks.hashed_count(e) < catalog.models.get(e).n_blocks]


def _hashed_beside(catalog: Catalog, expert: str) -> bool:
    """Whether a new version is hashed beside its analysis (``incremental.VersionHasher``): a local full
    checkpoint. (Others, a delta checkpoint or a remote one, are hashed in a pass of their own first.)"""
    record = catalog.models.get(expert)
    return record.kind == "checkpoint" and not isinstance(location(record.uri), RemotePath)


def _hash_first(catalog: Catalog, versions: Sequence[str], progress: bool) -> AnalyzeReport | None:
    """Hash ``versions`` (new versions of analysed experts) in a pass of their own first, so that the analysis
    proper knows which of their tensors are unchanged (``incremental.py``)."""
    if not versions:
        return None
    return analyze(catalog, [catalog.models.exact_ref(catalog.models.get(e)) for e in versions], progress=progress)


def _download_hub_models(job: AnalyzeJob) -> None:
    """Download each Hub model analysis reads into the Hugging Face cache first, whole.

    Analysis reads its weights whole anyway; through the cache they cross the
    network once (as mergekit's download does), this pass reads them locally,
    and every later merge finds them there. Without this, the first merge would
    fetch the planned ranges a second time. Ranged reads from the Hub remain for
    what the cache lacks: models analysed elsewhere (a shared catalog), or an
    evicted cache.
    """
    for model_id in dict.fromkeys(r.tag for item in job.schedule for r in item.reads):
        root = job.root(model_id)
        if isinstance(root, RemotePath) and root.hub is not None:
            checkpoint = open_checkpoint(root)
            index = [INDEX_FILE] if checkpoint.index is not None else []
            hub.download(root, [*(f.name for f in checkpoint.files), *index, *checkpoint.aux_files])


# --------------------------------------------------------------------------- planning


def _prepare(catalog: Catalog, model_ids: Sequence[str] | None, base_id: str | None,
             incremental: bool = False, deferred: Sequence[str] = (), schedule: bool = True) -> AnalyzeJob:
    """What one call reads and computes; ``deferred``: new versions whose hashes come from a
    ``VersionHasher`` (their analysis is then scheduled tensor by tensor as they arrive, ``_scheduled``);
    ``schedule=False``: the models only, nothing scheduled."""
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
        assert base_id is not None  # experts are only chosen against a base
        if records[expert].kind in ("delta", LORA):  # its tensors were checked against its base when registered
            check_delta_base(records[expert], records[base_id])
        else:
            check_layout(expert, tensors[expert], base_id, tensors[base_id])
    loras = {m: open_lora(catalog, m) for m, r in records.items() if r.kind == LORA}
    for m in records:
        _ = loras.get(m) or open_registered(catalog, m)  # refuses a model changed on disk since registration
    job = AnalyzeJob(
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
    if schedule and not deferred:
        job.schedule = list(_scheduled(job, None))
    return job


def _previous_versions(catalog: Catalog, experts: Sequence[str], base_id: str) -> dict[str, str]:
    """``previous_versions`` of the same kind: equal bytes mean equal Δ only within one format (and not for
    adapters, whose config scales the same factors)."""
    kind = {m: catalog.models.get(m).kind for m in experts}
    return {e: p for e, p in previous_versions(catalog, experts, base_id).items()
            if catalog.models.get(p).kind == kind[e] != LORA}


def _all_known(hashes: list[str | None]) -> bool:
    return all(h is not None for h in hashes)


def _scheduled(job: AnalyzeJob, hasher: VersionHasher | None) -> Iterator[WorkItem]:
    """Which windows of which models' tensors to read, in read order (``windows.py``): a window of the base
    tensor, then that window of each expert's. A new version ``hasher`` hashes is decided tensor by tensor,
    once its hashes are in (so this runs as the reads are consumed).

    (expert, tensor) pairs whose result follows from known hashes alone are
    recorded as they are reached, without a read.
    """
    base = job.base_id
    if base is not None:
        for e in job.experts:
            job.deltas[e], job.stats[e] = [], []
        for bt in job.tensors[base]:
            if hasher is not None:
                _take_hashes(job, hasher, bt.name)
            yield from _schedule_tensor(job, bt)
    for m in job.records:
        if m == base or m in job.experts:
            continue
        for t in job.tensors[m]:
            if not _all_known([b.hash for b in job.blocks[m][t.name]]):
                yield from (r.item(job.root(m)) for r in _reads(job, m, "hash", t))


def _expected(job: AnalyzeJob) -> tuple[int, int]:
    """For a schedule produced as it is consumed: the bytes it reads at most (every tensor of every model of
    the call, and the new versions' changed tensors a second time) and its largest read (a tensor's window,
    or a block where one is larger)."""
    total = sum(t.nbytes for m in job.records for t in job.tensors[m])
    total += sum(t.nbytes for e in job.inherit for t in job.tensors[e])
    windows = (min(t.numel, WINDOW_ELEMENTS) * (t.nbytes // max(t.numel, 1)) for m in job.records
               for t in job.tensors[m])
    blocks = (b.end - b.begin for m in job.records for per in job.blocks[m].values() for b in per)
    return total, max(1, *windows, *blocks)


def _hash_work(job: AnalyzeJob, versions: Sequence[str]) -> list[tuple[str, str, list[WorkItem]]]:
    """What a ``VersionHasher`` reads for ``versions``, in the order ``_scheduled`` asks for it."""
    if job.base_id is None:
        return []
    return [(e, bt.name, [r.item(job.root(e)) for r in _reads(job, e, "hash", t)])
            for bt in job.tensors[job.base_id] for e in versions if (t := job.tensor(e, bt.name)) is not None]


def _take_hashes(job: AnalyzeJob, hasher: VersionHasher, tensor: str) -> None:
    """The hashes of ``tensor`` of each new version ``hasher`` reads, into the job (and so into the catalog
    with the rest, ``_record``)."""
    for e in job.experts:
        if e in job.inherit and job.tensor(e, tensor) is not None and hasher.hashes_for(e):
            hashes = hasher.hashes(e, tensor)
            if hashes:
                job.new_hashes.setdefault(e, {})[tensor] = hashes


def _reads(job: AnalyzeJob, model_id: str, role: str, t: TensorRecord) -> list[Read]:
    blocks = job.blocks[model_id][t.name]
    windows = block_windows(block_entries(t, blocks))
    return tensor_reads(model_id, role, t, blocks, windows, adapter_part(job.loras.get(model_id), t.name))


def _schedule_tensor(job: AnalyzeJob, bt: TensorRecord) -> list[WorkItem]:
    """The reads of one base tensor and of each expert's, interleaved window by window."""
    base = job.base
    base_hashes = [b.hash for b in job.blocks[base][bt.name]]
    mergeable = bt.dtype in MERGEABLE_DTYPES
    expert_reads: list[list[Read]] = []
    need_base = not _all_known(base_hashes)
    for e in job.experts:
        et = job.tensor(e, bt.name)
        if et is None:  # a delta that leaves the tensor out: Δ = 0, nothing to read
            job.add(e, from_hashes(bt, job.blocks[base][bt.name], [True] * len(base_hashes)))
            continue
        e_blocks = job.blocks[e][bt.name]
        e_hashes = job.hashes(e, bt.name)
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
        expert_reads.append(_reads(job, e, "expert", et))
        need_base = need_base or (mergeable and (fmt.needs_base or replaces(expert_reads[-1][0].lora)))
    reads = [_reads(job, base, "base", bt) if need_base else [], *expert_reads]
    return [r[w].item(job.root(r[w].model_id)) for w in range(max(len(r) for r in reads)) for r in reads
            if w < len(r)]


# ---------------------------------------------------------------------------- record


def _record(catalog: Catalog, job: AnalyzeJob) -> None:
    """Write new hashes and analyses: one transaction per model / per expert."""

    def check_same(model_id: str) -> None:
        if catalog.models.find(model_id) != job.records[model_id]:
            raise CatalogError(
                f"model '{model_id}' was re-registered while analyze ran; run `mergepipe analyze` again"
            )

    def flat(model_id: str) -> list[tuple[str, int, str]]:
        return [
            (tensor, i, h) for tensor, hashes in job.new_hashes.get(model_id, {}).items()
            for i, h in enumerate(hashes) if h is not None
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
            check_same(job.base)
            catalog.blocks.set_hashes(expert, flat(expert))
            if not catalog.stats.is_analyzed(expert, job.base):
                catalog.stats.record(expert, job.base, job.deltas[expert], job.stats[expert])
