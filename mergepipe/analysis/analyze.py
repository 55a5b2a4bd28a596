"""Analyse registered models: block hashes, and per (expert, base) the delta statistics and trim thresholds,
every byte read once per call through the shared read-ahead.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from typing import Callable

import torch

from mergepipe.analysis.experts import (
    LORA,
    ExpertFormat,
    check_delta_base,
    check_layout,
    expert_format,
    open_lora,
    open_registered,
    read_ahead,
    span_hashes,
)
from mergepipe.analysis.stats import TensorPass, TensorResult, Workspace, from_hashes, span_result
from mergepipe.catalog import Catalog
from mergepipe.catalog.records import BlockDelta, BlockRecord, ModelRecord, TensorRecord, TensorStats
from mergepipe.catalog.snapshots import host_key
from mergepipe.errors import CatalogError, ModelChangedError
from mergepipe.runtime import byte_progress, compute_threads
from mergepipe.storage import hub
from mergepipe.storage.checkpoint import INDEX_FILE, open_checkpoint
from mergepipe.storage.format import MERGEABLE_DTYPES
from mergepipe.storage.location import Location, RemotePath, location
from mergepipe.storage.lora import LoraAdapter, LoraTarget, SavedTensor
from mergepipe.storage.remote import TransferMeter
from mergepipe.storage.source import ByteRange, CheckpointSource, Fetched, WorkItem, block_digest
from mergepipe.storage.writer import raw_view

#: Entries in one window: 16 MiB per fp32 buffer (every tensor of a Qwen3-0.6B layer fits one).
WINDOW_ELEMENTS = 1 << 22
#: The byte-counter tag of second reads (not a model id: reports count each checkpoint byte once).
REREAD = "#reread"


def block_windows(sizes: Sequence[int], limit: int | None = None) -> list[tuple[int, int]]:
    """Consecutive block ranges ``(lo, hi)`` of at most ``limit`` (default ``WINDOW_ELEMENTS``) entries each."""
    limit = WINDOW_ELEMENTS if limit is None else limit
    windows: list[tuple[int, int]] = []
    lo, total = 0, 0
    for i, size in enumerate(sizes):
        if i > lo and total + size > limit:
            windows.append((lo, i))
            lo, total = i, 0
        total += size
    if sizes:
        windows.append((lo, len(sizes)))
    return windows


@dataclass(frozen=True)
class Read:
    """Blocks ``lo .. hi-1`` of one model's tensor, read at once: a read-ahead item's payload."""

    model_id: str
    role: str  # "base", "expert" or "hash"
    tensor: TensorRecord
    blocks: list[BlockRecord]  # all of the tensor's blocks
    lo: int
    hi: int
    last: bool  # the tensor's last window
    lora: LoraTarget | SavedTensor | None = None  # an adapter's factors (read whole: their span) or replacement

    @property
    def begin(self) -> int:
        return self.tensor.begin if isinstance(self.lora, LoraTarget) else self.blocks[self.lo].begin

    @property
    def end(self) -> int:
        return self.tensor.end if isinstance(self.lora, LoraTarget) else self.blocks[self.hi - 1].end

    def raw(self, view: memoryview, a: int, b: int) -> torch.Tensor:
        """Blocks ``a .. b-1`` of the fetched window ``view`` as a flat tensor of their dtype (no copy)."""
        t = self.tensor
        part = view[self.blocks[a].begin - self.begin : self.blocks[b - 1].end - self.begin]
        return raw_view(part, t.dtype, (len(part) // (t.nbytes // t.numel),))


def hash_window(item: WorkItem, views: list[memoryview]) -> list[str] | None:
    """The read-ahead's ``on_read``: the hashes of a window's blocks where some are unknown."""
    read: Read = item.payload
    if all(b.hash is not None for b in read.blocks[read.lo : read.hi]):
        return None
    (view,) = views
    if isinstance(read.lora, LoraTarget):  # each block: its rows of B, then A
        return span_hashes(read.lora, view, read.begin, read.blocks)
    return [block_digest(view[b.begin - read.begin : b.end - read.begin]) for b in read.blocks[read.lo : read.hi]]


@dataclass(frozen=True)
class AnalyzeReport:
    """What one ``analyze`` call did and what it cost."""

    base_id: str | None
    hashed: tuple[str, ...]
    analyzed: tuple[str, ...]
    skipped: tuple[str, ...]
    bytes_read: int
    bytes_by_model: dict[str, int]
    seconds: float
    # expert -> (tensors taken over from its previous version, tensors in all)
    inherited: dict[str, tuple[int, int]] = field(default_factory=dict)
    # bytes read again for the thresholds of tensors larger than a window (not in bytes_read)
    reread_bytes: int = 0

    @property
    def bytes_per_second(self) -> float:
        return self.bytes_read / self.seconds if self.seconds > 0 else 0.0


def analyze(
    catalog: Catalog,
    model_ids: Sequence[str] | None = None,
    base_id: str | None = None,
    progress: bool = True,
) -> AnalyzeReport:
    """Hash ``model_ids`` and, with ``base_id``, analyse each against the base."""
    start = time.perf_counter()
    if base_id is not None:
        base_id = catalog.models.resolve(base_id).id
    if model_ids is not None:
        model_ids = [catalog.models.resolve(m).id for m in model_ids]
    first = _hash_new_versions(catalog, model_ids, base_id, progress)
    job = _prepare(catalog, model_ids, base_id)
    _download_hub_models(job)
    remote = any(isinstance(job.root(m), RemotePath) for m in job.records)
    with CheckpointSource(TransferMeter() if remote else None) as source, compute_threads():
        read_bytes, read_seconds = _run(job, source, progress)
        by_model = source.bytes_by_tag()
    reread = by_model.pop(REREAD, 0)
    _record(catalog, job)
    if read_bytes and read_seconds > 0 and not remote:  # this machine's read rate: the time model's prior
        catalog.timings.add_read(host_key(), read_bytes, read_seconds)
    hashed = tuple(m for m in job.records if m in job.new_hashes)
    if first is not None:
        for model_id, n in first.bytes_by_model.items():
            by_model[model_id] = by_model.get(model_id, 0) + n
        hashed, reread = hashed + first.hashed, reread + first.reread_bytes
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


def _hash_new_versions(
    catalog: Catalog, model_ids: Sequence[str] | None, base_id: str | None, progress: bool
) -> AnalyzeReport | None:
    """Hash the new versions of analysed experts in a call of their own first."""
    if base_id is None:
        return None
    experts = _models(catalog, model_ids, base_id)[1]
    versions = [
        e
        for e in _previous_versions(catalog, experts, base_id)
        if catalog.blocks.hashed_count(e) < catalog.models.get(e).n_blocks
    ]
    if not versions:
        return None
    return analyze(catalog, [catalog.models.exact_ref(catalog.models.get(e)) for e in versions], progress=progress)


def _previous_versions(catalog: Catalog, experts: Sequence[str], base_id: str) -> dict[str, str]:
    """Expert -> its previous version, where that is analysed against ``base_id`` and of the same kind."""
    out = {}
    for expert_id in experts:
        record = catalog.models.get(expert_id)
        previous = next((v for v in catalog.models.versions(record.name) if v.version == record.version - 1), None)
        if previous is not None and previous.kind == record.kind != LORA:
            if catalog.stats.is_analyzed(previous.id, base_id):
                out[expert_id] = previous.id
    return out


def _download_hub_models(job: AnalyzeJob) -> None:
    """Download each Hub model analysis reads into the Hugging Face cache first, whole."""
    for model_id in dict.fromkeys(r.tag for item in job.schedule for r in item.reads):
        root = job.root(model_id)
        if isinstance(root, RemotePath) and root.hub is not None:
            checkpoint = open_checkpoint(root)
            index = [INDEX_FILE] if checkpoint.index is not None else []
            hub.download(root, [*(f.name for f in checkpoint.files), *index, *checkpoint.aux_files])


@dataclass
class AnalyzeJob:
    """Everything one analyze call knows before it reads, and what it computes."""

    base_id: str | None
    records: dict[str, ModelRecord]
    tensors: dict[str, list[TensorRecord]]
    blocks: dict[str, dict[str, list[BlockRecord]]]
    experts: list[str]  # to analyse against base_id
    skipped: list[str]
    formats: dict[str, ExpertFormat]  # expert -> how its bytes give Δ
    loras: dict[str, LoraAdapter]  # the LoRA adapters among the models
    # expert -> its previous version's rows and block hashes, by tensor
    inherit: dict[str, tuple[dict[str, TensorResult], dict[str, list[str | None]]]] = field(default_factory=dict)
    schedule: list[WorkItem] = field(default_factory=list)  # what to read, in order
    new_hashes: dict[str, dict[str, list[str | None]]] = field(default_factory=dict)  # filled window by window
    deltas: dict[str, list[BlockDelta]] = field(default_factory=dict)
    stats: dict[str, list[TensorStats]] = field(default_factory=dict)
    inherited: dict[str, int] = field(default_factory=dict)  # expert -> tensors taken over unchanged

    @property
    def base(self) -> str:
        """``base_id`` where there must be one: experts exist only in a call with a base."""
        if self.base_id is None:
            raise AssertionError("an expert was analysed without a base")
        return self.base_id

    def hashes(self, model_id: str, tensor: str) -> list[str | None]:
        recorded = [b.hash for b in self.blocks[model_id][tensor]]
        computed = self.new_hashes.get(model_id, {}).get(tensor)
        return recorded if computed is None else [c if c is not None else r for c, r in zip(computed, recorded)]

    def root(self, model_id: str) -> Location:
        return location(self.records[model_id].uri)  # a local directory, or a remote one read by ranged requests

    def tensor(self, model_id: str, name: str) -> TensorRecord | None:
        return next((t for t in self.tensors[model_id] if t.name == name), None)

    def add(self, expert: str, result: TensorResult) -> None:
        self.deltas[expert].extend(result[0])
        self.stats[expert].append(result[1])

    def reads(self, model_id: str, role: str, t: TensorRecord) -> list[WorkItem]:
        """The reads of one model's tensor, window by window; an adapter's factors are read whole."""
        blocks = self.blocks[model_id][t.name]
        adapter = self.loras.get(model_id)
        lora = (adapter.targets.get(t.name) or adapter.saved.get(t.name)) if adapter is not None else None
        rows = t.shape[0] if t.shape else 1
        per_row = t.numel // rows if rows else 0
        windows = block_windows([(b.row_end - b.row_start) * per_row for b in blocks])
        if isinstance(lora, LoraTarget):
            windows = [(0, len(blocks))]
        reads = [
            Read(model_id, role, t, blocks, lo, hi, n == len(windows) - 1, lora) for n, (lo, hi) in enumerate(windows)
        ]
        root = self.root(model_id)
        return [WorkItem(r, [ByteRange(root / t.file, r.begin, r.end, model_id)]) for r in reads]


def _models(catalog: Catalog, model_ids: Sequence[str] | None, base_id: str | None) -> tuple[list[str], list[str]]:
    """``(every model of the call, the experts among them still to analyse against base_id)``."""
    if model_ids is None:
        models = [m for m in catalog.models.list() if catalog.models.latest(m.name) == m]
        if base_id is not None:  # checkpoints, and the deltas taken against this base
            models = [m for m in models if m.id != base_id and (m.kind == "checkpoint" or m.delta_base == base_id)]
        ids = [m.id for m in models]
    else:
        ids = list(dict.fromkeys(model_ids))
    if base_id is None:
        return ids, []
    return ids, [m for m in ids if m != base_id and not catalog.stats.is_analyzed(m, base_id)]


def _prepare(catalog: Catalog, model_ids: Sequence[str] | None, base_id: str | None) -> AnalyzeJob:
    """What one call reads and computes, checked before any read."""
    if base_id is not None:
        catalog.models.get(base_id)
    ids, experts = _models(catalog, model_ids, base_id)
    records = {m: catalog.models.get(m) for m in ([base_id] if base_id else []) + ids}
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
        skipped=[m for m in ids if base_id is not None and m != base_id and m not in experts],
        formats={e: expert_format(records[e].kind) for e in experts},
        loras=loras,
    )
    if base_id is not None:
        for e, previous in _previous_versions(catalog, experts, base_id).items():
            deltas = catalog.stats.block_deltas(previous, base_id)
            stats = catalog.stats.tensor_stats(previous, base_id)
            results = {name: (list(deltas.get(name, [])), s) for name, s in stats.items()}
            job.inherit[e] = (results, catalog.blocks.hashes(previous))
    job.schedule = list(_scheduled(job))
    return job


def _known(hashes: list[str | None]) -> bool:
    return all(h is not None for h in hashes)


def _scheduled(job: AnalyzeJob) -> Iterator[WorkItem]:
    """What to read, in read order."""
    base = job.base_id
    if base is not None:
        for e in job.experts:
            job.deltas[e], job.stats[e] = [], []
        for bt in job.tensors[base]:
            yield from _schedule_tensor(job, bt)
    for m in job.records:
        if m != base and m not in job.experts:
            for t in job.tensors[m]:
                if not _known([b.hash for b in job.blocks[m][t.name]]):
                    yield from job.reads(m, "hash", t)


def _schedule_tensor(job: AnalyzeJob, bt: TensorRecord) -> list[WorkItem]:
    """The reads of one base tensor and of each expert's, interleaved window by window."""
    base = job.base
    base_hashes = [b.hash for b in job.blocks[base][bt.name]]
    mergeable = bt.dtype in MERGEABLE_DTYPES
    expert_reads: list[list[WorkItem]] = []
    need_base = not _known(base_hashes)
    for e in job.experts:
        et = job.tensor(e, bt.name)
        if et is None:  # a delta that leaves the tensor out: Δ = 0, nothing to read
            job.add(e, from_hashes(bt, job.blocks[base][bt.name], [True] * len(base_hashes)))
            continue
        e_blocks = job.blocks[e][bt.name]
        e_hashes = job.hashes(e, bt.name)
        results, previous_hashes = job.inherit.get(e, ({}, {}))
        if bt.name in results and _known(e_hashes) and previous_hashes.get(bt.name) == e_hashes:
            job.add(e, results[bt.name])  # byte-identical to the previous version's tensor: its rows hold
            job.inherited[e] = job.inherited.get(e, 0) + 1
            continue
        fmt = job.formats[e]
        known = _known(e_hashes) and (_known(base_hashes) or not fmt.needs_base)
        flags = fmt.unchanged_flags(e_hashes, base_hashes, e_blocks)
        if known and (not mergeable or all(flags)):
            job.add(e, from_hashes(bt, e_blocks, flags))
            continue
        expert_reads.append(job.reads(e, "expert", et))
        lora = expert_reads[-1][0].payload.lora
        need_base = need_base or (mergeable and (fmt.needs_base or isinstance(lora, SavedTensor)))
    reads = [job.reads(base, "base", bt) if need_base else [], *expert_reads]
    return [r[w] for w in range(max(len(r) for r in reads)) for r in reads if w < len(r)]


def _run(job: AnalyzeJob, source: CheckpointSource, progress: bool) -> tuple[int, float]:
    """Walk the schedule; the bytes the reading thread read and its seconds reading and hashing them."""
    total = sum(item.nbytes for item in job.schedule)
    readahead = read_ahead(source, job.schedule, hash_window)
    analyser = _Analyser(job, source)
    stream = readahead.run(job.schedule)  # remote: adjacent reads of a file in one request
    status = source.meter.status if source.meter else None  # remote MB/s and requests, beside the bar
    with byte_progress("analyze", total, progress and total > 0, status) as advance, closing(stream):
        try:
            for fetched in stream:
                read: Read = fetched.item.payload
                if fetched.result is not None:
                    found = job.new_hashes.setdefault(read.model_id, {})
                    found.setdefault(read.tensor.name, [None] * len(read.blocks))[read.lo : read.hi] = fetched.result
                if read.role == "base":
                    analyser.set_base(fetched)
                else:
                    if read.role == "expert":
                        analyser.expert(read, fetched.views[0])
                    fetched.release()
                advance(fetched.item.nbytes, f"{read.model_id}: {read.tensor.name}")
        finally:
            analyser.set_base(None)
    return readahead.read_bytes, readahead.read_seconds


class _Analyser:
    """Feeds each expert window to its tensor's pass (``stats.TensorPass``) against the base window."""

    def __init__(self, job: AnalyzeJob, source: CheckpointSource) -> None:
        self.job, self.source = job, source
        self.workspace = Workspace()
        self.passes: dict[tuple[str, str], TensorPass] = {}
        self.base: Fetched | None = None

    def set_base(self, fetched: Fetched | None) -> None:
        if self.base is not None:
            self.base.release()
        self.base = fetched

    def flags(self, read: Read, lo: int, hi: int) -> list[bool]:
        """Per block ``lo .. hi-1`` of the read's tensor: known from hashes to be unchanged."""
        job, name = self.job, read.tensor.name
        return job.formats[read.model_id].unchanged_flags(
            job.hashes(read.model_id, name)[lo:hi], job.hashes(job.base, name)[lo:hi], read.blocks[lo:hi]
        )

    def expert(self, read: Read, view: memoryview) -> None:
        """Take one window of an expert tensor; the tensor's result after its last window."""
        job, t, e = self.job, read.tensor, read.model_id
        who = f"'{e}' against '{job.base_id}'"
        if isinstance(read.lora, LoraTarget) or t.dtype not in MERGEABLE_DTYPES:
            if not read.last:
                return
            flags = self.flags(read, 0, len(read.blocks))
            if all(flags) or not isinstance(read.lora, LoraTarget) or t.dtype not in MERGEABLE_DTYPES:
                job.add(e, from_hashes(t, read.blocks, flags))
            else:  # ΔW of this tensor from its factors
                job.add(e, span_result(read.lora, view, t, read.blocks, who))
            return
        work = self.passes.get((e, t.name))
        if work is None:
            work = self.passes[(e, t.name)] = TensorPass(t, read.blocks, who, self.workspace)
        first = work.starts[read.lo]
        window = self.workspace.new_window(work.starts[read.hi] - first)
        base = None
        if job.formats[e].needs_base or isinstance(read.lora, SavedTensor):  # a replacement: Δ needs the base
            base = self.base
            if base is None or (base.item.payload.tensor.name, base.item.payload.lo) != (t.name, read.lo):
                raise AssertionError(f"base window of {t.name} was not read before the expert's")

        def values(a: int, b: int) -> torch.Tensor:
            out = window[work.starts[a] - first : work.starts[b] - first]
            base_raw = base.item.payload.raw(base.views[0], a, b) if base is not None else None
            return self.workspace.abs_delta(out, read.raw(view, a, b), base_raw)

        work.add(read.lo, self.flags(read, read.lo, read.hi), values)
        if read.last:
            del self.passes[(e, t.name)]
            job.add(e, work.result(self._again(read, work, window, base is not None)))

    def _again(
        self, read: Read, work: TensorPass, window: torch.Tensor, with_base: bool
    ) -> Callable[[int, int], torch.Tensor]:
        """|Δ| of changed blocks once more."""
        generation, first = self.workspace.generation, work.starts[read.lo]

        def again(a: int, b: int) -> torch.Tensor:
            if generation == self.workspace.generation and read.lo <= a and b <= read.hi:
                return window[work.starts[a] - first : work.starts[b] - first]
            expert = self.reread(read.model_id, read.tensor.name, a, b)
            base = self.reread(self.job.base, read.tensor.name, a, b) if with_base else None
            return self.workspace.abs_delta(self.workspace.buffer("again", expert.numel()), expert, base)

        return again

    def reread(self, model_id: str, name: str, a: int, b: int) -> torch.Tensor:
        """Blocks ``a .. b-1`` of a model's tensor, read again and checked against the first read's hashes."""
        job = self.job
        t = job.tensor(model_id, name)
        assert t is not None  # an expert's tensors are its base's (checked before reading)
        blocks = job.blocks[model_id][name][a:b]
        begin, end = blocks[0].begin, blocks[-1].end
        view = self.source.read(job.root(model_id) / t.file, begin, end, tag=REREAD)
        for block, digest in zip(blocks, job.hashes(model_id, name)[a:b]):
            if block_digest(view[block.begin - begin : block.end - begin]) != digest:
                raise ModelChangedError(
                    f"model '{model_id}' changed on disk while analyze ran: block {block.index} of tensor "
                    f"'{name}' no longer matches the bytes read first; run `mergepipe analyze` again"
                )
        return raw_view(view, t.dtype, ((end - begin) // (t.nbytes // t.numel),))


def _record(catalog: Catalog, job: AnalyzeJob) -> None:
    """Write new hashes and analyses: one transaction per model / per expert."""

    def check_same(model_id: str) -> None:
        if catalog.models.find(model_id) != job.records[model_id]:
            raise CatalogError(f"model '{model_id}' was re-registered while analyze ran; run `mergepipe analyze` again")

    def flat(model_id: str) -> list[tuple[str, int, str]]:
        found = job.new_hashes.get(model_id, {})
        return [(tensor, i, h) for tensor, hashes in found.items() for i, h in enumerate(hashes) if h is not None]

    for model_id in job.records:
        if model_id not in job.experts and model_id in job.new_hashes:
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
