"""Delta stores (``analyze --store-deltas``): per changed tensor of an (expert, base) pair, every non-zero
entry of Δ = E − B, largest |Δ| first, in hashed chunks, and three ternary sketch stages.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import re
import tempfile
import time
import uuid
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import reduce
from pathlib import Path
from typing import BinaryIO, NamedTuple

import numpy as np
import torch

from mergepipe.analysis.analyze import block_windows
from mergepipe.analysis.experts import check_blocks, open_registered, read_ahead
from mergepipe.catalog import Catalog
from mergepipe.catalog.statistics import DeltaChunk, DeltaStage, DeltaStoreRecord
from mergepipe.errors import ConfigError
from mergepipe.runtime import byte_progress, compute_threads
from mergepipe.storage.checkpoint import Checkpoint
from mergepipe.storage.format import (
    MAGIC,
    MERGEABLE_DTYPES,
    BlockSpec,
    TensorEntry,
    encode_chunk,
    encode_stage,
    tensor_blocks,
)
from mergepipe.storage.location import RemotePath
from mergepipe.storage.source import BlockCheck, ByteRange, CheckpointSource, WorkItem, block_digest
from mergepipe.storage.writer import raw_view

#: Stages written per tensor.
STAGES = 3
#: Elements per group of rows (a multiple of 5 elements, so packed stages concatenate).
GROUP_ELEMENTS = 4 * 1024 * 1024
#: Entries of the largest tensor read whole, and of a band of a larger one (~30 bytes each in memory).
BAND_ENTRIES = 1 << 24


@dataclass(frozen=True)
class SketchStage:
    """One stage of a tensor: its payload and what is left after it."""

    payload: bytes
    residual: float  # ||Δ - Σ_{s' <= s} S_s'||², float64
    norm: float  # ||Σ_{s' <= s} S_s'||, float64


def rows_of(shape: tuple[int, ...]) -> int:
    """Rows of a tensor as blocks count them: the first dimension; 0-d and 1-D tensors are one row."""
    return shape[0] if len(shape) >= 2 else 1


class Sketcher:
    """The stages of one tensor's delta, fed runs of whole rows."""

    def __init__(self, shape: tuple[int, ...], buffers: SketchBuffers | None = None) -> None:
        self.rows = rows_of(shape)
        self.cols = math.prod(shape) // self.rows if self.rows else 0
        self.step = max(5, GROUP_ELEMENTS // max(self.cols, 1) // 5 * 5)
        self._scales = [np.zeros(self.rows, dtype=np.float32) for _ in range(STAGES)]
        self._packed: list[list[bytes]] = [[] for _ in range(STAGES)]
        self._residual = [0.0] * STAGES
        self._norm2 = [0.0] * STAGES
        self._pending: list[torch.Tensor] = []  # rows fed and not yet sketched, in order
        self._done = 0  # rows sketched
        self._buffers = SketchBuffers() if buffers is None else buffers

    def add(self, rows: torch.Tensor) -> None:
        """Feed the next rows of the delta (fp32; flat or ``[n, cols]``)."""
        self._pending.append(rows.reshape(-1, self.cols))
        while sum(len(p) for p in self._pending) >= self.step:
            self._group(self._take(self.step))

    def finish(self) -> list[SketchStage]:
        """The stages, once every row has been fed."""
        left = sum(len(p) for p in self._pending)
        if left:
            self._group(self._take(left))
        if self._done != self.rows:
            raise ValueError(f"sketch fed {self._done} of {self.rows} rows")
        return [
            SketchStage(
                self._scales[s].astype("<f4").tobytes() + b"".join(self._packed[s]),
                self._residual[s],
                math.sqrt(self._norm2[s]),
            )
            for s in range(STAGES)
        ]

    def _take(self, count: int) -> torch.Tensor:
        """The first ``count`` pending rows (a view when one run holds them)."""
        pieces, taken = [], 0
        while taken < count:
            run = self._pending[0]
            piece = run[: count - taken]
            pieces.append(piece)
            taken += len(piece)
            if len(piece) == len(run):
                self._pending.pop(0)
            else:
                self._pending[0] = run[len(piece) :]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _group(self, group: torch.Tensor) -> None:
        start, count = self._done, len(group)
        work = self._buffers.rows(count, self.cols)
        approx: torch.Tensor | None = None
        rest = group  # group - approx: what the stages so far left (x - 0 is x, bit for bit)
        for s in range(STAGES):
            q, scale, finite = _stage(rest, work)
            if approx is None and finite:  # 0 + q * scale is q * scale: a finite row's scale is 0 only where q is
                approx = torch.mul(q, scale[:, None], out=work.approx)
            elif approx is None:
                approx = work.approx.zero_().addcmul_(q, scale[:, None])
            else:
                approx.addcmul_(q, scale[:, None])  # q * scale is exact: the same rounding as approx + q * scale
            rest = torch.sub(group, approx, out=work.rest)
            self._scales[s][start : start + count] = scale.numpy()
            self._packed[s].append(encode_stage(q.numpy(), _NO_SCALES))
            self._residual[s] += _energy(rest, work.wide)
            self._norm2[s] += _energy(approx, work.wide)
        self._done += count


_NO_SCALES = np.zeros(0, dtype=np.float32)
_COUNT_EXACT = 1 << 24  # fp32 counts whole numbers exactly up to here


class _Scratch(NamedTuple):
    """A group's buffers, ``[rows, cols]`` each and contiguous (reductions give a new tensor's bits)."""

    magnitude: torch.Tensor  # fp32: |R|, then sign(R)
    keep: torch.Tensor  # fp32: 1 where kept, else 0
    rest: torch.Tensor  # fp32: the residual after the stage
    approx: torch.Tensor  # fp32: the approximation so far
    wide: torch.Tensor  # float64: what a float64 reduction reads


class SketchBuffers:
    """The memory of ``_Scratch``, reused from group to group and tensor to tensor (no page faults again)."""

    def __init__(self) -> None:
        self._flat: list[torch.Tensor] = []  # four fp32 buffers, then a float64 one, of one length

    def rows(self, count: int, cols: int) -> _Scratch:
        size = count * cols
        if not self._flat or len(self._flat[0]) < size:
            self._flat = [
                *(torch.empty(size, dtype=torch.float32) for _ in range(4)),
                torch.empty(size, dtype=torch.float64),
            ]
        magnitude, keep, rest, approx, wide = (t[:size].view(count, cols) for t in self._flat)
        return _Scratch(magnitude, keep, rest, approx, wide)

    def clear(self) -> None:
        self._flat = []


def _energy(values: torch.Tensor, wide: torch.Tensor) -> float:
    """``float(torch.sum(torch.square(values.double())))``, squared in ``wide`` instead of a new tensor."""
    return float(wide.copy_(values).square_().sum())


def _stage(residual: torch.Tensor, work: _Scratch) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(q int8, fp32 scale per row, finite)`` of one stage for a group of rows."""
    magnitude = torch.abs(residual, out=work.magnitude)
    total = work.wide.copy_(magnitude).sum(dim=1)  # the definition's float64 row sums of |R|
    if not bool(torch.isfinite(total).all()):
        q, scale = _stage_as_defined(residual)
        return q, scale, False
    counts = torch.float32 if residual.shape[1] < _COUNT_EXACT else torch.float64
    nonzero = torch.sign(magnitude, out=work.keep).sum(dim=1, dtype=counts).double()
    half_mean = total / nonzero.clamp(min=1) / 2
    # 1 where |R| > m/2, else 0: |R| - t > 0 exactly when |R| > t (a difference of fp32 values is 0 only if equal)
    keep = torch.sub(magnitude, _round_down(half_mean)[:, None], out=work.keep).sign_().clamp_(min=0)
    kept = keep.sum(dim=1, dtype=counts).double()
    chosen = work.wide.copy_(magnitude.mul_(keep)).sum(dim=1)  # Σ |R| over the kept entries, float64
    scale = (chosen / kept.clamp(min=1)).to(torch.float32)
    q = torch.sign(residual, out=work.magnitude).mul_(keep).to(torch.int8)
    return q, scale, True


def _round_down(values: torch.Tensor) -> torch.Tensor:
    """The largest fp32 not above each float64 value (for v >= 0: fp32 x > v exactly when x > it)."""
    nearest = values.to(torch.float32)
    return torch.where(nearest.double() > values, torch.nextafter(nearest, torch.tensor(-math.inf)), nearest)


def _stage_as_defined(residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8, fp32 scale per row)`` of one stage for a group of rows, as defined (docs/ARCHITECTURE.md)."""
    magnitude = residual.abs().double()
    nonzero = (magnitude > 0).sum(dim=1)
    mean = magnitude.sum(dim=1) / nonzero.clamp(min=1)
    keep = magnitude > (mean / 2)[:, None]
    kept = keep.sum(dim=1)
    scale = (torch.where(keep, magnitude, 0.0).sum(dim=1) / kept.clamp(min=1)).to(torch.float32)
    q = (torch.sign(residual) * keep).to(torch.int8)
    return q, scale


_INF_BITS, _NAN_BITS, _MAX_BITS = 0x7F800000, 0x7FC00000, 0x7FFFFFFF  # of fp32 magnitudes, as int32
_LOW_BITS = 15  # of a magnitude's bits below its histogram bucket (31 bits in all: the sign is 0)
BUCKETS = 1 << (31 - _LOW_BITS)
_DIGIT_BITS = 16  # of a radix sort's digit (numpy sorts 16-bit integers stably by radix)
_FINE_LOW_BITS = 11  # below the buckets ``in_chunks`` ranks a large set of entries by (2^20 of them, 8 MB)
_FINE_ENTRIES = 1 << 20  # a set of entries this large is ranked by the fine buckets
_PIECE = 1 << 20  # entries labelled and grouped at a time


def magnitude_bits(values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The int32 bits of ``|values|`` (fp32), every NaN as ``_NAN_BITS``."""
    bits = np.abs(values, out=out).view(np.int32)
    if bits.size and bits.max() > _INF_BITS:
        bits[bits > _INF_BITS] = _NAN_BITS
    return bits


def in_chunks(
    bits: np.ndarray, positions: np.ndarray | None, first: int, size: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(positions, bits)`` of the given entries' store order (descending magnitude, equal ones by position)
    cut into slices: the first ``first`` entries (``1 <= first <= size``), then ``size`` at a time; each slice
    in position order, as a chunk stores it. The entries come in position order: ``positions`` (int64), or
    ``None`` for ``0 .. len(bits) - 1``.

    Buckets of the magnitudes' top bits that fall in one slice are grouped by a stable radix sort by slice;
    the few a slice edge cuts are ordered apart and split at the edges."""
    count = len(bits)
    if not count:
        return
    edges = np.arange(first, count, size)  # the first rank of each slice after the first
    slices = len(edges) + 1
    low_bits = _FINE_LOW_BITS if count > _FINE_ENTRIES else _LOW_BITS
    keys = bits >> low_bits
    lowest = int(keys.min())
    keys -= lowest  # buckets from the smallest magnitude there is: counts as long as the magnitudes' span
    counts = np.zeros(int(keys.max()) + 1, dtype=np.int64)
    for start in range(0, count, _PIECE):
        counts += np.bincount(keys[start : start + _PIECE], minlength=len(counts))
    above = np.cumsum(counts[::-1])[::-1] - counts  # the first rank of each bucket's entries
    first_slice = np.searchsorted(edges, above, side="right")  # the slice of each bucket's first entry
    cut = (first_slice != np.searchsorted(edges, above + counts - 1, side="right")) & (counts > 0)
    cut_buckets = np.flatnonzero(cut)
    labels = slices + len(cut_buckets)  # radix sorts of 8 and 16 bits are cheaper
    label = first_slice.astype(np.uint8 if labels <= 1 << 8 else np.uint16 if labels <= 1 << 16 else np.uint32)
    label[cut_buckets] = slices + np.arange(len(cut_buckets))  # a cut bucket: a group of its own
    groups = _grouped(keys, label, labels)
    del keys
    runs: list[list[np.ndarray]] = [[groups[k]] for k in range(slices)]
    for number, b in enumerate(cut_buckets.tolist(), start=slices):
        run = groups[number]  # the bucket's entries, position order
        run_bits = bits[run.astype(np.intp)]  # (numpy's own conversion of an int32 index is slower)
        one = bool((run_bits == run_bits[0]).all())
        ranked = run if one else run[_stable_order(_MAX_BITS - run_bits)]  # by rank
        inner = edges[(edges > above[b]) & (edges < above[b] + counts[b])] - above[b]
        for k, piece in enumerate(np.split(ranked, inner), start=int(first_slice[b])):
            runs[k].append(piece if one else np.sort(piece))
    del groups
    for k in range(slices):
        chosen = runs[k][0] if len(runs[k]) == 1 else np.sort(np.concatenate(runs[k]), kind="stable")  # a merge
        runs[k] = []
        chosen = chosen.astype(np.intp)  # what numpy would make of it at each use as an index
        yield (chosen if positions is None else positions[chosen]), bits[chosen]


def _grouped(keys: np.ndarray, label: np.ndarray, labels: int) -> list[np.ndarray]:
    """Per label, the indices of the entries whose bucket (``keys``) has it, ascending (int32 where they fit)."""
    index = np.int32 if len(keys) <= np.iinfo(np.int32).max else np.int64
    parts: list[list[np.ndarray]] = [[] for _ in range(labels)]
    for start in range(0, len(keys), _PIECE):
        piece = label[keys[start : start + _PIECE].astype(np.intp)]
        order = np.argsort(piece, kind="stable").astype(index)
        order += start
        ends = np.cumsum(np.bincount(piece, minlength=labels))
        for k, part in enumerate(np.split(order, ends[:-1])):
            if len(part):
                parts[k].append(part)
    groups = []
    for k in range(labels):  # joined one label at a time, its parts dropped as it is
        groups.append(
            np.concatenate(parts[k]) if len(parts[k]) > 1 else parts[k][0] if parts[k] else np.zeros(0, dtype=index)
        )
        parts[k] = []
    return groups


def _stable_order(keys: np.ndarray) -> np.ndarray:
    """The indices that sort non-negative integer ``keys`` (below 2³²) stably."""
    if keys.dtype.itemsize <= 2:
        return np.argsort(keys, kind="stable")
    order: np.ndarray | None = None
    for shift in (0, _DIGIT_BITS):
        digit = ((keys >> shift) & ((1 << _DIGIT_BITS) - 1)).astype(np.uint16)
        if (digit == digit[0]).all():
            continue
        step = np.argsort(digit if order is None else digit[order], kind="stable")
        order = step if order is None else order[step]
    return np.arange(len(keys)) if order is None else order


class Histogram:
    """Counts of non-zero magnitudes by their top 16 bits, fed a window at a time."""

    def __init__(self) -> None:
        self.counts = np.zeros(BUCKETS, dtype=np.int64)
        self._value = np.zeros(BUCKETS, dtype=np.int32)  # the magnitude of a bucket of one magnitude
        self._mixed = np.zeros(BUCKETS, dtype=bool)
        self._mixed[0] = True  # zeros (no entries) share bucket 0 with the smallest subnormals: never inferred

    def add(self, bits: np.ndarray) -> None:
        buckets = bits.astype(np.intp)  # numpy converts other indices to these at every use
        buckets >>= _LOW_BITS
        counts = np.bincount(buckets, minlength=BUCKETS)  # zeros too (bits >= 0: magnitudes), taken off below
        counts[0] -= np.count_nonzero(bits == 0)
        value = np.zeros(BUCKETS, dtype=np.int32)
        value[buckets] = bits  # one of each bucket's magnitudes (the last written)
        self._mixed[buckets[value[buckets] != bits]] = True
        self._mixed |= (counts > 0) & (self.counts > 0) & (value != self._value)
        fresh = (counts > 0) & (self.counts == 0)
        self._value[fresh] = value[fresh]
        self.counts += counts

    def exact(self, buckets: np.ndarray) -> tuple[dict[int, np.ndarray], np.ndarray]:
        """``(exact counts of those of ``buckets`` that hold one magnitude, the others)``."""
        known = {}
        for bucket in buckets[~self._mixed[buckets]].tolist():
            row = np.zeros(1 << _LOW_BITS, dtype=np.int64)
            row[self._value[bucket] & ((1 << _LOW_BITS) - 1)] = self.counts[bucket]
            known[bucket] = row
        return known, buckets[self._mixed[buckets]]


def exact_counts(bits: np.ndarray, buckets: np.ndarray) -> np.ndarray:
    """Counts of the exact magnitudes ``bits`` that fall in ``buckets`` (ascending)."""
    out = np.zeros((len(buckets), 1 << _LOW_BITS), dtype=np.int64)
    if not len(buckets):
        return out
    rank = np.full(BUCKETS, -1, dtype=np.int32)  # each bucket's row, -1 for the others: one lookup an entry
    rank[buckets] = np.arange(len(buckets))
    row = rank[bits >> _LOW_BITS]
    inside = (row >= 0) & (bits > 0)
    flat = row[inside].astype(np.int64) << _LOW_BITS | (bits[inside] & ((1 << _LOW_BITS) - 1))
    out.reshape(-1)[:] = np.bincount(flat, minlength=out.size)
    return out


@dataclass(frozen=True)
class Band:
    """The entries whose magnitude bits lie in ``[low, high]``: ``count`` of them."""

    low: int
    high: int
    count: int

    @property
    def streamed(self) -> bool:
        """One magnitude: its entries go out in position order, with no sort."""
        return self.low == self.high

    def holds(self, bits: np.ndarray) -> np.ndarray:
        return (bits >= self.low) & (bits <= self.high)


def plan_bands(counts: np.ndarray, exact: dict[int, np.ndarray], band_entries: int) -> list[Band]:
    """Bands of at most ``band_entries`` entries."""
    units: list[Band] = []  # descending: whole buckets, or exact values of oversized ones
    for bucket in np.flatnonzero(counts)[::-1].tolist():
        low = bucket << _LOW_BITS
        if bucket not in exact:  # (bucket 0 starts at 1: a zero is no entry)
            units.append(Band(max(low, 1), low | ((1 << _LOW_BITS) - 1), int(counts[bucket])))
            continue
        values = exact[bucket]
        units += [Band(low | v, low | v, int(values[v])) for v in np.flatnonzero(values)[::-1].tolist()]
    bands: list[Band] = []
    for unit in units:
        last = bands[-1] if bands else None
        if last is not None and last.count + unit.count <= band_entries:
            bands[-1] = Band(unit.low, last.high, last.count + unit.count)
        else:
            bands.append(unit)
    return bands


@dataclass(frozen=True)
class Side:
    """One model of the pair: its id, checkpoint and recorded block hashes (by tensor)."""

    model_id: str
    checkpoint: Checkpoint
    hashes: dict[str, list[str | None]]


@dataclass(frozen=True)
class Window:
    """Entries ``[start, start + len(delta))`` of a tensor: Δ in fp32 and the expert's element bytes."""

    start: int
    delta: torch.Tensor  # flat fp32
    elements: np.ndarray  # the expert's element bytes, one ``V<itemsize>`` item per entry


class _Pair:
    """Reads a tensor's delta, window by window, through the shared read-ahead, every block checked."""

    def __init__(self, source: CheckpointSource, base: Side, expert: Side, block_bytes: int, spill_dir: Path) -> None:
        self.source, self.sides = source, (base, expert)
        self.block_bytes, self.spill_dir = block_bytes, spill_dir
        self._geometry: dict[tuple[str, str], list[BlockSpec]] = {}
        self._copies: dict[tuple[str, str], tuple[Path, int]] = {}  # (model, tensor) -> local copy, its offset

    def windows(self, entry: TensorEntry, reuse: bool = False) -> Generator[Window, None, None]:
        """One pass over ``entry``, a window of blocks at a time."""
        return self._read([(entry, lo, hi) for lo, hi in self._windows(entry)], reuse)

    def wholes(self, entries: Sequence[TensorEntry]) -> Generator[Window, None, None]:
        """Each of ``entries`` read whole, in order, its window its own (the next read ahead meanwhile)."""
        return self._read([(e, 0, len(self._blocks(self.sides[0], e.name))) for e in entries], False, own=True)

    def _blocks(self, side: Side, name: str) -> list[BlockSpec]:
        key = (side.model_id, name)
        if key not in self._geometry:
            self._geometry[key] = tensor_blocks(side.checkpoint.tensor(name), self.block_bytes)
        return self._geometry[key]

    def _windows(self, entry: TensorEntry) -> list[tuple[int, int]]:
        return block_windows([b.numel for b in self._blocks(self.sides[0], entry.name)])

    def _range(self, side: Side, name: str, lo: int, hi: int) -> ByteRange:
        blocks = self._blocks(side, name)[lo:hi]
        copy = self._copies.get((side.model_id, name))
        if copy is not None:  # bytes checked when they were fetched
            return ByteRange(copy[0], blocks[0].begin - copy[1], blocks[-1].end - copy[1], side.model_id, name)
        checks = tuple(BlockCheck(b.index, b.begin, b.end, str(h)) for b, h in zip(blocks, side.hashes[name][lo:hi]))
        path = side.checkpoint.file_of(name).path
        return ByteRange(path, blocks[0].begin, blocks[-1].end, side.model_id, name, checks)

    def _read(
        self, windows: list[tuple[TensorEntry, int, int]], reuse: bool, own: bool = False
    ) -> Generator[Window, None, None]:
        starts = [self._blocks(self.sides[0], e.name)[lo].flat_start for e, lo, _ in windows]
        items = [
            WorkItem(start, [self._range(side, e.name, lo, hi) for side in self.sides])
            for start, (e, lo, hi) in zip(starts, windows)
        ]
        readahead = read_ahead(self.source, items, check_blocks)
        scratch = [np.empty(0, dtype=np.float32)] * 2  # with ``reuse``: the memory of the delta and the base's
        with contextlib.closing(readahead.run(items)) as stream:
            for (entry, _, _), fetched in zip(windows, stream):
                base_raw, expert_raw = fetched.views
                numel = len(expert_raw) // entry.itemsize
                if reuse and len(scratch[0]) < numel:
                    scratch = [np.empty(numel, dtype=np.float32) for _ in range(2)]
                delta = _float32(expert_raw, entry.dtype, numel, scratch[0][:numel] if reuse else None)
                delta.sub_(_float32(base_raw, entry.dtype, numel, scratch[1][:numel] if reuse else None))
                elements = np.frombuffer(expert_raw, dtype=f"V{entry.itemsize}")
                yield Window(fetched.item.payload, delta, elements.copy() if own else elements)
                fetched.release()

    @contextlib.contextmanager
    def fetched(self, entry: TensorEntry) -> Iterator[None]:
        """Passes over ``entry`` read a remote side from a local copy, fetched and checked once."""
        with contextlib.ExitStack() as stack:
            for side in self.sides:
                if not isinstance(side.checkpoint.file_of(entry.name).path, RemotePath):
                    continue
                copy = stack.enter_context(tempfile.NamedTemporaryFile(dir=self.spill_dir, prefix=SPILL_PREFIX))
                with contextlib.suppress(OSError):
                    fcntl.flock(copy.fileno(), fcntl.LOCK_EX)
                items = [WorkItem(None, [self._range(side, entry.name, lo, hi)]) for lo, hi in self._windows(entry)]
                first = items[0].reads[0].begin
                for fetched in read_ahead(self.source, items, check_blocks).run(items):
                    os.pwrite(copy.fileno(), fetched.views[0], fetched.item.reads[0].begin - first)
                    fetched.release()
                self._copies[(side.model_id, entry.name)] = (Path(copy.name), first)
                stack.callback(self._copies.pop, (side.model_id, entry.name))
            yield


def _float32(raw: memoryview, dtype: str, numel: int, out: np.ndarray | None = None) -> torch.Tensor:
    """The values in ``raw`` as an fp32 tensor in ``out``, or in new memory numpy allocated."""
    out = np.empty(numel, dtype=np.float32) if out is None else out
    return torch.from_numpy(out).copy_(raw_view(raw, dtype, (numel,)))


_SLUG = re.compile(r"[^A-Za-z0-9._-]+")
STORE_SUFFIX = ".mpdelta"
STAGING_SUFFIX = ".writing"
SPILL_PREFIX = ".mpdelta-spill-"
JUST_CREATED_SECONDS = 60.0


@dataclass(frozen=True)
class StoreReport:
    expert_id: str
    record: DeltaStoreRecord
    entries: int
    chunks: int
    seconds: float
    swept: list[Path]  # leftovers of killed builds removed from the directory first


def has_store(catalog: Catalog, expert_id: str, base_id: str) -> bool:
    """Whether the pair has a recorded store whose file is still there, whole."""
    record = catalog.deltas.find(expert_id, base_id)
    if record is None:
        return False
    path = Path(record.path)
    return path.is_file() and path.stat().st_size == record.file_size


def build_store(
    catalog: Catalog,
    expert_id: str,
    base_id: str,
    directory: str | os.PathLike[str],
    progress: bool = False,
    band_entries: int = BAND_ENTRIES,
) -> StoreReport:
    """Write the delta store of an analysed (expert, base) pair into ``directory`` and record it."""
    started = time.perf_counter()
    catalog.stats.require(expert_id, base_id)
    kind = catalog.models.get(expert_id).kind
    if kind in ("delta", "lora"):  # entries hold an expert's element bytes, not Δ's
        what = "a delta checkpoint" if kind == "delta" else "a LoRA adapter"
        raise ConfigError(
            f"'{expert_id}' is {what}: delta stores are built from full experts; "
            "plan it with the energy or uniform policy"
        )
    directory = Path(directory).expanduser().resolve()
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"--store-deltas {directory} is not a directory; give a directory for delta stores")
    directory.mkdir(parents=True, exist_ok=True)
    base, expert = open_registered(catalog, base_id), open_registered(catalog, expert_id)
    norms = catalog.stats.block_norms(expert_id, base_id)
    changed = [
        e
        for _, e in base.iter_tensors()
        if e.dtype in MERGEABLE_DTYPES and any(v is not None for v in norms.get(e.name, ()))
    ]
    slug = _SLUG.sub("_", f"{expert_id}--{base_id}")[:80]
    final = directory / f"{slug}-{uuid.uuid4().hex[:8]}{STORE_SUFFIX}"
    staging = final.with_name(f".{final.name}{STAGING_SUFFIX}")
    swept = sweep_abandoned(directory)
    total = sum(e.nbytes for e in changed)
    with CheckpointSource() as source, byte_progress("delta store", total, progress) as advance:
        pair = _Pair(
            source,
            Side(base_id, base, catalog.blocks.hashes(base_id)),
            Side(expert_id, expert, catalog.blocks.hashes(expert_id)),
            catalog.block_bytes,
            directory,
        )
        try:
            with open(staging, "xb") as out:
                with contextlib.suppress(OSError):  # no flock on this filesystem: no sweep can remove the file then
                    fcntl.flock(out.fileno(), fcntl.LOCK_EX)  # ours alone: just created (``xb``)
                out.write(MAGIC)
                chunks, stages = _write_tensors(pair, changed, catalog.block_bytes, band_entries, advance, out)
                out.flush()
                os.fsync(out.fileno())
                previous = catalog.deltas.find(expert_id, base_id)
                record = catalog.deltas.record(expert_id, base_id, str(final), out.tell(), chunks, stages)
                if previous is not None and previous.path != record.path:
                    Path(previous.path).unlink(missing_ok=True)
                os.rename(staging, final)
        finally:
            staging.unlink(missing_ok=True)
    entries = sum(c.entries for c in chunks)
    return StoreReport(expert_id, record, entries, len(chunks), time.perf_counter() - started, swept)


def sweep_abandoned(directory: Path) -> list[Path]:
    """Remove the staging files and local copies that killed builds left in ``directory``."""
    removed = []
    for path in sorted([*directory.glob(f".*{STORE_SUFFIX}{STAGING_SUFFIX}"), *directory.glob(f"{SPILL_PREFIX}*")]):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # gone meanwhile (its build finished), or not a plain file: not ours to touch
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            info = os.fstat(fd)
        except OSError:  # a live build's (BlockingIOError), or no flock on this filesystem: cannot tell
            continue
        finally:
            os.close(fd)  # also drops the lock just taken
        if info.st_size == 0 and time.time() - info.st_mtime < JUST_CREATED_SECONDS:
            continue
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def _write_tensors(
    pair: _Pair,
    changed: list[TensorEntry],
    block_bytes: int,
    band_entries: int,
    advance: Callable[[int, str], None],
    out: BinaryIO,
) -> tuple[list[DeltaChunk], list[DeltaStage]]:
    """Append every changed tensor's chunks, then its sketch stages, to ``out``."""
    chunks: list[DeltaChunk] = []
    stages: list[DeltaStage] = []
    buffers = SketchBuffers()  # the worker's, for every tensor in turn
    wholes = pair.wholes([e for e in changed if e.numel <= band_entries])  # taken in turn on the worker
    with (
        contextlib.closing(wholes),
        compute_threads(),
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="mergepipe-sketch") as worker,
    ):
        ahead: _Whole | None = None  # the next tensor, prepared on the worker
        for number, entry in enumerate(changed):
            writer = _ChunkWriter(entry, block_bytes, out)
            if entry.numel <= band_entries:
                whole = ahead or _Whole(worker, wholes, entry, buffers)
                following = changed[number + 1] if number + 1 < len(changed) else None
                # prepared (behind this one's sketch) while this one is ordered, if both fit in a band's memory
                fits = following is not None and entry.numel + following.numel <= band_entries
                ahead = _Whole(worker, wholes, following, buffers) if following is not None and fits else None
                window, positions, bits = whole.take()
                for chosen, chosen_bits in in_chunks(bits, positions, writer.room, writer.per_chunk):
                    writer.add(chosen, chosen_bits, window.elements[chosen])
                advance(entry.nbytes, entry.name)
                del window, positions, bits
                tensor_stages = whole.stages.result()
            else:
                with pair.fetched(entry):  # a sketch pass of its own, beside every pass of the ordering
                    sketch = worker.submit(_sketch, entry, pair.windows(entry), buffers)
                    scan = Histogram()
                    for window in pair.windows(entry, reuse=True):
                        scan.add(_bits_in_place(window))
                        advance(window.elements.nbytes, entry.name)
                    _banded_tensor(pair, entry, scan, writer, band_entries, advance)
                    tensor_stages = sketch.result()
                    buffers.clear()
            chunks += writer.finish()
            stages += _tensor_stages(tensor_stages, entry, out)
    return chunks, stages


def _sketch(entry: TensorEntry, windows: Iterable[Window], buffers: SketchBuffers) -> list[SketchStage]:
    """The sketch stages of a tensor's delta, fed window by window."""
    sketcher = Sketcher(entry.shape, buffers=buffers)
    for window in windows:
        sketcher.add(window.delta)
    return sketcher.finish()


class _Whole:
    """The next tensor read whole, prepared and then sketched on the worker."""

    def __init__(
        self, worker: ThreadPoolExecutor, wholes: Iterator[Window], entry: TensorEntry, buffers: SketchBuffers
    ) -> None:
        self.prepared: Future[tuple[Window, np.ndarray, np.ndarray]] | None = Future()
        self.stages = worker.submit(self._run, self.prepared, wholes, entry, buffers)

    @staticmethod
    def _run(
        prepared: Future[tuple[Window, np.ndarray, np.ndarray]],
        wholes: Iterator[Window],
        entry: TensorEntry,
        buffers: SketchBuffers,
    ) -> list[SketchStage]:
        try:
            window = next(wholes)
            values = window.delta.numpy()
            positions = np.flatnonzero(values != 0)  # (a mask first: several times faster than nonzero of floats)
            prepared.set_result((window, positions, magnitude_bits(values[positions])))
        except BaseException as error:
            prepared.set_exception(error)
            raise
        return _sketch(entry, [window], buffers)

    def take(self) -> tuple[Window, np.ndarray, np.ndarray]:
        """What ``prepared`` gives, once: no reference to it is kept here (its memory goes with the caller's)."""
        prepared, self.prepared = self.prepared, None
        assert prepared is not None, "taken twice"
        return prepared.result()


def _banded_tensor(
    pair: _Pair,
    entry: TensorEntry,
    scan: Histogram,
    writer: _ChunkWriter,
    band_entries: int,
    advance: Callable[[int, str], None],
) -> None:
    """Order and write a tensor too large to hold whole from the histogram of its magnitudes."""
    exact, mixed = scan.exact(np.flatnonzero(scan.counts > band_entries))
    if len(mixed):  # an oversized bucket of several magnitudes: one more pass counts them
        fine = reduce(np.add, (exact_counts(_bits_in_place(w), mixed) for w in pair.windows(entry, reuse=True)))
        exact.update(zip(mixed.tolist(), fine))
    bands = plan_bands(scan.counts, exact, band_entries)
    number = 0
    while number < len(bands):
        band, number = bands[number], number + 1
        advance(0, f"{entry.name}, band {number} of {len(bands)}")
        streamed = band if band.streamed else None
        if streamed is not None:
            if number == len(bands) or bands[number].streamed:
                _collect(pair, entry, None, streamed, writer)
                continue
            band, number = bands[number], number + 1  # collected while the streamed one is written: it follows
            advance(0, f"{entry.name}, band {number} of {len(bands)}")
        positions, bits, elements = _collect(pair, entry, band, streamed, writer)
        for index, chosen_bits in in_chunks(bits, None, writer.room, writer.per_chunk):  # indices in the band
            writer.add(positions[index], chosen_bits, elements[index])


def _bits_in_place(window: Window) -> np.ndarray:
    """The window's ``magnitude_bits``, in the memory of its delta (which they replace)."""
    values = window.delta.numpy()
    return magnitude_bits(values, out=values)


def _collect(
    pair: _Pair, entry: TensorEntry, band: Band | None, streamed: Band | None, writer: _ChunkWriter
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(positions, magnitude bits, element bytes)`` of a band's entries in position order, from one pass."""
    count = 0 if band is None else band.count
    positions = np.empty(count, dtype=np.int32 if entry.numel <= np.iinfo(np.int32).max else np.int64)
    bits = np.empty(count, dtype=np.int32)
    elements = np.empty(count, dtype=f"V{entry.itemsize}")
    filled = 0
    for window in pair.windows(entry, reuse=True):
        window_bits = _bits_in_place(window)
        if streamed is not None:
            hit = np.flatnonzero(window_bits == streamed.low)
            writer.add(hit + window.start, np.full(len(hit), streamed.low, dtype=np.int32), window.elements[hit])
        if band is None:
            continue
        hit = np.flatnonzero(band.holds(window_bits))
        if filled + len(hit) > band.count:
            break
        positions[filled : filled + len(hit)] = hit + window.start
        bits[filled : filled + len(hit)] = window_bits[hit]
        elements[filled : filled + len(hit)] = window.elements[hit]
        filled += len(hit)
    if filled != count:  # every block matched its hash, so only a bug can get here
        raise RuntimeError(f"a pass over '{entry.name}' found other entries than the first")
    return positions, bits, elements


class _ChunkWriter:
    """Cuts a tensor's entries, fed in store order as runs in position order."""

    def __init__(self, entry: TensorEntry, block_bytes: int, out: BinaryIO) -> None:
        self.name, self.out = entry.name, out
        self.per_chunk = max(1, block_bytes // (entry.itemsize + 1))
        self.rows: list[DeltaChunk] = []
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._count = 0

    @property
    def room(self) -> int:
        """The entries that complete the chunk being filled (a whole chunk's when none is pending)."""
        return self.per_chunk - self._count

    def add(self, positions: np.ndarray, bits: np.ndarray, elements: np.ndarray) -> None:
        """The next entries, in position order."""
        self._pending.append((positions, bits, elements))
        self._count += len(positions)
        while self._count >= self.per_chunk:
            self._write(self.per_chunk)

    def finish(self) -> list[DeltaChunk]:
        if self._count:
            self._write(self._count)
        return self.rows

    def _write(self, count: int) -> None:
        runs = len(self._pending)
        parts = self._pending[0] if runs == 1 else [np.concatenate(a) for a in zip(*self._pending)]
        positions, bits, elements = (a[:count] for a in parts)
        self._pending = []
        if len(parts[0]) > count:
            rest_positions, rest_bits, rest_elements = (a[count:] for a in parts)
            self._pending.append((rest_positions, rest_bits, rest_elements))
        self._count -= count
        if runs > 1:
            order = np.argsort(positions, kind="stable")
            positions, bits, elements = positions[order], bits[order], elements[order]
        payload, gap_bytes = encode_chunk(positions, elements)
        begin = self.out.tell()
        self.out.write(payload)
        energy = float(np.square(bits.view(np.float32).astype(np.float64)).sum())
        self.rows.append(
            DeltaChunk(
                self.name, len(self.rows), begin, begin + len(payload), count, gap_bytes, energy, block_digest(payload)
            )
        )


def _tensor_stages(stages: list[SketchStage], entry: TensorEntry, out: BinaryIO) -> list[DeltaStage]:
    """Append one tensor's sketch stages to ``out``; their index rows."""
    rows = []
    for number, stage in enumerate(stages, start=1):
        begin = out.tell()
        out.write(stage.payload)
        rows.append(
            DeltaStage(
                entry.name,
                number,
                begin,
                begin + len(stage.payload),
                rows_of(entry.shape),
                stage.residual,
                stage.norm,
                block_digest(stage.payload),
            )
        )
    return rows
