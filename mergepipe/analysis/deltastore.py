"""Build an expert's delta store: its delta entries, largest first, in chunks,
and sketch stages of every changed tensor.

With a store, a budget buys an expert's delta in cheaper forms than whole
blocks (planner policy ``entries``): sketch stages (a coarse value for every
entry, 1.6 bits each, ``sketch.py``) and, for exactness, the tensor's top
entries (reading the first chunks of a tensor gives exactly its largest
entries). Real fine-tunes change every tensor a little, so whole blocks
carry little more value than others. Encoding: ``storage/entries.py``.

One pass per tensor: the base and the expert tensor are read (every block
checked against the hashes analysis recorded), ``Δ = E - B`` in fp32, its
non-zero entries ordered by descending ``|Δ|`` (stable: ties by position,
the order every magnitude trim uses, so a store prefix covering a TIES
density's top-k entries is exactly what the trim keeps), and cut into
chunks of about the catalog's block size; the sketch stages follow. The file is written beside its
final name, fsynced and renamed into place, then recorded in the catalog in
one transaction; a store for the same pair is replaced and its old file
removed.

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
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import BinaryIO, TypeVar

import numpy as np
import torch

from mergepipe.analysis.inputs import open_registered
from mergepipe.analysis.sketch import rows_of, sketch_stages
from mergepipe.catalog import Catalog
from mergepipe.catalog.deltas import DeltaChunk, DeltaStage, DeltaStoreRecord
from mergepipe.errors import ConfigError, ModelChangedError
from mergepipe.progress import byte_progress
from mergepipe.storage.blocks import tensor_blocks
from mergepipe.storage.checkpoint import Checkpoint
from mergepipe.storage.convert import raw_view
from mergepipe.storage.entries import MAGIC, encode_chunk
from mergepipe.storage.format import MERGEABLE_DTYPES, TensorEntry
from mergepipe.storage.hashing import block_digest
from mergepipe.storage.remote_source import CheckpointSource

_SLUG = re.compile(r"[^A-Za-z0-9._-]+")
STORE_SUFFIX = ".mpdelta"
STAGING_SUFFIX = ".writing"
JUST_CREATED_SECONDS = 60.0
_T = TypeVar("_T")
_INF_BITS, _NAN_BITS, _MAX_BITS = 0x7F800000, 0x7FC00000, 0x7FFFFFFF  # of fp32 magnitudes, as int32
_KEY_BITS = 63  # of a non-negative int64 sort key


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
    path = None if record is None else Path(record.path)
    return path is not None and path.is_file() and path.stat().st_size == record.file_size


def build_store(catalog: Catalog, expert_id: str, base_id: str, directory: str | os.PathLike[str],
                progress: bool = False) -> StoreReport:
    """Write the delta store of an analysed (expert, base) pair into ``directory`` and record it."""
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
    hashes = {m: catalog.blocks.hashes(m) for m in (base_id, expert_id)}
    deltas = catalog.stats.block_norms(expert_id, base_id)
    changed = [e for _, e in base.iter_tensors()
               if e.dtype in MERGEABLE_DTYPES and any(v is not None for v in deltas.get(e.name, ()))]
    slug = _SLUG.sub("_", f"{expert_id}--{base_id}")[:80]
    final = directory / f"{slug}-{uuid.uuid4().hex[:8]}{STORE_SUFFIX}"
    swept = sweep_abandoned(directory)
    total = sum(e.nbytes for e in changed)
    with CheckpointSource() as source, byte_progress("delta store", total, progress) as advance:
        read = partial(_delta, catalog, source, base, expert, hashes, ids=(expert_id, base_id))
        chunks, stages = _write_locked(final, partial(_write_tensors, read, changed, catalog.block_bytes, advance))
    previous = catalog.deltas.find(expert_id, base_id)
    record = catalog.deltas.record(expert_id, base_id, str(final), final.stat().st_size, chunks, stages)
    if previous is not None and previous.path != record.path:
        Path(previous.path).unlink(missing_ok=True)
    return StoreReport(expert_id, record, sum(c.entries for c in chunks), len(chunks),
                       time.perf_counter() - started, swept)


def _write_locked(final: Path, write: Callable[[BinaryIO], _T]) -> _T:
    """``write``'s result, having made ``final`` from the magic and what ``write`` appends: written beside
    it under the staging file's lock (held until the rename, see the module's docstring), fsynced, renamed."""
    staging = final.with_name(f".{final.name}{STAGING_SUFFIX}")
    try:
        with open(staging, "xb") as out:
            with contextlib.suppress(OSError):  # no flock on this filesystem: no sweep can remove the file then
                fcntl.flock(out.fileno(), fcntl.LOCK_EX)  # ours alone: just created (``xb``)
            out.write(MAGIC)
            result = write(out)
            out.flush()
            os.fsync(out.fileno())
            os.rename(staging, final)
    finally:
        staging.unlink(missing_ok=True)
    return result


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


def _write_tensors(read: Callable[[TensorEntry], tuple[torch.Tensor, memoryview]], changed: list[TensorEntry],
                   block_bytes: int, advance: Callable[[int, str], None],
                   out: BinaryIO) -> tuple[list[DeltaChunk], list[DeltaStage]]:
    """Append every changed tensor's chunks and sketch stages to ``out``; their index rows."""
    chunks: list[DeltaChunk] = []
    stages: list[DeltaStage] = []
    for entry in changed:
        delta, expert_raw = read(entry)
        chunks += _tensor_chunks(delta, expert_raw, entry, block_bytes, out)
        stages += _tensor_stages(delta, entry, out)
        advance(entry.nbytes, entry.name)
    return chunks, stages


def _delta(catalog: Catalog, source: CheckpointSource, base: Checkpoint, expert: Checkpoint, hashes: dict,
           entry: TensorEntry, ids: tuple[str, str]) -> tuple[torch.Tensor, memoryview]:
    """``(flat fp32 Δ = E - B, the expert tensor's raw bytes)``, every block read checked."""
    expert_id, base_id = ids
    base_raw = _checked_read(source, base.file_of(entry.name).path, entry, hashes[base_id][entry.name],
                             catalog.block_bytes, base_id)
    e_entry = expert.tensor(entry.name)
    expert_raw = _checked_read(source, expert.file_of(entry.name).path, e_entry, hashes[expert_id][entry.name],
                               catalog.block_bytes, expert_id)
    delta = raw_view(expert_raw, entry.dtype, (entry.numel,)).to(torch.float32) - \
        raw_view(base_raw, entry.dtype, (entry.numel,)).to(torch.float32)
    return delta, expert_raw


def _tensor_chunks(delta: torch.Tensor, expert_raw: memoryview, entry: TensorEntry, block_bytes: int,
                   out) -> list[DeltaChunk]:
    """Append one tensor's chunks to ``out``; their index rows."""
    values = delta.numpy()
    positions = largest_first(values)
    elements = np.frombuffer(expert_raw, dtype=np.uint8).reshape(entry.numel, entry.itemsize)
    per_chunk = max(1, block_bytes // (entry.itemsize + 1))
    rows = []
    for index, start in enumerate(range(0, len(positions), per_chunk)):
        chosen = np.sort(positions[start : start + per_chunk])
        payload, gap_bytes = encode_chunk(chosen, elements[chosen])
        begin = out.tell()
        out.write(payload)
        energy = float(np.square(values[chosen].astype(np.float64)).sum())
        rows.append(DeltaChunk(entry.name, index, begin, begin + len(payload), len(chosen), gap_bytes, energy,
                               block_digest(payload)))
    return rows


def largest_first(values: np.ndarray) -> np.ndarray:
    """The positions of the non-zero entries of the flat fp32 ``values``, by descending ``|Δ|``, equal ones
    by position (every NaN alike, first): what a stable descending sort of ``|Δ|`` gives.

    One in-place sort of int64 keys ``(2³¹ - 1 - bits(|Δ|)) << p | position`` (the bits of a non-negative
    float order as it does): about half the memory of sorting the values with their indices (20 bytes per
    entry at the peak, 8 while sorting, against ~36), and faster.
    """
    positions = np.flatnonzero(values)
    bits = max(1, (len(values) - 1).bit_length())
    magnitudes = np.abs(values[positions])
    keys = magnitudes.view(np.int32).astype(np.int64)
    del magnitudes
    keys[keys > _INF_BITS] = _NAN_BITS
    if bits + 31 > _KEY_BITS:  # positions too wide to share a key with the magnitude (over 2³² entries)
        return positions[np.lexsort((positions, -keys))]
    np.subtract(_MAX_BITS, keys, out=keys)
    keys <<= bits
    keys |= positions
    del positions
    keys.sort()
    keys &= (1 << bits) - 1
    return keys


def _tensor_stages(delta: torch.Tensor, entry: TensorEntry, out) -> list[DeltaStage]:
    """Append one tensor's sketch stages to ``out``; their index rows."""
    rows = []
    for number, stage in enumerate(sketch_stages(delta, entry.shape), start=1):
        begin = out.tell()
        out.write(stage.payload)
        rows.append(DeltaStage(entry.name, number, begin, begin + len(stage.payload), rows_of(entry.shape),
                               stage.residual, stage.norm, block_digest(stage.payload)))
    return rows


def _checked_read(source: CheckpointSource, path: Path, entry: TensorEntry, recorded: list[str | None],
                  block_bytes: int, model_id: str) -> memoryview:
    """A whole tensor, every block checked against the hash analysis recorded."""
    view = source.read(path, entry.begin, entry.end, tag=model_id)
    for block, digest in zip(tensor_blocks(entry, block_bytes), recorded):
        if block_digest(view[block.begin - entry.begin : block.end - entry.begin]) != digest:
            raise ModelChangedError(
                f"model '{model_id}' changed on disk since it was analysed: block {block.index} of tensor "
                f"'{entry.name}' in {path} no longer matches its recorded hash; re-register and analyse it"
            )
    return view
