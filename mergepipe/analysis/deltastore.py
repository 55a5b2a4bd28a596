"""Build an expert's delta store: its delta entries, largest first, in chunks,
and sketch stages of every changed tensor.

With a store, a budget buys an expert's delta in cheaper forms than whole
blocks (planner policy ``entries``): sketch stages (a coarse value for every
entry, 1.6 bits each, ``sketch.py``) and, for exactness, the tensor's top
entries (reading the first chunks of a tensor gives exactly its largest
entries). Real fine-tunes change every tensor a little, so whole blocks
carry little more value than others. Encoding: ``storage/delta_encoding.py``.

Per tensor: the base and the expert tensor are read (every block checked
against the hashes analysis recorded), ``Δ = E - B`` in fp32, its non-zero
entries ordered by descending ``|Δ|`` (stable: ties by position, the order
every magnitude trim uses, so a store prefix covering a TIES density's top-k
entries is exactly what the trim keeps), and cut into chunks of about the
catalog's block size; the sketch stages follow. A tensor of at most
``band_entries`` entries is read whole, in one pass. A larger one is never
whole in memory: a first pass, a window of blocks at a time, makes a
histogram of |Δ|, and each band of magnitudes is then collected by one more
pass and ordered (``store_order.py``); the bytes are the same either way.
Memory is then bounded by a band (~30 bytes an entry) whatever the tensor's
size. A streamed band (one magnitude) is written during the pass that
collects the band after it, so it costs no pass of its own.

The sketch is computed on a worker thread (torch, on all cores but one as
analysis and merges run it), beside the ordering and writing of the chunks
(numpy) on this one: a tensor read whole is read there, its non-zero entries
found and then sketched, and the next tensor's read is queued behind it
while this thread orders the first (when both fit in a band's memory); a
larger tensor is sketched from a pass of its own, beside the histogram and
band passes. A remote tensor is fetched once instead: its first pass feeds
the sketch, done before the bands (whose memory it would add to). The file
is written beside its final name, fsynced, recorded in the catalog in one
transaction (a store for the same pair is replaced and its old file
removed) and renamed into place.

A build holds an exclusive ``flock`` on its staging file (``.NAME.mpdelta.writing``) while it writes, so
the next build in the directory can tell a killed build's leftover (nobody holds its lock: the kernel
drops it when the process dies, even by SIGKILL) from a live build's file, and removes only leftovers.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial, reduce
from pathlib import Path
from typing import BinaryIO, TypeVar

import numpy as np
import torch

from mergepipe.analysis.opening import open_registered
from mergepipe.analysis.sketch import Sketcher, SketchBuffers, SketchStage, rows_of
from mergepipe.analysis.store_order import (
    Band,
    Histogram,
    exact_counts,
    in_chunks,
    magnitude_bits,
    oversized,
    plan_bands,
)
from mergepipe.analysis.store_passes import Passes, Side, TensorReader, Window
from mergepipe.catalog import Catalog
from mergepipe.catalog.deltas import DeltaChunk, DeltaStage, DeltaStoreRecord
from mergepipe.errors import ConfigError
from mergepipe.progress import byte_progress
from mergepipe.storage.delta_encoding import MAGIC, encode_chunk
from mergepipe.storage.format import MERGEABLE_DTYPES, TensorEntry
from mergepipe.storage.hashing import block_digest
from mergepipe.storage.remote_source import CheckpointSource
from mergepipe.threads import compute_threads

_SLUG = re.compile(r"[^A-Za-z0-9._-]+")
STORE_SUFFIX = ".mpdelta"
STAGING_SUFFIX = ".writing"
JUST_CREATED_SECONDS = 60.0
_T = TypeVar("_T")
_P = TypeVar("_P")
#: Entries of the largest tensor read whole, and of a band of a larger one (~30 bytes each in memory).
BAND_ENTRIES = 1 << 24


@dataclass(frozen=True)
class StoreReport:
    expert_id: str
    record: DeltaStoreRecord
    entries: int
    chunks: int
    seconds: float
    swept: list[Path]  # staging files of killed builds removed from the directory first


def has_store(catalog: Catalog, expert_id: str, base_id: str) -> bool:
    """Whether the pair has a recorded store whose file is still there, whole."""
    record = catalog.deltas.find(expert_id, base_id)
    if record is None:
        return False
    path = Path(record.path)
    return path.is_file() and path.stat().st_size == record.file_size


def build_store(catalog: Catalog, expert_id: str, base_id: str, directory: str | os.PathLike[str],
                progress: bool = False, band_entries: int = BAND_ENTRIES) -> StoreReport:
    """Write the delta store of an analysed (expert, base) pair into ``directory`` and record it.

    ``band_entries`` bounds memory: a larger tensor is ordered a band at a time (module docstring)."""
    started = time.perf_counter()
    catalog.stats.require(expert_id, base_id)
    kind = catalog.models.get(expert_id).kind
    if kind in ("delta", "lora"):  # entries hold an expert's element bytes, not Δ's
        what = "a delta checkpoint" if kind == "delta" else "a LoRA adapter"
        raise ConfigError(f"'{expert_id}' is {what}: delta stores are built from full experts; "
                          "plan it with the energy or uniform policy")
    directory = Path(directory).expanduser().resolve()
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"--store-deltas {directory} is not a directory; give a directory for delta stores")
    directory.mkdir(parents=True, exist_ok=True)
    base, expert = open_registered(catalog, base_id), open_registered(catalog, expert_id)
    deltas = catalog.stats.block_norms(expert_id, base_id)
    changed = [e for _, e in base.iter_tensors()
               if e.dtype in MERGEABLE_DTYPES and any(v is not None for v in deltas.get(e.name, ()))]
    slug = _SLUG.sub("_", f"{expert_id}--{base_id}")[:80]
    final = directory / f"{slug}-{uuid.uuid4().hex[:8]}{STORE_SUFFIX}"
    swept = sweep_abandoned(directory)
    total = sum(e.nbytes for e in changed)
    with CheckpointSource() as source, byte_progress("delta store", total, progress) as advance:
        reader = TensorReader(source, Side(base_id, base, catalog.blocks.hashes(base_id)),
                              Side(expert_id, expert, catalog.blocks.hashes(expert_id)), catalog.block_bytes, directory)
        write = partial(_write_tensors, reader, changed, catalog.block_bytes, band_entries, advance)
        (chunks, _), record = _write_locked(final, write, partial(_record, catalog, expert_id, base_id, final))
    return StoreReport(expert_id, record, sum(c.entries for c in chunks), len(chunks),
                       time.perf_counter() - started, swept)


def _record(catalog: Catalog, expert_id: str, base_id: str, final: Path, size: int,
            parts: tuple[list[DeltaChunk], list[DeltaStage]]) -> DeltaStoreRecord:
    """Record the store written (``size`` bytes, ``parts``) under ``final`` and remove the file of the one it
    replaces."""
    previous = catalog.deltas.find(expert_id, base_id)
    record = catalog.deltas.record(expert_id, base_id, str(final), size, *parts)
    if previous is not None and previous.path != record.path:
        Path(previous.path).unlink(missing_ok=True)
    return record


def _write_locked(final: Path, write: Callable[[BinaryIO], _P], record: Callable[[int, _P], _T]) -> tuple[_P, _T]:
    """What ``write`` and ``record`` return, having made ``final`` from the magic and what ``write`` appends:
    written beside it under the staging file's lock (held until the rename, see the module's docstring),
    fsynced, recorded (``record(size, what write returned)``), renamed.

    Recorded before the rename: a build killed in between leaves a record whose file is missing (not there
    for ``has_store``, so ``analyze --store-deltas`` builds it again; a merge that reads it stops with a
    one-line error) and an unlocked staging file the next build or ``gc`` removes, never a store file that
    no catalog records (catalogs may share a directory, so nothing could tell such a file from another
    catalog's store and remove it)."""
    staging = final.with_name(f".{final.name}{STAGING_SUFFIX}")
    try:
        with open(staging, "xb") as out:
            with contextlib.suppress(OSError):  # no flock on this filesystem: no sweep can remove the file then
                fcntl.flock(out.fileno(), fcntl.LOCK_EX)  # ours alone: just created (``xb``)
            out.write(MAGIC)
            written = write(out)
            out.flush()
            os.fsync(out.fileno())
            recorded = record(out.tell(), written)
            os.rename(staging, final)
    finally:
        staging.unlink(missing_ok=True)
    return written, recorded


def sweep_abandoned(directory: Path) -> list[Path]:
    """Remove the staging files that killed builds left in ``directory``; the paths removed.

    Only files named like a staging file whose lock nobody holds are touched: a live build (in this
    process or another) holds its file's lock until it has renamed or removed it. An empty one younger
    than ``JUST_CREATED_SECONDS`` is left too: its build may be between creating it and locking it.
    """
    removed = []
    for path in sorted(directory.glob(f".*{STORE_SUFFIX}{STAGING_SUFFIX}")):
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


def _write_tensors(reader: TensorReader, changed: list[TensorEntry], block_bytes: int, band_entries: int,
                   advance: Callable[[int, str], None], out: BinaryIO) -> tuple[list[DeltaChunk], list[DeltaStage]]:
    """Append every changed tensor's chunks and sketch stages to ``out``; their index rows. A tensor's sketch
    is computed on the worker thread while this one orders and writes its chunks; its stages follow them."""
    chunks: list[DeltaChunk] = []
    stages: list[DeltaStage] = []
    buffers = SketchBuffers()  # the worker's, for every tensor in turn
    with compute_threads(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="mergepipe-sketch") as worker:
        ahead: _Whole | None = None  # the next tensor, read whole on the worker
        for number, entry in enumerate(changed):
            writer = _ChunkWriter(entry, block_bytes, out)
            if entry.numel <= band_entries:
                whole = ahead or _Whole.start(worker, reader, entry, buffers)
                following = changed[number + 1] if number + 1 < len(changed) else None
                # read (queued behind this one's sketch) while this one is ordered, if both fit in a band's memory
                fits = following is not None and entry.numel + following.numel <= band_entries
                ahead = _Whole.start(worker, reader, following, buffers) if following is not None and fits else None
                window, positions, bits = whole.take()
                _whole_tensor(window, positions, bits, writer)
                advance(entry.nbytes, entry.name)
                del window, positions, bits
                tensor_stages = whole.stages.result()
            else:
                with reader.passes(entry) as passes:
                    if passes.fetched:  # fed by the first pass, and done before the bands (module docstring)
                        sketcher = _Feed(worker, Sketcher(entry.shape, buffers=buffers))
                        scan = _histogram(passes, advance, sketcher.add)
                        tensor_stages = sketcher.finish()
                        buffers.clear()
                        _banded_tensor(passes, scan, writer, band_entries, advance)
                    else:  # a pass of its own, beside every pass of the ordering
                        sketch = worker.submit(_sketch, entry, reader.passes(entry), buffers)
                        scan = _histogram(passes, advance, None)
                        _banded_tensor(passes, scan, writer, band_entries, advance)
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


class _Feed:
    """A sketcher fed on the worker thread, one run of rows in flight (the feeder's next window is read
    meanwhile; memory stays that of a window or two)."""

    def __init__(self, worker: ThreadPoolExecutor, sketcher: Sketcher) -> None:
        self._worker, self._sketcher = worker, sketcher
        self._last: Future[None] | None = None

    def add(self, rows: torch.Tensor) -> None:
        if self._last is not None:
            self._last.result()
        self._last = self._worker.submit(self._sketcher.add, rows)

    def finish(self) -> list[SketchStage]:
        if self._last is not None:
            self._last.result()
        return self._worker.submit(self._sketcher.finish).result()


class _Whole:
    """A tensor read whole on the worker thread, then sketched there: ``prepared`` gives ``(window, positions,
    magnitude bits)`` of its non-zero entries as soon as they are known, ``stages`` its sketch."""

    def __init__(self, prepared: Future[tuple[Window, np.ndarray, np.ndarray]],
                 stages: Future[list[SketchStage]]) -> None:
        self.prepared: Future[tuple[Window, np.ndarray, np.ndarray]] | None = prepared
        self.stages = stages

    def take(self) -> tuple[Window, np.ndarray, np.ndarray]:
        """What ``prepared`` gives, once: no reference to it is kept here (its memory goes with the caller's)."""
        prepared, self.prepared = self.prepared, None
        assert prepared is not None, "taken twice"
        return prepared.result()

    @classmethod
    def start(cls, worker: ThreadPoolExecutor, reader: TensorReader, entry: TensorEntry,
              buffers: SketchBuffers) -> _Whole:
        prepared: Future[tuple[Window, np.ndarray, np.ndarray]] = Future()

        def run() -> list[SketchStage]:
            try:
                window = reader.whole(entry)
                values = window.delta.numpy()
                positions = np.flatnonzero(values != 0)  # (a mask first: several times faster than nonzero of floats)
                prepared.set_result((window, positions, magnitude_bits(values[positions])))
            except BaseException as error:
                prepared.set_exception(error)
                raise
            return _sketch(entry, [window], buffers)

        return cls(prepared, worker.submit(run))


def _whole_tensor(window: Window, positions: np.ndarray, bits: np.ndarray, writer: _ChunkWriter) -> None:
    """Order and write a tensor read whole: its non-zero entries' ``positions`` and magnitude ``bits``."""
    for chosen, chosen_bits in in_chunks(bits, positions, writer.room, writer.per_chunk):
        writer.add(chosen, chosen_bits, window.elements[chosen])


def _histogram(passes: Passes, advance: Callable[[int, str], None],
               sketch: Callable[[torch.Tensor], None] | None) -> Histogram:
    """The first pass over a tensor too large to hold whole: the histogram of its magnitudes, each window's
    delta also given to ``sketch`` if any. Progress counts the tensor's bytes here; the later passes show which
    band is being ordered."""
    scan = Histogram()
    for window in passes if sketch is not None else passes.reusing():
        if sketch is not None:
            sketch(window.delta)
            scan.add(magnitude_bits(window.delta.numpy()))
        else:
            scan.add(_bits_in_place(window))
        advance(window.elements.nbytes, passes.entry.name)
    return scan


def _banded_tensor(passes: Passes, scan: Histogram, writer: _ChunkWriter, band_entries: int,
                   advance: Callable[[int, str], None]) -> None:
    """Order and write a tensor too large to hold whole, from the histogram of its magnitudes ``scan``: a
    band of magnitudes per pass, a streamed band and the sorted one after it sharing one (module docstring)."""
    name = passes.entry.name
    exact, mixed = scan.exact(oversized(scan.counts, band_entries))
    if len(mixed):  # an oversized bucket of several magnitudes: one more pass counts them
        fine = reduce(np.add, (exact_counts(_bits_in_place(w), mixed) for w in passes.reusing()))
        exact.update(zip(mixed.tolist(), fine))
    bands = plan_bands(scan.counts, exact, band_entries)
    number = 0
    while number < len(bands):
        band, number = bands[number], number + 1
        advance(0, f"{name}, band {number} of {len(bands)}")
        streamed = band if band.streamed else None
        if streamed is not None:
            if number == len(bands) or bands[number].streamed:
                _collect(passes, None, streamed, writer)
                continue
            band, number = bands[number], number + 1  # collected while the streamed one is written: it follows
            advance(0, f"{name}, band {number} of {len(bands)}")
        positions, bits, elements = _collect(passes, band, streamed, writer)
        for index, chosen_bits in in_chunks(bits, None, writer.room, writer.per_chunk):  # indices in the band
            writer.add(positions[index], chosen_bits, elements[index])


def _bits_in_place(window: Window) -> np.ndarray:
    """The window's ``magnitude_bits``, in the memory of its delta (which they replace)."""
    values = window.delta.numpy()
    return magnitude_bits(values, out=values)


def _collect(passes: Passes, band: Band | None, streamed: Band | None,
             writer: _ChunkWriter) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(positions, magnitude bits, element bytes)`` of a band's entries, in position order: one pass (positions
    in int32 where the tensor allows: 4 bytes an entry less). The entries of ``streamed``, a band of one
    magnitude that comes just before it, are written as the pass meets them (position order is their order)."""
    count = 0 if band is None else band.count
    positions = np.empty(count, dtype=np.int32 if passes.entry.numel <= np.iinfo(np.int32).max else np.int64)
    bits = np.empty(count, dtype=np.int32)
    elements = np.empty(count, dtype=f"V{passes.entry.itemsize}")
    filled = 0
    for window in passes.reusing():
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
        raise RuntimeError(f"a pass over '{passes.entry.name}' found other entries than the first")
    return positions, bits, elements


class _ChunkWriter:
    """Cuts a tensor's entries, fed in store order, into chunks of ``per_chunk`` entries appended to ``out``.

    Entries come in runs, each in position order, as a chunk stores them (``in_chunks`` gives a whole chunk's
    entries as one run when asked for ``room`` first): a chunk of one run is written as it is, one of several
    (across bands) is merged by a stable sort, nearly linear over a few sorted runs."""

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
        """The next entries, in position order: flat positions, magnitude bits and the expert's element
        items (one ``V<itemsize>`` item each)."""
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
        self.rows.append(DeltaChunk(self.name, len(self.rows), begin, begin + len(payload), count, gap_bytes,
                                    energy, block_digest(payload)))


def _tensor_stages(stages: list[SketchStage], entry: TensorEntry, out) -> list[DeltaStage]:
    """Append one tensor's sketch stages to ``out``; their index rows."""
    rows = []
    for number, stage in enumerate(stages, start=1):
        begin = out.tell()
        out.write(stage.payload)
        rows.append(DeltaStage(entry.name, number, begin, begin + len(stage.payload), rows_of(entry.shape),
                               stage.residual, stage.norm, block_digest(stage.payload)))
    return rows
