"""One analyze call's state, and the loop that feeds each expert window to its tensor's pass.

``analyze.py`` plans what to read (``AnalyzeJob.schedule``: windows of blocks, ``windows.py``); ``run``
walks that schedule through the shared read-ahead, which reads and hashes the next windows on its thread
while this one computes: the base window is kept while each expert's same window becomes its |Δ| in the
workspace and goes to the tensor's ``stats.TensorPass``; after a tensor's last window its rows are final.
"""

from __future__ import annotations

from contextlib import closing
from dataclasses import dataclass, field
from typing import Callable
from collections.abc import Iterable

import torch

from mergepipe.analysis.expert_format import ExpertFormat
from mergepipe.analysis.incremental import Inheritance
from mergepipe.analysis.lora_expert import replaces
from mergepipe.analysis.lora_stats import span_result
from mergepipe.analysis.stats import TensorPass, TensorResult, Workspace, from_hashes
from mergepipe.analysis.windows import Read, Rereader, hash_window, window_raw
from mergepipe.catalog.records import BlockDelta, BlockRecord, ModelRecord, TensorRecord, TensorStats
from mergepipe.progress import byte_progress
from mergepipe.storage.format import MERGEABLE_DTYPES
from mergepipe.storage.location import Location, location
from mergepipe.storage.lora import LoraAdapter, LoraTarget
from mergepipe.storage.readahead import Fetched, ReadAhead, WorkItem
from mergepipe.storage.remote_source import CheckpointSource

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
    readahead = ReadAhead(source, threads=source.read_threads(1), window_bytes=window, on_read=hash_window)
    analyser = _Analyser(job, source)
    stream = readahead.run(source.planned(schedule))  # remote: adjacent reads of a file in one request
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
    return job.formats[read.model_id].unchanged_flags(job.hashes(read.model_id, name)[lo:hi], base_hashes,
                                                      read.blocks[lo:hi])


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

    def _again(self, read: Read, work: TensorPass, window: torch.Tensor, with_base: bool
               ) -> Callable[[int, int], torch.Tensor]:
        """|Δ| of changed blocks once more: from the last window while the workspace still holds it, else
        read again (``Rereader``)."""
        job, name = self.job, read.tensor.name
        base_id = job.base
        generation, first = self.workspace.generation, work.starts[read.lo]

        def again(a: int, b: int) -> torch.Tensor:
            if generation == self.workspace.generation and read.lo <= a and b <= read.hi:
                return window[work.starts[a] - first : work.starts[b] - first]
            expert = (read.model_id, job.root(read.model_id), read.tensor, read.blocks[a:b],
                      job.hashes(read.model_id, name)[a:b])
            base = None
            if with_base:
                base_tensor = job.tensor(base_id, name)
                assert base_tensor is not None  # an expert's tensors are its base's (checked before reading)
                base = (base_id, job.root(base_id), base_tensor, job.blocks[base_id][name][a:b],
                        job.hashes(base_id, name)[a:b])
            return self.rereader.delta(expert, base)

        return again


