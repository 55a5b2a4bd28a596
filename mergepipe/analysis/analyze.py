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

import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from types import TracebackType
from typing import Callable

import numpy as np
import torch

from mergepipe.analysis.experts import (
    LORA,
    ExpertFormat,
    adapter_part,
    check_delta_base,
    check_layout,
    expert_format,
    open_lora,
    open_registered,
    replaces,
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
from mergepipe.storage.source import ByteRange, CheckpointSource, Fetched, ReadAhead, WorkItem, block_digest
from mergepipe.storage.writer import raw_view

#: Entries in one window: 16 MiB per fp32 buffer. Every tensor of a Qwen3-0.6B layer fits in one window
#: (no second read); an embedding takes ~40 windows; a few buffers of this size bound analysis memory.
WINDOW_ELEMENTS = 1 << 22

#: The byte-counter tag of second reads (not a model id: reports count each checkpoint byte once).
REREAD = "#reread"


def block_entries(t: TensorRecord, blocks: Sequence[BlockRecord]) -> list[int]:
    """Entries of each block (rows times the entries of a row: the same for every format of a tensor)."""
    rows = t.shape[0] if t.shape else 1
    per_row = t.numel // rows if rows else 0
    return [(b.row_end - b.row_start) * per_row for b in blocks]


def block_windows(sizes: Sequence[int], limit: int | None = None) -> list[tuple[int, int]]:
    """Consecutive block ranges ``(lo, hi)`` of at most ``limit`` (default ``WINDOW_ELEMENTS``) entries each
    (a larger block alone)."""
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
    """Blocks ``lo .. hi-1`` of one model's tensor, as one read (the payload of a read-ahead item)."""

    model_id: str
    role: str  # "base", "expert" or "hash"
    tensor: TensorRecord
    blocks: list[BlockRecord]  # all of the tensor's blocks
    lo: int
    hi: int
    last: bool  # the tensor's last window
    needs_hash: bool
    lora: LoraTarget | SavedTensor | None = None  # an adapter's factors (read whole, their span) or replacement

    @property
    def begin(self) -> int:
        return self.tensor.begin if isinstance(self.lora, LoraTarget) else self.blocks[self.lo].begin

    @property
    def end(self) -> int:
        return self.tensor.end if isinstance(self.lora, LoraTarget) else self.blocks[self.hi - 1].end

    def item(self, root: Location) -> WorkItem:
        return WorkItem(self, [ByteRange(root / self.tensor.file, self.begin, self.end, self.model_id)])


def tensor_reads(
    model_id: str,
    role: str,
    t: TensorRecord,
    blocks: list[BlockRecord],
    windows: list[tuple[int, int]],
    lora: LoraTarget | SavedTensor | None,
) -> list[Read]:
    """The reads of one model's tensor, window by window; an adapter's factors are read whole."""
    if isinstance(lora, LoraTarget):
        windows = [(0, len(blocks))]
    return [
        Read(model_id, role, t, blocks, lo, hi, n == len(windows) - 1, any(b.hash is None for b in blocks[lo:hi]), lora)
        for n, (lo, hi) in enumerate(windows)
    ]


def hash_window(item: WorkItem, views: list[memoryview]) -> list[str] | None:
    """Block hashes of a freshly read window, computed on the reading thread (the second core is better
    spent on torch than on blake3)."""
    read: Read = item.payload
    if not read.needs_hash:
        return None
    (view,) = views
    if isinstance(read.lora, LoraTarget):  # each block: its rows of B, then A
        return span_hashes(read.lora, view, read.begin, read.blocks)
    return [block_digest(view[b.begin - read.begin : b.end - read.begin]) for b in read.blocks[read.lo : read.hi]]


def window_raw(read: Read, view: memoryview, a: int, b: int) -> torch.Tensor:
    """Blocks ``a .. b-1`` of a fetched window as a flat tensor of their dtype (no copy)."""
    t = read.tensor
    part = view[read.blocks[a].begin - read.begin : read.blocks[b - 1].end - read.begin]
    itemsize = t.nbytes // t.numel
    return raw_view(part, t.dtype, (len(part) // itemsize,))


class Rereader:
    """The second look: blocks read again, checked against their recorded hashes, their |Δ| recomputed."""

    def __init__(self, source: CheckpointSource, workspace: Workspace) -> None:
        self.source = source
        self.workspace = workspace
        self._buffers: dict[str, np.ndarray] = {}

    def _read(
        self,
        name: str,
        model_id: str,
        root: Location,
        t: TensorRecord,
        blocks: Sequence[BlockRecord],
        hashes: Sequence[str | None],
    ) -> torch.Tensor:
        begin, end = blocks[0].begin, blocks[-1].end
        buf = self._buffers.get(name)
        if buf is None or buf.nbytes < end - begin:
            buf = self._buffers[name] = np.empty(end - begin, dtype=np.uint8)
        view = self.source.read(root / t.file, begin, end, out=buf, tag=REREAD)
        for block, digest in zip(blocks, hashes):
            if block_digest(view[block.begin - begin : block.end - begin]) != digest:
                raise ModelChangedError(
                    f"model '{model_id}' changed on disk while analyze ran: block {block.index} of tensor "
                    f"'{t.name}' no longer matches the bytes read first; run `mergepipe analyze` again"
                )
        return raw_view(view, t.dtype, ((end - begin) // (t.nbytes // t.numel),))

    def delta(
        self,
        expert: tuple[str, Location, TensorRecord, Sequence[BlockRecord], Sequence[str | None]],
        base: tuple[str, Location, TensorRecord, Sequence[BlockRecord], Sequence[str | None]] | None,
    ) -> torch.Tensor:
        """|Δ| of the given blocks of an expert (model id, root, tensor, blocks, their hashes) against the
        same blocks of the base (``None``: the expert's bytes are Δ), in the workspace's ``again`` buffer."""
        expert_raw = self._read("expert", *expert)
        base_raw = self._read("base", *base) if base is not None else None
        out = self.workspace.buffer("again", expert_raw.numel())
        return self.workspace.abs_delta(out, expert_raw, base_raw)


#: Windows the hashing thread reads ahead of its hashing: enough to keep the disk busy.


@dataclass(frozen=True)
class Inheritance:
    """Where expert ``expert`` may take unchanged tensors from, and how many it took."""

    expert: str
    previous: str  # the previous version's id
    results: dict[str, TensorResult]  # tensor -> the previous version's rows
    previous_hashes: dict[str, list[str | None]]


def previous_versions(catalog: Catalog, experts: Sequence[str], base_id: str) -> dict[str, str]:
    """Expert id -> the id of its previous version, for experts whose previous version is analysed
    against ``base_id``."""
    out = {}
    for expert_id in experts:
        record = catalog.models.get(expert_id)
        if record.version < 2:
            continue
        previous = next((v for v in catalog.models.versions(record.name) if v.version == record.version - 1), None)
        if previous is not None and catalog.stats.is_analyzed(previous.id, base_id):
            out[expert_id] = previous.id
    return out


def inheritance(catalog: Catalog, expert_id: str, previous_id: str, base_id: str) -> Inheritance:
    """The previous version's rows, per tensor, ready to be taken over."""
    deltas = catalog.stats.block_deltas(previous_id, base_id)
    stats = catalog.stats.tensor_stats(previous_id, base_id)
    results = {name: (list(deltas.get(name, [])), s) for name, s in stats.items()}
    return Inheritance(expert_id, previous_id, results, catalog.blocks.hashes(previous_id))


def inherited(inherit: Inheritance | None, tensor: str, hashes: list[str | None]) -> TensorResult | None:
    """The previous version's result for ``tensor`` if the expert's blocks there are byte-identical to
    it (every hash known and equal), else None."""
    if inherit is None or tensor not in inherit.results or any(h is None for h in hashes):
        return None
    return inherit.results[tensor] if inherit.previous_hashes.get(tensor) == hashes else None


class VersionHasher:
    """The block hashes of new versions, read and hashed on a thread of its own (module docstring).

    ``work`` lists, in the order analysis will ask for them, each (model, tensor) and the reads of its
    windows; ``hashes(model, tensor)`` waits for that tensor's hashes (an error of the thread is raised
    there). A context manager: leaving it stops the thread (between windows) and waits for it.
    """

    def __init__(self, work: Sequence[tuple[str, str, Sequence[WorkItem]]]) -> None:
        self._work = work
        self._ready: dict[tuple[str, str], list[str | None]] = {}
        self._failed: BaseException | None = None
        self._stop = False
        self._changed = threading.Condition()
        self.source = CheckpointSource(None)  # local files only: its own byte counters
        self.read_bytes = 0
        self.read_seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="mergepipe-version-hash", daemon=True)
        for model_id, tensor, items in work:  # nothing to read (an empty tensor): no hashes to wait for
            if not items:
                self._ready[(model_id, tensor)] = []

    def __enter__(self) -> VersionHasher:
        self.source.__enter__()
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        with self._changed:
            self._stop = True
        self._thread.join()
        self.source.__exit__(kind, exc, tb)

    def hashes_for(self, model_id: str) -> bool:
        """Whether this hasher hashes ``model_id``."""
        return any(m == model_id for m, _, _ in self._work)

    def hashes(self, model_id: str, tensor: str) -> list[str | None]:
        """The block hashes of ``tensor`` of ``model_id``, once the thread has them."""
        key = (model_id, tensor)
        with self._changed:
            while key not in self._ready and self._failed is None:
                self._changed.wait()
            if key in self._ready:
                return self._ready.pop(key)
            assert self._failed is not None
            raise self._failed

    def _items(self) -> Iterator[WorkItem]:
        for _, _, items in self._work:
            if self._stop:
                return
            yield from items

    def _run(self) -> None:
        largest = max((item.nbytes for _, _, items in self._work for item in items), default=1)
        readahead = ReadAhead(self.source, threads=1, window_bytes=_WINDOWS_AHEAD * largest, on_read=hash_window)
        pending: dict[tuple[str, str], list[str | None]] = {}
        try:
            with closing(readahead.run(self._items())) as stream:
                for fetched in stream:
                    read: Read = fetched.item.payload
                    fetched.release()
                    key = (read.model_id, read.tensor.name)
                    found = pending.setdefault(key, [None] * len(read.blocks))
                    found[read.lo : read.hi] = fetched.result or [None] * (read.hi - read.lo)
                    if read.last:
                        with self._changed:
                            self._ready[key] = pending.pop(key)
                            self._changed.notify_all()
        except BaseException as exc:
            with self._changed:
                self._failed = exc
                self._changed.notify_all()
        finally:
            self.read_bytes, self.read_seconds = readahead.read_bytes, readahead.read_seconds


#: How many windows the reading thread may run ahead of the computing one:
#: enough to overlap I/O and hashing with compute, little enough to bound memory.
_WINDOWS_AHEAD = 3


@dataclass
class AnalyzeJob:
    """Everything one analyze call knows before it reads, and what it computes."""

    base_id: str | None
    records: dict[str, ModelRecord]
    tensors: dict[str, list[TensorRecord]]
    blocks: dict[str, dict[str, list[BlockRecord]]]
    experts: list[str]  # to analyse against base_id
    skipped: list[str]
    formats: dict[str, ExpertFormat] = field(default_factory=dict)  # expert -> how its bytes give Δ
    loras: dict[str, LoraAdapter] = field(default_factory=dict)  # the LoRA adapters among the models
    # what to read, in order: a list, or produced as the reads are consumed (new versions hashed beside their
    # analysis, ``analyze._scheduled``), with ``expected`` then its (total bytes at most, largest read)
    schedule: Iterable[WorkItem] = field(default_factory=list)
    expected: tuple[int, int] | None = None
    new_hashes: dict[str, dict[str, list[str | None]]] = field(default_factory=dict)  # filled window by window
    deltas: dict[str, list[BlockDelta]] = field(default_factory=dict)
    stats: dict[str, list[TensorStats]] = field(default_factory=dict)
    inherit: dict[str, Inheritance] = field(default_factory=dict)  # expert -> its previous version's rows
    inherited: dict[str, int] = field(default_factory=dict)  # expert -> tensors taken over unchanged
    _by_name: dict[str, dict[str, TensorRecord]] = field(default_factory=dict)

    @property
    def base(self) -> str:
        """``base_id`` where there must be one: experts (and their windows) exist only in a call with a base."""
        if self.base_id is None:
            raise AssertionError("an expert was analysed without a base")
        return self.base_id

    def hashes(self, model_id: str, tensor: str) -> list[str | None]:
        recorded = [b.hash for b in self.blocks[model_id][tensor]]
        computed = self.new_hashes.get(model_id, {}).get(tensor)
        if computed is None:
            return recorded
        return [c if c is not None else r for c, r in zip(computed, recorded)]

    def root(self, model_id: str) -> Location:
        return location(self.records[model_id].uri)  # a local directory, or a remote one read by ranged requests

    def tensor(self, model_id: str, name: str) -> TensorRecord | None:
        if model_id not in self._by_name:
            self._by_name[model_id] = {t.name: t for t in self.tensors[model_id]}
        return self._by_name[model_id].get(name)

    def set_hashes(self, read: Read, hashes: list[str]) -> None:
        tensor = self.new_hashes.setdefault(read.model_id, {}).setdefault(read.tensor.name, [None] * len(read.blocks))
        tensor[read.lo : read.lo + len(hashes)] = hashes

    def add(self, expert: str, result: TensorResult) -> None:
        deltas, stats = result
        self.deltas[expert].extend(deltas)
        self.stats[expert].append(stats)


def run(job: AnalyzeJob, source: CheckpointSource, progress: bool) -> tuple[int, float]:
    """Walk the schedule; the bytes the reading thread read and the seconds it spent reading and hashing them
    (this machine's checked read rate, beside whatever analysis computed meanwhile)."""
    schedule: Iterable[WorkItem]
    if job.expected is None:
        schedule = list(job.schedule)
        total = sum(item.nbytes for item in schedule)
        largest = max((item.nbytes for item in schedule), default=1)
    else:
        schedule, (total, largest) = job.schedule, job.expected
    window = _WINDOWS_AHEAD * largest
    readahead = ReadAhead(source, threads=1, window_bytes=window, on_read=hash_window)
    analyser = _Analyser(job, source)
    stream = readahead.run(schedule)  # remote: adjacent reads of a file in one request
    status = source.meter.status if source.meter else None  # remote MB/s and requests, beside the bar
    with byte_progress("analyze", total, progress and total > 0, status) as advance, closing(stream):
        try:
            for fetched in stream:
                read: Read = fetched.item.payload
                if fetched.result is not None:
                    job.set_hashes(read, fetched.result)
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


def _flags(job: AnalyzeJob, read: Read) -> list[bool]:
    """Per block of the read's window: known from hashes to be unchanged."""
    name, lo, hi = read.tensor.name, read.lo, read.hi
    base_hashes = job.hashes(job.base, name)[lo:hi]
    return job.formats[read.model_id].unchanged_flags(
        job.hashes(read.model_id, name)[lo:hi], base_hashes, read.blocks[lo:hi]
    )


class _Analyser:
    """Feeds each expert window to its tensor's pass (``stats.TensorPass``) against the base window."""

    def __init__(self, job: AnalyzeJob, source: CheckpointSource) -> None:
        self.job = job
        self.workspace = Workspace()
        self.rereader = Rereader(source, self.workspace)
        self.passes: dict[tuple[str, str], TensorPass] = {}
        self.base: Fetched | None = None

    def set_base(self, fetched: Fetched | None) -> None:
        if self.base is not None:
            self.base.release()
        self.base = fetched

    def expert(self, read: Read, view: memoryview) -> None:
        """Record what one window of an expert tensor says; the tensor's result after its last window."""
        job, t, e = self.job, read.tensor, read.model_id
        who = f"'{e}' against '{job.base_id}'"
        if isinstance(read.lora, LoraTarget) or t.dtype not in MERGEABLE_DTYPES:
            if not read.last:
                return
            whole = Read(e, read.role, t, read.blocks, 0, len(read.blocks), True, False, read.lora)
            flags = _flags(job, whole)
            if all(flags) or t.dtype not in MERGEABLE_DTYPES or not isinstance(read.lora, LoraTarget):
                job.add(e, from_hashes(t, read.blocks, flags))
            else:  # ΔW of this tensor from its factors
                job.add(e, span_result(read.lora, view, t, read.blocks, who))
            return
        work = self.passes.get((e, t.name))
        if work is None:
            work = self.passes[(e, t.name)] = TensorPass(t, read.blocks, who, self.workspace)
        window = self.workspace.new_window(work.starts[read.hi] - work.starts[read.lo])
        base = self._base_of(read)

        def values(a: int, b: int) -> torch.Tensor:
            out = window[work.starts[a] - work.starts[read.lo] : work.starts[b] - work.starts[read.lo]]
            base_raw = window_raw(base.item.payload, base.views[0], a, b) if base is not None else None
            return self.workspace.abs_delta(out, window_raw(read, view, a, b), base_raw)

        work.add(read.lo, _flags(job, read), values)
        if read.last:
            del self.passes[(e, t.name)]
            job.add(e, work.result(self._again(read, work, window, base is not None)))

    def _base_of(self, read: Read) -> Fetched | None:
        """The base window an expert window's Δ needs (None for a delta checkpoint)."""
        if not (self.job.formats[read.model_id].needs_base or replaces(read.lora)):
            return None
        base = self.base
        payload: Read | None = base.item.payload if base is not None else None
        if base is None or payload is None or (payload.tensor.name, payload.lo) != (read.tensor.name, read.lo):
            raise AssertionError(f"base window of {read.tensor.name} was not read before the expert's")
        return base

    def _again(
        self, read: Read, work: TensorPass, window: torch.Tensor, with_base: bool
    ) -> Callable[[int, int], torch.Tensor]:
        """|Δ| of changed blocks once more: from the last window while the workspace still holds it, else
        read again (``Rereader``)."""
        job, name = self.job, read.tensor.name
        base_id = job.base
        generation, first = self.workspace.generation, work.starts[read.lo]

        def again(a: int, b: int) -> torch.Tensor:
            if generation == self.workspace.generation and read.lo <= a and b <= read.hi:
                return window[work.starts[a] - first : work.starts[b] - first]
            expert = (
                read.model_id,
                job.root(read.model_id),
                read.tensor,
                read.blocks[a:b],
                job.hashes(read.model_id, name)[a:b],
            )
            base = None
            if with_base:
                base_tensor = job.tensor(base_id, name)
                assert base_tensor is not None  # an expert's tensors are its base's (checked before reading)
                base = (
                    base_id,
                    job.root(base_id),
                    base_tensor,
                    job.blocks[base_id][name][a:b],
                    job.hashes(base_id, name)[a:b],
                )
            return self.rereader.delta(expert, base)

        return again


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
    # expert -> (tensors taken from its previous version unchanged, tensors in all): incremental.py
    inherited: dict[str, tuple[int, int]] = field(default_factory=dict)
    # bytes read a second time, from the page cache, for the thresholds of tensors larger than a window
    # (windows.py); not in bytes_read, which counts each checkpoint byte once
    reread_bytes: int = 0

    @property
    def bytes_per_second(self) -> float:
        return self.bytes_read / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict:
        return {
            "base_id": self.base_id,
            "hashed": list(self.hashed),
            "analyzed": list(self.analyzed),
            "skipped": list(self.skipped),
            "bytes_read": self.bytes_read,
            "bytes_by_model": dict(self.bytes_by_model),
            "seconds": self.seconds,
            "inherited": {e: list(n) for e, n in self.inherited.items()},
            "reread_bytes": self.reread_bytes,
        }


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
    with (
        CheckpointSource(TransferMeter() if remote else None) as source,
        compute_threads(),
        VersionHasher(_hash_work(job, hashed_beside)) as hasher,
    ):
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
    return [
        e
        for e in _previous_versions(catalog, experts, base_id)
        if catalog.blocks.hashed_count(e) < catalog.models.get(e).n_blocks
    ]


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


def _prepare(
    catalog: Catalog,
    model_ids: Sequence[str] | None,
    base_id: str | None,
    incremental: bool = False,
    deferred: Sequence[str] = (),
    schedule: bool = True,
) -> AnalyzeJob:
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
        job.inherit = {
            e: inheritance(catalog, e, previous, base_id)
            for e, previous in _previous_versions(catalog, experts, base_id).items()
        }
    if schedule and not deferred:
        job.schedule = list(_scheduled(job, None))
    return job


def _previous_versions(catalog: Catalog, experts: Sequence[str], base_id: str) -> dict[str, str]:
    """``previous_versions`` of the same kind: equal bytes mean equal Δ only within one format (and not for
    adapters, whose config scales the same factors)."""
    kind = {m: catalog.models.get(m).kind for m in experts}
    return {
        e: p
        for e, p in previous_versions(catalog, experts, base_id).items()
        if catalog.models.get(p).kind == kind[e] != LORA
    }


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
    windows = (
        min(t.numel, WINDOW_ELEMENTS) * (t.nbytes // max(t.numel, 1)) for m in job.records for t in job.tensors[m]
    )
    blocks = (b.end - b.begin for m in job.records for per in job.blocks[m].values() for b in per)
    return total, max(1, *windows, *blocks)


def _hash_work(job: AnalyzeJob, versions: Sequence[str]) -> list[tuple[str, str, list[WorkItem]]]:
    """What a ``VersionHasher`` reads for ``versions``, in the order ``_scheduled`` asks for it."""
    if job.base_id is None:
        return []
    return [
        (e, bt.name, [r.item(job.root(e)) for r in _reads(job, e, "hash", t)])
        for bt in job.tensors[job.base_id]
        for e in versions
        if (t := job.tensor(e, bt.name)) is not None
    ]


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
    return [r[w].item(job.root(r[w].model_id)) for w in range(max(len(r) for r in reads)) for r in reads if w < len(r)]


# ---------------------------------------------------------------------------- record


def _record(catalog: Catalog, job: AnalyzeJob) -> None:
    """Write new hashes and analyses: one transaction per model / per expert."""

    def check_same(model_id: str) -> None:
        if catalog.models.find(model_id) != job.records[model_id]:
            raise CatalogError(f"model '{model_id}' was re-registered while analyze ran; run `mergepipe analyze` again")

    def flat(model_id: str) -> list[tuple[str, int, str]]:
        return [
            (tensor, i, h)
            for tensor, hashes in job.new_hashes.get(model_id, {}).items()
            for i, h in enumerate(hashes)
            if h is not None
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
